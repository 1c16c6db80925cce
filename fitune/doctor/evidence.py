"""The figures behind doctor findings: GPU measurements from bench/ and fitune's own estimates.

Measured figures are copied here (the package does not ship bench/) as `MeasuredCase` records naming the file and
case they come from; tests/test_doctor_evidence.py re-reads that file and fails when a figure no longer matches.
Estimated figures are computed on demand with `fitune.memory.estimate` (validated against the same file; README,
"Accuracy"), so they follow the estimator. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..memory import estimate
from ..memory.weights import count_params
from ..setup import TrainSetup
from ..specs import load_model_spec
from ..specs.gpu import resolve_gpu
from ..specs.model import catalog_key_for_hub_id
from ..units import gib

HF_RECIPE = "bench/results/hf_recipe/hf_recipe.jsonl"
"""Measured on one H200 with transformers 5.17 + PEFT 0.21 (bench/results/hf_recipe/COMMAND.md): the file read."""
HF_RECIPE_CITED = "the HF recipe's measured runs (docs/accuracy.md)"
"""How a user-facing message names those records: the documentation, not a path an installed wheel lacks."""
REFERENCE_MODEL = "llama-3.1-8b"
"""The model estimates are quoted for when the script's model is not in fitune's catalog (the forum case)."""
USUAL_RANK = 16
"""The LoRA rank the doctor suggests in place of a large one (or of full fine-tuning) and quotes costs against."""
LARGE_RANK = 64
"""The largest LoRA rank most recipes use (8-64): a rank above it is flagged (`lora-rank-large`) and gets the
smaller-rank fixes (r/4 and USUAL_RANK); the adapter's bytes grow linearly with r."""
ESTIMATED = "fitune estimate (its error against measured runs: docs/accuracy.md)"


@dataclass(frozen=True)
class MeasuredCase:
    """One measured run of the HF recipe: the fields the doctor quotes. All sizes in bytes."""

    group: str
    case: int
    label: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    saved_tensor_bytes: int
    """Bytes autograd saved in the last step's forward (parameters excluded)."""
    tokens_per_s: int
    """Rounded to a whole token."""

    def cite(self) -> str:
        return f"{HF_RECIPE_CITED}, {self.group} case {self.case}"


LLAMA_QV_FULL = MeasuredCase(
    "llama-3.1-8b:bf16", 0, "llama-3.1-8b LoRA r8 q,v, 2x2048, checkpointing full, sdpa",
    23614532096, 25480396800, 3242246148, 9641)
LLAMA_QV_NONE = MeasuredCase(
    "llama-3.1-8b:bf16", 1, "llama-3.1-8b LoRA r8 q,v, 2x2048, no checkpointing, sdpa",
    45048474112, 46569357312, 24677220868, 12684)
LLAMA_QV_8192_FULL = MeasuredCase(
    "llama-3.1-8b:bf16", 4, "llama-3.1-8b LoRA r8 q,v, 1x8192, checkpointing full, sdpa",
    31062665728, 34730934272, 6484492300, 8592)
LLAMA_QV_32768_FULL = MeasuredCase(
    "llama-3.1-8b:bf16", 5, "llama-3.1-8b LoRA r8 q,v, 1x32768, checkpointing full, sdpa",
    75745077760, 89881837568, 25937969164, 5977)
LLAMA_EAGER_NONE = MeasuredCase(
    "llama-3.1-8b:bf16", 7, "llama-3.1-8b LoRA r8 q,v, 1x2048, no checkpointing, eager",
    56622082560, 57784926208, 38352207884, 7737)
LLAMA_ALL_FULL = MeasuredCase(
    "llama-3.1-8b:bf16", 8, "llama-3.1-8b LoRA r16 all-linear, 2x2048, checkpointing full, sdpa",
    24076954112, 26422018048, 3242246148, 6156)
LLAMA_ALL_NONE = MeasuredCase(
    "llama-3.1-8b:bf16", 9, "llama-3.1-8b LoRA r16 all-linear, 2x2048, no checkpointing, sdpa",
    61667355136, 65749909504, 40833679876, 8502)
LLAMA_NF4_QV_FULL = MeasuredCase(
    "llama-3.1-8b:nf4", 0, "llama-3.1-8b QLoRA r8 q,v, 2x2048, checkpointing full, sdpa",
    13256764928, 15248392192, 3242246148, 9056)
