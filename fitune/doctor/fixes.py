"""`diagnose`: the script as written, estimated on a GPU, and the smallest changes to it that make it fit.

Each fix is a change to the user's own script (a plain transformers + PEFT step, `stack="hf"`), tied to the lines
that state what it changes, estimated in full (`fitune.memory.estimate`) and timed by the planner's throughput
model (`fitune.plan.throughput.predict`). They are ranked as `fitune plan` ranks its plans: those that fit without
allocator retries first, then those that keep the Adam update (8-bit Adam counts), then predicted tokens/s;
changes that alter what is trained (LoRA rank or targets, shorter sequences, a different method) come after the
ones that do not. Single changes are tried first; pairs only when no single change fits without retries, triples
only when no pair does. Beside them, `fitune plan`'s best setup on fitune's own runner is quoted.

Pure Python: no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..errors import FituneError
from ..memory import estimate
from ..memory.estimate import MemoryEstimate
from ..plan import throughput
from ..plan.search import ADAM_FAMILY, PlanRequest, describe, plan
from ..setup import TrainSetup
from ..specs import load_model_spec, optimizers as optimizer_specs
from ..specs.gpu import GpuSpec
from ..specs.model import ModelSpec
from .evidence import LARGE_RANK, USUAL_RANK
from .extract import Edit, Recovered, ScriptSetup

#: Fixes shown (the best `MAX_FIXES`, ranked).
MAX_FIXES = 4
BNB_CONFIG = ('BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, '
              "bnb_4bit_compute_dtype=torch.bfloat16)")
"""The QLoRA load of the measured recipe (fitune/runtime/model.py; bench/results/hf_recipe/ nf4 cases)."""


@dataclass(frozen=True)
class Fix:
    """One change (or a few together) to the script, with its estimate and predicted speed."""

    change: str
    """What changes, in words: "micro-batch 1 x 2 accumulation"."""
    edits: tuple[str, ...]
    """Per line: "line 42: per_device_train_batch_size=2 -> 1"."""
    lines: tuple[int, ...]
    setup: TrainSetup
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    retries_expected: bool
    tokens_per_s: float
    """Predicted on the GPU (fitune.plan.throughput)."""
    speed_change: float
    """tokens_per_s / the script's as written - 1."""
    cost: str
    """What it costs besides speed (quality, data, a dependency)."""
    changes_training: bool
    """It changes what is trained (rank, targets, sequence length, method), not only how the step runs."""

    def to_dict(self) -> dict:
        return {"change": self.change, "edits": list(self.edits), "lines": list(self.lines),
                "setup": self.setup.to_dict(), "peak_allocated_bytes": self.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "fits": self.fits,
                "retries_expected": self.retries_expected, "tokens_per_s": round(self.tokens_per_s, 1),
                "speed_change": round(self.speed_change, 4), "cost": self.cost,
                "changes_training": self.changes_training}


@dataclass(frozen=True)
class RunnerPlan:
    """`fitune plan`'s best setup for the same model, tokens and adapters, on fitune's runner."""

    command: str
    description: str
    peak_reserved_bytes: int
    tokens_per_s: float
    retries_expected: bool

    def to_dict(self) -> dict:
        return {"command": self.command, "plan": self.description, "peak_reserved_bytes": self.peak_reserved_bytes,
                "tokens_per_s": round(self.tokens_per_s, 1), "retries_expected": self.retries_expected}


@dataclass(frozen=True)
class Diagnosis:
    script: ScriptSetup
    estimate: MemoryEstimate
    tokens_per_s: float
    """The script as written, predicted on the GPU (as if it fit)."""
    fixes: tuple[Fix, ...]
    runner_plan: RunnerPlan | None

    @property
    def needs_fix(self) -> bool:
        return not self.estimate.fits or bool(self.estimate.retries_expected)


def diagnose(script: ScriptSetup, gpu: GpuSpec, spec: ModelSpec | None = None) -> Diagnosis:
    """Estimate the script's setup on `gpu`; when it does not fit cleanly, rank the changes that make it fit."""
    spec = spec or load_model_spec(script.model)
    est = estimate(spec, script.setup, gpu)
    speed = throughput.predict(spec, script.setup, gpu).tokens_per_s
    fixes: tuple[Fix, ...] = ()
    if not est.fits or est.retries_expected:
        fixes = tuple(_search(spec, script, gpu, speed, bool(est.fits)))
    return Diagnosis(script, est, speed, fixes, _runner_plan(spec, script, gpu, speed, est))


# ---- candidates ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Change:
    key: str
    label: str
    values: dict
    edits: tuple[str, ...]
    lines: tuple[int, ...]
    cost: str
    changes_training: bool = False


