"""Predicted training speed: the time of one optimizer step from FLOPs, bytes moved and kernel launches.

The model (per micro-batch of `T = batch x seq` tokens, on a GPU with dense bf16 peak P and memory bandwidth B):

    t_micro = c_linear    x linear FLOPs / P          matmuls of the weights (forward, input and weight gradients,
                                                      the recomputed forward under checkpointing), lm_head included
            + c_attention x attention FLOPs / P       QK^T and PV (causal: halved, except eager which computes all)
            + c_launch    x launches                  kernel launches: fixed CPU cost, what makes small batches slow
            + c_activation x activation bytes / B     element-wise passes over activations (norms, RoPE, SiLU,
                                                      residuals, LoRA's A/B paths, the fp32 logits and loss)
            + c_eager     x score bytes / B           eager attention's [batch, heads, seq, seq] scores and softmax
            + c_dequant   x dequantised bytes / B     QLoRA: each NF4 weight unpacked to bf16 for every matmul
    t_step  = grad_accum x t_micro + optimizer bytes / B

Sources: FLOPs per token from fitune/perf/flops.py (Kaplan et al. 2020; PaLM appendix B), split into linear and
attention parts here. The byte and launch counts are structure, not measurements: what each term counts is
written next to it below, and the coefficients `c_*` absorb the constants (kernels that run below bandwidth,
launches per module). The coefficients are fitted (non-negative least squares on the relative error, c_linear
held >= 1 because no matmul beats the datasheet peak) to the 45 measured H200 steps of the HF recipe,
bench/results/hf_recipe/hf_recipe.jsonl; `python -m fitune.plan.throughput` refits them and rewrites
fitune/plan/calibration.py, and tests/test_plan.py refits them from the committed data and checks the error.

Other GPUs: the FLOP terms scale with the GPU's dense bf16 (or fp16) peak, the byte terms with its memory
bandwidth, the launch term not at all. That is an assumption (consumer cards and older generations reach a
different fraction of their peak than an H200); `fitune plan` says so next to every prediction.

Several GPUs (TrainSetup.num_gpus, .strategy): each rank runs the model above on its own micro-batches, plus the
communication of its strategy (`communication_bytes`: ring collectives over the GPU's link, `link_gb_s` in the GPU
catalog, an assumption until measured) of which only the part that outlasts the compute it overlaps counts
(`communication_s`). Not calibrated: no multi-GPU step has been measured.

Not modelled: the data loader, the first step's compilation and allocator warm-up. The optimizer step is physical bytes over bandwidth, uncalibrated (the
45 measured runs are LoRA/QLoRA, whose optimizer step is negligible).

Pure Python; no torch import.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from dataclasses import dataclass

from ..memory.estimate import TILE_TOKENS
from ..memory.loss import CHUNK_TOKENS
from ..memory import adapters as adapter_terms
from ..memory import weights as weight_terms
from ..perf.flops import forward_flops_per_token
from ..setup import TrainSetup
from ..specs.gpu import GpuSpec, gpu_catalog, resolve_gpu
from ..specs.model import ModelSpec, load_model_spec
from ..specs import optimizers as optimizer_specs
from .calibration import COEFFICIENTS

#: The calibration GPU: the bench ran on an H200; its catalog entry gives the peak and bandwidth of the fit.
CALIBRATION_GPU = "h200"

#: The terms of the model, in the order of the coefficients.
TERMS = ("linear", "attention", "launches", "triton_launches", "checkpointed_layers", "activations", "eager_scores",
         "dequant", "host_transfers")

#: Kernels one decoder layer launches in a forward pass, by part (counted in transformers' Llama layer, 5.17):
#: its RMSNorm is 7 element-wise kernels (upcast, pow, mean, add eps, rsqrt, multiply, downcast) plus the weight's
#: multiply, RoPE about 6 per projection (two slices, a negation, a concatenation, two multiplies) and an add,
#: SiLU and the product 2, the residual adds 2, attention about 4 (SDPA and the transposes around it), the 7
#: projections, and 4 per LoRA-wrapped Linear (A, B, the scale, the add). Liger's kernels (kernels: liger) are one
#: launch per RMSNorm, one for RoPE on q and k together, one for SiLU x up. Structural counts; the fitted `c_launch`
#: turns them into seconds.
KERNELS_NORM = {"torch": 8, "liger": 1}
KERNELS_ROPE = {"torch": 13, "liger": 1}
KERNELS_ACT = {"torch": 2, "liger": 1}
KERNELS_OTHER = 2 + 4 + 7  # residual adds, attention, projections
KERNELS_PER_LORA_TARGET = 4
#: A compiled layer (compile: layers): Inductor writes one Triton kernel per RMSNorm (with the residual add before
#: it), one for RoPE on q and k, one for SiLU x up, one per LoRA target for the scale and add; the matmuls (2 per
#: LoRA target) and attention stay library kernels. All are launched from Inductor's generated code, without the
#: Python wrapper a Liger kernel has, so they count as plain launches, not Triton ones.
KERNELS_LORA_MATMULS = 2
#: fitune's chunked loss: kernels per chunk of CHUNK_TOKENS (the chunk's matmul, log-softmax, gather, the gradient
#: of cross-entropy, the hidden-state gradient's matmul, the weight gradient's), fitune/runtime/techniques/chunked_loss.py.
KERNELS_PER_LOSS_CHUNK = 8

#: The share of a micro-batch's compute spent in backward: 2 of the 3 forward-equivalents of a training step
#: (Kaplan et al. 2020, C ~ 6N per token: 2N forward, 4N backward). DDP's all-reduce can hide behind it.
BACKWARD_SHARE = 2 / 3
#: Link assumed for a GPU the catalog does not name (`--gpu 24GiB`): PCIe 4.0 x16, GB/s each way.
DEFAULT_LINK_GB_S = 25.0
#: ZeRO-Offload's CPU Adam: trainable parameters one rank updates per second on its share of the host's cores.
#: A GUESS (ZeRO-Offload, arXiv:2101.06840, section 4.2 reports CPU-Adam several times faster than PyTorch's CPU
#: Adam, about a second for a billion parameters on a server CPU).
HOST_ADAM_PARAMS_PER_S = 1.0e9

@dataclass(frozen=True)
class StepTerms:
    """What one micro-batch costs, before dividing by a GPU's rates."""

    linear_flops: float
    attention_flops: float
    launches: float
    triton_launches: float
    """Of the launches, Liger's Triton kernels: each costs more CPU time than an ATen kernel (Triton's Python
    launcher)."""
    checkpointed_layers: float
    activation_bytes: float
    eager_score_bytes: float
    dequant_bytes: float
    host_bytes: float = 0.0
    """Bytes copied between the GPU and host memory: offloaded checkpoints out in forward and back in backward."""

    def as_tuple(self) -> tuple[float, ...]:
        return (self.linear_flops, self.attention_flops, self.launches, self.triton_launches, self.checkpointed_layers,
                self.activation_bytes,
                self.eager_score_bytes, self.dequant_bytes, self.host_bytes)


