"""The script rules, one module per family. Each rule is a named function over a `ScriptIndex` (see base.py).

loading.py        how the model is loaded: dtype, device_map, attention implementation
precision.py      fp16 where bf16 would do, fp16 on a bf16 model, a GradScaler left unused
arguments.py      hyper-parameters of the wrong type (a learning rate written as a string)
data.py           padding, truncation, labels, packing
checkpointing.py  gradient checkpointing that does not take effect or costs more than needed
loop.py           the training loop: empty_cache, evaluation under autograd, losses kept alive
adapters.py       LoRA targets and biases, the optimizer of a full fine-tuning
engine.py         DeepSpeed ZeRO in a script that may run on one GPU
"""

from __future__ import annotations

from . import adapters, arguments, checkpointing, data, engine, loading, loop, precision
from .base import Hit, Rule

ALL_RULES: tuple[Rule, ...] = (*loading.RULES, *precision.RULES, *arguments.RULES, *data.RULES, *checkpointing.RULES,
                               *loop.RULES, *adapters.RULES, *engine.RULES)

__all__ = ["ALL_RULES", "Hit", "Rule"]
