"""`estimate()`: where every byte of one training step goes, per category and per phase.

How: the resident terms (weights, adapters, optimizer state, cuBLAS workspaces) are closed formulas
(weights.py, adapters.py, optimizer.py, overheads.py); the step itself is written onto a tape op by op
(layers.py, loss.py) and replayed (tape.py) to find each phase's peak and what is live at it; the same tape runs
through a model of the caching allocator (allocator.py) for the reserved peak. Steady state is modelled
(the second and later steps: optimizer state exists, gradients were freed by `zero_grad(set_to_none=True)`).

Pure Python; no torch import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..setup import TrainSetup
from ..specs.gpu import GpuSpec
from ..specs.model import ModelSpec
from ..specs import optimizers as optimizer_specs
from . import adapters, loss as loss_terms, optimizer as opt_terms, overheads, parallel as parallel_terms, weights
from ..units import GiB
from .allocator import replay_reserved
from .autograd import Autograd, Tensor
from .layers import FP32, LayerContext, decoder_layer, rms_norm

#: Tokens per tile of fitune's tiled MLP (fitune.runtime.techniques.tiled_mlp.TILE_TOKENS).
TILE_TOKENS = 2048
#: Rows per tile of fitune's lean RMSNorm (fitune.runtime.techniques.lean_norm.TILE_TOKENS).
LEAN_NORM_ROWS = 8192
from .tape import (ACTIVATIONS, ADAPTERS, CATEGORIES, FORWARD, GRADIENTS, LOGITS, OPTIMIZER,
                   OPTIMIZER_STEP, TAPE_TIMELINE_POINTS, TRANSIENTS, WEIGHTS, WORKSPACES, Event, Tape,
                   TapePoint, replay)
from .tape import timeline as tape_timeline

ALLOCATOR_OVERHEAD = "allocator_overhead"


@dataclass(frozen=True)
class PhaseEstimate:
    peak_allocated_bytes: int
    breakdown: dict[str, int]
    at: str  # the allocation at which the phase peaks (a tensor label)


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of one training step. All sizes in bytes."""

    model: str
    setup: TrainSetup
    breakdown: dict[str, int]
    """Bytes per category live at the overall peak, plus `allocator_overhead` = reserved - allocated."""
    phases: dict[str, PhaseEstimate]
    peak_phase: str
    peak_allocated_bytes: int
    """What `torch.cuda.max_memory_allocated()` reports over the steps."""
    peak_reserved_bytes: int
    """What `torch.cuda.max_memory_reserved()` reports: allocated plus the caching allocator's fragmentation."""
    resident_bytes: dict[str, int]
    trainable_params: int
    total_params: int
    host_bytes: int = 0
    """Pinned CPU memory the plan needs, per rank (offloaded checkpoints; ZeRO-Offload's parameters, gradients and
    optimizer state)."""
    forward_saved_bytes: int = 0
    """What autograd keeps from the forward for backward (activations, log-probs, index tensors): the number
    `--engine trace` and the GPU bench's `saved_tensor_bytes` measure."""
    gpu: GpuSpec | None = None
    """The GPU judged against; for a multi-GPU rank its budget is less what NCCL / DeepSpeed take outside the
    allocator."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    host_breakdown: dict[str, int] = field(default_factory=dict)
    """`host_bytes` by category (multi-GPU setups): offloaded_checkpoints, weights, gradients, optimizer_states."""
    tape: list = field(default_factory=list, repr=False, compare=False)
    """The step's tape (memory/tape.py `Event`s) that `phases` replays from `resident_bytes`."""

    def timeline(self, max_points: int = TAPE_TIMELINE_POINTS) -> list[TapePoint]:
        """The replayed tape: live bytes per category after each of at most `max_points` events, in tape order
        (what `fitune profile --json` prints as `estimate.timeline`, drawn over the measured timeline)."""
        return tape_timeline(self.tape, self.resident_bytes, max_points)

    @property
    def fits(self) -> bool | None:
        """Whether the step can complete: the allocated peak stays within the GPU's allocator budget.

        Between the allocated and the reserved peak the allocator survives by flushing its cache and retrying
        (`retries_expected`): measured on an H200 capped to an RTX 4090's 23.4 GiB, the seeds' case (21.99 GiB
        allocated, 23.73 GiB reserved uncapped) completed with 1 retry, while 41.95 GiB allocated ran out of memory
        (bench/results/profile/). None without a GPU.
        """
        return None if self.gpu is None else self.peak_allocated_bytes <= self.gpu.training_budget_bytes

    @property
    def retries_expected(self) -> bool | None:
        """The reserved peak exceeds the budget: expect cache flushes mid-step (slower; a fragmented cache can
        still fail)."""
        return None if self.gpu is None else self.peak_reserved_bytes > self.gpu.training_budget_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.gpu is None else self.gpu.training_budget_bytes - self.peak_reserved_bytes

    @property
    def tight(self) -> bool | None:
        """Within 5 % of the budget either way: the reserved peak varies by a few percent between runs."""
        if self.gpu is None:
            return None
        return abs(self.headroom_bytes) < 0.05 * self.gpu.training_budget_bytes or bool(self.fits and self.retries_expected)

    def largest_terms(self, n: int = 3) -> list[tuple[str, int]]:
        items = [(k, v) for k, v in self.breakdown.items() if v > 0]
        return sorted(items, key=lambda kv: -kv[1])[:n]


