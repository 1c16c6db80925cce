"""Batching examples: packing, dynamic padding, and the deterministic, resumable BatchStream training reads.

Packing keeps examples apart without an attention mask: position ids restart at 0 for each example and the batch
carries no attention_mask, so transformers (masking_utils.find_packed_sequence_indices) builds a block-diagonal
causal mask. It only does so when no KV cache is passed; `Batch.model_inputs()` sets `use_cache=False` for that
reason (with the default `use_cache=True`, Llama creates a DynamicCache and examples in a pack see each other).
In a packed row the first label of every example is -100, so no token of one example is predicted from the last
token of the example before it.

torch is imported only inside the functions that build tensors (collate and what calls it).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import ConfigError, DataError
from .encode import IGNORE_INDEX, Example

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class PackedSequence:
    """Several examples back to back in one row of at most seq_len_tokens; an example is never split across two."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    """The examples' labels, with the first label of every example -100 (no token predicts the next example)."""
    position_ids: tuple[int, ...]
    """0, 1, ... restarting at 0 where each example starts (what keeps examples apart in attention)."""
    boundaries: tuple[int, ...]
    """Start offset of each example in the row; boundaries[0] == 0."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each example in the row."""
        ends = self.boundaries[1:] + (len(self.input_ids),)
        return tuple(end - start for start, end in zip(self.boundaries, ends))

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class Batch:
    """A batch of rows as CPU tensors of shape (rows, width), width = the longest row (dynamic padding)."""

    input_ids: "torch.LongTensor"
    labels: "torch.LongTensor"
    """-100 on padding and on tokens without loss."""
    attention_mask: "torch.LongTensor | None"
    """1 on tokens, 0 on padding (unpacked batches); None for packed batches (see position_ids)."""
    position_ids: "torch.LongTensor | None"
    """Packed batches: positions restarting at 0 per example (padding is one more segment at the end); None for
    unpacked batches, where the model counts positions itself."""
    tokens: int
    """Tokens that are not padding."""
    trained_tokens: int
    """Tokens with a label (labels != -100): the number of loss terms, e.g. `num_items_in_batch` summed over the
    micro-batches of one optimizer step."""
    items: tuple = ()
    """The Examples / PackedSequences the batch was collated from (`split_batch` re-collates them)."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width_tokens(self) -> int:
        """Padded row length."""
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a transformers causal LM: `model(**batch.model_inputs())`.

        `use_cache=False` matters for packed batches: transformers builds the block-diagonal mask from position_ids
        only when no KV cache is passed (masking_utils._preprocess_mask_arguments), and a model whose config says
        `use_cache=True` would otherwise create one in its forward."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def to(self, device: Any) -> "Batch":
        """The same batch with its tensors on `device`."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            tokens=self.tokens,
            trained_tokens=self.trained_tokens,
            items=self.items,
        )



# ---------------------------------------------------------------------------------------------------------------
# Packing


def pack(examples: Sequence[Example], seq_len_tokens: int) -> list[PackedSequence]:
    """Pack examples into rows of at most seq_len_tokens, best-fit decreasing: longest example first, each into the
    fullest row it still fits in (ties: the earliest row), else a new row. Deterministic; an example is never
    split. Within a row, examples follow in the order they were placed.

    Raises:
        DataError: an example is longer than seq_len_tokens (tokenize with the same seq_len you pack with).
    """
    too_long = [len(e) for e in examples if len(e) > seq_len_tokens]
    if too_long:
        raise DataError(
            f"{len(too_long)} examples are longer than the pack length {seq_len_tokens} tokens (longest "
            f"{max(too_long)}); tokenize with the seq_len you pack with"
        )
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row index), sorted: bisect finds the best fit
    for i in order:
        length = len(examples[i])
        k = bisect.bisect_left(free, (length, -1))
        if k == len(free):
            rows.append([i])
            row, left = len(rows) - 1, seq_len_tokens - length
        else:
            left, row = free.pop(k)
            rows[row].append(i)
            left -= length
        if left > 0:
            bisect.insort(free, (left, row))
    return [_pack_row([examples[i] for i in row]) for row in rows]


def _pack_row(examples: Sequence[Example]) -> PackedSequence:
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    boundaries: list[int] = []
    for example in examples:
        boundaries.append(len(input_ids))
        input_ids.extend(example.input_ids)
        labels.append(IGNORE_INDEX)  # the first label would be scored against the previous example's last logits
        labels.extend(example.labels[1:])
        position_ids.extend(range(len(example)))
    return PackedSequence(tuple(input_ids), tuple(labels), tuple(position_ids), tuple(boundaries))


# ---------------------------------------------------------------------------------------------------------------
# Batching