MISTRAL_QV_FULL = MeasuredCase(
    "mistral-7b:bf16", 0, "mistral-7b LoRA r8 q,v, 2x2048, checkpointing full, sdpa",
    17356630528, 18440257536, 1677770756, 10061)
GEMMA_EAGER_FULL = MeasuredCase(
    "gemma-2-2b:bf16", 0, "gemma-2-2b LoRA r8 q,v, 2x2048, checkpointing full, eager",
    20560286208, 24102567936, 6819996676, 13188)
GEMMA_SDPA_FULL = MeasuredCase(
    "gemma-2-2b:bf16", 3, "gemma-2-2b LoRA r8 q,v, 2x2048, checkpointing full, sdpa",
    20526731776, 23150460928, 6819996676, 17125)

MEASURED_CASES = (LLAMA_QV_FULL, LLAMA_QV_NONE, LLAMA_QV_8192_FULL, LLAMA_QV_32768_FULL, LLAMA_EAGER_NONE,
                  LLAMA_ALL_FULL, LLAMA_ALL_NONE, LLAMA_NF4_QV_FULL, MISTRAL_QV_FULL, GEMMA_EAGER_FULL, GEMMA_SDPA_FULL)


@dataclass(frozen=True)
class MeasuredProfile:
    """One `fitune profile` run on the GPU (bench/results/profile/*.json): the fields the doctor quotes."""

    file: str
    cap_bytes: int | None
    """The memory cap (torch.cuda.set_per_process_memory_fraction) the run had; None: the whole H200."""
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_alloc_retries: int
    oom: bool


SEEDS_CAPPED = MeasuredProfile("bench/results/profile/seeds_ckpt_capped_rtx4090.json", 25125558681,
                               23614532096, 24077402112, 1, False)
SEEDS_UNCAPPED = MeasuredProfile("bench/results/profile/seeds_ckpt_uncapped.json", None,
                                 23614532096, 25480396800, 0, False)
SEEDS_NOCKPT_CAPPED = MeasuredProfile("bench/results/profile/seeds_nockpt_capped_rtx4090.json", 25125558681,
                                      24842933760, 25113395200, 1, True)
MEASURED_PROFILES = (SEEDS_CAPPED, SEEDS_UNCAPPED, SEEDS_NOCKPT_CAPPED)

DOCTOR_SCRIPTS = "bench/results/doctor/doctor_scripts.jsonl"
"""Forum scripts run as written on the H200 under a card's allocator cap (bench/results/doctor/COMMAND.md)."""
RETRIES_VERDICT_OUTCOMES = {"completed": 1, "out_of_memory": 3}
"""Of the scripts in DOCTOR_SCRIPTS whose estimate said "fits only with allocator retries" (allocated under the
budget, reserved over it), how many completed and how many ran out of memory (tests/test_doctor_evidence.py
recounts them from the file)."""


def retries_verdict_evidence(gpu_name: str) -> str:
    """What the measured forum scripts say about a "fits only with allocator retries" verdict."""
    done, oom = RETRIES_VERDICT_OUTCOMES["completed"], RETRIES_VERDICT_OUTCOMES["out_of_memory"]
    return (f"measured: of the {done + oom} forum scripts run as written under a 24 GB card's cap with this verdict, "
            f"{done} completed and {oom} ran out of memory (docs/evidence.md): on the {gpu_name}, plan for it not "
            "to fit, and take a fix below")


def _peak(case: MeasuredCase) -> str:
    return f"{gib(case.peak_allocated_bytes)} peak allocated"


# ---- estimates ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _est(model_name: str, **setup_fields):
    """fitune's estimate of one step of `model_name` with TrainSetup(**setup_fields) (tuples for list fields)."""
    return estimate(load_model_spec(model_name), TrainSetup(**setup_fields))


@lru_cache(maxsize=256)
def _est_setup(model_name: str, setup, gpu: str | None = None):
    """fitune's estimate of `setup` on `model_name`, with `gpu`'s cuBLAS workspaces (as `fitune doctor --gpu`)."""
    return estimate(load_model_spec(model_name), setup, resolve_gpu(gpu) if gpu else None)