def _candidates(ss: ScriptSetup) -> list[_Change]:
    s, f = ss.setup, ss.fields
    out: list[_Change] = []
    if s.keep_outputs:
        out.append(_free_outputs(ss))
    if s.grad_checkpointing == "none":
        out.append(_checkpointing(ss))
    if s.batch_size > 1:
        for micro in dict.fromkeys((s.batch_size // 2, 1)):
            if s.batch_size % micro == 0:
                out.append(_micro_batch(ss, micro))
    if s.attn == "eager":
        out.append(_Change("attn", "sdpa attention", {"attn": "sdpa"},
                           _edit(f["attn"], '"sdpa"', "attn_implementation"), _lines(f["attn"]), "none"))
    if s.dtype == "fp32" and s.method != "qlora":
        out.append(_Change("dtype", "bf16 weights", {"dtype": "bf16"},
                           _edit(f["dtype"], "torch.bfloat16", "dtype", ss.anchors.get("model_load")),
                           _lines(f["dtype"]), "bf16 rounding (what every measured LoRA run used)"))
    if s.method == "lora":
        out.append(_qlora(ss))
    if s.optimizer == "adamw":
        out.append(_adam8bit(ss))
    if s.method in ("lora", "qlora") and s.lora_rank > LARGE_RANK:
        for r in dict.fromkeys((s.lora_rank // 4, USUAL_RANK)):  # the "smaller rank" candidates
            if r < s.lora_rank:
                out.append(_Change(f"rank{r}", f"LoRA r{r}", {"lora_rank": r, "lora_alpha": max(1, s.lora_alpha * r //
                                                                                               s.lora_rank)},
                                   _edit(f["lora_rank"], str(r), "r", ss.anchors.get("lora_config")),
                                   _lines(f["lora_rank"]), f"a smaller adapter (r{s.lora_rank} -> r{r}; lora_alpha "
                                   "scaled alike keeps the update's scale)", True))
    if s.method in ("lora", "qlora") and (s.all_linear or len(s.lora_targets) > 2):
        out.append(_Change("targets", "LoRA on q_proj,v_proj", {"lora_targets": ("q_proj", "v_proj")},
                           _edit(f["lora_targets"], '["q_proj", "v_proj"]', "target_modules",
                                 ss.anchors.get("lora_config")), _lines(f["lora_targets"]),
                           "fewer adapted layers (usually somewhat lower quality)", True))
    if s.method == "full":
        out.append(_Change("lora", f"LoRA r{USUAL_RANK} instead of full fine-tuning",
                           {"method": "lora", "lora_rank": USUAL_RANK, "lora_targets": ("all-linear",)},
                           (f"{_after_load(ss)}: model = get_peft_model(model, LoraConfig(r={USUAL_RANK}, "
                            f'lora_alpha={2 * USUAL_RANK}, target_modules="all-linear", task_type="CAUSAL_LM"))',),
                           _lines(f["method"]), "trains adapters instead of every weight", True))
    if s.seq_len_tokens >= 512:
        half = s.seq_len_tokens // 2
        out.append(_Change("seq", f"sequences of {half} tokens", {"seq_len_tokens": half},
                           _edit(f["seq_len_tokens"], str(half), "max_length"), _lines(f["seq_len_tokens"]),
                           f"examples longer than {half} tokens are truncated", True))
    return out


def _free_outputs(ss: ScriptSetup) -> _Change:
    out_line, back = ss.anchors.get("output"), ss.anchors.get("backward")
    var = ss.fields["keep_outputs"].why.split("`")[1] if "`" in ss.fields["keep_outputs"].why else "outputs"
    before = f"before line {back}" if back else "before backward"
    edits = (_at(out_line, f"loss = model(**batch).loss (keep only the loss), or `del {var}` {before}: "
                           f"loss = {var}.loss; del {var}; loss.backward()"),)
    return _Change("outputs", "free the model output before backward", {"keep_outputs": False}, edits,
                   tuple(x for x in (out_line, back) if x), "none")


def _checkpointing(ss: ScriptSetup) -> _Change:
    rec = ss.fields["grad_checkpointing"]
    if ss.style == "unsloth":
        edits = _edit(rec, '"unsloth"', "use_gradient_checkpointing", ss.anchors.get("lora_config"))
        values = {"grad_checkpointing": "offload"}
    elif ss.style in ("trainer", "sft"):
        edits = _edit(rec, "True", "gradient_checkpointing", ss.anchors.get("training_args"))
        values = {"grad_checkpointing": "full"}
    elif rec.lines:  # enabled, but the model never enters train mode
        edits = (f"before the training loop: model.train() (line {rec.lines[0]} enables checkpointing, which "
                 "recomputes only in train mode)",)
        values = {"grad_checkpointing": "full"}
    else:
        edits = (f"{_after_load(ss)}: model.gradient_checkpointing_enable(); "
                 "model.config.use_cache = False; and model.train() before the loop",)
        values = {"grad_checkpointing": "full"}
    return _Change("ckpt", "gradient checkpointing", values, edits, _lines(rec),
                   "recomputes every layer's forward in backward")


def _micro_batch(ss: ScriptSetup, micro: int) -> _Change:
    s, f = ss.setup, ss.fields
    accum = s.grad_accum * s.batch_size // micro
    edits = list(_edit(f["batch_size"], str(micro), "per_device_train_batch_size" if ss.style != "loop" else
                       "batch_size"))
    acc = f["grad_accum"]
    if ss.style != "loop" or acc.edit is not None:
        edits += _edit(acc, str(accum), "gradient_accumulation_steps", ss.anchors.get("training_args"))
    else:
        back = ss.anchors.get("backward")
        edits.append(f"in the loop{f' (line {back})' if back else ''}: accumulate {accum} micro-batches: "
                     f"(loss / {accum}).backward(), then optimizer.step() and zero_grad() every {accum} batches")
    return _Change(f"micro{micro}", f"micro-batch {micro} x {accum} accumulation",
                   {"batch_size": micro, "grad_accum": accum}, tuple(edits),
                   tuple(sorted({*_lines(f["batch_size"]), *_lines(acc)})), "same effective batch, smaller steps")


def _qlora(ss: ScriptSetup) -> _Change:
    load = ss.anchors.get("model_load")
    if ss.style == "unsloth":
        edits = (_at(load, "load_in_4bit=True"),)
    else:
        edits = (_at(load, f"from_pretrained(..., quantization_config={BNB_CONFIG}, device_map={{'': 0}}) (no "
                           "prepare_model_for_kbit_training: it casts embeddings and lm_head to float32, which this "
                           "estimate does not count)"),)
    return _Change("qlora", "QLoRA (4-bit base weights)", {"method": "qlora", "dtype": "bf16"}, edits,
                   (load,) if load else (), "4-bit NF4 base weights: a small quality cost; needs bitsandbytes + CUDA")


def _adam8bit(ss: ScriptSetup) -> _Change:
    rec = ss.fields["optimizer"]
    if rec.edit is not None and rec.edit.kind == "class":
        edits = (f"line {rec.edit.line}: {rec.edit.text}(...) -> bnb.optim.AdamW8bit(...) (import bitsandbytes as "
                 "bnb)",)
    elif ss.style == "loop":
        edits = ("the optimizer: bnb.optim.AdamW8bit(model.parameters(), lr=...) (import bitsandbytes as bnb)",)
    else:
        edits = _edit(rec, '"adamw_bnb_8bit"', "optim", ss.anchors.get("training_args"))
    return _Change("adam8", optimizer_specs.get("adamw8bit").label, {"optimizer": "adamw8bit"}, edits, _lines(rec),
                   "the same Adam update with 8-bit states; needs bitsandbytes + CUDA")


def _edit(rec: Recovered, new: str, kw: str, anchor: int | None = None) -> tuple[str, ...]:
    """"line N: old -> new" for where the field is written, or where to add it."""
    e: Edit | None = rec.edit
    if e is None:
        where = f"line {anchor}: " if anchor else ""
        return (f"{where}add {kw}={new}",)
    if e.kind == "constant":
        return (f"line {e.line}: {e.text} -> {e.name} = {new}",)
    if e.kind == "argparse":
        return (f"line {e.line}: {e.text} -> default={new} (or run the script with {e.call} {new})",)
    if e.kind == "missing":
        return (f"line {e.line}: add {e.name}={new} to {e.call}",)
    if e.kind == "class":
        return (f"line {e.line}: {e.text} -> {new}",)
    return (f"line {e.line}: {e.text} -> {e.name}={new}",)


def _at(line: int | None, text: str) -> str:
    """"line N: text", or the text alone when the script has no such line (never "line None:")."""
    return f"line {line}: {text}" if line else text


def _after_load(ss: ScriptSetup) -> str:
    """Where code goes that must follow the model load: "after line N", or "after the model is loaded"."""
    load = ss.anchors.get("model_load")
    return f"after line {load}" if load else "after the model is loaded"


def _lines(rec: Recovered) -> tuple[int, ...]:
    return rec.lines or ((rec.edit.line,) if rec.edit else ())


# ---- the search ----------------------------------------------------------------------------------------------------
def _search(spec: ModelSpec, ss: ScriptSetup, gpu: GpuSpec, base_speed: float, fits_already: bool) -> list[Fix]:
    """The ranked fixes; `fits_already`: the script fits but only with allocator retries."""
    singles = _candidates(ss)
    evaluated: dict[tuple[str, ...], Fix | None] = {}


    def evaluate(combo: tuple[_Change, ...], steps: int = 1) -> Fix | None:
        keys = tuple(c.key for c in combo)
        if keys in evaluated and steps == 1:
            return evaluated[keys]
        values: dict = {}
        for c in combo:
            values.update(c.values)
        s = ss.setup.replace(**values)
        try:
            e = estimate(spec, s, gpu, allocator_steps=steps)  # 1: a screen (the first step's reserved peak)
        except Exception:  # noqa: BLE001 - a combination the model rejects (a rank above the hidden size) is no fix
            evaluated[keys] = None
            return None
        speed = throughput.predict(spec, s, gpu).tokens_per_s
        fix = Fix(" + ".join(c.label for c in combo), tuple(x for c in combo for x in c.edits),
                  tuple(sorted({x for c in combo for x in c.lines})), s, e.peak_allocated_bytes,
                  e.peak_reserved_bytes, bool(e.fits), bool(e.retries_expected), speed,
                  speed / base_speed - 1 if base_speed else 0.0, "; ".join(c.cost for c in combo if c.cost != "none")
                  or "none", any(c.changes_training for c in combo))
        evaluated[keys] = fix
        return fix

    def useful(f: Fix | None) -> bool:
        # a step that already fits with allocator retries is fixed only by a change that removes them
        return f is not None and f.fits and not (fits_already and f.retries_expected)

    combos = {f.change: (c,) for c in singles if useful(f := evaluate((c,)))}
    for size in (2, 3):
        if any(not evaluated[tuple(c.key for c in combo)].retries_expected for combo in combos.values()):
            break
        pool = [c for c in singles if (c,) not in combos.values()]
        for combo in itertools.combinations(pool, size):
            if len({c.key[:4] for c in combo}) < size:
                continue  # two micro-batch sizes, or two ranks, together
            fix = evaluate(combo)
            if useful(fix):
                combos[fix.change] = combo
    screened = sorted(_minimal([evaluated[tuple(c.key for c in combo)] for combo in combos.values()]), key=_rank)
    confirmed = [evaluate(combos[f.change], steps=2) for f in screened[:MAX_FIXES + 2]]  # the steady state
    return sorted([f for f in confirmed if useful(f)], key=_rank)[:MAX_FIXES]


def _rank(f: Fix):
    return (f.retries_expected, f.changes_training, f.setup.optimizer not in ADAM_FAMILY, -f.tokens_per_s,
            f.change.count(" + "))


def _minimal(fixes: list[Fix]) -> list[Fix]:
    """Drop a combination when one of its parts already fits as well on its own."""
    clean = [f for f in fixes if " + " not in f.change]
    out = []
    for f in fixes:
        parts = f.change.split(" + ")
        if len(parts) > 1 and any(g.change in parts and g.retries_expected <= f.retries_expected for g in clean):
            continue
        if len(parts) > 2 and any(" + " in g.change and set(g.change.split(" + ")) < set(parts)
                                  and g.retries_expected <= f.retries_expected for g in fixes):
            continue
        out.append(f)
    return out


# ---- fitune's runner ---------------------------------------------------------------------------------------------
def _runner_plan(spec: ModelSpec, ss: ScriptSetup, gpu: GpuSpec, speed: float, est) -> RunnerPlan | None:
    """`fitune plan`'s best setup for the same tokens per step and adapters; None when it finds none."""
    s = ss.setup
    methods = {"lora": ("lora", "qlora"), "qlora": ("lora", "qlora"), "full": ("full", "lora", "qlora"),
               "freeze": ("freeze",)}[s.method]
    try:
        res = plan(PlanRequest(model=spec, gpu=gpu, seq_len_tokens=s.seq_len_tokens,
                               batch_size=s.batch_size * s.grad_accum, methods=methods, lora_rank=s.lora_rank,
                               lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout, lora_targets=s.lora_targets,
                               freeze_trainable_layers=s.freeze_trainable_layers, top=1))
    except FituneError:
        return None
    if not res.plans:
        return None
    p = res.plans[0]
    if est.fits and not est.retries_expected and p.tokens_per_s <= speed:
        return None  # the script fits and the runner would not be faster
    targets = "all-linear" if s.all_linear else ",".join(s.lora_targets)
    command = (f"fitune plan {spec.name} --gpu {gpu.name} --seq-len {s.seq_len_tokens} --batch-size "
               f"{s.batch_size * s.grad_accum}" + (f" --lora-rank {s.lora_rank} --lora-targets {targets}"
                                                   if s.method in ("lora", "qlora") else "")
               + (" --method full,lora,qlora" if s.method == "full" else ""))
    return RunnerPlan(command, describe(p.setup), p.peak_reserved_bytes, p.tokens_per_s, p.retries_expected)