@dataclass(frozen=True)
class Rates:
    """What a GPU does per second: dense bf16 (or fp16) FLOP/s and memory bytes/s."""

    peak_flops: float
    bandwidth_bytes_s: float
    name: str
    scaled: bool
    """True when the rates are another GPU's than the calibration's (the prediction is scaled)."""
    host_bytes_s: float = DEFAULT_LINK_GB_S * 1e9
    """The GPU's link to host memory, bytes/s each way (the catalog's PCIe generation)."""


@dataclass(frozen=True)
class SpeedPrediction:
    """Predicted speed of one setup."""

    step_time_s: float
    """One optimizer step: grad_accum micro-batches and the optimizer update."""
    micro_batch_time_s: float
    tokens_per_step: int
    """Token positions computed per step (padding included)."""
    tokens_per_s: float
    """tokens_per_step / step_time_s on one GPU."""
    terms_s: dict[str, float]
    """Seconds of each term in one micro-batch (the breakdown of `micro_batch_time_s`)."""
    optimizer_s: float
    communication_s: float = 0.0
    """Seconds per step spent in communication that compute does not hide (several GPUs, or ZeRO-Offload's
    host transfers); part of `step_time_s`."""


# ---- what one micro-batch costs ------------------------------------------------------------------------------


def _fwd_passes(setup: TrainSetup, model: ModelSpec) -> float:
    """Forward passes over the decoder layers: 1, plus the recomputation of checkpointed layers."""
    mode = setup.checkpointed_layers_mode
    if mode in ("full", "offload"):
        return 2.0
    if mode == "selective":
        return 1.0 + (setup.selective_k() or 0) / model.num_layers
    return 1.0


