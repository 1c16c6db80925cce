"""What `--engine trace` models of a `TrainSetup`, field by field, and the errors it raises.

The trace engine runs the plain transformers + PEFT recipe (`--stack hf`) on fake CPU tensors. It runs every
setting it is given as given, or refuses it by name: it never replaces a value with a nearby one (flash with
sdpa, offloaded checkpointing with full) and then reports the setup it was asked for.

Modelled, run as given:
    method lora | full | freeze (the last `freeze_trainable_layers` decoder layers train, as fitune's runner),
    lora_rank, lora_alpha, lora_targets (any module PEFT can wrap, `all-linear` included), lora_dropout (when
    TrainSetup has it: PEFT's `nn.Dropout` on each adapter's input), dtype bf16 | fp16 | fp32,
    grad_checkpointing none | full | selective:K (non-reentrant, as the recipe; selective checkpoints the first
    K decoder layers, as fitune's runner), attn sdpa | eager, optimizer adamw | sgd | adafactor (the
    constructors of fitune's profiler; foreach, the CUDA default), batch_size, seq_len_tokens, grad_accum
    (micro-batches per optimizer step: the second and later ones start with the gradients alive, so two are
    traced; the rest repeat the second), keep_outputs (the model output held through the backward, as
    `out = model(...); out.loss.backward()`), loss hf, stack hf.

Refused by name (`TraceUnsupportedError`, exit 2), each with the reason:
    method qlora, optimizer adamw8bit | paged_adamw8bit (bitsandbytes kernels need CUDA), attn flash
    (a CUDA kernel), grad_checkpointing offload, loss chunked, tiled_mlp, lean_lora, lean_norm, kernels liger,
    expandable_segments, stack fitune (fitune's runner; the trace runs the plain recipe).

A TrainSetup field newer than this table is refused when it differs from its default (and noted when it does
not), so a new setting can never be ignored silently.

Imports no torch.
"""

from __future__ import annotations

import dataclasses

from ..errors import FituneError
from ..setup import TrainSetup
from ..specs import optimizers as optimizer_specs

#: TrainSetup fields whose every value is handled above (run, or refused by name).
KNOWN_FIELDS = frozenset({
    "method", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dtype", "grad_checkpointing", "attn",
    "optimizer", "batch_size", "seq_len_tokens", "freeze_trainable_layers", "grad_accum", "loss", "tiled_mlp",
    "lean_lora", "lean_norm", "kernels", "expandable_segments", "stack", "keep_outputs",
})

_RUNNER = "a technique of fitune's runner; the trace runs the plain transformers + PEFT recipe"
_NEXT_STEP = "use the analytic engine (--engine analytic, the default)"


class TraceUnsupportedError(FituneError):
    """A setting the trace engine cannot run on fake CPU tensors; the message names each one and why."""


class TraceModelError(FituneError):
    """transformers cannot build the model from its config.json, or the fake-tensor run of it failed."""


def check_setup(setup: TrainSetup) -> list[str]:
    """Refuse every setting of `setup` the trace engine cannot model, all at once; return notes for the others.

    Only values that are valid but not modelled are refused here; invalid values are left to
    `TrainSetup.validate`, which the engine calls next.

    Raises:
        TraceUnsupportedError: one line per refused setting, naming its flag and value.
    """
    if not isinstance(setup, TrainSetup):
        raise TypeError(f"setup must be a fitune.setup.TrainSetup, got {type(setup).__name__}")
    refused: list[str] = []

    def refuse(flag_and_value: str, why: str) -> None:
        refused.append(f"{flag_and_value} ({why})")

    if setup.method == "qlora":
        refuse("--method qlora", "QLoRA's NF4 layers are bitsandbytes kernels that need CUDA, and the trace runs on "
               "fake CPU tensors")
    optimizer = optimizer_specs.get(setup.optimizer)
    if optimizer.trace_note is None:  # the registry's entry has no CPU path (CUDA kernels)
        refuse(f"--optimizer {setup.optimizer}", "bitsandbytes' 8-bit optimizers need CUDA"
               if "bitsandbytes" in optimizer.packages else f"{optimizer.cuda} need CUDA")
    if setup.attn == "flash":
        refuse("--attn flash", "flash-attention 2 is a CUDA kernel; the trace runs --attn sdpa or eager")
    if setup.checkpointed_layers_mode == "offload":
        refuse("--grad-checkpointing offload", _RUNNER)
    if setup.loss == "chunked":
        refuse("--loss chunked", _RUNNER)
    for flag, on in (("--tiled-mlp", setup.tiled_mlp), ("--lean-lora", setup.lean_lora),
                     ("--lean-norm", setup.lean_norm), ("--expandable-segments", setup.expandable_segments)):
        if on:
            refuse(flag, _RUNNER)
    if setup.kernels == "liger":
        refuse("--kernels liger", _RUNNER)
    if setup.stack == "fitune":
        refuse("--stack fitune", "fitune's runner; the trace runs the plain transformers + PEFT recipe, --stack hf")

    notes: list[str] = []
    for f in dataclasses.fields(setup):
        if f.name in KNOWN_FIELDS:
            continue
        value, default = getattr(setup, f.name), _default(f)
        if value != default:
            refuse(f"{_flag(f)} {value!r}", "a TrainSetup field the trace engine does not model yet")
        else:
            notes.append(f"{_flag(f)} is not modelled by the trace engine; it is at its default {default!r}")

    if len(refused) == 1:
        raise TraceUnsupportedError(f"--engine trace cannot model {refused[0]}; {_NEXT_STEP}")
    if refused:
        lines = "\n".join(f"  - {r}" for r in refused)
        raise TraceUnsupportedError(f"--engine trace cannot model {len(refused)} settings; {_NEXT_STEP}:\n{lines}")
    return notes


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _flag(f: dataclasses.Field) -> str:
    """The command-line flag of a TrainSetup field (its schema's, else --field-name)."""
    schema = f.metadata.get("schema") or {}
    if schema.get("flag"):
        return schema["flag"]
    return "--" + (schema.get("yaml") or f.name).replace(".", "-").replace("_", "-")
