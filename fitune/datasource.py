"""The data vocabulary the spine names, below `fitune.data`: the record formats and the names people type for them,
the file types read, what a Hub data set id looks like, and the checks `TrainConfig.validate` makes from a path alone
(no record read, no tokenizer loaded).

`fitune.config` (the spine) reads these names from here, so that it imports nothing above it; `fitune.data` (which
reads, detects, encodes and batches) imports them from here too, and keeps them importable under its own modules
(`fitune.data.formats.FORMATS`, `fitune.data.read.SUFFIXES`, ...). Pure Python, nothing imported but the standard
library and `fitune.specs.sources`.
"""

from __future__ import annotations

import os
import re

FORMATS = ("chat", "completion", "text", "alpaca", "sharegpt", "conversational_completion")
"""Record shapes fitune reads (one record of each in docs/data.md):
- chat:                      {"messages": [{"role": ..., "content": ...}, ...]} (OpenAI's fine-tuning format);
- completion:                {"prompt": "...", "completion": "..."} (TRL's standard prompt-completion);
- text:                      {"text": "..."};
- alpaca:                    {"instruction": ..., "input": ... (optional, may be empty), "output": ..., "system": ...
                             (optional)} (Stanford Alpaca's alpaca_data.json);
- sharegpt:                  {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...], "system":
                             ... (optional)} (also "role"/"content" inside the conversation);
- conversational_completion: {"prompt": [messages], "completion": [messages]} (TRL's conversational
                             prompt-completion): the loss only on the completion's assistant messages."""

FORMAT_ALIASES = {
    "messages": "chat", "openai": "chat", "conversation": "chat",
    "prompt_completion": "completion", "pretrain": "text", "raw": "text", "plain": "text",
    "instruction": "alpaca", "share_gpt": "sharegpt", "conversations": "sharegpt",
    "conversational_prompt_completion": "conversational_completion", "chat_prompt_completion":
        "conversational_completion",
}
"""Other names `data.format` accepts, each for exactly one format (`conversation` stays OpenAI messages, as it was;
ShareGPT's key is `conversations`)."""

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt")
"""File types `read_records` reads; a folder is read as a saved Hugging Face dataset."""
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `datasets.Dataset(Dict).save_to_disk` writes; a folder with one of them is a saved dataset."""
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""ORG/NAME, as the Hub spells repository ids (one slash, letters, digits, '.', '_', '-')."""


def is_hub_id(path: str, file_suffixes: tuple[str, ...] = ()) -> bool:
    """`path` names a Hub data set: ORG/NAME, not an existing local path, and not ending like a data file (a missing
    `data/train.jsonl` is a missing file, not a data set)."""
    return (bool(HUB_ID.match(path)) and not os.path.exists(path)
            and not path.lower().endswith(file_suffixes))


def data_path_problem(path: str) -> str | None:
    """Why the existing `path` cannot be a data file, judged without reading its records (its type, suffix and
    size); None when it may be one. Said without the path (callers add it)."""
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, marker)) for marker in HF_DATASET_MARKERS):
            return (f"is a folder but not a dataset saved with datasets' save_to_disk (it has none of "
                    f"{', '.join(HF_DATASET_MARKERS)}); pass a .jsonl, .json, .csv, .tsv, .txt or .parquet file, or "
                    "the folder save_to_disk wrote")
        return None
    if not os.path.isfile(path):
        return "is not a regular file (a device or a pipe?); pass a .jsonl, .json, .csv, .tsv, .txt or .parquet file"
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        return (f"cannot read {suffix or 'a file without a suffix'}; fitune reads .jsonl (one JSON object per "
                "line), .json (a list of objects), .csv / .tsv (a header row, then one record per row), .txt (one "
                "text per line), .parquet, a folder saved with datasets' save_to_disk, or a Hub data set id "
                "ORG/NAME. Convert the file, or rename it if it already is one of these (JSON lines: .jsonl)")
    return None


def tokenizer_source_problem(source: str, key: str = "--tokenizer") -> str | None:
    """Why `source` cannot hold a tokenizer, judged from the path alone (None when it may): not a folder, a .gguf
    file or a Hub id. `fitune train` checks it with the config, before anything loads."""
    from .specs import sources  # a model's Hub id (this module's `is_hub_id` is a data set's)

    if os.path.isdir(source) or os.path.isfile(source) and sources.is_gguf_path(source) or sources.is_hub_id(source):
        return None
    return (f"{key} {source}: no such folder; pass a folder with tokenizer.json / tokenizer_config.json (a downloaded "
            "model folder works), a .gguf file or a Hub id (org/name) in the Hub cache")
