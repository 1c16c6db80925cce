"""Rules about the training engine around the step: DeepSpeed ZeRO in a script that may run on one GPU."""

from __future__ import annotations

import ast
from typing import Iterator

from ..findings import INFO
from ..index import ScriptIndex
from .base import Hit, call_text, rule

def _zero_stage(ix: ScriptIndex, node: ast.expr | None) -> int | None:
    """The `zero_optimization.stage` of a DeepSpeed config given as a dict literal (or a name bound to one)."""
    if isinstance(node, ast.Name):
        bound = [a.value for a in ix.assignments_to(node.id)]
        node = bound[-1] if bound else None
    if not isinstance(node, ast.Dict):
        return None
    for k, v in zip(node.keys, node.values):
        if isinstance(k, ast.Constant) and k.value == "zero_optimization" and isinstance(v, ast.Dict):
            for k2, v2 in zip(v.keys, v.values):
                if isinstance(k2, ast.Constant) and k2.value == "stage" and isinstance(v2, ast.Constant):
                    return v2.value if isinstance(v2.value, int) else None
    return None


@rule("deepspeed-on-one-gpu", INFO, "DeepSpeed ZeRO: what it does on a single GPU", ("C14", "C24"))
def deepspeed_on_one_gpu(ix: ScriptIndex) -> Iterator[Hit]:
    """`TrainingArguments(deepspeed=...)` or `deepspeed.initialize(...)`: ZeRO divides memory over GPUs; on one GPU
    it divides nothing. What each stage does there was measured (C14, C24)."""
    sites = [(c, c.kw("deepspeed")) for c in ix.training_args if c.kw("deepspeed") is not None]
    sites += [(c, c.kw("config") if c.kw("config") is not None else c.kw("config_params"))
              for c in ix.calls if c.name == "deepspeed.initialize"]
    for c, config in sites[:1]:
        stage = _zero_stage(ix, config)
        which = f"ZeRO stage {stage}" if stage is not None else "DeepSpeed ZeRO"
        yield Hit(c.line,
                  f"`{call_text(c)}` trains with {which}. ZeRO divides weights, gradients and optimizer state "
                  "over GPUs; on one GPU it divides nothing and adds its own buffers. Measured on one H200: "
                  "stage 2 left a LoRA step's peak as it was and doubled a full fine-tune's (an fp32 master copy "
                  "and gradient); stage 3 ran 2.6-3.2x slower; only stage 3 with parameters and optimizer on the "
                  "CPU lowered the GPU's peak, at 3.8x (LoRA) to 19.5x (full) the time and 34-39 GiB of host "
                  "memory.",
                  "on one GPU, drop DeepSpeed and lower memory with gradient checkpointing, a smaller micro-batch "
                  "with accumulation, QLoRA or a chunked loss (`fitune plan` ranks them); keep ZeRO for several "
                  "GPUs",
                  "measured (fitune train --gpus 1 --strategy zero2 | zero3 | zero3_offload; "
                  "Llama-3.1-8B LoRA r8 q,v 2 x 2048: 21.99 GiB without DeepSpeed, 22.00 with zero2, 22.97 with "
                  "zero3, 9.87 with zero3_offload; Llama-3.2-1B full: 13.15, 25.39, 26.88, 9.06 GiB); "
                  "docs/evidence.md C14, C24")


RULES = (deepspeed_on_one_gpu,)