def estimate(model: ModelSpec, setup: TrainSetup, gpu: GpuSpec | None = None, device: str = "cuda",
             allocator_steps: int = 2) -> MemoryEstimate:
    """Estimate peak memory of one training step of `setup` on `model` (optionally judged against `gpu`).

    `device="cpu"` models a CPU run (no cuBLAS workspaces), for comparisons with `fitune profile --device cpu`.
    `allocator_steps=1` replays the caching allocator over one step only: about half the time, and the reserved
    peak of a first step (screening many setups; the default 2 gives the steady state).
    """
    setup.validate(num_layers=model.num_layers, hidden_size=model.hidden_size, linear_names=model.linear_names())
    notes: list[str] = []
    if setup.lora_dropout and setup.method in ("lora", "qlora"):
        notes.append(f"lora_dropout {setup.lora_dropout:g} is not in this estimate: with dropout PEFT keeps a "
                     "dropped-out copy of each adapter input and its mask, which no measured case has covered "
                     "(every measured case used 0, PEFT's default)")
    res = _resident_terms(model, setup, gpu, device, notes)  # weights, adapters, optimizer state, workspaces
    step = _record_step(model, setup, res)  # the step, op by op, on a tape
    forward_saved = _live_at_end_of_forward(step.tape.events, (ACTIVATIONS, LOGITS)) - FP32  # minus the loss scalar
    phases = replay(step.tape.events, res.resident)
    peak_phase = max(phases, key=lambda p: phases[p].peak_bytes)
    peak_alloc = phases[peak_phase].peak_bytes
    reserved = max(_reserved_peak(model, setup, res, step, allocator_steps), peak_alloc)
    categories = CATEGORIES + (parallel_terms.PARALLEL_CATEGORIES if res.layout is not None else ())
    breakdown = {k: phases[peak_phase].by_category.get(k, 0) for k in categories}
    breakdown[ALLOCATOR_OVERHEAD] = reserved - peak_alloc
    host_bytes = step.host_bytes
    if setup.stack == "fitune":
        notes.append("--stack fitune models fitune train: no KV cache, and its chunked loss and offloaded or selective "
                     "checkpointing when chosen")
    host_breakdown: dict[str, int] = {}
    if res.layout is not None:
        gpu = _rank_gpu(gpu, res.layout, notes)
        host_breakdown = {**({"offloaded_checkpoints": host_bytes} if host_bytes else {}), **res.layout.host}
        host_bytes += sum(res.layout.host.values())
    return MemoryEstimate(
        model=model.name,
        setup=setup,
        breakdown=breakdown,
        phases={p: PhaseEstimate(v.peak_bytes, {k: v.by_category.get(k, 0) for k in categories}, v.at_label)
                for p, v in phases.items()},
        peak_phase=peak_phase,
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=reserved,
        resident_bytes=res.resident,
        trainable_params=res.trainable_params,
        total_params=weights.count_params(model).total,
        host_bytes=host_bytes,
        forward_saved_bytes=forward_saved,
        gpu=gpu,
        notes=tuple(notes),
        host_breakdown=host_breakdown,
        tape=step.tape.events,
    )


# ---- resident before the step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Resident:
    """What `estimate` knows before recording the step: the resident bytes and the sizes the step scales with."""

    act_bytes: int
    """Bytes per element of the activations (and of the weights as computed: NF4 is dequantised to bf16)."""
    trainable_params: int
    trainable_bytes: int
    resident: dict[str, int]
    """Bytes per category resident before the step (weights, adapters, optimizer state, workspaces; per rank)."""
    layout: "parallel_terms.RankLayout | None"
    """One rank of a multi-GPU run (parallel.py), None on one GPU without a strategy."""


