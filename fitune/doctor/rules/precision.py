"""Rules about number formats: fp16 where bf16 would do, fp16 on a bf16 model, a loss scaler left unused."""

from __future__ import annotations

import ast
from typing import Iterator

from .. import evidence
from ..findings import ERROR, WARNING
from ..index import Assignment, Call, ScriptIndex
from .arguments import OPTIMIZERS
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
        what = _fp16_autocast(ix, c)
        if what:
            yield c.line, what
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


def _fp16_autocast(ix: ScriptIndex, c: Call) -> str:
    """What an autocast call does when it computes in float16 ("`torch.autocast(...)` autocasts to float16"), else
    ""."""
    dtype = c.kw("dtype")
    if dtype is not None:
        return f"`{call_text(c)}` autocasts to float16" if ix.dtype_of(dtype) == "fp16" else ""
    if _autocast_device(ix, c) == "cuda":
        return f"`{call_text(c)}` without dtype autocasts to float16 on CUDA"
    return ""


def _autocast_device(ix: ScriptIndex, c) -> str | None:
    """"cuda" for torch.cuda.amp.autocast() and autocast("cuda"); None when the device is not a literal."""
    if c.name.endswith("cuda.amp.autocast"):
        return "cuda"
    device = c.kw("device_type") if c.kw("device_type") is not None else c.arg(0)
    value = ix.value(device)
    return value if isinstance(value, str) else None


GRAD_SCALER_SOURCE = ("source: torch/amp/grad_scaler.py (\"To minimize gradient underflow, a large scale factor should be "
                      "used\"; its example: scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update(); "
                      "the scale starts at 2**16). CPU check (fitune's tests): a float16 gradient of "
                      "1e-8 is 0 unscaled and 6.6e-4 at the initial scale")


@rule("grad-scaler-unused", ERROR, "GradScaler created but not applied to fp16 autocast training", ("C19",))
def grad_scaler_unused(ix: ScriptIndex) -> Iterator[Hit]:
    """`scaler = GradScaler()` in a loop that autocasts to float16, but `scaler.scale(loss)` (or `scaler.step`,
    `scaler.update`) is missing: the scaler the script asks for does nothing, or half of it does."""
    autocasts = [(c, w) for c in ix.calls_named("autocast") for w in [_fp16_autocast(ix, c)] if w]
    manual = [c for c in ix.calls if c.tail == "backward" and not c.receiver.endswith("accelerator")]
    if not autocasts or not manual:
        return
    cast, cast_text = autocasts[0]
    for a in _grad_scalers(ix):
        used = {c.tail for c in ix.calls if c.receiver == a.target}
        made = f"`{a.target} = {ast.unparse(a.value.func)}(...)`"
        if "scale" not in used:
            yield Hit(a.line,
                      f"{made} creates a loss scaler that is never used: {cast_text} (line {cast.line}), and the "
                      f"loss goes to backward() unscaled (line {manual[0].line}). Float16 gradients smaller than "
                      "6e-8 flush to zero (below 6.1e-5 they already lose precision), so those updates are lost: "
                      "the loss falls slowly, or not at all.", FIX_SCALER, GRAD_SCALER_SOURCE)
        elif "step" not in used and "unscale_" not in used and _optimizer_steps(ix):
            yield Hit(a.line,
                      f"{made} scales the loss, but `{a.target}.step(optimizer)` is never called: the optimizer "
                      "steps on gradients still multiplied by the scale (65536 at the start), and nothing skips a "
                      "step whose gradients overflowed to inf or NaN: one such step writes NaN into the weights "
                      "(with SGD, every update is also 65536 times too large).", FIX_SCALER, GRAD_SCALER_SOURCE)
        elif "step" in used and "update" not in used:
            yield Hit(a.line,
                      f"{made} scales the loss, but `{a.target}.update()` is never called: the scale stays at its "
                      "initial 65536, so if the gradients overflow at that scale, scaler.step skips every step and "
                      "nothing lowers the scale: the model does not train.", FIX_SCALER, GRAD_SCALER_SOURCE)


FIX_SCALER = ("on Ampere or newer (RTX 30xx/40xx/50xx, A100, L4, H100) autocast to bf16 and drop the scaler: "
              "torch.autocast(\"cuda\", dtype=torch.bfloat16); on a T4, V100 or RTX 20xx use all of it: "
              "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() (in place of loss.backward(); "
              "optimizer.step())")


def _grad_scalers(ix: ScriptIndex) -> list[Assignment]:
    """`name = GradScaler(...)` assignments the rule can follow: enabled (or not said), the name never handed on to a
    call or another name (then it may be used where the index does not look)."""
    out = []
    for a in ix.assignments:
        if a.target.startswith("[") or not isinstance(a.value, ast.Call):
            continue
        if ix.dotted(a.value.func).rsplit(".", 1)[-1] != "GradScaler":
            continue
        enabled = next((k.value for k in a.value.keywords if k.arg == "enabled"), None)
        if enabled is not None and not ix.is_true(enabled):
            continue
        if not _handed_on(ix, a.target):
            out.append(a)
    return out