def describe_script(script) -> str:
    """"llama-3.1-8b, LoRA r8 on q_proj,v_proj, 2 x 2048 tokens, bf16, checkpointing full" for a ScriptSetup."""
    s = script.setup
    method = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tuning", "freeze": "freeze"}[s.method]
    if s.method in ("lora", "qlora"):
        method += f" r{s.lora_rank} on {','.join(s.lora_targets)}"
    return (f"{script.model}, {method}, {s.batch_size} x {s.seq_len_tokens} tokens, {s.dtype}, checkpointing "
            f"{s.grad_checkpointing}, {s.attn}, {s.optimizer}")


def live(script, fixed: dict, fixed_label: str, as_written: dict | None = None, written_label: str = "as written",
         term: str | None = None) -> str:
    """fitune's estimate of this script's own step, as written and with the fix: "fitune estimate (validated ...),
    this script's step (llama-3.1-8b, LoRA r8 ...): peak 21.99 GiB allocated as written, 17.10 GiB with ..."."""
    base = _est_setup(script.model, script.setup.replace(**(as_written or {})), script.gpu)
    fix = _est_setup(script.model, script.setup.replace(**fixed), script.gpu)
    text = (f"{ESTIMATED}, this script's step ({describe_script(script)}): peak {gib(base.peak_allocated_bytes)} "
            f"allocated {written_label}, {gib(fix.peak_allocated_bytes)} {fixed_label}")
    if term:
        text += (f"; {term.replace('_', ' ')} {gib(base.resident_bytes.get(term, base.breakdown.get(term, 0)))} vs "
                 f"{gib(fix.resident_bytes.get(term, fix.breakdown.get(term, 0)))}")
    return text


# ---- the evidence each rule quotes ------------------------------------------------------------------------------
def lora_all_linear(model_name: str = REFERENCE_MODEL, script=None) -> str:
    measured = (f"measured: {LLAMA_QV_NONE.label}: {_peak(LLAMA_QV_NONE)}; r16 all-linear, same setup: "
                f"{_peak(LLAMA_ALL_NONE)} ({LLAMA_QV_NONE.cite()} and {LLAMA_ALL_NONE.case}); with checkpointing "
                f"full: {_peak(LLAMA_QV_FULL)} vs {_peak(LLAMA_ALL_FULL)} (cases {LLAMA_QV_FULL.case} and "
                f"{LLAMA_ALL_FULL.case})")
    if script is not None:
        return (live(script, {"lora_targets": ("q_proj", "v_proj")}, "with target_modules q_proj,v_proj")
                + ". " + measured)
    qv = _est(model_name)
    al = _est(model_name, lora_targets=("all-linear",))
    saved_qv = qv.phases["forward"].breakdown.get("saved_activations", 0)
    saved_al = al.phases["forward"].breakdown.get("saved_activations", 0)
    qv_ck = _est(model_name, grad_checkpointing="full")
    al_ck = _est(model_name, lora_targets=("all-linear",), grad_checkpointing="full")
    return (
        f"{measured}. "
        f"{ESTIMATED}, {model_name} r8, 2x2048, no checkpointing: saved activations at the end of the forward "
        f"{gib(saved_qv)} (q,v) vs {gib(saved_al)} (all-linear), peak {gib(qv.peak_allocated_bytes)} vs "
        f"{gib(al.peak_allocated_bytes)}; with checkpointing full: {gib(qv_ck.peak_allocated_bytes)} vs "
        f"{gib(al_ck.peak_allocated_bytes)}"
    )


_DEFAULT_DTYPE = ("Default dtype: transformers 5 from_pretrained sets dtype='auto' when none is given "
                  "(modeling_utils.py), transformers 4 loaded float32")


def fp32_weights(model_name: str = REFERENCE_MODEL, script=None) -> str:
    if script is not None and script.setup.method != "qlora":
        return live(script, {"dtype": "bf16"}, "in bf16", {"dtype": "fp32"}, "with float32 weights",
                    term="weights") + ". " + _DEFAULT_DTYPE
    bf16 = _est(model_name, grad_checkpointing="full")
    fp32 = _est(model_name, grad_checkpointing="full", dtype="fp32")
    return (f"{ESTIMATED}: {model_name} weights {gib(bf16.resident_bytes['weights'])} in bf16 vs "
            f"{gib(fp32.resident_bytes['weights'])} in fp32; LoRA r8 q,v, 2x2048, checkpointing full: peak "
            f"{gib(bf16.peak_allocated_bytes)} vs {gib(fp32.peak_allocated_bytes)}. {_DEFAULT_DTYPE}")


