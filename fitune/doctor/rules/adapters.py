"""Rules about what trains: LoRA targets and biases, and the optimizer of a full fine-tuning."""

from __future__ import annotations

from typing import Iterator

from .. import evidence
from ..findings import INFO, WARNING
from ..evidence import LARGE_RANK, REFERENCE_MODEL, USUAL_RANK
from ..index import ScriptIndex
from ...errors import FituneError
from ...units import gib
from .base import Hit, call_text, known_setup, rule, script_catalog_model, script_model

ALL_LINEAR_SETS = (
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},  # Llama, Mistral, Qwen, Gemma
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},  # Phi-3
)
MEMORY_LEAN_OPTIMIZERS = ("8bit", "adafactor", "sgd", "lomo", "galore", "apollo")
"""`optim=` values (substrings) of TrainingArguments whose state is far below AdamW's 8 bytes per parameter."""
LARGE_MODEL_PARAMS = 1_000_000_000
"""From about 1B parameters AdamW's fp32 states alone (8 GiB+) crowd out a consumer card."""


@rule("lora-all-linear", INFO, "LoRA on every linear layer (what it costs)", ("C08",))
def lora_all_linear(ix: ScriptIndex) -> Iterator[Hit]:
    for c in ix.calls_named("LoraConfig"):
        targets = ix.value(c.kw("target_modules"))
        names = {t for t in targets if isinstance(t, str)} if isinstance(targets, list) else set()
        everything = targets == "all-linear" or any(s <= names for s in ALL_LINEAR_SETS)  # [1, None, {}]: no names
        if not everything:
            continue
        yield Hit(c.line,
                  f"`{call_text(c)}` puts adapters on every linear layer. That is a fair choice for quality; its "
                  "memory cost is the inputs each adapter saves for backward (large without checkpointing, small "
                  "with it), plus more adapter weights, gradients and optimizer states.",
                  'if memory is the problem: turn gradient checkpointing on, or target_modules=["q_proj", "v_proj"] '
                  "(fewer adapters, usually somewhat lower quality)",
                  evidence.lora_all_linear(script_model(ix), known_setup(ix)))


@rule("lora-bias", INFO, 'LoRA with bias="all" or "lora_only"', ("C08",))
def lora_bias(ix: ScriptIndex) -> Iterator[Hit]:
    for c in ix.calls_named("LoraConfig"):
        bias = ix.value(c.kw("bias"))
        if bias not in ("all", "lora_only"):
            continue
        model = script_model(ix)
        n = evidence.bias_params(model)
        yield Hit(c.line,
                  f'`{call_text(c)}` trains biases too (bias="{bias}"): the adapters no longer restore the base '
                  "model when disabled, and each trained bias adds its gradient and optimizer state. Memory is rarely "
                  "the reason to avoid it: a bias's gradient is a sum over the output gradient and saves no "
                  "activation.",
                  'bias="none" (PEFT\'s default) unless you need the biases to adapt',
                  f"computed from the catalog config: {model} has {n:,} bias parameters "
                  f"(at most 16 bytes each with gradient and AdamW states: {n * 16 / 2**20:.1f} MiB); reasoned "
                  "(not measured): no activation is saved for a bias gradient")


@rule("full-finetune-adamw", WARNING, "full fine-tuning of a large model with a non-8-bit AdamW", ("C05", "C06"))
def full_finetune_adamw(ix: ScriptIndex) -> Iterator[Hit]:
    if not ix.trains or ix.uses_peft or ix.freezes_parameters or not ix.model_loads:
        return
    if any(load.has_kw("quantization_config", "load_in_4bit", "load_in_8bit") for load in ix.model_loads):
        return
    known = script_catalog_model(ix)
    if known and evidence.param_count(known) < LARGE_MODEL_PARAMS:
        return
    model = known or REFERENCE_MODEL
    for line, what in _adamw_sites(ix):
        yield Hit(line,
                  f"{what} in a full fine-tuning: AdamW keeps two states per parameter in the parameters' dtype (4 "
                  "bytes per parameter in bf16, 8 in fp32) on top of the weights and a gradient per parameter; for "
                  "a model of a few billion parameters the states alone fill most of a 24 GB card.",
                  'optim="adamw_bnb_8bit" or "paged_adamw_8bit" in TrainingArguments (bitsandbytes.optim.AdamW8bit '
                  "in a plain loop), or LoRA, which trains a few million parameters",
                  evidence.full_finetune_optimizer(model, known_setup(ix)),
                  severity=None if known else INFO)