def step_terms(model: ModelSpec, setup: TrainSetup) -> StepTerms:
    """FLOPs, launches and bytes moved of one micro-batch of `setup` (batch_size x seq_len_tokens tokens)."""
    m, s = model, setup
    T = s.batch_size * s.seq_len_tokens
    L = m.num_layers
    w = weight_terms.DTYPE_BYTES[s.dtype] if s.method != "qlora" else 2
    fwd = _fwd_passes(s, m)
    lin, att = forward_flops_per_token(m, s.seq_len_tokens)  # per token, forward, whole model
    head = 2 * m.vocab_size * m.hidden_size
    decoder = lin - head
    # backward: the input gradient of every matmul (2N) below the lm_head; the weight gradient (2N) only for
    # trained weights. freeze: backward stops below the first trained layer.
    if s.method == "freeze":
        k = min(s.freeze_trainable_layers, L) / L
        linear = head + decoder * fwd + head + decoder * k * 2  # lm_head input grad; trained layers: input + weight
        attention = att * fwd + att * k * 2
    else:
        weight_grads = lin if s.method == "full" else 0
        linear = head + decoder * fwd + lin + weight_grads
        attention = att * fwd + att * 2
    if s.tiled_mlp and T > TILE_TOKENS:
        # fitune's tiled MLP recomputes each tile's gate/up/down once more in backward (tiled_mlp.py)
        linear += L * 2 * 3 * m.hidden_size * m.intermediate_size
    if s.attn == "eager":
        attention *= 2  # eager multiplies the whole seq x seq square; sdpa/flash skip the masked half
    bwd_layers = L if s.method != "freeze" else min(s.freeze_trainable_layers, L)

    targets = adapter_terms.lora_targets(m, s)
    launches = layer_launches(m, s, len(targets)) * (L * fwd + 2 * bwd_layers)  # backward: about twice the forward's
    triton = 0.0
    if s.kernels == "liger":  # each fused kernel once in forward (and recomputation), once in backward
        triton = (KERNELS_NORM["liger"] * m.norms_per_layer + KERNELS_ROPE["liger"] + KERNELS_ACT["liger"]) \
            * (L * fwd + bwd_layers)
    if s.loss == "chunked":
        launches += -(-T // CHUNK_TOKENS) * KERNELS_PER_LOSS_CHUNK
    activation_bytes = T * (layer_elementwise_bytes(m, s, targets) * (L * fwd + 2 * bwd_layers)
                            + loss_elementwise_bytes(m))

    eager = 0.0
    if s.attn == "eager":
        # scores written, softmax read + written (fp32 upcast), probabilities read by PV: ~4 passes forward
        eager = s.batch_size * m.num_heads * s.seq_len_tokens ** 2 * w * 4 * (L * fwd + 2 * bwd_layers)

    dequant = 0.0
    if s.method == "qlora":
        # every matmul of an NF4 weight unpacks it to bf16 first: read 0.5 B, write 2 B, the matmul reads 2 B
        dequant = weight_terms.count_params(m).decoder_linear * 4.5 * (fwd + 1)
    ckpt_layers = (fwd - 1) * L  # layers run under torch.utils.checkpoint (its hooks cost CPU time per layer)
    host = 0.0
    if s.checkpointed_layers_mode == "offload":
        # each layer's input (T x hidden, activations' dtype) goes to pinned host memory in forward and comes back
        # for the recomputation (fitune/runtime/techniques/offload.py)
        host = 2.0 * T * m.hidden_size * w * L
    return StepTerms(float(linear * T), float(attention * T), float(launches), float(triton), float(ckpt_layers),
                     float(activation_bytes), float(eager), float(dequant), float(host))


def layer_launches(m: ModelSpec, s: TrainSetup, lora_targets: int) -> float:
    """Kernels one decoder layer launches in a forward pass (KERNELS_*): Liger's fused kernels or transformers'
    modules; fitune's lean RMSNorm runs its element-wise kernels once per tile of TILE_TOKENS tokens."""
    if s.compile == "layers":  # Inductor's fused kernels are launched from its generated code, not from Python
        return KERNELS_OTHER + KERNELS_LORA_MATMULS * lora_targets + m.norms_per_layer + 2 + lora_targets
    k = "liger" if s.kernels == "liger" else "torch"
    norm = KERNELS_NORM[k] * m.norms_per_layer
    if s.lean_norm and k == "torch":
        norm *= -(-s.batch_size * s.seq_len_tokens // TILE_TOKENS)
    return norm + KERNELS_ROPE[k] + KERNELS_ACT[k] + KERNELS_OTHER + KERNELS_PER_LORA_TARGET * lora_targets


def layer_elementwise_bytes(m: ModelSpec, s: TrainSetup, lora_targets: list[str]) -> float:
    """Bytes one decoder layer's element-wise kernels read and write per token in a forward pass (backward moves
    about twice as much). Counted from what each kernel reads and writes, activations in bf16 (fp32 doubles it):
    - RMSNorm: transformers' (and fitune's lean one, the same arithmetic) upcasts to fp32 and makes 7 passes, about
      26 bytes per feature; Liger's one kernel reads the input and writes the output: 4 bytes;
    - RoPE on q and k: rotate_half's slices and concatenation, two products and an add, about 16 bytes per element;
      Liger rotates in place: 4;
    - SiLU and the product: 10 bytes per intermediate element (read 2 + write 2, read 4 + write 2); Liger: 6;
    - the two residual adds: 6 bytes per feature each;
    - LoRA per target: PEFT's fp32 adapters cast the input to fp32 (6 bytes per input feature) and scale and add the
      fp32 output (12 per output feature); lean LoRA runs in bf16: the scale and add only (6 per output feature).
    A compiled layer (compile: layers) moves what Liger's kernels move for the norms, RoPE and SiLU x up.
    """
    liger = s.kernels == "liger" or s.compile == "layers"
    h = m.hidden_size
    norm = (4 if liger else 26) * h * m.norms_per_layer
    rope = (4 if liger else 16) * (m.q_dim + m.kv_dim)
    act = (6 if liger else 10) * m.intermediate_size
    residual = 2 * 6 * h
    lora = 0
    for lin in m.linears(False):
        if lin.name in lora_targets:
            lora += 6 * lin.out_features if s.lean_lora else 6 * lin.in_features + 12 * lin.out_features
    scale = 2 if s.dtype == "fp32" and s.method != "qlora" else 1
    return float(scale * (norm + rope + act + residual + lora))


def loss_elementwise_bytes(m: ModelSpec) -> float:
    """Bytes the loss's element-wise kernels move per token: the bf16 logits written, upcast to fp32, the
    log-softmax, its gradient and the input gradient (2 + 4 + 4 + 4 + 4 bytes per vocabulary entry). fitune's chunked
    loss does the same passes a chunk at a time."""
    return float(m.vocab_size * (2 + 4 + 4 + 4 + 4))


def optimizer_step_bytes(model: ModelSpec, setup: TrainSetup) -> float:
    """Bytes the optimizer step reads and writes (physical count, uncalibrated).

    Per trainable parameter: the weight and gradient read, the weight written, plus state: adamw 2 fp32 states
    read and written (16 B), 8-bit AdamW 4 B, adafactor ~4 B, sgd 0 (each optimizer's registry entry,
    `step_state_bytes_per_param`). LoRA weights are fp32 (PEFT).

    Raises:
        ConfigError: an optimizer the registry does not know (no default is assumed).
    """
    n = adapter_terms.trainable_param_count(model, setup)
    p = adapter_terms.LORA_PARAM_BYTES if setup.method in ("lora", "qlora") else weight_terms.DTYPE_BYTES[setup.dtype]
    state = optimizer_specs.get(setup.optimizer).step_state_bytes_per_param
    grad_accumulate = 2 * p if setup.method in ("full", "freeze") and setup.grad_accum > 1 else 0
    return float(n * (3 * p + state + grad_accumulate))


# ---- rates of a GPU ------------------------------------------------------------------------------------------


def gpu_rates(gpu: GpuSpec | None) -> Rates:
    """The GPU's peak and bandwidth; the calibration GPU's when `gpu` names no catalog card (`--gpu 24GiB`)."""
    cal = gpu_catalog()[CALIBRATION_GPU]
    if gpu is not None and gpu.name in gpu_catalog():
        entry = gpu_catalog()[gpu.name]
        peak = gpu.peak_bf16_tflops if gpu.supports_bf16 else entry.get("peak_fp16_dense_tflops")
        bw = gpu.memory_bandwidth_gb_s
        if peak and bw:
            return Rates(peak * 1e12, bw * 1e9, gpu.name, gpu.name != CALIBRATION_GPU, link_bytes_s(gpu)[1])
    return Rates(cal["peak_bf16_dense_tflops"] * 1e12, cal["memory_bandwidth_gb_s"] * 1e9, CALIBRATION_GPU, False,
                 link_bytes_s(resolve_gpu(CALIBRATION_GPU))[1])


def has_rates(gpu: GpuSpec | None) -> bool:
    """Whether the GPU's own peak and bandwidth are known (else predictions use the calibration GPU's)."""
    return gpu is not None and gpu_rates(gpu).name == gpu.name


# ---- the prediction ------------------------------------------------------------------------------------------


def load_coefficients() -> dict[str, float]:
    return dict(COEFFICIENTS)


def term_seconds(terms: StepTerms, rates: Rates, coefficients: dict[str, float]) -> dict[str, float]:
    c = coefficients
    return {
        "linear": c["linear"] * terms.linear_flops / rates.peak_flops,
        "attention": c["attention"] * terms.attention_flops / rates.peak_flops,
        "launches": c["launches"] * terms.launches,
        "triton_launches": c.get("triton_launches", 0.0) * terms.triton_launches,
        "checkpointed_layers": c["checkpointed_layers"] * terms.checkpointed_layers,
        "activations": c["activations"] * terms.activation_bytes / rates.bandwidth_bytes_s,
        "eager_scores": c["eager_scores"] * terms.eager_score_bytes / rates.bandwidth_bytes_s,
        "dequant": c["dequant"] * terms.dequant_bytes / rates.bandwidth_bytes_s,
        "host_transfers": c.get("host_transfers", 0.0) * terms.host_bytes / rates.host_bytes_s,
    }


def predict(model: ModelSpec, setup: TrainSetup, gpu: GpuSpec | None,
            coefficients: dict[str, float] | None = None) -> SpeedPrediction:
    """Predicted step time and tokens/s of `setup` (micro-batch `batch_size`, `grad_accum` of them) on one GPU
    (one rank of `setup.num_gpus`: the tokens/s of all of them is N times this)."""
    rates = gpu_rates(gpu)
    secs = term_seconds(step_terms(model, setup), rates, coefficients or load_coefficients())
    micro = sum(secs.values())
    opt = optimizer_step_bytes(model, setup) / rates.bandwidth_bytes_s
    comm = 0.0
    if setup.num_gpus > 1 or setup.strategy != "ddp":
        if setup.strategy == "zero3_offload":
            opt = 0.0  # the CPU steps (in `communication_s`)
        elif setup.strategy != "ddp":
            opt /= setup.num_gpus  # each rank updates its shard
        comm = communication_s(model, setup, gpu, micro) + zero3_fetch_overhead_s(model, setup)
    step = setup.grad_accum * micro + opt + comm
    tokens = setup.grad_accum * setup.batch_size * setup.seq_len_tokens
    return SpeedPrediction(step, micro, tokens, tokens / step, secs, opt, comm)


# ---- communication between GPUs ------------------------------------------------------------------------------


def ring_all_reduce_bytes(nbytes: float, num_gpus: int) -> float:
    """Bytes each GPU sends in a ring all-reduce of `nbytes`: 2 (N - 1) / N x bytes (NCCL's bus-bandwidth factor,
    nccl-tests doc/PERFORMANCE.md; the ZeRO paper's 2 Psi per step of data parallelism, section 7.1)."""
    return 2 * (num_gpus - 1) / num_gpus * nbytes


def ring_all_gather_bytes(nbytes: float, num_gpus: int) -> float:
    """Bytes each GPU sends in a ring all-gather (or reduce-scatter) of a tensor of `nbytes` in all: (N - 1) / N x
    bytes (nccl-tests doc/PERFORMANCE.md)."""
    return (num_gpus - 1) / num_gpus * nbytes


ring_reduce_scatter_bytes = ring_all_gather_bytes


@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank moves per optimizer step, by when they can overlap compute."""

    per_micro: float
    """Collectives of every micro-batch, hidden behind that micro-batch's compute (FSDP / ZeRO-3 prefetching)."""
    per_micro_backward: float
    """Collectives of every micro-batch that only backward can hide (ZeRO-2's gradient reduction)."""
    per_step_backward: float
    """Once per step, hidden behind the last micro-batch's backward (DDP's bucketed all-reduce; accumulation
    steps run under no_sync)."""
    after_step: float
    """Once per step, after the optimizer: nothing to hide behind (ZeRO-2's parameter all-gather)."""
    host_per_micro: float = 0.0
    """ZeRO-Offload: bytes over the host link (PCIe) per micro-batch, overlapped like `per_micro`."""
    host_params_stepped: float = 0.0
    """ZeRO-Offload: trainable parameters the CPU updates per step (this rank's partition)."""


ZERO3_FETCH_S = 0.54e-3
"""Seconds ZeRO-3 spends per parameter tensor and fetch beyond the transfer itself (its per-module hooks, the
partition bookkeeping, the waits on its fetch events): measured on one H200, where nothing is transferred, as the
step time zero3 adds over the same step without DeepSpeed divided by tensors x fetches: Llama-3.1-8B LoRA r8 q,v
0.52 ms (419 tensors, 3 fetches), Llama-3.2-1B full fine-tune 0.57 ms (146 tensors, 3 fetches); their mean
(bench/results/zero/zero.jsonl)."""


def zero3_fetch_overhead_s(model: ModelSpec, setup: TrainSetup) -> float:
    """ZeRO-3's fixed cost per step: every parameter tensor (frozen base weights included, and LoRA's A and B) is
    fetched in each forward, again for the backward and, with checkpointing, for the recomputation; each fetch
    costs ZERO3_FETCH_S. 0 for the other strategies."""
    if setup.strategy not in ("zero3", "zero3_offload"):
        return 0.0
    tensors = _full_tensor_count(model, setup)
    if setup.method in ("lora", "qlora"):
        tensors += 2 * len(adapter_terms.lora_targets(model, setup)) * model.num_layers
    fetches = 2 + (1 if setup.grad_checkpointing != "none" else 0)
    return setup.grad_accum * tensors * fetches * ZERO3_FETCH_S


_FULL_TENSORS: dict[int, tuple[ModelSpec, int]] = {}
"""id(model) -> (model, its parameter tensors in a full fine-tune): a plan's search asks for every ZeRO-3 setup it
scores, and the count is the model's alone (the model is kept so that its id is not reused while cached)."""


def _full_tensor_count(model: ModelSpec, setup: TrainSetup) -> int:
    """The parameter tensors of `model` in a full fine-tune (`adapter_terms.trainable_tensor_shapes`), memoised."""
    hit = _FULL_TENSORS.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_FULL_TENSORS) > 64:
            _FULL_TENSORS.clear()
        hit = (model, len(adapter_terms.trainable_tensor_shapes(model, setup.replace(method="full"))))
        _FULL_TENSORS[id(model)] = hit
    return hit[1]


def communication_bytes(model: ModelSpec, setup: TrainSetup) -> CommBytes:
    """What one rank sends per step under its strategy (ring algorithms).

    ddp: all-reduce of the trainable gradients once per step. fsdp, zero3: all-gather of the parameters in forward
    and again in backward (resharded after forward), reduce-scatter of the gradients, every micro-batch (ZeRO paper
    section 7.2.2: 3 Psi per step against data parallelism's 2 Psi). zero2: reduce-scatter of the gradients every
    micro-batch, all-gather of the updated 16-bit parameters after the step. zero3_offload: zero3's collectives
    plus the rank's parameter partition from host memory twice per micro-batch and its gradient partition back.
    Frozen weights are gathered like trained ones (LoRA under FSDP / ZeRO-3); they have no gradients.
    """
    n = setup.num_gpus
    w = weight_terms.DTYPE_BYTES[setup.dtype] if setup.method != "qlora" else 2
    params = float(weight_terms.weight_bytes(model, setup.method, "bf16" if setup.method == "qlora" else setup.dtype))
    trainable = float(adapter_terms.trainable_param_bytes(model, setup))
    if setup.method in ("lora", "qlora"):
        params += trainable  # the adapters are gathered with their layer
    s = setup.strategy
    if s == "ddp":
        return CommBytes(0.0, 0.0, ring_all_reduce_bytes(trainable, n), 0.0)
    if s == "zero2":
        updated = adapter_terms.trainable_param_count(model, setup) * w
        return CommBytes(0.0, ring_reduce_scatter_bytes(trainable, n), 0.0, ring_all_gather_bytes(updated, n))
    per_micro = 2 * ring_all_gather_bytes(params, n) + ring_reduce_scatter_bytes(trainable, n)
    if s == "zero3_offload":
        count = adapter_terms.trainable_param_count(model, setup)
        host = 2 * params / n + 4 * count / n  # 16-bit parameters in, fp32 gradients out
        return CommBytes(per_micro, 0.0, 0.0, 0.0, host, count / n)
    return CommBytes(per_micro, 0.0, 0.0, 0.0)


def link_bytes_s(gpu: GpuSpec | None) -> tuple[float, float]:
    """(GPU-to-GPU, GPU-to-host) bytes per second each way: the catalog's `link_gb_s` and the PCIe link (both
    assumptions, fitune/specs/data/gpus.json `link_source`); PCIe 4.0 for a GPU given as a bare budget."""
    link = (gpu.link_gb_s if gpu is not None and gpu.link_gb_s else DEFAULT_LINK_GB_S) * 1e9
    host = (gpu.host_link_gb_s if gpu is not None and gpu.host_link_gb_s else DEFAULT_LINK_GB_S) * 1e9
    return link, host


def communication_s(model: ModelSpec, setup: TrainSetup, gpu: GpuSpec | None, micro_batch_s: float) -> float:
    """Seconds per step the communication adds to the compute (what overlapping does not hide).

    Assumptions (none measured): collectives run at the link bandwidth (`link_bytes_s`); what a strategy prefetches
    (FSDP, ZeRO-3) overlaps the whole micro-batch's compute; bucketed gradient reductions (DDP, ZeRO-2) overlap the
    backward only (`BACKWARD_SHARE` of the micro-batch); ZeRO-2's parameter all-gather and ZeRO-Offload's CPU step
    overlap nothing; ZeRO-Offload's host transfers share the micro-batch's overlap with its collectives.
    """
    c = communication_bytes(model, setup)
    link, host = link_bytes_s(gpu)
    backward = BACKWARD_SHARE * micro_batch_s
    per_micro = max(0.0, c.per_micro / link + c.host_per_micro / host - micro_batch_s) \
        + max(0.0, c.per_micro_backward / link - backward)
    return (setup.grad_accum * per_micro + max(0.0, c.per_step_backward / link - backward)
            + c.after_step / link + c.host_params_stepped / HOST_ADAM_PARAMS_PER_S)


# ---- the fit -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One measured step from bench/results/hf_recipe/hf_recipe.jsonl."""

    label: str
    model: ModelSpec
    setup: TrainSetup
    tokens_per_s: float


@dataclass(frozen=True)
class Fit:
    coefficients: dict[str, float]
    errors: tuple[float, ...]
    """Predicted / measured tokens/s - 1, per case, in the order of the records."""
    labels: tuple[str, ...]

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(e) for e in self.errors)

    @property
    def max_abs_error(self) -> float:
        return max(abs(e) for e in self.errors)