def _resident_terms(model: ModelSpec, setup: TrainSetup, gpu: GpuSpec | None, device: str,
                    notes: list[str]) -> _Resident:
    """The resident terms (closed formulas of weights.py, adapters.py, optimizer.py, overheads.py), and for one rank
    of a multi-GPU run what its strategy divides, keeps on the host and adds (parallel.py). Appends the notes of the
    options that change where the memory lives (offload_embeddings, paged_adamw8bit)."""
    w = weights.DTYPE_BYTES[setup.dtype]
    if setup.method == "qlora":
        w = 2  # NF4 storage, bf16 compute
    trainable = adapters.trainable_param_count(model, setup)
    trainable_bytes = adapters.trainable_param_bytes(model, setup)
    weight_bytes = weights.weight_bytes(model, setup.method, "bf16" if setup.method == "qlora" else setup.dtype)
    offloaded_embedding = weights.offloaded_embedding_bytes(model, setup)
    weight_bytes -= offloaded_embedding  # offload_embeddings: the table is in CPU memory
    if setup.offload_embeddings and not offloaded_embedding:
        notes.append("offload_embeddings: this model ties its lm_head to the input embeddings, so the table stays "
                     "on the GPU (fitune train refuses the option for it)")
    adapter_bytes = trainable_bytes if setup.method in ("lora", "qlora") else 0
    state_bytes = _optimizer_state_bytes(model, setup, trainable_bytes)
    if not optimizer_specs.get(setup.optimizer).in_allocator:
        notes.append(f"{setup.optimizer} keeps its {state_bytes / GiB:.2f} GiB of state in CUDA managed memory, "
                     "outside PyTorch's allocator (not in the peaks); it pages to CPU under pressure")
        state_bytes_allocator = 0
    else:
        state_bytes_allocator = state_bytes
    cc = gpu.compute_capability if gpu is not None and gpu.compute_capability else "9.0"
    workspace = overheads.cublas_workspaces_bytes(cc) if device == "cuda" else 0
    resident = {
        WEIGHTS: weight_bytes,
        ADAPTERS: adapter_bytes,
        OPTIMIZER: state_bytes_allocator,
        WORKSPACES: workspace,
    }
    layout = None
    if parallel_terms.is_parallel(setup):
        layout = parallel_terms.RankLayout.of(model, setup, weight_bytes, adapter_bytes, state_bytes_allocator,
                                              trainable, trainable_bytes, w,
                                              _numels(adapters.trainable_tensor_shapes(model, setup))
                                              if setup.method in ("full", "freeze") else None)
        resident = {**resident, **layout.resident}
    return _Resident(w, trainable, trainable_bytes, resident, layout)


# ---- the step, op by op --------------------------------------------------------------------------------------


@dataclass
class _Step:
    """The tape of one step as it is recorded, and what the recording found besides."""

    tape: Tape
    ag: Autograd
    rank: "parallel_terms.RankStep | None"
    """A multi-GPU rank's hooks (parallel.py `RankStep`), around the single-GPU step; None on one GPU."""
    k_ckpt: int
    """Decoder layers under activation checkpointing (the first k)."""
    host_bytes: int = 0
    """Offloaded checkpoint inputs, in pinned host memory."""


def _record_step(model: ModelSpec, setup: TrainSetup, res: _Resident) -> _Step:
    """Forward, backward (and the next micro-batch with gradient accumulation), optimizer step, onto one tape."""
    tape = Tape()
    ag = Autograd(tape)
    ctx = _layer_context(model, setup, res.act_bytes)
    mode = setup.checkpointed_layers_mode
    k_ckpt = {"none": 0, "full": model.num_layers, "offload": model.num_layers}.get(mode, setup.selective_k() or 0)
    step_start = len(tape.events)
    rank = None if res.layout is None else parallel_terms.RankStep(res.layout, ag, model.num_layers, setup.optimizer)
    step = _Step(tape, ag, rank, k_ckpt)
    loss, inputs = _record_forward(step, model, setup, ctx)
    # ---- backward
    if rank:
        rank.start_backward()
    ag.seed_grad(loss, FP32, "grad:loss")
    ag.backward()
    if rank:
        rank.end_backward()
    ag.release_held()  # `out` is rebound by the next step's forward: gone before the optimizer step ends
    tape.free(*inputs, loss.tid)
    if setup.grad_accum > 1:
        _next_micro_batch(tape, step_start)
    # ---- optimizer step
    tape.phase = OPTIMIZER_STEP
    if rank:
        rank.optimizer_step()  # the rank's share of the step, then zero_grad
    else:
        _record_optimizer_step(tape, ag, model, setup, res.trainable_bytes)
    return step


def _layer_context(model: ModelSpec, setup: TrainSetup, w: int) -> LayerContext:
    """What every decoder layer of the step shares: shapes, dtypes, LoRA, attention, the chosen techniques."""
    mode = setup.checkpointed_layers_mode
    return LayerContext(
        model=model, batch_size=setup.batch_size, seq_len_tokens=setup.seq_len_tokens, act_bytes=w,
        lora_targets=adapters.lora_targets(model, setup), lora_rank=setup.lora_rank,
        qlora=setup.method == "qlora", trainable_base=setup.method == "full", attn=setup.attn,
        use_cache=mode == "none" and setup.stack == "hf",
        tiled_mlp_tokens=TILE_TOKENS if setup.tiled_mlp else 0,
        lean_lora=setup.lean_lora, lean_norm_rows=LEAN_NORM_ROWS if setup.lean_norm else 0,
        liger=setup.kernels == "liger", compiled=setup.compile == "layers",
    )


