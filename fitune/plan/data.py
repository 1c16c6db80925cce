"""What the training data says about the plan: its token lengths set the sequence length and whether packing pays.

The lengths come from fitune's runner's own tokenisation (`fitune.train.data.read_records` /
`tokenize_records`) when that module is installed, else from `fitune doctor`'s data scan (the same formats and chat
template rule). Both need transformers for the tokenizer; they are imported only when `--data` is given.

Batching without packing is dynamic padding, as fitune's runner does it: each micro-batch padded to its longest
example, the examples in a shuffled order (the runner shuffles; a fixed seed here). With packing, examples are laid
back to back in rows of the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Sequence lengths are rounded up to a multiple of this (tensor-core friendly shapes).
SEQ_LEN_MULTIPLE = 64
#: The share of examples the chosen sequence length may truncate (the 99th percentile sets it).
TRUNCATE_SHARE = 0.01
#: Packing is turned on when it removes at least this share of the computed token positions (padding).
PACKING_MIN_GAIN = 0.10


@dataclass(frozen=True)
class DataProfile:
    """Token lengths of a training file."""

    path: str
    lengths_tokens: tuple[int, ...]
    """Tokens of each example before truncation, in file order."""
    source: str
    """Which tokenisation produced them: fitune.train.data or fitune.doctor.data."""

    @property
    def examples(self) -> int:
        return len(self.lengths_tokens)

    @property
    def mean_tokens(self) -> float:
        return sum(self.lengths_tokens) / len(self.lengths_tokens) if self.lengths_tokens else 0.0

    def percentile_tokens(self, q: float) -> int:
        xs = sorted(self.lengths_tokens)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    @property
    def max_tokens(self) -> int:
        return max(self.lengths_tokens) if self.lengths_tokens else 0


@dataclass(frozen=True)
class Batching:
    """How a micro-batch of the data fills its token positions."""

    packing: bool
    slot_len_tokens: int
    """Average length of a micro-batch row (padding included): what one step computes per row."""
    real_share: float
    """Real tokens over computed positions (1 - padding share)."""


def choose_seq_len(profile: DataProfile, cap_tokens: int) -> tuple[int, int]:
    """(sequence length, examples it truncates): the 99th percentile rounded up to 64, at most `cap_tokens`."""
    p = profile.percentile_tokens(1 - TRUNCATE_SHARE)
    seq = min(cap_tokens, max(SEQ_LEN_MULTIPLE, -(-p // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE))
    return seq, sum(1 for n in profile.lengths_tokens if n > seq)


def batching(profile: DataProfile, seq_len_tokens: int, micro_batch: int, packing: bool) -> Batching:
    """Fill of one epoch: dynamic padding of shuffled micro-batches, or packing into rows of the sequence."""
    import random

    clipped = [min(n, seq_len_tokens) for n in profile.lengths_tokens]
    random.Random(0).shuffle(clipped)
    real = sum(clipped)
    if not clipped or not real:
        return Batching(packing, seq_len_tokens, 1.0)
    if packing:
        rows = math.ceil(real / seq_len_tokens)
        return Batching(True, seq_len_tokens, real / (rows * seq_len_tokens))
    groups = [clipped[i:i + micro_batch] for i in range(0, len(clipped), micro_batch)]
    slots = sum(len(g) * max(g) for g in groups)
    return Batching(False, max(1, round(slots / len(clipped))), real / slots)


def packing_pays(profile: DataProfile, seq_len_tokens: int, micro_batch: int) -> bool:
    """Packing removes at least PACKING_MIN_GAIN of the computed positions compared with dynamic padding."""
    padded = batching(profile, seq_len_tokens, micro_batch, packing=False)
    packed = batching(profile, seq_len_tokens, micro_batch, packing=True)
    # computed positions are real tokens / real_share: the share packing saves is 1 - padded / packed
    return 1 - padded.real_share / packed.real_share >= PACKING_MIN_GAIN


def profile_data(path: str, tokenizer_dir: str) -> DataProfile:
    """Tokenise `path` with the tokenizer in `tokenizer_dir` and return every example's length.

    Raises:
        DataError (a FituneError): the file or tokenizer cannot be read, or no example could be tokenised.
    """
    lengths = _lengths_from_runner(path, tokenizer_dir)
    if lengths is not None:
        return DataProfile(path, tuple(lengths), "fitune.train.data")
    from ..doctor.data import scan_data

    report = scan_data(path, tokenizer_dir, seq_len_tokens=1 << 30)
    return DataProfile(path, tuple(report.lengths_tokens), "fitune.doctor.data")


def _lengths_from_runner(path: str, tokenizer_dir: str) -> list[int] | None:
    """The runner's tokenisation, if fitune.train.data exists with the API the loop uses; None otherwise."""
    try:
        from ..train import data as train_data
    except ImportError:
        return None
    read, tokenize = getattr(train_data, "read_records", None), getattr(train_data, "tokenize_records", None)
    if read is None or tokenize is None:
        return None
    from ..doctor.data import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    try:
        examples, _ = tokenize(read(path), tok, None, 1 << 30)
    except TypeError:  # a different signature than the loop's: use the doctor's scan instead
        return None
    lengths = []
    for ex in examples:
        ids = getattr(ex, "input_ids", None)
        if ids is None and isinstance(ex, dict):
            ids = ex.get("input_ids")
        if ids is None:
            return None
        lengths.append(len(ids))
    return lengths or None
