"""What the training data says about the plan: its token lengths set the sequence length and whether packing pays.

The lengths are those `fitune train` trains on: the file is read and encoded by `fitune.data` (the same reader,
format detection, chat template, special prefix and eos as training), before truncation. transformers is imported
only when `--data` is given, to load the tokenizer.

Batching without packing is dynamic padding, as fitune's runner does it: each micro-batch padded to its longest
example, the examples in a shuffled order (the runner shuffles; a fixed seed here). With packing, examples are laid
back to back in rows of the sequence length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..data import load_tokenizer, read_records, tokenize_records
from ..data.scan import counting
from ..data.stats import percentile

#: Sequence lengths are rounded up to a multiple of this (tensor-core friendly shapes).
SEQ_LEN_MULTIPLE = 64
#: The share of examples the chosen sequence length may truncate (the 99th percentile sets it).
TRUNCATE_SHARE = 0.01
#: Packing is turned on when it removes at least this share of the computed token positions (padding).
PACKING_MIN_GAIN = 0.10
#: ... or when rows without packing would be shorter than this share of the sequence length on average: a short
#: micro-batch leaves the GPU idle between kernels. Measured on the H200 (bench/results/peers/real_length.jsonl):
#: Llama-3.1-8B LoRA at micro-batch 1 on instruction-like data (median 300 words) trained 1,612 tokens/s unpacked,
#: against about 17k on full 2,048-token rows.
PACKING_SHORT_ROWS = 0.5
#: A sequence length no record reaches: profile_data measures whole records.
NO_TRUNCATION_TOKENS = 1 << 30


@dataclass(frozen=True)
class DataProfile:
    """Token lengths of a training file."""

    path: str
    lengths_tokens: tuple[int, ...]
    """Tokens of each example before truncation, in file order."""
    source: str
    """Which tokenisation produced them ("fitune.data": fitune train's own)."""
    format: str = ""
    """The format the records were read as (`fitune.data.formats.FORMATS`: detected from them)."""

    @property
    def examples(self) -> int:
        return len(self.lengths_tokens)

    @property
    def mean_tokens(self) -> float:
        return sum(self.lengths_tokens) / len(self.lengths_tokens) if self.lengths_tokens else 0.0

    def percentile_tokens(self, q: float) -> int:
        return percentile(sorted(self.lengths_tokens), q)

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
    """Packing removes at least PACKING_MIN_GAIN of the computed positions compared with dynamic padding, or rows
    without it would be short (PACKING_SHORT_ROWS)."""
    padded = batching(profile, seq_len_tokens, micro_batch, packing=False)
    packed = batching(profile, seq_len_tokens, micro_batch, packing=True)
    if padded.slot_len_tokens < PACKING_SHORT_ROWS * seq_len_tokens:
        return True  # short rows: packing fills the micro-batch
    # computed positions are real tokens / real_share: the share packing saves is 1 - padded / packed
    return 1 - padded.real_share / packed.real_share >= PACKING_MIN_GAIN


def profile_data(path: str, tokenizer_dir: str, progress=None) -> DataProfile:
    """Encode `path` as `fitune train` does, with the tokenizer in `tokenizer_dir`, and return the length of every
    record with something to train on, before truncation (choose_seq_len then counts what a length truncates).

    Raises:
        DataError (a FituneError): the file or tokenizer cannot be read, a record is bad (as training would stop on
            it), or no record has a token to train on.
    """
    # no truncation here: the plan chooses the sequence length from the whole lengths; `progress(done, total)` is
    # told how far the encoding has come (the CLI's bar)
    _, stats = tokenize_records(counting(read_records(path), progress), load_tokenizer(tokenizer_dir), None,
                                NO_TRUNCATION_TOKENS)
    return DataProfile(path, stats.lengths_tokens, "fitune.data", stats.format)