#: The measured steps the model is fitted to, relative to the repository: the HF recipe's (transformers' modules,
#: PEFT's LoRA, the loss of transformers) and fitune's runner with its techniques (bench/speed_calibration.py).
SOURCES = ("bench/results/hf_recipe/hf_recipe.jsonl", "bench/results/speed/speed.jsonl")


def read_measurements(path: str) -> list[Measured]:
    """The successful steps of a results file: an hf_recipe.jsonl (tokens/s from the fastest step after the first)
    or a speed.jsonl of bench/speed_calibration.py (the median over steps 3 and later; the setup in `setup`)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if not d.get("ok") or not d.get("tokens_per_s"):
                continue
            fields = d["setup"] if "setup" in d else d  # an hf_recipe record holds every setup field it varied
            setup = TrainSetup.from_dict(fields, strict=False)
            s = setup
            kernels = s.kernels + ("+compile" if s.compile == "layers" else "")
            label = (f"{d['model']} {s.stack} {s.method} {kernels} {','.join(s.lora_targets)} r{s.lora_rank} "
                     f"{s.batch_size}x{s.grad_accum}x{s.seq_len_tokens} ckpt {s.grad_checkpointing} {s.attn} "
                     f"loss {s.loss}{' tiled' if s.tiled_mlp else ''}")
            out.append(Measured(label, load_model_spec(d["model"]), setup, float(d["tokens_per_s"])))
    return out


def calibration_measurements(root: str) -> list[Measured]:
    """Every measured step of SOURCES under the repository `root`."""
    return [m for src in SOURCES for m in read_measurements(os.path.join(root, src))]


def fit(measured: list[Measured], gpu: GpuSpec | None = None) -> Fit:
    """Fit the coefficients to measured steps: minimise sum((t_pred / t_measured - 1)^2), c >= 0, c_linear >= 1.

    The measured time of a micro-batch is (tokens_per_step / tokens_per_s - the optimizer's update) / grad_accum.
    Solved exactly by trying every subset of free terms (2^8 least-squares solves of at most 8 unknowns on one Gram
    matrix): small enough to need no numerical library.
    """
    rates = gpu_rates(gpu or resolve_gpu(CALIBRATION_GPU))
    unit = {t: 1.0 for t in TERMS}
    rows, targets = [], []
    for r in measured:
        x = term_seconds(step_terms(r.model, r.setup), rates, unit)
        # per micro-batch: the optimizer's update (physical bytes, not fitted) is taken out of the measured step
        opt = optimizer_step_bytes(r.model, r.setup) / rates.bandwidth_bytes_s
        t = (r.setup.grad_accum * r.setup.batch_size * r.setup.seq_len_tokens / r.tokens_per_s - opt) \
            / r.setup.grad_accum
        rows.append([x[k] / t for k in TERMS])
        targets.append(1.0)
    # c_linear = 1 + c', c' >= 0: move the fixed part to the right-hand side
    rhs = [y - row[0] for row, y in zip(rows, targets)]
    coef = _nnls(rows, rhs)
    coef[0] += 1.0
    coefficients = dict(zip(TERMS, coef))
    errors = []
    for r in measured:
        p = predict(r.model, r.setup, gpu or resolve_gpu(CALIBRATION_GPU), coefficients)
        errors.append(p.tokens_per_s / r.tokens_per_s - 1)
    return Fit(coefficients, tuple(errors), tuple(r.label for r in measured))


def leave_one_model_out(measured: list[Measured]) -> list[float]:
    """Errors of each case predicted by a fit made without any case of its model (out-of-sample errors)."""
    gpu = resolve_gpu(CALIBRATION_GPU)
    errors = []
    for name in sorted({r.model.name for r in measured}):
        train = [r for r in measured if r.model.name != name]
        c = fit(train).coefficients
        errors += [predict(r.model, r.setup, gpu, c).tokens_per_s / r.tokens_per_s - 1
                   for r in measured if r.model.name == name]
    return errors


def _nnls(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """Non-negative least squares by enumeration of the active set (fine for a handful of unknowns), on the Gram
    matrix A^T A and A^T b computed once: the residual of a solution c is c^T G c - 2 c^T g + b^T b."""
    n = len(rows[0])
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    g = [sum(r[i] * y for r, y in zip(rows, rhs)) for i in range(n)]
    bb = sum(y * y for y in rhs)
    best, best_res = [0.0] * n, bb
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            sol = _solve([[gram[i][j] for j in subset] + [g[i]] for i in subset])
            if sol is None or any(v < 0 for v in sol):
                continue
            c = [0.0] * n
            for j, v in zip(subset, sol):
                c[j] = v
            res = (sum(c[i] * gram[i][j] * c[j] for i in subset for j in subset)
                   - 2 * sum(c[i] * g[i] for i in subset) + bb)
            if res < best_res - 1e-12 * bb:
                best, best_res = c, res
    return best


def _solve(a: list[list[float]]) -> list[float] | None:
    """Solve the augmented system `a` (n rows of n coefficients and the right-hand side) by Gaussian elimination
    with partial pivoting; None when singular."""
    n = len(a)
    a = [row[:] for row in a]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_report(measured: list[Measured]) -> tuple[Fit, list[float]]:
    """The fit to every case and the leave-one-model-out errors (in the order of `measured`)."""
    result = fit(measured)
    loo_by_label: dict[int, float] = {}
    gpu = resolve_gpu(CALIBRATION_GPU)
    for name in sorted({r.model.name for r in measured}):
        c = fit([r for r in measured if r.model.name != name]).coefficients
        for i, r in enumerate(measured):
            if r.model.name == name:
                loo_by_label[i] = predict(r.model, r.setup, gpu, c).tokens_per_s / r.tokens_per_s - 1
    return result, [loo_by_label[i] for i in range(len(measured))]


def error_table(measured: list[Measured], errors: list[float], loo: list[float]) -> str:
    """docs/plan.md's table: |predicted / measured - 1| by model and stack, in-sample and with the model left out of
    the fit (median / max)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(measured):
        groups.setdefault((r.model.name, r.setup.stack), []).append(i)
    lines = ["| model | runner | cases | in sample: median / max | left out: median / max |",
             "| --- | --- | --- | --- | --- |"]
    for (model, stack), idx in sorted(groups.items()):
        e, o = [abs(errors[i]) for i in idx], [abs(loo[i]) for i in idx]
        lines.append(f"| {model} | {'fitune' if stack == 'fitune' else 'HF recipe'} | {len(idx)} | "
                     f"{statistics.median(e):.1%} / {max(e):.1%} | {statistics.median(o):.1%} / {max(o):.1%} |")
    return "\n".join(lines).replace("%", " %")


def _summary(errors: list[float]) -> tuple[float, float]:
    return round(statistics.median(abs(e) for e in errors), 4), round(max(abs(e) for e in errors), 4)


def write_calibration(root: str, out_py: str) -> tuple[Fit, list[float]]:
    """Fit to SOURCES under `root` and write the coefficients and errors as a Python module
    (`fitune/plan/calibration.py`)."""
    measured = calibration_measurements(root)
    result, loo = fit_report(measured)
    runner = [i for i, r in enumerate(measured) if r.setup.stack == "fitune"]
    med, mx = _summary(list(result.errors))
    loo_med, loo_max = _summary(loo)
    run_med, run_max = _summary([result.errors[i] for i in runner])
    run_loo_med, run_loo_max = _summary([loo[i] for i in runner])
    lines = [
        '"""Throughput coefficients fitted to the measured H200 steps of SOURCES.',
        "",
        "Generated by `python -m fitune.plan.throughput` (fitune/plan/throughput.py: `write_calibration`); do not edit.",
        "tests/test_plan.py refits from the committed data and checks these numbers and the fit error.",
        '"""',
        "",
        f"SOURCES = {SOURCES!r}",
        f"CASES = {len(measured)}",
        f"RUNNER_CASES = {len(runner)}",
        '"""Of which measured on fitune\'s own runner (stack fitune, its techniques)."""',
        f"MODELS = {sorted({r.model.name for r in measured})!r}",
        "COEFFICIENTS = {",
        *[f"    {k!r}: {v!r}," for k, v in result.coefficients.items()],
        "}",
        f"MEDIAN_ABS_ERROR = {med!r}",
        '"""Median |predicted / measured tokens/s - 1| over the fitted cases."""',
        f"MAX_ABS_ERROR = {mx!r}",
        f"LEAVE_ONE_MODEL_OUT_MEDIAN_ABS_ERROR = {loo_med!r}",
        '"""The same, each model predicted by a fit made without its own cases."""',
        f"LEAVE_ONE_MODEL_OUT_MAX_ABS_ERROR = {loo_max!r}",
        f"RUNNER_MEDIAN_ABS_ERROR = {run_med!r}",
        '"""The errors over fitune\'s runner cases only, in-sample and leave-one-model-out."""',
        f"RUNNER_MAX_ABS_ERROR = {run_max!r}",
        f"RUNNER_LEAVE_ONE_MODEL_OUT_MEDIAN_ABS_ERROR = {run_loo_med!r}",
        f"RUNNER_LEAVE_ONE_MODEL_OUT_MAX_ABS_ERROR = {run_loo_max!r}",
        "",
    ]
    with open(out_py, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return result, loo


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a maintenance script
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    p = argparse.ArgumentParser(description="refit the throughput model to the measured steps of SOURCES")
    p.add_argument("--out", default=os.path.join(here, "calibration.py"))
    p.add_argument("--show", action="store_true", help="print every case's error, in-sample and leave-one-model-out")
    args = p.parse_args(argv)
    result, loo = write_calibration(root, args.out)
    if args.show:
        for label, e, o in zip(result.labels, result.errors, loo):
            print(f"{label:100s} {e:+7.1%} {o:+7.1%}")
        print(error_table(calibration_measurements(root), list(result.errors), loo))
    print("coefficients:", {k: round(v, 6) for k, v in result.coefficients.items()})
    print(f"median |error| {result.median_abs_error:.1%}, max {result.max_abs_error:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