_FP16_RANGE = ("Reasoned (not measured here): fp16's range ends at 65504 and its normal numbers at 6.1e-5, so it "
               "needs a loss scaler whose skipped steps slow training; bf16 has float32's range and needs none")


def fp16_same_bytes(model_name: str = REFERENCE_MODEL, script=None) -> str:
    if script is not None and script.setup.dtype != "fp32":
        return (live(script, {"dtype": "bf16"}, "in bf16", {"dtype": "fp16"}, "in fp16")
                + f" - both are 2 bytes per value. {_FP16_RANGE}")
    bf16 = _est(model_name, grad_checkpointing="full")
    fp16 = _est(model_name, grad_checkpointing="full", dtype="fp16")
    return (f"{ESTIMATED}: {model_name} LoRA, 2x2048, checkpointing full: peak {gib(bf16.peak_allocated_bytes)} in "
            f"bf16, {gib(fp16.peak_allocated_bytes)} in fp16 - both are 2 bytes per value. {_FP16_RANGE}")


def seq_len_cost(model_name: str = REFERENCE_MODEL, script=None) -> str:
    if script is not None and script.setup.seq_len_tokens >= 2:
        n = script.setup.seq_len_tokens
        return live(script, {"seq_len_tokens": n // 2}, f"when the batch's longest example has {n // 2} tokens",
                    written_label=f"padded to {n}") + ": a padding token costs what a real one does"
    s2048 = _est(model_name, grad_checkpointing="full")
    s1024 = _est(model_name, grad_checkpointing="full", seq_len_tokens=1024)
    n2048 = _est(model_name)
    n1024 = _est(model_name, seq_len_tokens=1024)
    return (f"{ESTIMATED}: {model_name} LoRA r8 q,v, batch 2: peak {gib(s2048.peak_allocated_bytes)} at 2048 tokens "
            f"vs {gib(s1024.peak_allocated_bytes)} at 1024 with checkpointing full, {gib(n2048.peak_allocated_bytes)}"
            f" vs {gib(n1024.peak_allocated_bytes)} without: a padding token costs what a real one does")


def long_example_cost(script=None) -> str:
    measured = (f"measured: {LLAMA_QV_FULL.label}: {_peak(LLAMA_QV_FULL)}; one 8192-token sequence instead "
                f"({LLAMA_QV_8192_FULL.label}): {_peak(LLAMA_QV_8192_FULL)} ({LLAMA_QV_FULL.cite()} and "
                f"{LLAMA_QV_8192_FULL.case}). With dynamic padding one untruncated long example pads its whole batch "
                "to its length")
    if script is not None:
        n = script.setup.seq_len_tokens
        return (live(script, {"seq_len_tokens": n}, f"truncated to {n}", {"seq_len_tokens": 2 * n},
                     f"when a batch meets one {2 * n}-token example") + ". " + measured)
    return measured


def doubled_sequence(model_name: str = REFERENCE_MODEL, script=None) -> str:
    if script is not None:
        n = script.setup.seq_len_tokens
        return live(script, {"seq_len_tokens": n}, f"at the {n} tokens intended", {"seq_len_tokens": 2 * n},
                    f"with the sequence doubled ({2 * n} tokens)")
    s2048 = _est(model_name, grad_checkpointing="full")
    s4096 = _est(model_name, grad_checkpointing="full", seq_len_tokens=4096)
    return (f"{ESTIMATED}: {model_name} LoRA r8 q,v, batch 2, checkpointing full: peak "
            f"{gib(s2048.peak_allocated_bytes)} at 2048 tokens, {gib(s4096.peak_allocated_bytes)} at 4096 (the "
            "sequence doubled)")


def full_finetune_optimizer(model_name: str = REFERENCE_MODEL, script=None) -> str:
    if script is not None and script.setup.method == "full":
        return live(script, {"optimizer": "adamw8bit"}, "with adamw8bit", {"optimizer": "adamw"}, "with AdamW",
                    term="optimizer_states")
    adamw = _est(model_name, method="full", grad_checkpointing="full")
    adam8 = _est(model_name, method="full", grad_checkpointing="full", optimizer="adamw8bit")
    lora = _est(model_name, grad_checkpointing="full")
    return (f"{ESTIMATED}: {model_name} full fine-tuning, bf16, 2x2048, checkpointing full: optimizer states "
            f"{gib(adamw.resident_bytes['optimizer_states'])} with AdamW vs "
            f"{gib(adam8.resident_bytes['optimizer_states'])} with adamw8bit; peak {gib(adamw.peak_allocated_bytes)}"
            f" vs {gib(adam8.peak_allocated_bytes)} (LoRA r8 q,v: {gib(lora.peak_allocated_bytes)})")


def eager_attention(script=None) -> str:
    per_seq_sdpa = LLAMA_QV_NONE.saved_tensor_bytes // 2
    measured = (f"measured: autograd saved {gib(LLAMA_EAGER_NONE.saved_tensor_bytes)} per 2048-token sequence with "
                f"eager attention ({LLAMA_EAGER_NONE.label}) vs {gib(per_seq_sdpa)} with sdpa (half of case "
                f"{LLAMA_QV_NONE.case}'s 2 sequences) ({LLAMA_EAGER_NONE.cite()} and {LLAMA_QV_NONE.case}): eager "
                f"keeps each layer's batch x heads x seq x seq attention probabilities; with checkpointing the "
                f"difference nearly vanishes ({GEMMA_EAGER_FULL.label}: {_peak(GEMMA_EAGER_FULL)}; sdpa: "
                f"{_peak(GEMMA_SDPA_FULL)}; {HF_RECIPE_CITED}, {GEMMA_EAGER_FULL.group} cases {GEMMA_EAGER_FULL.case} and "
                f"{GEMMA_SDPA_FULL.case})")
    if script is not None:
        return live(script, {"attn": "sdpa"}, "with sdpa", {"attn": "eager"}, "with eager") + ". " + measured
    return measured


def allocator_flushes_itself() -> str:
    return (f"measured: the seeds' step (llama-3.1-8b LoRA r8 q,v, 2x2048, checkpointing full) reserves "
            f"{gib(SEEDS_UNCAPPED.peak_reserved_bytes)} on a whole H200 ({SEEDS_UNCAPPED.file}); capped to "
            f"{gib(SEEDS_CAPPED.cap_bytes)} (an RTX 4090) it completed at {gib(SEEDS_CAPPED.peak_allocated_bytes)} "
            f"allocated, {gib(SEEDS_CAPPED.peak_reserved_bytes)} reserved, after {SEEDS_CAPPED.num_alloc_retries} "
            f"allocator retry (docs/accuracy.md, the seeds' case under a 24 GB card's budget): the caching allocator frees its cache by itself before it "
            "fails")


def checkpointing_effect(script=None) -> str:
    measured = checkpointing_measured()
    if script is not None:
        return live(script, {"grad_checkpointing": "full"}, "recomputing", {"grad_checkpointing": "none"},
                    "without recomputation") + ". " + measured
    return measured


def checkpointing_measured() -> str:
    return (f"measured: {LLAMA_QV_NONE.label}: {_peak(LLAMA_QV_NONE)}, {LLAMA_QV_NONE.tokens_per_s} tokens/s; "
            f"checkpointing full: {_peak(LLAMA_QV_FULL)}, {LLAMA_QV_FULL.tokens_per_s} tokens/s "
            f"({LLAMA_QV_NONE.cite()} and {LLAMA_QV_FULL.case})")


def catalog_name(model_id: str) -> str | None:
    """"meta-llama/Llama-3.1-8B-Instruct" or "llama-3.1-8b" -> the catalog name; None when not in the catalog: the
    matching `fitune estimate` uses for a Hub id that is not in the Hub cache (`fitune.specs.model.
    catalog_key_for_hub_id`: exact, then tolerant of an owner, `Meta-`, `-Instruct`, `-it`, `-bnb-4bit`, ...)."""
    return catalog_key_for_hub_id(model_id)


def param_count(model_name: str) -> int:
    return count_params(load_model_spec(model_name)).total


def bias_params(model_name: str) -> int:
    """Bias parameters of the decoder's linear layers (what LoRA's bias="all" makes trainable), from the config."""
    m = load_model_spec(model_name)
    per_kind = ((False, m.dense_layers), (True, m.moe_layers))
    return sum(lin.out_features * lin.count_per_layer * n for moe, n in per_kind for lin in m.linears(moe) if lin.bias)
