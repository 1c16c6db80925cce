"""`plan()`: the fastest training setups that fit a GPU, and why the faster ones do not.

The space: method (from the request) x micro-batch (every divisor of the per-GPU batch, the rest as gradient
accumulation: the effective batch never changes) x activation checkpointing (none | full | offload, and
selective:K below) x attention x loss (transformers' or the chunked one) x optimizer; with --gpus N also strategy (ddp | fsdp | zero2 |
zero3 | zero3_offload) x GPU count (the divisors of N that split the batch; `parallel_options`), memory per GPU
(fitune/memory/parallel.py) and communication in the speed (throughput.py); packing is decided from the data.
LoRA rank and targets are the user's and never change.

How it stays fast (an 8B model answers in well under a second):
1. every setup's speed is predicted first (throughput.py: arithmetic only), and setups are visited fastest first;
2. memory order prunes: a setup that needs at least as much memory as one that did not fit (larger micro-batch,
   no checkpointing, eager instead of sdpa, LoRA instead of QLoRA...) is not estimated, and neither is one that is
   both slower and no lighter than a plan already found (it could never be chosen);
3. the optimizer is picked per setup in order of preference (adamw, then 8-bit AdamW - the same update with
   quantised states - then adafactor and sgd, which change the training) and only while it could make a
   difference: when the peak without any optimizer state is over the budget, no optimizer will fit;
4. memory is estimated on 2- and 3-layer models and extrapolated (fast.py); the fastest candidates (the first
   `top`, and more until one runs without allocator retries, MAX_CONFIRMATIONS at most) are confirmed with the
   full estimate, whose verdicts (fits, allocator retries) the returned plans carry;
5. the space is bounded whatever the request: --gpus at most MAX_PLAN_GPUS (one machine), GPU counts and
   micro-batches thinned to one per power-of-two range; an option with many micro-batches first finds by bisection
   where its lightest setups stop fitting (`_micro_ceilings`), pruning what lies above unestimated; a method stops
   once `top` + SPARE_CANDIDATES of its setups fit with Adam (slower ones could not rank); and the visit ends at
   MAX_SEARCH_COST estimates, with a note saying so (`fitune plan --gpus 16 --batch-size 720720` with every method
   answers in seconds);
6. selective:K is not an axis: the fastest setups without checkpointing that did not fit, or fit tight, get a
   twin with checkpointing on their first K layers, K the smallest that leaves a plan's room (`_selective_twins`).

Ranking: plans without allocator retries first; then plans that keep the Adam update; then predicted tokens/s (a
tight plan's 3 % less with no room left, 1.5 % less with 5 % of room; a plan at risk of running out of memory in its
first step, at its fallback's speed).
The list holds the best plan of each method asked for (when it fits), then the next fastest.
Alternatives whose predicted speeds are within 1 % count as equally fast (the throughput model cannot tell them
apart) and the one with fewer changes from the defaults wins.

Pure Python, no torch import.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..memory import weights as weight_terms
from ..memory.phases import HOST_RUNTIME_BASELINE_BYTES, run_host_floor, save_added_host_bytes
from ..setup import DEFAULT_SETUP, TrainSetup
from .measured import unmeasured_reasons
from ..specs.gpu import GpuSpec, catalog_gpu_names, resolve_gpu
from ..specs.model import ModelSpec
from ..specs import optimizers as optimizer_specs
from ..units import GiB
from . import throughput
from .calibration import CASES, LEAVE_ONE_MODEL_OUT_MEDIAN_ABS_ERROR, MEDIAN_ABS_ERROR, MODELS
from .data import DataProfile, batching, packing_pays
from .fast import FastEstimate, FastEstimator

#: Optimizers in order of preference (the registry's order, fitune/specs/optimizers.py): the Adam family first
#: (the same update; 8-bit states quantise it); adafactor and sgd change the training, so they rank after every
#: Adam plan.
OPTIMIZER_PREFERENCE = optimizer_specs.preference()
ADAM_FAMILY = optimizer_specs.adam_family()
#: Optimizers from lightest to heaviest state in PyTorch's allocator (paged states live in managed memory).
OPTIMIZER_BY_MEMORY = optimizer_specs.by_allocator_memory()
#: Checkpointing modes the search ranks. offload comes with the tiled MLP (the long-context setup of
#: bench/max_context.py); it ranks after full checkpointing (same predicted compute plus the tiled MLP's
#: recomputation), so it is chosen when nothing lighter fits. selective:K is searched apart (`_selective_twins`):
#: its K comes from the memory, not from a list.
RUNNABLE_CHECKPOINTING = ("none", "full", "offload")
#: selective:K (checkpointing on the first K decoder layers, the rest keep their activations) is tried as the twin
#: of the fastest setups without checkpointing that do not fit, or fit tight: the smallest K whose full estimate
#: leaves a plan's room (TIGHT_SHARE of the budget) and no allocator retries. At most SELECTIVE_TWINS setups out of
#: SELECTIVE_TRIES tried, a few full estimates each (SELECTIVE_CONFIRMS), K at most SELECTIVE_MAX_SHARE of the
#: layers: past half, a smaller micro-batch or full checkpointing costs less than recomputing that many layers.
SELECTIVE_TWINS = 2
SELECTIVE_TRIES = 3
SELECTIVE_CONFIRMS = 3
SELECTIVE_MAX_SHARE = 0.5
#: Losses fitune's runner runs: transformers' (full fp32 logits) and its chunked linear + cross-entropy.
RUNNABLE_LOSSES = ("hf", "chunked")
_LOSS_MEMORY = {"chunked": 0, "hf": 1}
DEFAULT_METHODS = ("lora",)
"""The method a plan keeps unless the user allows others (`--method lora,qlora`): the first one named is theirs."""
DEFAULT_ATTNS = ("sdpa", "eager")
#: Handicap on the predicted speed per non-default choice (eager attention): the model cannot resolve 1 %.
SPEED_TIE = 0.01

_METHOD_MEMORY = {"qlora": 0, "lora": 1, "full": 2}  # freeze is not ordered against the others
_CKPT_MEMORY = {"offload": -1, "full": 0, "none": 1}
_ATTN_MEMORY = {"sdpa": 0, "eager": 1}  # flash is compared only with itself
METHOD_LABELS = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tune", "freeze": "freeze"}


def _ckpt_memory(ckpt: str) -> tuple[float, int]:
    """Order of the checkpointing modes by memory: none > selective:K (the fewer layers, the more) > full > offload."""
    if ckpt.startswith("selective:"):
        return 0.5, -int(ckpt.partition(":")[2])
    return _CKPT_MEMORY[ckpt], 0


def kept_as_given(methods, lora_rank: int, lora_targets) -> str:
    """What the plan keeps of the request, for its header: the adapter's rank and targets when a LoRA method may be
    chosen, else the method(s) asked."""
    if any(m in ("lora", "qlora") for m in methods):
        return f"LoRA r{lora_rank} on {','.join(lora_targets)} kept as given"
    return f"{' / '.join(METHOD_LABELS.get(m, m) for m in methods)} as asked"


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked: the model, the GPU(s), the sequence and the effective batch; what may vary."""

    model: ModelSpec
    gpu: GpuSpec
    seq_len_tokens: int = DEFAULT_SETUP.seq_len_tokens
    """Tokens per sequence (after --data has set it from the token lengths)."""
    batch_size: int = DEFAULT_SETUP.batch_size
    """Sequences per optimizer step over all GPUs: micro-batch x grad_accum x num_gpus."""
    num_gpus: int = 1
    """Data parallel: each GPU holds a full copy and takes batch_size / num_gpus sequences per step."""
    methods: tuple[str, ...] = DEFAULT_METHODS
    lora_rank: int = DEFAULT_SETUP.lora_rank
    lora_alpha: int = DEFAULT_SETUP.lora_alpha
    lora_dropout: float = DEFAULT_SETUP.lora_dropout
    lora_targets: tuple[str, ...] = DEFAULT_SETUP.lora_targets
    freeze_trainable_layers: int = DEFAULT_SETUP.freeze_trainable_layers
    attns: tuple[str, ...] = DEFAULT_ATTNS
    """Attention implementations to consider (flash only when flash-attn is installed)."""
    optimizers: tuple[str, ...] = OPTIMIZER_PREFERENCE
    losses: tuple[str, ...] = RUNNABLE_LOSSES
    """Losses to consider: hf (transformers') and chunked (fitune's runner)."""
    allow_quantize: bool = True
    """False (--no-quantize): QLoRA is never suggested, even when nothing else fits."""
    host_ram_bytes: int | None = None
    """Host memory, bytes: plans whose host peak (loading, the pinned buffers of offloaded checkpoints, the outputs
    written at the end: fitune/memory/phases.py) is over it are left out. None: not checked."""
    host_ram_origin: str = "--host-ram"
    """Where `host_ram_bytes` came from, as the rejections quote it: "--host-ram", "host RAM (this machine's)" or
    "host RAM (assumed; --host-ram to change)"."""
    kernels: str = "torch"
    """torch (transformers' modules + fitune's lean RMSNorm) | liger (the user has liger-kernel: its fused RMSNorm,
    SwiGLU and RoPE; less memory and measured faster, bench/results/issue5/)."""
    compile: str = "none"
    """layers: compile each decoder layer (fitune/runtime/techniques/compile_layers.py; Inductor fuses the norms,
    RoPE, SwiGLU and LoRA arithmetic, so Liger and the lean RMSNorm are left out); measured faster than Liger on
    Llama (bench/results/speed/speed.jsonl, groups *_compile)."""
    keep_outputs: bool = False
    """The user's own loop keeps the model output through backward (`out = model(**batch); out.loss.backward()`):
    the plans are then for that script, not fitune's runner: transformers' modules and loss, PEFT's LoRA, no
    fitune technique (stack hf), checkpointing none or full, one GPU."""
    data: DataProfile | None = None
    top: int = 3
    """Plans to return (each confirmed with the full estimate)."""

    @property
    def dtype(self) -> str:
        return "bf16" if self.gpu.supports_bf16 else "fp16"

    @property
    def per_gpu_batch(self) -> int:
        return self.batch_size // self.num_gpus

    def validate(self) -> "PlanRequest":
        problems = []
        for flag, v in (("--seq-len", self.seq_len_tokens), ("--batch-size", self.batch_size), ("--gpus", self.num_gpus),
                        ("--top", self.top)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{flag} must be a positive integer, got {v!r}")
        if not problems and self.num_gpus > MAX_PLAN_GPUS:
            problems.append(f"--gpus {self.num_gpus}: fitune plans runs on one machine (its runner starts one process "
                            f"per GPU with torchrun --standalone), at most {MAX_PLAN_GPUS} GPUs; plan with the GPUs "
                            "of one machine (8 on most)")
        if not problems and self.batch_size % self.num_gpus:
            problems.append(f"--batch-size {self.batch_size} does not split over --gpus {self.num_gpus}: data parallel "
                            f"gives each GPU batch / N sequences; use a multiple of {self.num_gpus}")
        unknown = [m for m in self.methods if m not in _METHOD_MEMORY and m != "freeze"]
        if unknown:
            problems.append(f"--method {','.join(unknown)}: not a method; choose from lora, qlora, full, freeze")
        if not self.methods:
            problems.append("--method is empty (and --no-quantize leaves nothing): name lora, qlora, full or freeze")
        if self.keep_outputs and self.num_gpus > 1:
            problems.append("--keep-outputs plans your own single-GPU loop; with --gpus the plans run on fitune's "
                            "runner, which never keeps the output: drop one of them")
        if self.keep_outputs and self.compile != "none":
            problems.append("--keep-outputs plans your own transformers loop; --compile layers is a technique of "
                            "fitune's runner: use --compile none (or drop --keep-outputs)")
        if self.compile != "none" and self.kernels != "torch":
            problems.append(f"--compile {self.compile} fuses what --kernels {self.kernels} fuses: choose one")
        if self.keep_outputs and self.kernels != "torch":
            problems.append(f"--keep-outputs plans your own transformers loop; --kernels {self.kernels} is a technique "
                            "of fitune's runner: use --kernels torch (or drop --keep-outputs)")
        if problems:
            raise ConfigError(problems)
        TrainSetup(method="lora", lora_rank=self.lora_rank, lora_targets=self.lora_targets).validate(
            num_layers=self.model.num_layers, hidden_size=self.model.hidden_size,
            linear_names=self.model.linear_names())
        return self


@dataclass(frozen=True)
class Plan:
    """One runnable setup that fits, with its memory and predicted speed."""

    setup: TrainSetup
    """Per GPU: `batch_size` is the micro-batch, `grad_accum` the accumulation."""
    packing: bool
    num_gpus: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    budget_bytes: int
    retries_expected: bool
    breakdown: dict[str, int]
    step_time_s: float
    tokens_per_s: float
    """Token positions per second over all GPUs (padding included)."""
    trained_tokens_per_s: float
    """Real tokens per second (padding excluded; equal to tokens_per_s without --data)."""
    turns_on: tuple[str, ...]
    requires: tuple[str, ...]
    exact: bool = True
    """The memory numbers are the full estimate's (always, for returned plans)."""
    unvalidated_reasons: tuple[str, ...] = ()
    """Why the plan's numbers have not been checked against a measurement (several GPUs, a sharding strategy);
    empty when they rest on measured ground."""
    tight: bool = False
    """The reserved peak is within 5 % of the budget (as `fitune estimate` marks it): run-to-run fragmentation
    decides whether it fits."""
    fallback_tokens_per_s: float | None = None
    """Set when the allocated peak is within AT_RISK_SHARE of the budget: the predicted trained tokens/s of what
    `fitune train` falls back to if the first step runs out of memory (`fallback_setup`); the plan ranks by it."""
    retry_cost_s: float = 0.0
    """Seconds a step is expected to lose to allocator retries when `retries_expected`: RETRY_COST_S for each decoder
    layer; 0 otherwise. The plan ranks at its speed net of it (`ranked_tokens_per_s`), after every plan without."""
    method_change: str = ""
    """When the plan trains with another method than the one asked for (the first of --method): what that costs
    and what it buys. Empty otherwise."""

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.peak_reserved_bytes


@dataclass(frozen=True)
class Rejection:
    """An option that does not fit (or fits only with allocator retries), with its number."""

    option: str
    message: str
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    budget_bytes: int
    reason: str
    """over_budget | allocator_retries | host_ram."""


@dataclass(frozen=True)
class Change:
    """A change that would make the request fit (when nothing does as asked)."""

    change: str
    why: str
    peak_allocated_bytes: int
    fits: bool
    retries_expected: bool
    runnable: bool
    """False: needs a runner feature fitune train lacks today (sharding over GPUs)."""


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    plans: tuple[Plan, ...]
    rejected: tuple[Rejection, ...]
    changes: tuple[Change, ...] = ()
    """Filled when no plan fits: the cheapest changes that would."""
    minimum: FastEstimate | None = None
    """When no plan fits: the lightest setup of the request and what it needs."""
    searched: int = 0
    """Setups in the space (method x micro-batch x checkpointing x attention x optimizer)."""
    estimated_fast: int = 0
    estimated_full: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---- the search -------------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """Every axis but the optimizer."""

    method: str
    micro: int
    ckpt: str
    attn: str
    packing: bool
    loss: str = "hf"
    score: float = 0.0
    optimizer: str | None = None
    estimate: FastEstimate | None = None
    gpus: int = 0
    """GPUs the setup runs on (0: the request's --gpus)."""
    strategy: str = "ddp"
    offload_embeddings: bool = False
    """The frozen input embedding table in CPU memory: searched only with offloaded checkpoints, and only where the
    same setup with the table on the GPU does not fit without allocator retries."""


#: How the GPUs share the model, in the order the search prefers them when the predicted speeds tie
#: (TrainSetup.strategy; fitune/memory/parallel.py models each).
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload")


def parallel_options(req: PlanRequest, method: str) -> list[tuple[int, str]]:
    """(GPU count, strategy) pairs to search for `method`: one GPU as it is, and every strategy on each count that
    divides --gpus and the batch, up to --gpus. QLoRA's 4-bit weights are not offloaded by ZeRO (left out)."""
    if req.num_gpus == 1:
        return [(1, "ddp")]
    counts = [n for n in range(2, req.num_gpus + 1) if req.num_gpus % n == 0 and req.batch_size % n == 0]
    if len(counts) > MAX_GPU_COUNTS:  # 60 has 11 divisors: the largest in each power-of-two range (60 among them)
        counts = sorted({n.bit_length(): n for n in counts}.values())
    strategies = [s for s in STRATEGIES if not (method == "qlora" and s == "zero3_offload")]
    return [(1, "ddp")] + [(n, s) for n in counts for s in strategies]


#: The most GPUs `fitune plan --gpus` takes: fitune's runner is one machine's (torchrun --standalone), and the
#: search's space grows with the GPU counts and strategies it tries.
MAX_PLAN_GPUS = 16
#: GPU counts searched (each with every strategy): more divisors of --gpus than this are thinned to the largest in
#: each power-of-two range, as the micro-batches are.
MAX_GPU_COUNTS = 4
#: An option (method, GPU count, strategy) with more micro-batches than this first finds, by bisection on its
#: lightest setup, the smallest micro-batch that cannot fit: every setup from there up is pruned unestimated.
MICRO_PROBE_MIN = 8
#: Setups of one method that fit with an Adam optimizer, beyond --top, after which the method's slower setups are
#: not estimated: they would rank below those (a plan keeps the Adam update first, then the faster), and the spares
#: stand in for candidates the full estimate turns down.
SPARE_CANDIDATES = 3
#: The estimates a search makes at most, in units of one extrapolated estimate (a full one counts num_layers / 5 of
#: them: what it costs next to two shallow models): the bound that keeps `fitune plan` within seconds whatever the
#: space (4 methods x 16 GPUs x a batch of 720,720). Ordinary requests (one GPU, a few methods) spend a tenth.
MAX_SEARCH_COST = 800
#: Full estimates `_confirm` makes at most, beyond the first of each method: when every confirmed candidate needs
#: allocator retries (or the fast estimate was optimistic), the search stops there rather than confirming
#: hundreds; the plans it shows then carry their retries.
MAX_CONFIRMATIONS = 12

#: The largest micro-batch and gradient accumulation a plan proposes: TrainSetup's own bounds on batch_size and
#: grad_accum, so that every plan is a config `fitune train` accepts.
MAX_MICRO_BATCH = 65536
MAX_GRAD_ACCUM = 1 << 20
#: A batch with more divisors than this (720,720 has 240) is searched over the largest divisor in each power-of-two
#: range [2^k, 2^(k+1)) instead: at most 17 micro-batches, so the search's cost never grows with the batch.
MAX_MICRO_CANDIDATES = 24


def micro_batch_candidates(per_gpu_batch: int) -> list[int]:
    """The micro-batches searched for a per-GPU batch: its divisors m (the rest, batch / m, is accumulation) with
    m <= MAX_MICRO_BATCH and batch / m <= MAX_GRAD_ACCUM, ascending; thinned to one per power-of-two range when
    there are more than MAX_MICRO_CANDIDATES. Trial division over at most MAX_MICRO_BATCH numbers: the work is
    bounded by constants, never by the batch the user typed (`--batch-size 1000000000`)."""
    return list(_micro_batch_candidates(per_gpu_batch))


@functools.lru_cache(maxsize=256)  # the same per-GPU batch comes back for every method and strategy of a search
def _micro_batch_candidates(per_gpu_batch: int) -> tuple[int, ...]:
    divisors = [m for m in range(1, min(per_gpu_batch, MAX_MICRO_BATCH) + 1)
                if per_gpu_batch % m == 0 and per_gpu_batch // m <= MAX_GRAD_ACCUM]
    if len(divisors) <= MAX_MICRO_CANDIDATES:
        return tuple(divisors)
    largest_per_range = {m.bit_length(): m for m in divisors}  # ascending: the last one of each range stays
    return tuple(sorted(largest_per_range.values()))


def unvalidated_reasons(s: TrainSetup) -> list[str]:
    """What no measurement backs in a setup's numbers (multi-GPU memory and communication)."""
    out = []
    if s.num_gpus > 1:
        out.append(f"{s.num_gpus} GPUs: per-rank memory and communication time are modelled, not measured on "
                   "several GPUs")
    if s.strategy != "ddp":
        out.append(f"strategy {s.strategy}: its buffers and sharding are modelled from the FSDP / DeepSpeed docs, "
                   "not measured")
    return out


def plan(req: PlanRequest, fast: FastEstimator | None = None, progress=None) -> PlanResult:
    """Search the request's space; return the ranked plans that fit and the lines that explain the rest.
    `progress(done, total)`, when given, is called as the setups are visited (the CLI's progress bar)."""
    req.validate()
    fast = fast or FastEstimator(req.model, req.gpu)
    budget = req.gpu.training_budget_bytes
    rejected: list[Rejection] = []
    methods = []
    for method in req.methods:
        r = _host_ram_rejection(req, method)
        if r is None:
            methods.append(method)
            rejected += [o for o in [_offload_host_rejection(req, method)] if o is not None]
        else:
            rejected.append(r)

    groups, unprobed = _space(req, methods)
    search = _Search(req, fast, methods, unprobed)
    for g in _reported(groups, progress):
        if search.spent() >= MAX_SEARCH_COST:
            search.stopped = True
            break  # bounded: the setups left are slower than every one tried
        search.visit(g)

    if not search.stopped:
        search.accepted += _selective_twins(req, fast, search)
    accepted, infeasible = search.accepted, search.infeasible
    plans, with_retries = _confirm(req, fast, accepted)
    plans = _marked(req, plans)
    if plans:
        rejected += _why_not_faster(plans[-1], infeasible, with_retries)
    fitting = {p.setup.method for p in plans} | {g.method for g in accepted}
    rejected += _methods_without_plan(req, fast, [m for m in methods if m not in fitting])
    changes: list[Change] = []
    minimum = None
    if not plans:
        minimum, changes = _what_would_fit(req, fast, methods)
    notes = _notes(req, plans) + _search_notes(req, methods, search)
    return PlanResult(req, tuple(plans), tuple(rejected), tuple(changes), minimum,
                      searched=len(groups) * len(req.optimizers), estimated_fast=fast.shallow_calls,
                      estimated_full=fast.full_calls, notes=tuple(notes))


def _space(req: PlanRequest, methods: list[str]) -> tuple[list[_Group], dict[tuple, list[int]]]:
    """Every setup of the space but the optimizer, fastest first (by predicted speed); and the options (method, GPU
    count, strategy) with more than MICRO_PROBE_MIN micro-batches, whose ceilings `_Search` finds when it gets
    there."""
    groups = []
    unprobed: dict[tuple, list[int]] = {}
    for method in methods:
        for gpus, strategy in parallel_options(req, method):
            per_gpu = req.batch_size // gpus
            micros = micro_batch_candidates(per_gpu)
            if len(micros) > MICRO_PROBE_MIN:
                unprobed[(method, gpus, strategy)] = micros
            ckpts, losses = (("none", "full"), ("hf",)) if req.keep_outputs else (RUNNABLE_CHECKPOINTING, req.losses)
            for micro, ckpt, attn, loss in itertools.product(micros, ckpts, req.attns, losses):
                if ckpt == "offload" and _offload_over_host(req, micro, method):
                    continue  # the offloaded checkpoints would not fit in the host memory given
                for emb in (False, True) if ckpt == "offload" and _embeddings_offloadable(req, method, gpus) else (False,):
                    if emb and _offload_over_host(req, micro, method, offload_embeddings=True):
                        continue  # nor with the embedding table in host memory too
                    g = _Group(method, micro, ckpt, attn, _packing(req, micro, attn), loss, gpus=gpus, strategy=strategy,
                               offload_embeddings=emb)
                    g.score = (_tokens_per_s(req, _setup(req, g, "adamw"), g.packing)[1]
                               * (1 - SPEED_TIE * _nondefault(g)))
                    groups.append(g)
    groups.sort(key=lambda g: -g.score)
    return groups, unprobed


class _Search:
    """The visit of the space, fastest setup first: what fit (`accepted`), what did not (`infeasible`), the
    ceilings found by bisection, and the shortcuts' keys (see the module docstring for the rules)."""

    def __init__(self, req: PlanRequest, fast: FastEstimator, methods: list[str], unprobed: dict[tuple, list[int]]):
        self.req, self.fast, self.unprobed = req, fast, unprobed
        self.budget = req.gpu.training_budget_bytes
        self.accepted: list[_Group] = []
        self.infeasible: list[_Group] = []
        self.ceilings: list[_Group] = []  # per option and checkpointing: the lightest setup at the first micro over
        # Keys of the setups two shortcuts look up (sets: one lookup per setup, whatever the space's size): with
        # the table on the GPU, those that did not fit without retries; with the plain loss, those that fit with
        # room to spare.
        self.table_on_gpu_failed: set[tuple] = set()
        self.plain_loss_roomy: set[tuple] = set()
        self.enough = req.top + SPARE_CANDIDATES
        self.adam_accepted = dict.fromkeys(methods, 0)
        self.stopped = False
        """True when MAX_SEARCH_COST ended the visit before the space did."""

    def spent(self) -> int:
        """The estimates made so far, a full one weighed by how many times a two-shallow-models one it costs."""
        return self.fast.shallow_calls + self.fast.full_calls * max(1, self.req.model.num_layers // 5)

    def visit(self, g: _Group) -> None:
        """Estimate `g` unless a shortcut or a pruning rule says how it would come out (or that it cannot matter)."""
        if self.adam_accepted[g.method] >= self.enough:
            return  # slower than `enough` Adam setups of its method that fit: it could not rank among the plans
        if g.offload_embeddings and _twin_key(g) not in self.table_on_gpu_failed:
            return  # the table moves to the CPU only where even offloaded checkpoints do not fit without retries
        if g.loss == "chunked" and _loss_key(g) in self.plain_loss_roomy:
            return  # the plain loss already fits here with room to spare, and chunking is never faster
        option = (g.method, g.gpus, g.strategy)
        if option in self.unprobed and not _pruned(g, self.infeasible, self.ceilings):
            self.ceilings += _micro_ceilings(self.req, self.fast, *option, self.unprobed.pop(option))
        if _pruned(g, self.infeasible, self.ceilings):
            if not g.offload_embeddings:
                self.table_on_gpu_failed.add(_twin_key(g))
            return  # needs at least the memory of a setup that did not fit
        if any(_heavier_or_equal(g, p) for p in self.accepted):
            return  # slower than a plan already found and no lighter: never the better choice
        if _choose_optimizer(self.req, self.fast, g, self.budget):
            self.accepted.append(g)
            self.adam_accepted[g.method] += g.optimizer in ADAM_FAMILY
            if g.estimate is not None and g.estimate.retries_expected and not g.offload_embeddings:
                self.table_on_gpu_failed.add(_twin_key(g))
            if g.estimate is not None and g.estimate.peak_reserved_bytes < 0.95 * self.budget:
                self.plain_loss_roomy.add(_loss_key(g))
        else:
            self.infeasible.append(g)
            if not g.offload_embeddings:
                self.table_on_gpu_failed.add(_twin_key(g))


def _selective_twins(req: PlanRequest, fast: FastEstimator, search: _Search) -> list[_Group]:
    """selective:K twins of the fastest setups without checkpointing that did not fit or fit tight, where such a
    setup is predicted faster than every roomy plan of its method (see SELECTIVE_TWINS)."""
    if req.keep_outputs:
        return []  # the user's own loop: transformers' checkpointing is all or nothing
    room = (1 - TIGHT_SHARE) * search.budget  # the reserved peak of a plan that is not tight, at most
    measured = [g for g in search.accepted if g.estimate is not None]
    roomy: dict[str, float] = {}
    for g in measured:
        if g.estimate.peak_reserved_bytes <= room:
            roomy[g.method] = max(roomy.get(g.method, 0.0), g.score)
    tight = [g for g in measured if g.estimate.peak_reserved_bytes > room]
    candidates = [g for g in search.infeasible + tight if g.ckpt == "none" and not g.offload_embeddings
                  and g.score > roomy.get(g.method, 0.0)]
    if "chunked" in req.losses:  # the twin of either loss is the chunked one: the lighter, at a launch's cost
        lighter = {}
        for g in sorted(candidates, key=lambda g: -g.score):
            lighter.setdefault(_loss_key(g), dataclasses.replace(g, loss="chunked"))
        candidates = list(lighter.values())
    twins: list[_Group] = []
    without: list[_Group] = []  # candidates no K up to SELECTIVE_MAX_SHARE makes fit: heavier ones are skipped
    for g in sorted(candidates, key=lambda g: -g.score):
        if len(twins) >= SELECTIVE_TWINS or len(twins) + len(without) >= SELECTIVE_TRIES:
            break
        if any(_heavier_or_equal(g, x) for x in without):
            continue
        twin = _selective_twin(req, fast, g)
        if twin is None:
            without.append(g)
        else:
            twins.append(twin)
    return twins


def _selective_twin(req: PlanRequest, fast: FastEstimator, g: _Group) -> _Group | None:
    """`g` with checkpointing on its first K layers, K the smallest that leaves a plan's room (full estimates;
    the first K guessed from the memory per layer between no and full checkpointing); None when more than
    SELECTIVE_MAX_SHARE of the layers would be needed. The first Adam-family optimizer (by preference) that
    gets there."""
    layers = req.model.num_layers
    target = (1 - TIGHT_SHARE) * req.gpu.training_budget_bytes
    for opt in [o for o in OPTIMIZER_PREFERENCE if o in req.optimizers and o in ADAM_FAMILY]:
        none = fast.estimate(_setup(req, g, opt))
        full = fast.estimate(_setup(req, dataclasses.replace(g, ckpt="full"), opt))
        per_layer = (none.peak_allocated_bytes - full.peak_allocated_bytes) / layers
        if per_layer <= 0 or full.peak_reserved_bytes > target:
            continue
        if none.peak_reserved_bytes <= target:
            return None  # it has a plan's room without checkpointing: no twin to make
        k = math.ceil((none.peak_reserved_bytes - target) / per_layer)
        for _ in range(SELECTIVE_CONFIRMS):
            if k > SELECTIVE_MAX_SHARE * layers:
                break
            twin = dataclasses.replace(g, ckpt=f"selective:{k}", optimizer=opt, estimate=None)
            e = fast.confirm(_setup(req, twin, opt))
            if e.fits and not e.retries_expected and e.peak_reserved_bytes <= target:
                twin.estimate = e
                twin.score = _tokens_per_s(req, e.setup, twin.packing)[1] * (1 - SPEED_TIE * _nondefault(twin))
                return twin
            k += max(1, math.ceil((e.peak_reserved_bytes - target) / per_layer))
    return None


def _search_notes(req: PlanRequest, methods: list[str], search: _Search) -> list[str]:
    """What bounded the search, when something did: the GPU counts thinned, the estimates' budget spent."""
    notes = []
    counts = sorted({n for m in methods for n, _ in parallel_options(req, m) if n > 1})
    every = [n for n in range(2, req.num_gpus + 1) if req.num_gpus % n == 0 and req.batch_size % n == 0]
    if counts != every:
        notes.append(f"--gpus {req.num_gpus}: searched on {', '.join(map(str, counts))} GPUs (the largest count in "
                     f"each power-of-two range of the {len(every)} that split the batch)")
    if search.stopped:
        open_methods = [METHOD_LABELS[m] for m in methods if search.adam_accepted[m] < search.enough]
        notes.append(f"the search stopped at its bound ({MAX_SEARCH_COST} estimate units, fitune/plan/search.py "
                     "MAX_SEARCH_COST) before the slowest setups of "
                     f"{', '.join(open_methods) or 'the space'}: a slower setup than those shown may fit; ask for fewer "
                     "methods (--method) or GPUs (--gpus), or a smaller --batch-size, to search it all")
    return notes


def _pruned(g: _Group, infeasible: list[_Group], ceilings: list[_Group]) -> bool:
    """`g` needs at least the memory of a setup that did not fit."""
    return any(_heavier_or_equal(g, x) for x in infeasible) or any(_heavier_or_equal(g, x) for x in ceilings)


def _micro_ceilings(req: PlanRequest, fast: FastEstimator, method: str, gpus: int, strategy: str,
                    micros: list[int]) -> list[_Group]:
    """For each checkpointing mode the option searches, its lightest setup (the lightest loss, attention and
    optimizer) at the smallest of `micros` where it does not fit, found by bisection (about log2 of the
    micro-batches' count estimates each). Memory grows with the micro-batch and along every other axis, so each
    setup of the option at least as heavy as one of these is pruned without an estimate of its own."""
    optimizer = next(o for o in OPTIMIZER_BY_MEMORY if o in req.optimizers)
    ckpts = ("none", "full") if req.keep_outputs else RUNNABLE_CHECKPOINTING
    out: list[_Group] = []
    bound = len(micros)  # a heavier mode fails where a lighter one did: only the micro-batches below are open
    for ckpt in sorted(ckpts, key=_CKPT_MEMORY.get):
        def probe(i: int) -> _Group:
            g = _lightest_group(req, method, micros[i], gpus, strategy, ckpt)
            g.estimate = fast.estimate(_setup(req, g, optimizer))
            return g

        low, high, failing = 0, bound, None  # every index below low fits; the index high fails (or is the bound)
        if high == len(micros):  # nothing known yet: with room to spare the largest fits, and one probe says so
            g = probe(high - 1)
            if g.estimate.fits:
                continue
            high, failing = high - 1, g
        if high > 0:  # without room at all the smallest fails, and one probe says so
            g = probe(0)
            if g.estimate.fits:
                low = 1
            else:
                high, failing = 0, g
        while low < high:
            mid = (low + high) // 2
            g = probe(mid)
            if g.estimate.fits:
                low = mid + 1
            else:
                high, failing = mid, g
        if failing is None:
            continue  # it fits below the lighter mode's ceiling, which prunes this mode above it
        out.append(failing)
        bound = high
        if high == 0:
            break  # not even the smallest micro-batch fits: nor does it with any heavier mode
    return out


def _lightest_group(req: PlanRequest, method: str, micro: int, gpus: int, strategy: str, ckpt: str) -> _Group:
    """The setup of an option (method, GPU count, strategy) at `micro` with checkpointing `ckpt` that needs the
    least memory among those the search visits: the chunked loss, the lightest attention, the embedding table on
    the CPU where that is searched; offloaded checkpoints become full where the host memory cannot hold them."""
    if ckpt == "offload" and _offload_over_host(req, micro, method):
        ckpt = "full"
    loss = "chunked" if "chunked" in req.losses and not req.keep_outputs else "hf"
    known = [a for a in req.attns if a in _ATTN_MEMORY]
    attn = min(known, key=_ATTN_MEMORY.get) if known else req.attns[0]
    emb = (ckpt == "offload" and _embeddings_offloadable(req, method, gpus)
           and not _offload_over_host(req, micro, method, offload_embeddings=True))
    return _Group(method, micro, ckpt, attn, _packing(req, micro, attn), loss, gpus=gpus, strategy=strategy,
                  offload_embeddings=emb)


def _reported(items: list, progress) -> Iterator:
    """`items` one by one, calling `progress(done, total)` before each and once at the end."""
    for done, item in enumerate(items):
        if progress is not None:
            progress(done, len(items))
        yield item
    if progress is not None:
        progress(len(items), len(items))


def _setup(req: PlanRequest, g: _Group, optimizer: str, **changes) -> TrainSetup:
    # offloaded checkpoints (with the tiled MLP) were never measured compiled: those plans run eager
    compiled = req.compile if g.ckpt != "offload" else "none"
    s = TrainSetup(method=g.method, lora_rank=req.lora_rank, lora_alpha=req.lora_alpha, lora_dropout=req.lora_dropout,
                   lora_targets=req.lora_targets,
                   dtype=req.dtype, grad_checkpointing=g.ckpt, attn=g.attn, optimizer=optimizer, batch_size=g.micro,
                   seq_len_tokens=req.seq_len_tokens, grad_accum=req.batch_size // (g.gpus or req.num_gpus) // g.micro,
                   freeze_trainable_layers=req.freeze_trainable_layers, stack="fitune", loss=g.loss,
                   lean_lora=g.method in ("lora", "qlora"), kernels=req.kernels, compile=compiled,
                   lean_norm=req.kernels == "torch" and compiled == "none"
                   and req.model.llama_rms_norm,
                   expandable_segments=True, tiled_mlp=g.ckpt == "offload", num_gpus=g.gpus or req.num_gpus,
                   strategy=g.strategy, offload_embeddings=g.offload_embeddings)
    if req.keep_outputs:  # the user's own transformers + PEFT loop, as written: none of fitune's techniques
        s = s.replace(stack="hf", keep_outputs=True, lean_lora=False, lean_norm=False, expandable_segments=False,
                      tiled_mlp=False)
    return s.replace(**changes) if changes else s


def _offload_host_bytes(req: PlanRequest, micro: int, seq_len_tokens: int | None = None) -> int:
    """Page-locked host memory of offloaded checkpoints: every layer's input, hidden x 2 bytes per token, in
    exact-size buffers (fitune/runtime/techniques/offload.py `PinnedPool`)."""
    seq = seq_len_tokens or req.seq_len_tokens
    return micro * seq * req.model.hidden_size * 2 * req.model.num_layers


def _offload_run_host_bytes(req: PlanRequest, micro: int, method: str, seq_len_tokens: int | None = None,
                            offload_embeddings: bool = False) -> int:
    """The run's host memory with offloaded checkpoints: the training step's (fitune/memory/phases.py
    `train_step_host_bytes`: the process's baseline, the pinned inputs `_offload_host_bytes`, the embedding table
    where it is offloaded) plus what saving adds (`save_added_host_bytes`, the optimizer state bounded by AdamW's:
    no estimate exists yet)."""
    s = _setup(req, _Group(method, micro, "offload", "sdpa", False, "chunked", offload_embeddings=offload_embeddings),
               "adamw", seq_len_tokens=seq_len_tokens or req.seq_len_tokens)
    return (HOST_RUNTIME_BASELINE_BYTES + _offload_host_bytes(req, micro, seq_len_tokens)
            + weight_terms.offloaded_embedding_bytes(req.model, s) + save_added_host_bytes(req.model, s))


def _offload_over_host(req: PlanRequest, micro: int, method: str, seq_len_tokens: int | None = None,
                       offload_embeddings: bool = False) -> bool:
    """Whether `_offload_run_host_bytes` is over the request's host RAM."""
    if req.host_ram_bytes is None:
        return False
    return _offload_run_host_bytes(req, micro, method, seq_len_tokens, offload_embeddings) > req.host_ram_bytes


def _offload_host_rejection(req: PlanRequest, method: str) -> Rejection | None:
    """The line that says why no plan of `method` offloads its checkpoints: even one row's need more host RAM than
    the request has (otherwise the user sees only setups without offloading, and not why)."""
    if req.keep_outputs or not _offload_over_host(req, 1, method):
        return None
    label = f"{METHOD_LABELS[method]}, offloaded checkpoints"
    need = _offload_run_host_bytes(req, 1, method)
    return Rejection(label, f"{label}: the run needs {_fmt(need)} of host RAM (each layer's input, 1 row, waits in "
                     f"host memory; a save adds its copies) > {_fmt(req.host_ram_bytes)} {req.host_ram_origin}",
                     None, None, req.gpu.training_budget_bytes, "host_ram")


def _packing(req: PlanRequest, micro: int, attn: str) -> bool:
    """Packing where it pays for the data; never with flash-attention 2 and more than one row per micro-batch,
    which `fitune train` refuses (transformers finds packed examples in the position ids of one row only:
    TrainConfig.validate), so such a plan runs its rows padded."""
    if attn == "flash" and micro > 1:
        return False
    return req.data is not None and packing_pays(req.data, req.seq_len_tokens, micro)


def _tokens_per_s(req: PlanRequest, setup: TrainSetup, packing: bool) -> tuple[throughput.SpeedPrediction, float, float]:
    """(prediction, token positions/s over all GPUs, trained tokens/s over all GPUs)."""
    if req.data is None:
        p = throughput.predict(req.model, setup, req.gpu)
        return p, p.tokens_per_s * setup.num_gpus, p.tokens_per_s * setup.num_gpus
    fill = batching(req.data, setup.seq_len_tokens, setup.batch_size, packing)
    p = throughput.predict(req.model, setup.replace(seq_len_tokens=fill.slot_len_tokens), req.gpu)
    return p, p.tokens_per_s * setup.num_gpus, p.tokens_per_s * fill.real_share * setup.num_gpus


def _nondefault(g: _Group) -> int:
    return (int(g.attn != "sdpa") + int(g.loss != "hf") + int(g.ckpt == "offload") + int(g.strategy != "ddp")
            + int(g.offload_embeddings) + int(g.ckpt.startswith("selective:")))


def _embeddings_offloadable(req: PlanRequest, method: str, gpus: int) -> bool:
    """Whether the search tries `offload_embeddings` (fitune/runtime/techniques/offload_embeddings.py): fitune's
    runner, LoRA / QLoRA (the table is frozen), one GPU, an lm_head of its own (a tied table is a matmul on every
    token and stays on the GPU)."""
    return (method in ("lora", "qlora") and (gpus or req.num_gpus) == 1 and not req.keep_outputs
            and not req.model.tie_word_embeddings)


def _twin_key(g: _Group) -> tuple:
    """The setup's axes but where the embedding table is: a setup with the table on the CPU and its twin with the
    table on the GPU share it. Score, optimizer and estimate are left out: they are results, not axes."""
    return (g.method, g.micro, g.ckpt, g.attn, g.packing, g.loss, g.gpus, g.strategy)


def _loss_key(g: _Group) -> tuple:
    """The setup's axes but the loss: setups equal on it differ in their loss alone."""
    return (g.method, g.micro, g.ckpt, g.attn, g.packing, g.gpus, g.strategy, g.offload_embeddings)


def _heavier_or_equal(a: _Group, b: _Group) -> bool:
    """`a` needs at least the memory of `b` on every axis (the estimator's memory is monotone along each)."""
    if not _parallel_heavier_or_equal(a, b):
        return False
    if a.method != b.method and not (a.method in _METHOD_MEMORY and b.method in _METHOD_MEMORY
                                     and _METHOD_MEMORY[a.method] >= _METHOD_MEMORY[b.method]):
        return False
    if a.attn != b.attn and not (a.attn in _ATTN_MEMORY and b.attn in _ATTN_MEMORY
                                 and _ATTN_MEMORY[a.attn] >= _ATTN_MEMORY[b.attn]):
        return False
    return (a.micro >= b.micro and _ckpt_memory(a.ckpt) >= _ckpt_memory(b.ckpt)
            and _LOSS_MEMORY[a.loss] >= _LOSS_MEMORY[b.loss] and a.offload_embeddings <= b.offload_embeddings)


def _parallel_heavier_or_equal(a: _Group, b: _Group) -> bool:
    """On the GPUs axis, with the same strategy: DDP's memory is the same on every count above one (and least on
    one, without buckets); a sharding strategy's falls as GPUs are added. Different strategies are not ordered."""
    if a.strategy != b.strategy:
        return False
    if a.strategy == "ddp":
        return a.gpus == b.gpus or b.gpus == 1 or (a.gpus > 1 and b.gpus > 1)
    return a.gpus <= b.gpus


def _choose_optimizer(req: PlanRequest, fast: FastEstimator, g: _Group, budget: int) -> bool:
    """The first optimizer (in preference order) whose estimate fits; False when none can."""
    for opt in [o for o in OPTIMIZER_PREFERENCE if o in req.optimizers]:
        e = fast.estimate(_setup(req, g, opt))
        if e.fits:
            g.optimizer, g.estimate = opt, e
            return True
        g.estimate = e
        if _floor_without_optimizer(e) > budget:
            return False  # even without optimizer state it would not fit
    return False


def _floor_without_optimizer(e: FastEstimate) -> int:
    """The peak minus what any optimizer adds (its state, and its step's temporaries when that phase peaks)."""
    floor = e.peak_allocated_bytes - e.breakdown.get("optimizer_states", 0)
    if e.peak_phase == "optimizer":
        floor -= e.breakdown.get("transients", 0)
    return floor


def _confirm(req: PlanRequest, fast: FastEstimator, accepted: list[_Group]) -> tuple[list[Plan], list[Plan]]:
    """Full estimates of the fastest candidates: for each method its fastest ones until one runs without allocator
    retries (two at most), then the next fastest until `top` are confirmed.

    Returns (the plans to show: the best of each method, then the fastest others, ranked; the confirmed plans with
    allocator retries left out of them)."""
    ranked = sorted(accepted, key=lambda g: (g.optimizer not in ADAM_FAMILY, -g.score))
    plans: dict[int, Plan] = {}
    twins: list[_Group] = []  # kept alive: their ids key `plans`

    def confirm(g: _Group) -> Plan | None:
        e = fast.confirm(_setup(req, g, g.optimizer))
        if e.fits and e.retries_expected:
            e = _lighter_optimizer_without_retries(req, fast, g, e) or e
        plans[id(g)] = _make_plan(req, g, e) if e.fits else None
        twin = _roomier_twin(req, fast, g, plans[id(g)])
        if twin is not None:
            twins.append(twin[0])
            plans[id(twin[0])] = twin[1]
        return plans[id(g)]

    for method in dict.fromkeys(g.method for g in ranked):
        for g in [g for g in ranked if g.method == method][:2]:
            p = confirm(g)
            if p is not None and not p.retries_expected:
                break
    extra = 0
    for g in ranked:
        found = [p for p in plans.values() if p is not None]
        if len(found) >= req.top and any(not p.retries_expected for p in found) or extra >= MAX_CONFIRMATIONS:
            break
        if id(g) not in plans:
            confirm(g)
            extra += 1
    found = [p for p in plans.values() if p is not None]
    key = lambda p: (p.retries_expected, p.setup.optimizer not in ADAM_FAMILY, -p.trained_tokens_per_s)  # noqa: E731
    found.sort(key=key)
    best_of_method = [next(p for p in found if p.setup.method == m) for m in dict.fromkeys(p.setup.method for p in found)]
    shown = sorted((best_of_method + [p for p in found if p not in best_of_method])[:req.top], key=key)
    return shown, [p for p in found if p not in shown and p.retries_expected]


#: The lighter optimizer a tight plan is also offered with (`_roomier_twin`): the same update, smaller state.
ROOMIER_TWIN = {"adamw": "adamw8bit"}
TWIN_MIN_GAIN = 0.01
"""The room a twin must add (a share of the budget) to be offered: LoRA r8 on q_proj and v_proj of an 8B model has
under 30 MiB of AdamW state, not worth another optimizer; r32 on every linear layer of it, 0.5 GiB."""


def _roomier_twin(req: PlanRequest, fast: FastEstimator, g: _Group, p: Plan | None) -> tuple[_Group, Plan] | None:
    """A tight plan's twin with the lighter optimizer of ROOMIER_TWIN, when it fits without retries and has at least
    TWIN_MIN_GAIN more room: the ranking then prefers it where it is predicted about as fast (`tightness_penalty`).
    The search adds a lighter optimizer only to a setup whose own does not fit, so a plan that fits by a few hundred
    MiB was never offered with more room. Measured at 131,072 tokens on the rtx4090's budget (QLoRA r32 all-linear,
    offloaded checkpoints, the embedding table in host memory): with AdamW, 654 MiB of room by the estimate, the run
    took the allocator's whole room and retried 1-3 times a step (bench/results/issue33/ballast_4090_adamw); with
    8-bit AdamW, 1.1 GiB by the estimate, it reserved 1.0 GiB more than estimated and never retried, 57 s a step as
    with AdamW (bench/results/issue33/ballast_plan1, ballast_8bit)."""
    lighter = ROOMIER_TWIN.get(g.optimizer or "")
    if p is None or p.retries_expected or lighter not in req.optimizers:
        return None
    if p.headroom_bytes >= TIGHT_SHARE * p.budget_bytes:
        return None
    twin = dataclasses.replace(g, optimizer=lighter)
    e = fast.confirm(_setup(req, twin, lighter))
    gain_bytes = p.peak_reserved_bytes - e.peak_reserved_bytes
    if not e.fits or e.retries_expected or gain_bytes < TWIN_MIN_GAIN * p.budget_bytes:
        return None
    twin.estimate = e
    return twin, _make_plan(req, twin, e)


TIGHT_SHARE = 0.05
"""A plan whose reserved peak is within this share of the budget is `tight` (as `fitune estimate` marks it)."""
TIGHT_PENALTY = 0.03
"""Ranking handicap of a plan whose reserved peak is at the budget (a fit that fragmentation decides): more than the
model's tie margin, less than the differences it is sure of. It falls linearly to half of this at TIGHT_SHARE below
the budget (`tightness_penalty`), so that of two tight plans predicted about as fast, the one with more room ranks
first."""
AT_RISK_SHARE = 0.02
"""A plan whose allocated peak is within this share of the budget may run out of memory in its first step: the
estimate's allocated error is up to 2 % (the estimator's goal; measured within 1 %) and the allocator needs room
above what is allocated. Measured: QLoRA r16 all-linear, micro-batch 2 x 2048, estimated 23.27 GiB allocated and
23.33 reserved, reserved 24.17 GiB without a cap and ran out of memory under the 24 GB card's 23.40 (docs/speed.md).
Such a plan ranks at the predicted speed of what `fitune train` then falls back to (`fallback_setup`)."""

#: What training with another method than the one asked for costs, beyond memory and speed (its quality side).
METHOD_COSTS = {
    "qlora": "the frozen base weights are rounded to 4-bit NF4: the QLoRA paper (Dettmers et al. 2023, "
             "arXiv:2305.14314) matched 16-bit LoRA on its benchmarks, but the rounding error is real and differs by "
             "model; the adapter trains against the rounded model",
    "lora": "the base weights stay frozen and only rank-r adapters learn: less capacity for large changes than "
            "training every weight",
    "freeze": "only the last layers learn; the others keep what they knew, and the layers that learn are fewer "
              "than LoRA's adapters reach",
    "full": "every weight changes: the most capacity, and the most forgetting of what the model knew; the saved "
            "result is a whole model, not an adapter",
}


def _marked(req: PlanRequest, plans: list[Plan]) -> list[Plan]:
    """Each plan with its `tight` mark and, when its method is not the one asked for, what the change costs and
    what it buys (against the best plan of the asked method, or: it fits where that one does not)."""
    asked = req.methods[0] if req.methods else "lora"
    own = next((p for p in plans if p.setup.method == asked), None)
    out = []
    for p in plans:
        tight = abs(p.headroom_bytes) < TIGHT_SHARE * p.budget_bytes or p.retries_expected
        change = ""
        if p.setup.method != asked and asked in METHOD_LABELS:
            if own is None:
                buys = f"it fits where {METHOD_LABELS[asked]} does not"
            else:
                ratio = p.trained_tokens_per_s / own.trained_tokens_per_s if own.trained_tokens_per_s else 0.0
                saved = own.peak_reserved_bytes - p.peak_reserved_bytes
                buys = (f"{ratio:.2f}x the predicted speed of the best {METHOD_LABELS[asked]} plan, "
                        f"{abs(saved) / 2**30:.2f} GiB {'less' if saved >= 0 else 'more'} reserved memory")
            change = (f"{METHOD_LABELS[p.setup.method]} instead of {METHOD_LABELS[asked]}: buys {buys}; costs: "
                      f"{METHOD_COSTS.get(p.setup.method, 'a different training method')}")
        fallback = None
        if p.budget_bytes - p.peak_allocated_bytes < AT_RISK_SHARE * p.budget_bytes and not p.retries_expected:
            s = fallback_setup(p.setup)
            fallback = None if s is None else _tokens_per_s(req, s, p.packing)[2]
        out.append(dataclasses.replace(p, tight=bool(tight), method_change=change, fallback_tokens_per_s=fallback))
    out.sort(key=plan_rank_key)
    return out


def plan_rank_key(p: Plan) -> tuple:
    """The order plans are shown and picked in: those expected to retry last, then the Adam family first, then
    `ranked_tokens_per_s` (which handicaps tight plans by their room: `tightness_penalty`), and at equal ranked speed
    the one with more room under the budget first."""
    return (p.retries_expected, p.setup.optimizer not in ADAM_FAMILY, -ranked_tokens_per_s(p), -p.headroom_bytes)


RETRY_COST_S = 0.011
"""Seconds one allocator retry costs a step, measured: the 77,824-token QLoRA plan on 15.4 GiB took 24.84 s a step
with 30-32 retries and 24.51 s with the cap raised and none (bench/results/issue33/retry_cost; one sample each, the
difference inside run-to-run noise), about 11 ms a retry. Plans expected to retry are charged one a decoder layer,
as those runs retried (30-32 on 32 layers, bench/results/issue33/retries): a guess elsewhere."""


def ranked_tokens_per_s(p: Plan) -> float:
    """The speed a plan ranks by: its fallback's when it is at risk of running out of memory (AT_RISK_SHARE);
    else its own, less `tightness_penalty` (at equal predicted speed the one with room wins). A plan expected to
    retry ranks at its speed net of `retry_cost_s` (and still after every plan without retries: `plan_rank_key`)."""
    if p.fallback_tokens_per_s is not None:
        return p.fallback_tokens_per_s
    speed = p.trained_tokens_per_s * (1 - tightness_penalty(p))
    if p.retry_cost_s and p.step_time_s > 0:
        speed *= p.step_time_s / (p.step_time_s + p.retry_cost_s)
    return speed


def tightness_penalty(p: Plan) -> float:
    """The ranking handicap of a tight plan: TIGHT_PENALTY with no room left under the budget (or over it), falling
    linearly to half of it at TIGHT_SHARE of room; 0 when not tight. Measured: at 131,072 tokens on the rtx4090's
    budget, the plan with 0.57 % room by the estimate (136 MiB) took the allocator's whole room and retried 9 times
    in its first step (bench/results/issue33/ballast_4090); with 2.8 % (654 MiB) it retried 1, 2 and 3 times in
    steps 1-3 (ballast_4090_adamw); with 4.8 % (1.1 GiB, `_roomier_twin`), which this handicap ranks first of the
    three, none (ballast_plan1)."""
    if not p.tight:
        return 0.0
    room_share = min(max(p.headroom_bytes, 0) / p.budget_bytes / TIGHT_SHARE, 1.0)
    return TIGHT_PENALTY * (1.0 - 0.5 * room_share)


def fallback_setup(s: TrainSetup) -> TrainSetup | None:
    """What `fitune train`'s OOM guard runs when a step of `s` runs out of memory (train/loop.py `_replan`): half
    the micro-batch with the same effective batch; at micro-batch 1, checkpointing on every layer; None when
    neither is left (or the user's own loop, which has no guard)."""
    if s.stack != "fitune":
        return None
    if s.batch_size > 1:  # each batch splits into micro-batches of half its size (an odd one: the last is smaller)
        micro = s.batch_size // 2
        return s.replace(batch_size=micro, grad_accum=math.ceil(s.batch_size / micro) * s.grad_accum)
    if s.grad_checkpointing == "none":
        return s.replace(grad_checkpointing="full")
    return None


def _lighter_optimizer_without_retries(req, fast, g: _Group, e: FastEstimate) -> FastEstimate | None:
    """A later optimizer of the preference list whose smaller state removes the overshoot of the reserved peak."""
    overshoot = e.peak_reserved_bytes - e.budget_bytes
    prefs = [o for o in OPTIMIZER_PREFERENCE if o in req.optimizers]
    for opt in prefs[prefs.index(g.optimizer) + 1:]:
        if e.breakdown.get("optimizer_states", 0) < overshoot:
            return None  # dropping all optimizer state would not be enough
        e2 = fast.confirm(_setup(req, g, opt))
        if e2.fits and not e2.retries_expected:
            g.optimizer = opt
            return e2
    return None


def _make_plan(req: PlanRequest, g: _Group, e: FastEstimate) -> Plan:
    s = e.setup
    pred, tps, trained = _tokens_per_s(req, s, g.packing)
    return Plan(setup=s, packing=g.packing, num_gpus=s.num_gpus, peak_allocated_bytes=e.peak_allocated_bytes,
                peak_reserved_bytes=e.peak_reserved_bytes, budget_bytes=e.budget_bytes,
                retries_expected=bool(e.retries_expected), breakdown=dict(e.breakdown), step_time_s=pred.step_time_s,
                tokens_per_s=tps, trained_tokens_per_s=trained, turns_on=tuple(_turns_on(req, s, g.packing)),
                requires=tuple(requirements(s)), exact=e.exact,
                retry_cost_s=RETRY_COST_S * req.model.num_layers if e.retries_expected else 0.0,
                unvalidated_reasons=tuple(unvalidated_reasons(s) + unmeasured_reasons(s, req.model.model_type)))


def _turns_on(req: PlanRequest, s: TrainSetup, packing: bool) -> list[str]:
    out = []
    if s.method == "qlora":
        out.append("4-bit NF4 base weights (QLoRA)")
    if s.grad_accum > 1:
        out.append(f"gradient accumulation x{s.grad_accum} (micro-batch {s.batch_size})")
    if s.grad_checkpointing != "none":
        plain = throughput.predict(req.model, s.replace(grad_checkpointing="none"), req.gpu).step_time_s
        ckpt = throughput.predict(req.model, s, req.gpu).step_time_s
        which = "every layer" if s.selective_k() is None else \
            f"the first {s.selective_k()} of {req.model.num_layers} layers only"
        out.append(f"activation checkpointing (recomputes {which}: {ckpt / plain - 1:+.0%} step time)")
    if s.checkpointed_layers_mode == "offload":
        host = _offload_host_bytes(req, s.batch_size)
        out.append(f"offloaded checkpoints (each layer's input waits in pinned host memory: {_fmt(host)} of host RAM)")
    if s.tiled_mlp:
        out.append("tiled MLP (one tile of the MLP's intermediates at a time)")
    if s.offload_embeddings:
        table = weight_terms.offloaded_embedding_bytes(req.model, s)
        out.append(f"offloaded input embeddings (the frozen table, {_fmt(table)}, in CPU memory; each step's rows are "
                   "looked up there and copied to the GPU)")
    if s.attn != "sdpa":
        out.append(f"{s.attn} attention")
    if s.loss == "chunked":
        out.append("chunked loss (the full fp32 logits are never materialised)")
    if s.lean_lora:
        out.append("lean LoRA (the adapter branch in bf16: no fp32 copy of each adapter's input)")
    if s.lean_norm:
        out.append("lean RMSNorm (tiles in fp32, saves only its bf16 input)")
    if s.kernels == "liger":
        out.append("Liger's fused RMSNorm, SwiGLU and RoPE kernels")
    if s.compile == "layers":
        loss = ", and each chunk of the loss in one function" if s.loss == "chunked" else ""
        out.append("each decoder layer compiled (torch.compile fuses its norms, RoPE, SwiGLU and LoRA arithmetic"
                   f"{loss}; the first step pays the compilation)")
    if s.expandable_segments:
        out.append("expandable segments in PyTorch's allocator (little fragmentation)")
    if s.optimizer != OPTIMIZER_PREFERENCE[0]:  # the default optimizer turns nothing on
        out.append(optimizer_specs.get(s.optimizer).label)
    if packing:
        out.append("packing (short examples share rows)")
    if s.num_gpus > 1 or s.strategy != "ddp":
        out.append(STRATEGY_LABELS[s.strategy].format(n=s.num_gpus))
    return out


#: What each strategy turns on, for `turns_on` ({n}: the GPU count).
STRATEGY_LABELS = {
    "ddp": "data parallel over {n} GPUs (DDP: a full copy on each, gradients all-reduced)",
    "fsdp": "FSDP2 over {n} GPUs (parameters, gradients and optimizer state sharded per decoder layer)",
    "zero2": "DeepSpeed ZeRO-2 over {n} GPUs (gradients and optimizer state sharded)",
    "zero3": "DeepSpeed ZeRO-3 over {n} GPUs (parameters, gradients and optimizer state sharded)",
    "zero3_offload": "DeepSpeed ZeRO-3 over {n} GPUs with parameters and optimizer state in CPU memory",
}


def requirements(s: TrainSetup) -> list[str]:
    """What a setup needs beyond torch + transformers + peft."""
    out = []
    if s.method == "qlora" or "bitsandbytes" in optimizer_specs.get(s.optimizer).packages:
        out.append("bitsandbytes + a CUDA GPU")
    if s.attn == "flash":
        out.append("flash-attn")
    if s.kernels == "liger":
        out.append("liger-kernel + a CUDA GPU")
    if s.compile == "layers":
        out.append("torch.compile's Triton backend (a CUDA GPU)")
    return out


# ---- the explanations ---------------------------------------------------------------------------------------------


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _verdict(option: str, e: FastEstimate, extra: str = "") -> Rejection | None:
    budget = e.budget_bytes
    if not e.fits:
        return Rejection(option, f"{option}: {_fmt(e.peak_allocated_bytes)} > {_fmt(budget)} budget{extra}",
                         e.peak_allocated_bytes, e.peak_reserved_bytes if e.exact else None, budget, "over_budget")
    if e.retries_expected:
        return Rejection(option, f"{option}: fits only with allocator retries ({_fmt(e.peak_reserved_bytes)} reserved > "
                         f"{_fmt(budget)}; {_fmt(e.peak_allocated_bytes)} allocated){extra}",
                         e.peak_allocated_bytes, e.peak_reserved_bytes, budget, "allocator_retries")
    return None


def _judge(fast: FastEstimator, s: TrainSetup) -> FastEstimate:
    """Fast when it does not fit (the allocated peak extrapolates exactly); the full estimate to judge retries."""
    e = fast.estimate(s)
    return fast.confirm(s) if e.fits and not e.exact else e


def describe(s: TrainSetup) -> str:
    """'LoRA, micro-batch 1 x 2 accumulation, checkpointing full, sdpa, adamw[, fsdp on 8 GPUs]' (the axes the
    search varies)."""
    batch = f"micro-batch {s.batch_size}" + (f" x {s.grad_accum} accumulation" if s.grad_accum > 1 else "")
    method = METHOD_LABELS[s.method] + (f" (the last {s.freeze_trainable_layers} layers train)" if s.method == "freeze" else "")
    loss = ", chunked loss" if s.loss == "chunked" else ""
    gpus = f", {s.strategy} on {s.num_gpus} GPU{'s' if s.num_gpus > 1 else ''}" \
        if s.num_gpus > 1 or s.strategy != "ddp" else ""
    return f"{method}, {batch}, checkpointing {s.grad_checkpointing}, {s.attn}{loss}, {s.optimizer}{gpus}"


def _why_not_faster(last: Plan, infeasible: list[_Group], with_retries: list[Plan]) -> list[Rejection]:
    """The setups predicted faster than the last plan shown and why they are not plans: over the budget (only the
    lightest of them: the heavier ones follow) or fitting only with allocator retries."""
    out = []
    faster = [g for g in infeasible if g.estimate is not None and g.score > last.trained_tokens_per_s
              and not any(x is not g and _heavier_or_equal(g, x) for x in infeasible)]
    for g in sorted(faster, key=lambda g: -g.score):
        r = _verdict(describe(g.estimate.setup), g.estimate)
        if r:
            out.append(r)
    for p in with_retries:
        if p.trained_tokens_per_s > last.trained_tokens_per_s:
            out.append(Rejection(describe(p.setup), f"{describe(p.setup)}: fits only with allocator retries "
                                 f"({_fmt(p.peak_reserved_bytes)} reserved > {_fmt(p.budget_bytes)}; "
                                 f"{_fmt(p.peak_allocated_bytes)} allocated)", p.peak_allocated_bytes,
                                 p.peak_reserved_bytes, p.budget_bytes, "allocator_retries"))
    return out


def _lightest(req: PlanRequest, method: str, seq_len_tokens: int | None = None, **changes) -> TrainSetup:
    attn = "sdpa" if "sdpa" in req.attns else req.attns[0]
    opt = next(o for o in OPTIMIZER_BY_MEMORY if o in req.optimizers)
    ckpt = "offload" if not _offload_over_host(req, 1, method, seq_len_tokens) and not req.keep_outputs else "full"
    emb = _embeddings_offloadable(req, method, 0) and not (  # 0: on the request's --gpus
        ckpt == "offload" and _offload_over_host(req, 1, method, seq_len_tokens, offload_embeddings=True))
    g = _Group(method, 1, ckpt, attn, False, "chunked" if "chunked" in req.losses and not req.keep_outputs else "hf",
               offload_embeddings=emb)
    s = _setup(req, g, opt, **changes)
    return s.replace(seq_len_tokens=seq_len_tokens) if seq_len_tokens else s


def _describe_lightest(s: TrainSetup) -> str:
    return f"micro-batch 1, checkpointing {s.grad_checkpointing}, optimizer {s.optimizer}"


def _methods_without_plan(req: PlanRequest, fast: FastEstimator, methods: list[str]) -> list[Rejection]:
    """One line per method with no setup that fits: what its lightest setup needs."""
    out = []
    for method in methods:
        s = _lightest(req, method)
        r = _verdict(METHOD_LABELS[method], _judge(fast, s), f" at the least ({_describe_lightest(s)})")
        if r:
            out.append(r)
    return out


def _host_ram_rejection(req: PlanRequest, method: str) -> Rejection | None:
    """A method whose run needs more host memory than the request has, whatever its setup
    (fitune/memory/phases.py `run_host_floor`): loading (straight onto the GPU from a folder, a few tensors in
    flight; the whole model dequantized on the CPU from a .gguf file) or the outputs written at the end (full /
    freeze: save_pretrained copies the whole model to the host)."""
    if req.host_ram_bytes is None:
        return None
    source = "gguf" if req.model.gguf_weights_type else "folder"
    need, phase, why = run_host_floor(req.model, _lightest(req, method), source)
    if need <= req.host_ram_bytes:
        return None
    label = METHOD_LABELS[method]
    return Rejection(label, f"{label}: {phase} needs {_fmt(need)} of host RAM ({why}) > {_fmt(req.host_ram_bytes)} "
                     f"{req.host_ram_origin}", None, None, req.gpu.training_budget_bytes, "host_ram")


def _what_would_fit(req: PlanRequest, fast: FastEstimator, methods: list[str]) -> tuple[FastEstimate | None, list[Change]]:
    """The smallest requirement of the request, and the cheapest changes that would make it fit."""
    pool = methods or list(req.methods)
    lightest = [fast.confirm(_lightest(req, m)) for m in pool]
    minimum = min(lightest, key=lambda e: e.peak_allocated_bytes)
    changes: list[Change] = []

    # shorter sequences, with the method that needs least
    m = minimum.setup.method
    seq = req.seq_len_tokens // 2
    while seq >= 128:
        e = _judge(fast, _lightest(req, m, seq_len_tokens=seq))
        if e.fits:  # the longest that fits; and the longest without allocator retries, when shorter
            changes.append(Change(f"--seq-len {seq}", f"{METHOD_LABELS[m]}, {_describe_lightest(e.setup)}; longer "
                                  "examples are truncated", e.peak_allocated_bytes, True, bool(e.retries_expected), True))
            if not e.retries_expected:
                break
        seq //= 2
    if not any(c.change.startswith("--seq-len") for c in changes):
        resident = sum(minimum.breakdown.get(k, 0) for k in ("weights", "adapter_weights", "optimizer_states"))
        changes.append(Change("--seq-len", f"no sequence length fits: the weights and optimizer state alone need "
                              f"{_fmt(resident)}", resident, False, False, True))
    # a lighter method than those asked
    for alt in ("qlora", "lora"):
        if alt == "qlora" and not req.allow_quantize:
            continue
        if alt in pool or _METHOD_MEMORY.get(alt, 9) >= min(_METHOD_MEMORY.get(x, 9) for x in pool):
            continue
        e = _judge(fast, _lightest(req, alt))
        if e.fits:
            changes.append(Change(f"--method {alt}", f"{METHOD_LABELS[alt]}, {_describe_lightest(e.setup)}",
                                  e.peak_allocated_bytes, True, bool(e.retries_expected), True))
            break
    # a bigger GPU: the smallest whose budget holds the reserved peak (no allocator retries), with adamw
    preferred = next(o for o in OPTIMIZER_PREFERENCE if o in req.optimizers)
    lightest_adam = fast.confirm(minimum.setup.replace(optimizer=preferred))
    need = lightest_adam.peak_reserved_bytes
    for name in sorted(catalog_gpu_names(), key=lambda n: resolve_gpu(n).allocator_budget_bytes):
        g = resolve_gpu(name)
        if g.training_budget_bytes < need or not g.supports_bf16:
            continue
        changes.append(Change(f"--gpu {name}", f"{_fmt(g.training_budget_bytes)} for the step holds the "
                              f"{_fmt(need)} reserved peak ({METHOD_LABELS[m]}, {_describe_lightest(lightest_adam.setup)})",
                              lightest_adam.peak_allocated_bytes, True, False, True))
        break
    # more GPUs: data parallel does not help; sharding would (not modelled)
    changes.append(_sharding_change(req, minimum))
    return minimum, changes


def _sharding_change(req: PlanRequest, minimum: FastEstimate) -> Change:
    """Rough: ZeRO-3 / FSDP divides weights, gradients and optimizer states by N; activations stay per GPU."""
    b = minimum.breakdown
    sharded = sum(b.get(k, 0) for k in ("weights", "adapter_weights", "gradients", "optimizer_states"))
    rest = minimum.peak_allocated_bytes - sharded
    budget = req.gpu.training_budget_bytes
    if rest >= budget or sharded <= 0:
        return Change("more GPUs", "do not help: data parallel keeps a full copy per GPU, and what is not sharded "
                      f"({_fmt(rest)}) is over the budget alone", minimum.peak_allocated_bytes, False, False, False)
    n = max(2, -(-sharded // (budget - rest)))
    return Change(f"{n} GPUs with sharding (FSDP / ZeRO-3)",
                  f"rough: weights, gradients and optimizer states split {n} ways, before the gathered layers and "
                  f"buffers; `fitune plan --gpus {n}` searches FSDP and ZeRO with the per-GPU estimate (unvalidated)",
                  rest + sharded // n, True, False, False)


def _notes(req: PlanRequest, plans: list[Plan]) -> list[str]:
    notes = []
    rates = throughput.gpu_rates(req.gpu)
    where = (f"scaled to the {req.gpu.name} by its dense {'bf16' if req.gpu.supports_bf16 else 'fp16'} peak and memory "
             "bandwidth (an assumption)") if rates.scaled else (
        "on the H200 itself" if rates.name == req.gpu.name else
        f"with an H200's rates: {req.gpu.name} names no catalog GPU, so compare plans with each other, not with a clock")
    notes.append(f"tokens/s: a model calibrated on {CASES} measured H200 steps of {len(MODELS)} models, fitune's runner "
                 f"and the HF recipe (median error {MEDIAN_ABS_ERROR:.0%}; {LEAVE_ONE_MODEL_OUT_MEDIAN_ABS_ERROR:.0%} "
                 f"on a model left out of the fit), {where}")
    if req.num_gpus > 1:
        notes.append(f"--gpus {req.num_gpus}: searched DDP, FSDP and ZeRO-2/3 (and ZeRO-3 offload) on up to {req.num_gpus} "
                     f"GPUs; the batch of {req.batch_size} is split over the GPUs; memory is per GPU; communication is "
                     "modelled on the GPU's link (an assumption: fitune estimate --list-gpus), not measured")
    if any("bitsandbytes + a CUDA GPU" in p.requires for p in plans):
        notes.append("QLoRA and 8-bit optimizers need bitsandbytes and a CUDA GPU")
    return notes