def _record_forward(step: _Step, model: ModelSpec, setup: TrainSetup, ctx: LayerContext) -> tuple[Tensor, tuple]:
    """The forward: inputs, embedding, decoder layers, final norm, loss. Returns the loss and the inputs that live
    until the end of backward (input ids, shifted labels, RoPE cos/sin); the attention mask is freed here."""
    tape, ag, rank, w = step.tape, step.ag, step.rank, ctx.act_bytes
    T = setup.batch_size * setup.seq_len_tokens
    mode = setup.checkpointed_layers_mode
    inputs_require_grad = mode != "none" or setup.method == "full"  # enable_input_require_grads() with checkpointing
    if rank:
        rank.start_forward()
    # input ids (int64; saved by the embedding only when it trains) and the shifted labels (saved by nll_loss)
    ids = tape.alloc(8 * T, ACTIVATIONS if setup.method == "full" else TRANSIENTS, "input_ids")
    labels = tape.alloc(8 * T, ACTIVATIONS, "shift_labels")
    cos_sin = tape.alloc(overheads.rope_cache_bytes(model, setup.seq_len_tokens, w), ACTIVATIONS, "rope cos/sin")
    mask = tape.alloc(overheads.attention_mask_bytes(model, setup), TRANSIENTS, "attention mask")
    x = ag.new(w * model.hidden_size * T, inputs_require_grad, "embeddings")
    if rank:
        rank.after_embedding()
    _record_embedding_backward(ag, model, setup, x, w)
    if inputs_require_grad and mode == "none":
        ag.save_only([x], "embedding output")  # kept alive with requires_grad (measured: 2 x h bytes/token)
    x = _record_layers(step, model, setup, ctx, x)
    loss = _record_head(step, model, setup, ctx, x, T)
    tape.free(mask)
    return loss, (cos_sin, ids, labels)


def _record_embedding_backward(ag: Autograd, model: ModelSpec, setup: TrainSetup, x: Tensor, w: int) -> None:
    """Full fine-tuning: the embedding's backward (embedding_dense_backward) writes a vocab x hidden gradient at the
    very end of backward: a new parameter gradient, or with tied weights a temporary summed into lm_head's .grad."""
    if setup.method != "full":
        return
    emb_grad = w * model.vocab_size * model.hidden_size
    if model.tie_word_embeddings:
        ag.record(x, [], [], [], extra_bytes=emb_grad, label="embedding (tied)")
    else:
        ag.record(x, [], [], [], param_grad_bytes=emb_grad, label="embedding")


def _record_layers(step: _Step, model: ModelSpec, setup: TrainSetup, ctx: LayerContext, x: Tensor) -> Tensor:
    """The decoder layers, the first `k_ckpt` under activation checkpointing (their offloaded inputs counted into
    `step.host_bytes`); freeze: the last `freeze_trainable_layers` train their base weights."""
    ag, rank = step.ag, step.rank
    offload = setup.checkpointed_layers_mode == "offload"
    freeze_from = model.num_layers - setup.freeze_trainable_layers if setup.method == "freeze" else None
    sliding = _sliding_layers(model)
    for layer in range(model.num_layers):
        c = ctx
        if freeze_from is not None and layer >= freeze_from:
            c = LayerContext(**{**ctx.__dict__, "trainable_base": True})
        if rank:
            rank.before_layer(layer)
        if layer < step.k_ckpt:
            y, offloaded = _checkpointed_layer(ag, c, x, layer in sliding, offload=offload)
            step.host_bytes += offloaded
        else:
            y = decoder_layer(ag, c, x, layer in sliding)
        if rank:
            rank.after_layer(layer)
        ag.drop(x)
        x = y
    return x


def _record_head(step: _Step, model: ModelSpec, setup: TrainSetup, ctx: LayerContext, x: Tensor, T: int) -> Tensor:
    """Final norm, lm_head and loss (loss.py), then the model output dropped (or held: keep_outputs)."""
    ag, w = step.ag, ctx.act_bytes
    if step.rank:
        step.rank.before_head()
    h = rms_norm(ag, ctx, x, model.hidden_size, "final_norm", model.rms_norm_one_plus_weight)  # Gemma
    ag.drop(x)
    if setup.loss == "chunked":
        loss = loss_terms.chunked_loss(ag, model, h, T, w, lm_head_trainable=setup.method == "full",
                                       compiled=setup.compile == "layers")
    else:
        loss = loss_terms.hf_loss(ag, model, h, T, w, lm_head_trainable=setup.method == "full",
                                  keep_outputs=setup.keep_outputs)
    ag.drop(h)
    if setup.keep_outputs:  # `out = model(**batch)` holds its logits and KV cache until the step ends
        ag.hold(*ag.forward_end)
    ag.drop(*ag.forward_end)  # the model output (logits, KV cache) is dropped once `.loss` is read
    return loss


