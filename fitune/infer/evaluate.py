"""Loss and perplexity of a loaded model on a data file, with the labels `fitune train` trains on.

    evaluate(model, tokenizer, path, seq_len_tokens=...)   EvalResult: mean loss over trained tokens, perplexity
    lm_eval_command(info)                                   the lm-evaluation-harness command for the same weights

The records are encoded by fitune.data (the same encoder, format detection, truncation and label masking as
training: chat trains the assistant turns, completion the completion, text everything), batched without packing
and without shuffling, and the summed token losses are divided by the number of trained tokens: the mean over
tokens, not over batches, so the batch size does not change the answer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .. import data as data_mod
from ..errors import ConfigError
from .load import RunInfo

DEFAULT_SEQ_LEN_TOKENS = 2048
"""seq_len outside a run (a model folder given directly)."""
LM_EVAL_TASKS = "hellaswag,arc_easy"
"""The tasks the printed lm_eval command names; any of `lm_eval ls tasks` will do."""


@dataclass(frozen=True)
class EvalResult:
    """The loss of one model on one data file."""

    loss: float
    """Mean cross-entropy per trained token (nats)."""
    perplexity: float
    """exp(loss)."""
    examples: int
    """Records evaluated (those with at least one trained token inside seq_len)."""
    tokens: int
    """Tokens fed to the model (prompts included, padding not)."""
    trained_tokens: int
    """Tokens scored: the loss's denominator."""
    truncated: int
    """Examples cut at seq_len_tokens."""
    dropped: int
    """Records with no token to score (say, an answer entirely past seq_len)."""
    data_format: str
    """chat | completion | text."""
    seq_len_tokens: int
    data: str
    """The data file."""

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(model, tokenizer, path: str, *, seq_len_tokens: int, data_format: str | None = None,
             batch_size: int = 8, progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """The mean token loss of `model` on the records of `path`, labelled as training labels them.

    Raises:
        DataError / ConfigError: the file cannot be read or encoded, or has nothing to score.
    """
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import torch

    from ..runtime.step import forward_loss

    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: give at least 1")
    examples, stats = data_mod.load_examples(path, tokenizer, data_format, seq_len_tokens)
    stream = data_mod.BatchStream(examples, batch_size, 0, data_mod.pad_id(tokenizer), packed=False, shuffle=False)
    n_batches = math.ceil(len(examples) / batch_size)
    total, scored, fed = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for i in range(n_batches):
            batch = stream.next_batch()
            # num_items=1: transformers' loss returns the sum over the batch's trained tokens, divided below
            total += float(forward_loss(model, batch, num_items=1).item())
            scored += batch.trained_tokens
            fed += batch.tokens
            if progress is not None:
                progress(i + 1, n_batches)
    loss = total / scored
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), examples=len(examples), tokens=fed,
                      trained_tokens=scored, truncated=stats.truncated_records, dropped=stats.dropped_records,
                      data_format=stats.format, seq_len_tokens=seq_len_tokens, data=path)


_LM_EVAL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def lm_eval_command(info: RunInfo, tasks: str = LM_EVAL_TASKS, device: str = "cuda:0") -> str:
    """The lm-evaluation-harness command that benchmarks the same weights (`pip install lm_eval[hf]`).

    Full weights: `pretrained=DIR`; an adapter: `pretrained=BASE,peft=ADAPTER` (lm-eval's HFLM loads it with PEFT);
    a .gguf base: its folder with `gguf_file=NAME`. A checkpoint cannot be given to lm-eval: the command names the
    run's adapter/ that the run writes at its end."""
    def model_args(source: str) -> str:
        if source.endswith(".gguf"):
            folder, name = os.path.split(os.path.abspath(source))
            return f"pretrained={folder},gguf_file={name}"
        return f"pretrained={os.path.abspath(source) if os.path.exists(source) else source}"

    if info.weights in ("adapter", "checkpoint"):
        adapter = info.weights_dir if info.weights == "adapter" else os.path.join(info.path, "adapter")
        args = f"{model_args(str(info.base_model))},peft={os.path.abspath(adapter)}"
        if info.method == "qlora":
            args += ",load_in_4bit=True"
    else:
        args = model_args(info.weights_dir)
    args += f",dtype={_LM_EVAL_DTYPES.get(info.dtype, 'auto')}"
    return f"lm_eval --model hf --model_args {args} --tasks {tasks} --device {device} --batch_size auto"