def collate(items: Sequence[Example | PackedSequence], pad_token_id: int | None, packed: bool) -> Batch:
    """Stack items into a Batch, right-padded to the longest (dynamic padding).

    Unpacked: attention_mask 1 on tokens, 0 on padding; position_ids None.
    Packed: one row per item (an Example counts as a pack of one); position_ids restart per example, and padding
    continues as one more segment 0, 1, ... at the end; attention_mask None, so transformers builds the
    block-diagonal mask from position_ids (see Batch.model_inputs).
    Labels are -100 on padding in both. pad_token_id None (tokenizers without a pad token, e.g. Llama 3's) pads
    with 0: padding is never attended to nor scored, so the id does not matter.
    """
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import torch

    if not items:
        raise ValueError("collate: no items to batch")
    pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
    rows = [_as_pack(item) for item in items] if packed else list(items)
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = None if packed else torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    for r, row in enumerate(rows):
        n = len(row)
        input_ids[r, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        labels[r, :n] = torch.tensor(row.labels, dtype=torch.long)
        if packed:
            position_ids[r, :n] = torch.tensor(row.position_ids, dtype=torch.long)
            position_ids[r, n:] = torch.arange(width - n)
        else:
            attention_mask[r, :n] = 1
    return Batch(
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
        tokens=sum(len(row) for row in rows),
        trained_tokens=int((labels != IGNORE_INDEX).sum()),
        items=tuple(items),
    )


def _as_pack(item: Example | PackedSequence) -> PackedSequence:
    if isinstance(item, PackedSequence):
        return item
    return _pack_row([item])


def split_batch(batch: Batch, micro_batch_size: int, pad_token_id: int | None, packed: bool) -> list[Batch]:
    """The rows of `batch` as micro-batches of at most micro_batch_size rows, each re-collated (padded only to its
    own longest row). Same tokens and labels, in the same order."""
    if micro_batch_size < 1:
        raise ValueError(f"split_batch: micro_batch_size must be at least 1, got {micro_batch_size}")
    if not batch.items:
        raise ValueError("split_batch: the batch has no items to re-collate; split batches that collate() made")
    return [
        collate(batch.items[start : start + micro_batch_size], pad_token_id, packed)
        for start in range(0, len(batch.items), micro_batch_size)
    ]


class BatchStream:
    """Deterministic, resumable batches: order = a permutation seeded by (seed, epoch); state is (epoch, index).

    Infinite: after the last batch of an epoch (full or partial - the last one holds the remainder) the epoch
    increments and a new permutation starts. `index` counts items (not batches) taken from the current epoch, so
    a resumed stream yields exactly the batches an uninterrupted one would, whatever happened in between."""

    STATE_VERSION = 1

    def __init__(
        self,
        items: Sequence[Example | PackedSequence],
        batch_size: int,
        seed: int,
        pad_token_id: int | None,
        packed: bool,
        shuffle: bool = True,
    ):
        if not items:
            raise DataError("no examples to batch; the data file produced none (see the DataStats of tokenizing)")
        if batch_size < 1:
            raise ConfigError(f"batch_size: {batch_size} is not a batch size; use 1 or more")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.shuffle = shuffle
        self.epoch = 0
        """Epochs completed."""
        self.index = 0
        """Items of the current epoch already batched."""
        self._order: tuple[int, list[int]] | None = None
        self._fingerprint: str | None = None

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.items) / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """Item indices in the order epoch `epoch` visits them."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                # str seeds are hashed with SHA-512 by random.seed: the same permutation on every Python/platform
                random.Random(f"fitune-data/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next_batch(self) -> Batch:
        chosen = self.order(self.epoch)[self.index : self.index + self.batch_size]
        self.index += len(chosen)
        if self.index >= len(self.items):
            self.epoch, self.index = self.epoch + 1, 0
        return collate([self.items[i] for i in chosen], self.pad_token_id, self.packed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def fingerprint(self) -> str:
        """A hash of the items' lengths and token sums: tells a checkpoint's data from changed data."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for item in self.items:
                digest.update(f"{len(item)}:{sum(item.input_ids)}:{sum(item.labels)};".encode())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict:
        """Plain ints and strings (JSON- and torch.save-safe)."""
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "items": len(self.items),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The batch size may differ (the position is counted in items); the data, seed and
        shuffling must be the checkpoint's.

        Raises:
            DataError: the state is from other data, another seed or shuffle setting.
        """
        problems = []
        if state.get("version") != self.STATE_VERSION:
            problems.append(f"data state version {state.get('version')!r}, expected {self.STATE_VERSION}")
        for key, now in (("items", len(self.items)), ("seed", self.seed), ("shuffle", self.shuffle),
                         ("fingerprint", self.fingerprint())):
            if key in state and state[key] != now:
                problems.append(f"{key}: checkpoint {state[key]!r}, now {now!r}")
        if problems:
            raise DataError(
                "cannot resume the data position: the checkpoint was made with other data or settings ("
                + "; ".join(problems)
                + "); resume with the same data file, seq_len, packing and seed, or start a new run"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self.items):
            raise DataError(f"cannot resume the data position: epoch {epoch}, index {index} is out of range")
        self.epoch, self.index = epoch, index

    def split(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        """The same tokens in micro-batches of at most micro_batch_size rows (for the OOM guard); see split_batch."""
        return split_batch(batch, micro_batch_size, self.pad_token_id, self.packed)