def _record_optimizer_step(tape: Tape, ag: Autograd, model: ModelSpec, setup: TrainSetup, trainable_bytes: int) -> None:
    """One GPU: the optimizer step's temporaries (optimizer.py), then `zero_grad(set_to_none=True)`."""
    largest, per = _largest_trainable(model, setup)
    step_bytes = opt_terms.optimizer_step_transient_bytes(setup.optimizer, trainable_bytes, largest, per)
    layout = optimizer_specs.get(setup.optimizer).step_layout
    if layout == "per_tensor" and setup.method in ("full", "freeze"):
        # one parameter at a time: its fp32 copies, freed before the next parameter's
        copies = opt_terms.optimizer_step_transient_bytes(setup.optimizer, 0, 1, per) // 4
        for n in _numels(adapters.trainable_tensor_shapes(model, setup)):
            tape.free(*[tape.alloc(4 * n, TRANSIENTS, "optimizer step") for _ in range(copies)])
        sizes = []
    elif layout == "per_tensor" and largest:
        # separate fp32 copies of one tensor (the allocator places each on its own)
        sizes = [4 * largest] * (step_bytes // (4 * largest))
    elif layout == "foreach" and setup.method in ("full", "freeze"):
        # the foreach step's temporaries (`torch._foreach_sqrt(exp_avg_sqs)`) are one tensor per parameter
        sizes = [n * per for n in _numels(adapters.trainable_tensor_shapes(model, setup))]
    else:
        sizes = [step_bytes]
    step_tmps = [tape.alloc(n, TRANSIENTS, "optimizer step") for n in sizes if n]
    tape.free(*step_tmps)
    tape.free(*ag.param_grads)  # zero_grad(set_to_none=True)


# ---- the reserved peak -------------------------------------------------------------------------------------


def _reserved_peak(model: ModelSpec, setup: TrainSetup, res: _Resident, step: _Step, allocator_steps: int) -> int:
    """The caching allocator's reserved peak (allocator.py) over `allocator_steps` replays of the step's tape, after
    the resident allocations in the order loading (or the strategy's initialisation) makes them."""
    resident, layout = res.resident, res.layout
    lazy_state = setup_events = state_at = None
    if layout is None and setup.method in ("full", "freeze") and resident.get(OPTIMIZER, 0):
        # created by the first optimizer step, tensor by tensor, into what the backward left cached
        per = weights.DTYPE_BYTES[setup.dtype]
        lazy_state = [n for shape in adapters.trainable_tensor_shapes(model, setup)
                      for n in opt_terms.state_tensor_bytes(setup.optimizer, shape, per)]
        blocks = _resident_blocks(model, setup, {**resident, OPTIMIZER: 0})
    elif layout is None:
        blocks = _resident_blocks(model, setup, resident)
    elif layout.strategy in ("zero2", "zero3") and layout.resident.get(OPTIMIZER) and setup.method in ("full", "lora"):
        # ZeRO: DeepSpeed's initialisation request by request (flat buffers, fp32 master partitions, the freed
        # per-parameter tensors and temporaries left cached); the optimizer's state over each flat fp32 partition
        # lazily by the first step, where the step's tape says (parallel.py `RankStep.optimizer_step`)
        blocks = []
        setup_events = _zero_setup_events(model, setup, resident, layout)
        state_at = step.rank.state_points
    elif layout.strategy in ("zero2", "zero3") and layout.resident.get(OPTIMIZER):
        # ZeRO (freeze, qlora): the flat fp32 master partition is made at initialisation; the optimizer's own state
        # over it (one flat tensor per state) lazily by the first step, into what the backward left cached
        n = parallel_terms.sharded(layout.trainable_params, layout.num_gpus)
        master = parallel_terms.ZERO_MASTER_BYTES * n
        lazy_state = [x for x in opt_terms.state_tensor_bytes(setup.optimizer, (n,), 4) if x]
        blocks = _rank_blocks(_resident_blocks(model, setup, {**resident, OPTIMIZER: 0}), layout,
                              optimizer_blocks=[master])
    else:
        blocks = _rank_blocks(_resident_blocks(model, setup, {**resident, OPTIMIZER: 0}), layout)
    reserved, _ = replay_reserved(blocks, step.tape.events, steps=allocator_steps,
                                  expandable=setup.expandable_segments, first_step_state=lazy_state,
                                  setup_events=setup_events, first_step_state_at=state_at)
    return reserved


def _rank_gpu(gpu: GpuSpec | None, layout: "parallel_terms.RankLayout", notes: list[str]) -> GpuSpec | None:
    """One rank's budget: NCCL and DeepSpeed take device memory outside PyTorch's allocator (guesses until
    measured, parallel.py), which the allocator cannot use."""
    s = f"{layout.num_gpus} GPU{'s' if layout.num_gpus > 1 else ''}, {layout.strategy}"
    if layout.num_gpus > 1 or layout.strategy not in parallel_terms.ZERO:
        notes.append(f"per GPU: one rank of {s}; multi-GPU estimates are not validated against measurements yet")
    elif layout.strategy == "zero3_offload":
        notes.append(f"one GPU, {layout.strategy}: measured on one H200 (model built under zero.Init), this estimate "
                     "was within 0.8 % of the peak allocated and within 1.8 % of the peak reserved (Llama-3.1-8B "
                     "LoRA, Llama-3.2-1B full; docs/evidence.md C14)")
    else:
        notes.append(f"one GPU, {layout.strategy}: measured on one H200 within 0.2 % of the peak allocated and 2.6 % "
                     "of the peak reserved (docs/evidence.md C14); on one GPU ZeRO divides nothing and adds its own "
                     "buffers")
    if layout.host:
        notes.append(f"zero3_offload keeps {sum(layout.host.values()) / GiB:.2f} GiB per rank in pinned host memory "
                     f"(x {layout.num_gpus} ranks on the host)")
    outside = layout.outside_allocator_bytes
    if gpu is None or not outside:
        return gpu
    notes.append(f"{outside / GiB:.2f} GiB assumed outside PyTorch's allocator for NCCL"
                 + (" and DeepSpeed" if layout.strategy in parallel_terms.ZERO else "")
                 + " (a guess until measured): the budget is that much smaller")
    return dataclasses.replace(gpu, allocator_budget_bytes=gpu.allocator_budget_bytes - outside)


def _rank_blocks(blocks: list[int], layout: "parallel_terms.RankLayout",
                 optimizer_blocks: list[int] | None = None) -> list[int]:
    """The resident allocations of one rank: the model's tensors (`_resident_blocks`, in loading order; the two
    cuBLAS workspaces last) divided as the strategy shards them, then the optimizer state (one flat block: ZeRO's
    partition; FSDP's per-parameter shards taken together) and the strategy's own buffers."""
    model_blocks, workspaces = blocks[:-2], blocks[-2:]
    d = layout.weight_divisor
    if d == 0:
        model_blocks = []
    elif d > 1:
        model_blocks = [parallel_terms.sharded(b, d) for b in model_blocks]
    state = [layout.resident[OPTIMIZER]] if layout.resident.get(OPTIMIZER) else []
    if optimizer_blocks is not None:
        state = optimizer_blocks
    return model_blocks + state + list(layout.extra_blocks) + workspaces


def _zero_setup_events(model: ModelSpec, setup: TrainSetup, resident: dict[str, int],
                       layout: "parallel_terms.RankLayout") -> list[tuple[int, int]]:
    """The requests from loading to the first step of one ZeRO-2 / ZeRO-3 rank (parallel.py
    `zero_setup_allocations`): the model's tensors as loaded (`_resident_blocks`; LoRA's adapters cast to the
    16-bit dtype by DeepSpeed's engine, the copy-and-free of the cast not replayed: megabytes), divided as the
    strategy shards them; the trainable ones (all of a full fine-tune, the adapters of LoRA) flattened by
    DeepSpeed; then the two cuBLAS workspaces of the first step."""
    blocks = _resident_blocks(model, setup, {**resident, OPTIMIZER: 0})
    model_blocks, workspaces = blocks[:-2], blocks[-2:]
    if setup.method == "lora":
        n_lora = len(model_blocks) - len(_resident_blocks(model, setup, {**resident, ADAPTERS: 0, OPTIMIZER: 0})[:-2])
        trainable = [False] * (len(model_blocks) - n_lora) + [True] * n_lora
        model_blocks = model_blocks[:-n_lora] + [b * layout.lp_bytes // 4 for b in model_blocks[-n_lora:]] \
            if n_lora else model_blocks
    else:
        trainable = [True] * len(model_blocks)
    d = layout.weight_divisor
    model_blocks = [parallel_terms.sharded(b, d) for b in model_blocks]
    n = parallel_terms.sharded(layout.trainable_params, layout.num_gpus)
    events = parallel_terms.zero_setup_allocations(layout.strategy, model_blocks, trainable, layout.lp_bytes, n,
                                                   list(layout.sub_groups), layout.resident.get(parallel_terms.COMM, 0))
    return events + [(parallel_terms.ZERO_SETUP_KEY - 10_000_000 - i, b) for i, b in enumerate(workspaces)]


def _next_micro_batch(tape: Tape, start: int) -> None:
    """Gradient accumulation: the next micro-batch runs the same forward and backward with the first one's
    parameter gradients still resident, and autograd adds each new parameter gradient into `.grad` in place
    (AccumulateGrad: allocated by the op, summed, freed). Appends those events: the tape of the first
    micro-batch with every parameter-gradient allocation followed by its free. Later micro-batches repeat the
    second one exactly, so one more is enough for the peak (the trace engine checks it: fitune/trace)."""
    window = tape.events[start:]
    offset = 1 << 40  # new tensor ids, apart from the first micro-batch's
    summed = set()  # a multi-GPU rank frees gradients itself (parallel.py): summed ones are gone already
    for ev in window:
        if ev.tid in summed:
            continue
        tape.events.append(Event(ev.tid + offset, ev.nbytes, ev.category, ev.phase, ev.label, ev.retag, ev.stream))
        if ev.nbytes > 0 and not ev.retag and ev.category == GRADIENTS:
            tape.events.append(Event(ev.tid + offset, -ev.nbytes, ev.category, ev.phase, ev.label + " (summed into .grad)"))
            summed.add(ev.tid)


def _live_at_end_of_forward(events, categories) -> int:
    live = 0
    for ev in events:
        if ev.phase != FORWARD:
            break
        if ev.category in categories:
            live += ev.nbytes
    return live


def _optimizer_state_bytes(model: ModelSpec, setup: TrainSetup, trainable_bytes: int) -> int:
    if setup.method in ("lora", "qlora"):
        targets = adapters.lora_targets(model, setup)
        numels = []
        for moe, n_layers in ((False, model.dense_layers), (True, model.moe_layers)):
            for lin in model.linears(moe):
                if lin.name in targets:
                    numels += [setup.lora_rank * lin.in_features, setup.lora_rank * lin.out_features] * n_layers
        if optimizer_specs.get(setup.optimizer).factored:
            shapes = []
            for moe, n_layers in ((False, model.dense_layers), (True, model.moe_layers)):
                for lin in model.linears(moe):
                    if lin.name in targets:
                        shapes += [(setup.lora_rank, lin.in_features), (lin.out_features, setup.lora_rank)] * n_layers
            return opt_terms.state_bytes_of_shapes(setup.optimizer, shapes, adapters.LORA_PARAM_BYTES)
        return opt_terms.optimizer_state_bytes(setup.optimizer, numels, adapters.LORA_PARAM_BYTES)
    n = adapters.trainable_param_count(model, setup)
    per = weights.DTYPE_BYTES[setup.dtype]
    if optimizer_specs.get(setup.optimizer).factored:
        return opt_terms.state_bytes_of_shapes(setup.optimizer, adapters.trainable_tensor_shapes(model, setup), per)
    return opt_terms.optimizer_state_bytes(setup.optimizer, [n], per)


def _largest_trainable(model: ModelSpec, setup: TrainSetup) -> tuple[int, int]:
    """(elements of the largest trainable tensor, bytes per element): what a per-tensor optimizer step's
    temporaries scale with."""
    if setup.method in ("lora", "qlora"):
        targets = adapters.lora_targets(model, setup)
        sizes = [setup.lora_rank * max(lin.in_features, lin.out_features)
                 for moe in (False, True) for lin in model.linears(moe) if lin.name in targets]
        return max(sizes, default=0), adapters.LORA_PARAM_BYTES
    return max(_numels(adapters.trainable_tensor_shapes(model, setup)), default=0), weights.DTYPE_BYTES[setup.dtype]


def _numels(shapes: list[tuple[int, ...]]) -> list[int]:
    out = []
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(n)
    return out


def _resident_blocks(model: ModelSpec, setup: TrainSetup, resident: dict[str, int]) -> list[int]:
    """The resident allocations in the order model loading makes them: one per parameter tensor.

    They are never freed, but their rounding into segments (2 MiB small-pool segments, shared 20 MiB segments
    for tensors of 1-10 MiB) is part of the reserved memory. QLoRA and MoE weights are taken as one block each
    per layer (their packing does not follow the dense shapes).
    """
    w = weights.DTYPE_BYTES[setup.dtype] if setup.method != "qlora" else 2
    h = model.hidden_size
    embedding_on_gpu = not weights.offloaded_embedding_bytes(model, setup)
    blocks: list[int] = [model.vocab_size * h * w] if embedding_on_gpu else []
    per_layer: list[int] = []
    if setup.method == "qlora" or model.moe_layers:
        tables = (1 if model.tie_word_embeddings else 2) - (0 if embedding_on_gpu else 1)
        per_layer_bytes = (resident.get(WEIGHTS, 0) - model.vocab_size * h * w * tables) // model.num_layers
        per_layer = [max(per_layer_bytes, 0)]
    else:
        for lin in model.linears(False):
            per_layer.append(lin.in_features * lin.out_features * w)
            if lin.bias:
                per_layer.append(lin.out_features * w)
        per_layer += [h * w] * model.norms_per_layer + ([model.head_dim * w] * 2 if model.qk_norm else [])
    for _ in range(model.num_layers):
        blocks += per_layer
    blocks.append(h * w)  # final norm
    if not model.tie_word_embeddings:
        blocks.append(model.vocab_size * h * w)
    if resident.get(ADAPTERS, 0) and setup.method in ("lora", "qlora"):
        lora = []
        targets = adapters.lora_targets(model, setup)
        for lin in model.linears(False):
            if lin.name in targets:
                lora += [4 * setup.lora_rank * lin.in_features, 4 * setup.lora_rank * lin.out_features]
        for _ in range(model.num_layers):
            blocks += lora
        if resident.get(OPTIMIZER, 0):
            ratio = resident[OPTIMIZER] / max(1, resident[ADAPTERS])
            for _ in range(model.num_layers):
                blocks += [int(b * ratio / 2) for b in lora for _ in range(2)]
    elif resident.get(OPTIMIZER, 0):
        blocks.append(resident[OPTIMIZER])
    blocks += [resident.get(WORKSPACES, 0) // 2] * 2
    return blocks


def _sliding_layers(model: ModelSpec) -> set[int]:
    """The decoder layers with sliding-window attention: those config.json's `layer_types` names, else all but every
    `full_attention_every_n_layers`-th (Gemma 2 and 3), else the last `sliding_window_layers` (specs/model.py)."""
    if not model.sliding_window_layers:
        return set()
    layer_types = model.hf_config.get("layer_types")
    if layer_types:
        return {i for i, t in enumerate(layer_types) if t == "sliding_attention"}
    n = model.full_attention_every_n_layers
    if n:
        return {i for i in range(model.num_layers) if (i + 1) % n != 0}
    return set(range(model.num_layers - model.sliding_window_layers, model.num_layers))


def _checkpointed_layer(ag: Autograd, c: LayerContext, x: Tensor, sliding: bool, offload: bool) -> tuple[Tensor, int]:
    """A layer under non-reentrant activation checkpointing (torch.utils.checkpoint, use_reentrant=False).

    Forward: the layer runs with its transients, but what autograd would save is dropped at once; only the
    layer's input is kept (in CPU memory when offloaded). Backward: the layer is recomputed (its saved tensors
    come back), then differentiated; PyTorch stops the recomputation once every saved tensor is back, so the
    layer's final output is not rebuilt (here: freed at once).
    """
    sub = Autograd(ag.tape, keep_saved=False)
    y = decoder_layer(sub, c, x, sliding)
    offloaded = 0
    if offload:
        offloaded = x.nbytes
    else:
        ag.save_only([x], "checkpoint input")

    def backward(main: Autograd, output: Tensor | None) -> None:
        g = main.take_grad(output)
        if g is None:
            return
        restored = x
        if offload:  # the input comes back from pinned host memory before the recomputation
            restored = Tensor(main.tape.alloc(x.nbytes, ACTIVATIONS, "checkpoint input (from host)"), x.nbytes, True, "x")
        # offload: the layer below's input is prefetched while this one recomputes (one more input on the GPU)
        prefetch = main.tape.alloc(x.nbytes, ACTIVATIONS, "prefetched checkpoint input") if offload else None
        sub2 = Autograd(main.tape, retag_saved=False)  # recomputed activations count as transients
        y2 = decoder_layer(sub2, c, restored, sliding)
        sub2._grads[y2.tid] = g
        sub2._grad_refs[g.tid] = 1
        # offload (fitune/runtime/techniques/offload.py) recomputes as reentrant checkpointing does: the whole layer,
        # then autograd.backward(y, grad_y). The recomputed output stays referenced through the layer's backward,
        # and the incoming gradient, still held by the caller, reaches the input leaf through the residual adds:
        # AccumulateGrad copies it (a shared gradient is not stolen). Two more hidden-size tensors than non-reentrant.
        if not offload:
            sub2.drop(y2)
        copy = main.tape.alloc(x.nbytes, TRANSIENTS, "x.grad (AccumulateGrad copy)") if offload else None
        sub2.backward()
        if offload:
            sub2.drop(y2)
        main.param_grads.extend(sub2.param_grads)
        gx = sub2._grads.pop(restored.tid, None)
        if gx is not None:
            main._grads[x.tid] = gx
            main._grad_refs[gx.tid] = 1
        if offload:
            main.tape.free(restored.tid, prefetch, copy)

    if offload:
        ag.tape.free(x.tid)  # the GPU copy goes; the host copy stays until backward
    ag.custom(backward, y, "checkpointed layer")
    return y, offloaded