def _adamw_sites(ix: ScriptIndex) -> Iterator[tuple[int, str]]:
    for c in ix.calls:
        if c.tail in ("AdamW", "Adam") and (c.name.startswith("torch.") or c.name in ("AdamW", "Adam")):
            yield c.line, f"`{call_text(c)}`"
    if not ix.uses_trainer:
        return
    for args in ix.training_args:
        if args.open_kwargs:
            continue
        optim = ix.value(args.kw("optim"))
        if args.kw("optim") is None:
            yield args.line, f"`{call_text(args)}` without optim= (Trainer's default AdamW)"
        elif isinstance(optim, str) and not any(s in optim for s in MEMORY_LEAN_OPTIMIZERS):
            yield args.line, f'`{call_text(args)}` with optim="{optim}"'


@rule("lora-rank-large", WARNING, f"a very large LoRA rank (r > {LARGE_RANK})")
def lora_rank_large(ix: ScriptIndex) -> Iterator[Hit]:
    """r in the hundreds: every adapter weight trains with its fp32 gradient and two AdamW states (16 bytes per
    parameter), and the adapter inputs' products grow with r."""
    sites = ix.calls_named("LoraConfig") + [c for c in ix.calls if c.tail == "get_peft_model"
                                            and c.receiver.endswith("FastLanguageModel")]
    for c in sites:
        r = ix.value(c.kw("r"))
        if not isinstance(r, int) or isinstance(r, bool) or r <= LARGE_RANK:
            continue
        ss = ix.script_setup
        model = ss.model
        try:
            big = _lora_cost(ss, r)
            small = _lora_cost(ss, USUAL_RANK)
        except FituneError:
            continue  # a rank above the model's hidden size: estimate reports that itself
        where = "" if ss.model_known else f" (the script's model is not in fitune's catalog: quoted for {model})"
        yield Hit(c.line,
                  f"`{call_text(c)}` asks for r={r}: {big[0] / 1e6:,.0f}M trainable parameters on "
                  f"{model}{where}, each with an fp32 weight, an fp32 gradient and two AdamW states - "
                  f"{gib(big[1])} before any activation, against {gib(small[1])} at r={USUAL_RANK}.",
                  f"r={USUAL_RANK} to {LARGE_RANK} is what most LoRA recipes use (scale lora_alpha with it to keep "
                  "the update's size); if the task needs that much capacity, QLoRA or 8-bit AdamW make room for it",
                  f"{evidence.ESTIMATED}, {evidence.describe_script(ss)}: adapter weights + optimizer states "
                  f"{gib(big[1])} at r={r} vs {gib(small[1])} at r={USUAL_RANK} (gradients add the adapter weights' "
                  f"size again while they exist); peak {gib(big[2])} vs {gib(small[2])} allocated")


def _lora_cost(ss, r: int) -> tuple[int, int, int]:
    """(trainable parameters, adapter weights + optimizer state bytes, peak allocated) of the script at rank r."""
    e = evidence._est_setup(ss.model, ss.setup.replace(lora_rank=r, method=ss.setup.method if ss.setup.method in (
        "lora", "qlora") else "lora"), ss.gpu)
    state = e.resident_bytes.get("adapter_weights", 0) + e.resident_bytes.get("optimizer_states", 0)
    return e.trainable_params, state, e.peak_allocated_bytes


RULES = (lora_all_linear, lora_bias, full_finetune_adamw, lora_rank_large)