def _optimizer_steps(ix: ScriptIndex) -> list[Call]:
    """`optimizer.step()` calls on a name bound to an optimizer class (torch.optim.AdamW(...), bnb's, ...)."""
    names = {a.target for a in ix.assignments
             if isinstance(a.value, ast.Call) and ix.dotted(a.value.func).rsplit(".", 1)[-1] in OPTIMIZERS}
    return [c for c in ix.calls if c.tail == "step" and c.receiver in names]


def _handed_on(ix: ScriptIndex, name: str) -> bool:
    for c in ix.calls:
        if any(ix.dotted(arg) == name for arg in [*c.node.args, *(k.value for k in c.node.keywords)]):
            return True
    return any(ix.dotted(a.value) == name for a in ix.assignments)


@rule("fp16-on-bf16-model", WARNING, "a model loaded in bf16 trained with fp16 mixed precision", ("C19",))
def fp16_on_bf16_model(ix: ScriptIndex) -> Iterator[Hit]:
    """`from_pretrained(..., dtype=torch.bfloat16)` then `TrainingArguments(fp16=True)` (or fp16 autocast): two
    16-bit formats at once. What transformers 5.17 + accelerate do with it was read from their code (evidence)."""
    loads = _bf16_models(ix)
    if not loads or not ix.trains:
        return
    load_line, load_text = loads[0]
    for line, what, how in _fp16_training(ix):
        yield Hit(line,
                  f"{what} on a model loaded in bf16 ({load_text}, line {load_line}): {how}, casting the bf16 weights "
                  "on the fly. Nothing raises, but the weights, their "
                  "gradients and the update stay bf16 while the activations are float16: a model trained in bf16 "
                  "can have activations above float16's 65504, which become inf and the loss NaN (steps skipped). "
                  "It saves no memory over bf16: both take 2 bytes.",
                  "bf16=True instead of fp16=True (torch.autocast(\"cuda\", dtype=torch.bfloat16) in a loop) on "
                  "Ampere or newer (RTX 30xx/40xx/50xx, A100, L4, H100); on a T4 or V100 (no bf16) load with "
                  "dtype=torch.float16 for LoRA (PEFT keeps the adapters in float32) or dtype=torch.float32 for a "
                  "full fine-tune, and keep fp16",
                  "source: transformers 5.17 training_args.py (fp16=True sets mixed_precision=\"fp16\") and "
                  "accelerate 1.15 (torch.autocast(dtype=float16) + GradScaler); torch/amp/grad_scaler.py unscale_ "
                  "raises \"Attempting to unscale FP16 gradients.\" only for float16 gradients. CPU check "
                  "(fitune's tests): TrainingArguments(fp16=True).mixed_precision is \"fp16\", and "
                  "the scaler unscales bf16 gradients without a word. Reasoned (not measured on a GPU): float16's "
                  "largest value is 65504, bf16's 3.4e38")


def _bf16_models(ix: ScriptIndex) -> list[tuple[int, str]]:
    """(line, how) of each place the model is made bf16: a load with dtype/torch_dtype bf16, .bfloat16(), .to()."""
    out = []
    for load in ix.model_loads:
        kw = "dtype" if load.kw("dtype") is not None else "torch_dtype"
        if ix.dtype_of(load.kw(kw)) == "bf16":
            out.append((load.line, f"`{call_text(load)}` with {kw}={ast.unparse(load.kw(kw))}"))
    for c in ix.calls:
        if c.receiver in ix.model_variables and (
                (c.tail == "bfloat16" and not c.node.args) or
                (c.tail == "to" and any(ix.dtype_of(a) == "bf16" for a in c.node.args))):
            out.append((c.line, f"`{ast.unparse(c.node)}`"))
    return sorted(out)


def _fp16_training(ix: ScriptIndex) -> Iterator[tuple[int, str, str]]:
    """(line, what, how it computes) of each place that trains in fp16 mixed precision."""
    accelerate = ("accelerate autocasts every matmul to float16 and scales the loss with a GradScaler (which refuses "
                  "only float16 gradients)")
    for args in ix.training_args:
        if ix.is_true(args.kw("fp16")):
            yield (args.line, f"`{call_text(args)}` sets fp16=True",
                   f"the Trainer hands fp16=True to accelerate as mixed_precision=\"fp16\"; {accelerate}")
    for c in ix.calls_named("Accelerator"):
        if ix.value(c.kw("mixed_precision")) == "fp16":
            yield c.line, f'`{call_text(c)}` uses mixed_precision="fp16"', accelerate
    for c in ix.calls_named("autocast"):
        what = _fp16_autocast(ix, c)
        if what:
            yield c.line, what, "autocast runs every matmul in float16"


RULES = (fp16_instead_of_bf16, grad_scaler_unused, fp16_on_bf16_model)
