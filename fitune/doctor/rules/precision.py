"""Rules about number formats: fp16 where bf16 would do."""

from __future__ import annotations

from typing import Iterator

from .. import evidence
from ..findings import WARNING
from ..index import ScriptIndex
from .base import Hit, call_text, known_setup, rule, script_model

FIX_BF16 = ("bf16 on Ampere or newer (RTX 30xx/40xx/50xx, A100, L4, H100): bf16=True / mixed_precision=\"bf16\" / "
            "dtype=torch.bfloat16; keep fp16 only on T4, V100 or RTX 20xx, and then watch the loss scale "
            "(fitune.integrations.hf.FituneCallback reports it)")


@rule("fp16-instead-of-bf16", WARNING, "fp16 training or autocast where bf16 would do", ("C19",))
def fp16_instead_of_bf16(ix: ScriptIndex) -> Iterator[Hit]:
    """fp16 costs exactly what bf16 costs in memory and adds loss scaling; flag each place that picks it."""
    why = evidence.fp16_same_bytes(script_model(ix), known_setup(ix))
    for line, what in _fp16_sites(ix):
        yield Hit(line, f"{what}: fp16 takes the same 2 bytes as bf16 but overflows above 65504, so it needs a "
                        "loss scaler, and a scale that keeps falling skips steps (the loss falls slowly).",
                  FIX_BF16, why)


def _fp16_sites(ix: ScriptIndex) -> Iterator[tuple[int, str]]:
    for args in ix.training_args:
        if ix.is_true(args.kw("fp16")):
            yield args.line, f"`{call_text(args)}` sets fp16=True"
    for c in ix.calls_named("Accelerator"):
        if ix.value(c.kw("mixed_precision")) == "fp16":
            yield c.line, f'`{call_text(c)}` uses mixed_precision="fp16"'
    for c in ix.calls_named("autocast"):
        dtype = c.kw("dtype")
        if dtype is not None:
            if ix.dtype_of(dtype) == "fp16":
                yield c.line, f"`{call_text(c)}` autocasts to float16"
        elif _autocast_device(ix, c) == "cuda":
            yield c.line, f"`{call_text(c)}` without dtype autocasts to float16 on CUDA"
    for c in ix.calls_named("BitsAndBytesConfig"):
        if ix.dtype_of(c.kw("bnb_4bit_compute_dtype")) == "fp16":
            yield c.line, f"`{call_text(c)}` computes in float16 (bnb_4bit_compute_dtype)"
    if ix.trains:
        for load in ix.model_loads:
            kw = load.kw("dtype") if load.kw("dtype") is not None else load.kw("torch_dtype")
            if ix.dtype_of(kw) == "fp16":
                yield load.line, f"`{call_text(load)}` loads the weights in float16 for training"
        for c in ix.calls_named("half"):
            if c.receiver in ix.model_variables and not c.node.args:
                yield c.line, f"`{call_text(c)}` casts the model to float16"


def _autocast_device(ix: ScriptIndex, c) -> str | None:
    """"cuda" for torch.cuda.amp.autocast() and autocast("cuda"); None when the device is not a literal."""
    if c.name.endswith("cuda.amp.autocast"):
        return "cuda"
    device = c.kw("device_type") if c.kw("device_type") is not None else c.arg(0)
    value = ix.value(device)
    return value if isinstance(value, str) else None


RULES = (fp16_instead_of_bf16,)
