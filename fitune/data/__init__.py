"""Training data, one path for every command: read, detect the format, encode, batch; and the scan that reports it.

`fitune train`, `fitune doctor --data` and `fitune plan --data` all count tokens with this package, so what the
doctor and the planner report is what training trains on:

    records = read_records("train.jsonl")                      # [(line_number, dict), ...], remembers its path
    examples, stats = tokenize_records(records, tokenizer, "chat", 2048)   # DataStats: kept, truncated, dropped
    items = pack(examples, 2048) if packing else examples      # PackedSequence rows, or one example a row
    stream = BatchStream(items, batch_size=2, seed=0, pad_token_id=pad_id(tokenizer), packed=packing)
    batch = stream.next_batch()                                 # Batch of CPU tensors (dynamic padding)
    loss = model(**batch.model_inputs()).loss

    scan = scan_file("train.jsonl", tokenizer, 2048)            # the same, bad records kept as data (doctor, plan)

Modules: read.py (files and Hub ids -> records, bad lines by number), hub.py (Hub data set ids, from the cache),
formats.py (the formats and their detection), convert.py (every format -> chat | completion | text), encode.py
(records -> Examples and DataStats with the tokenizer), stream.py (batches from records read lazily), batch.py (packing, padding, BatchStream), stats.py (histogram,
padding costs), scan.py (a whole file, leniently). Importing this package imports neither torch nor transformers;
`collate` imports torch and `load_tokenizer` transformers when called.
"""

from ..errors import DataError
from .batch import Batch, BatchStream, PackedSequence, collate, pack, split_batch
from .encode import (IGNORE_INDEX, DataStats, Example, RecordTokens, encode_records, load_examples, load_tokenizer,
                     pad_id, tokenize_records)
from .formats import FORMATS, detect_format, format_of
from .read import RecordProblem, Records, read_records, scan_records
from .scan import DataScan, scan_file
from .stats import HistogramBin, PaddingCost, histogram, length_stats, padding_costs, percentile

__all__ = [
    "FORMATS", "IGNORE_INDEX", "Batch", "BatchStream", "DataError", "DataScan", "DataStats", "Example",
    "HistogramBin", "PackedSequence", "PaddingCost", "RecordProblem", "RecordTokens", "Records", "collate",
    "detect_format", "encode_records", "format_of", "histogram", "length_stats", "load_examples", "load_tokenizer",
    "pack", "pad_id", "padding_costs", "percentile", "read_records", "scan_file", "scan_records", "split_batch",
    "tokenize_records",
]
