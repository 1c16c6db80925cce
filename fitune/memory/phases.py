"""Every phase of a run, not only the training step: load, train_step, eval_step, save, merge, export.

`estimate()` (estimate.py) models one training step. A run also loads the model, evaluates, writes checkpoints and
its outputs, and may be merged and exported afterwards; each has its own GPU peak and its own host-memory peak,
and any of them can be the one that runs out (issue 33). `phase_peaks()` returns one `PhasePeak` per phase, each
computed by a named function below whose docstring names the code path it models:

    load        fitune/runtime/model.py `build_model` / `_from_pretrained` (per source: a model folder or a Hub
                cache snapshot, a .gguf file, random weights from a config)
    train_step  the `MemoryEstimate` (estimate.py), plus the pinned host memory it needs
    eval_step   fitune/train/loop.py `_evaluate`: `torch.no_grad()` forward of one eval micro-batch
    save        fitune/train/checkpoint.py `save` (a periodic checkpoint) and fitune/train/loop.py
                `_write_outputs` (the adapter, or the whole model, written at the end)
    merge       fitune/infer/merge.py `merge_run` (`fitune merge`; LoRA and QLoRA only)
    export      fitune/export/gguf.py `_write` / `_tensor_data` (`fitune export`, a GGUF file)

Host bytes are what the process holds in RAM beyond the page cache (a memory-mapped safetensors file is page
cache, which the kernel reclaims: not counted). Every host figure includes a measured baseline: the interpreter
with torch, CUDA and transformers loaded, `HOST_LOAD_BASELINE_BYTES` before training (load, a QLoRA merge),
`HOST_RUNTIME_BASELINE_BYTES` once the steps have run, `HOST_CPU_BASELINE_BYTES` in a process without CUDA.

Pure Python; no torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..setup import TrainSetup
from ..specs import optimizers as optimizer_specs
from ..specs.model import ModelSpec
from ..units import GiB
from . import adapters, loss as loss_terms, overheads, weights
from .autograd import Autograd
from .estimate import LEAN_NORM_ROWS, TILE_TOKENS, _sliding_layers
from .layers import LayerContext, decoder_layer, rms_norm
from .tape import CATEGORIES, TRANSIENTS, Tape, replay

#: The phases of a run, in the order they happen.
PHASES = ("load", "train_step", "eval_step", "save", "merge", "export")
#: Where pretrained weights come from (`--source` of `fitune estimate`): a model folder, a Hub id's cached snapshot
#: (read as a folder), a .gguf file, or none (random weights drawn from a config, on the device).
SOURCES = ("folder", "hub", "gguf", "random")

HOST_RUNTIME_BASELINE_BYTES = 2 * GiB
"""Resident memory of a training process once it trains, outside pinned buffers: Python, torch with its CUDA
libraries and context, compiled kernels, transformers, PEFT, the tokenizer and the dataset. Measured at the eval
step and the saves of 8B runs (bench/results/pretrained_load/phases: 1.85 to 1.92 GiB with `compile: layers`,
H100, torch 2.11): rounded up."""
HOST_LOAD_BASELINE_BYTES = int(1.33 * GiB)
"""Resident memory of `fitune train` while it loads the model, outside the mapped weight files (the CUDA context
up, the tokenizer and data read, CUDA's libraries paged in by the first copies, nothing compiled yet); also the
baseline of `fitune merge` on the GPU (QLoRA). Measured at the end of loading 8B: 1.385 GiB (bf16) and 1.379 GiB
(QLoRA, its quantizing transient counted apart) (bench/results/pretrained_load/phases/call3,
`host_no_weight_files_peak_bytes`; 0.81 GiB before the load): the middle of the two, rounded."""
HOST_CPU_BASELINE_BYTES = int(0.85 * GiB)
"""A process that never starts CUDA (`fitune merge` of a LoRA run on the CPU, `fitune export`): fewer of CUDA's
libraries are paged in. Fitted to the one measurement there is (the 8B LoRA merge of
bench/results/pretrained_load/phases/call3: 2.34 GiB less what `merge_phase` adds), not checked independently."""
CHECKPOINT_SHARD_BYTES = 2 * GiB
"""fitune/train/checkpoint.py `SHARD_BYTES`: the optimizer state is copied to the host one shard at a time."""
SAVE_PRETRAINED_SHARD_BYTES = 50 * 10**9
"""transformers `save_pretrained(max_shard_size="50GB")`, its default: fitune train's final `model/` and `merged/`
folders (fitune/train/loop.py `_write_pretrained`). safetensors copies every tensor of a shard to the host
(`_to_ndarray`: `tensor.to("cpu")`) and keeps them all until the file is written."""
MERGE_SHARD_BYTES = 5 * 10**9
"""fitune/infer/merge.py `merge_run(max_shard_size="5GB")`, `fitune merge --max-shard-size`'s default."""
DEFAULT_HOST_RAM_BYTES = 64 * GiB
"""`fitune plan`'s host RAM when the GPU is not on this machine and `--host-ram` is not given: a desktop with a
24 GB card has 32 or 64 GB."""
EXPORT_F16_BYTES_PER_ELEMENT = 8
"""fitune/export/gguf.py `_tensor_data` (f16): the tensor as fp32 (4 bytes/element) and `np.abs(array)` (4) live
at once, before the f16 copy (2) is made from the fp32 one (6)."""
EXPORT_Q8_0_BYTES_PER_ELEMENT = 8
"""The same for q8_0: the fp32 tensor and its `np.abs` (the largest magnitude) are the peak as for f16; gguf-py's
`quants.quantize` then works 16 rows at a time (gguf/quants.py `_apply_over_grouped_rows`) into a 1.06-byte-per-
element output. Measured (bench/export_host.py, the 8B embedding as the largest tensor, on the CPU): the q8_0 and
f16 exports peak within 1 % of each other."""


@dataclass(frozen=True)
class PhasePeak:
    """The peak of one phase of a run. All sizes in bytes."""

    name: str
    """One of PHASES."""
    gpu_allocated_bytes: int
    """What `torch.cuda.max_memory_allocated()` would report during the phase (0: the phase runs on the CPU)."""
    gpu_reserved_bytes: int
    """What `torch.cuda.max_memory_reserved()` would report: the caching allocator keeps what earlier phases
    reserved."""
    host_bytes: int
    """Host memory the process holds at the phase's peak (resident + pinned), baseline included."""
    note: str
    """What the phase does and what dominates it (one sentence)."""


# ---- sizes the phases share ----------------------------------------------------------------------------------


def largest_linear_numel(m: ModelSpec) -> int:
    """Elements of the largest `nn.Linear` weight of a decoder layer (Llama 3 8B: the 14,336 x 4,096 MLP
    projections). MoE layers' routed experts are fused 3-D tensors, not `nn.Linear`: counted when larger."""
    sizes = [lin.in_features * lin.out_features for moe in (False, True) for lin in m.linears(moe)]
    if m.moe_layers:
        sizes.append(m.num_experts * 2 * m.moe_intermediate_size * m.hidden_size)  # the fused gate_up experts
    return max(sizes, default=0)


def largest_tensor_numel(m: ModelSpec) -> int:
    """Elements of the model's largest tensor: the vocabulary x hidden embedding table, or a larger linear."""
    return max(m.vocab_size * m.hidden_size, largest_linear_numel(m))


def model_weight_bytes(m: ModelSpec, setup: TrainSetup) -> int:
    """Bytes of the weights as the run holds them on its device after loading (weights.py `weight_bytes`: NF4
    decoder linears for QLoRA, else every parameter at the run's dtype; an offloaded embedding table still counts,
    it moves to the CPU only in `prepare_model`)."""
    return weights.weight_bytes(m, setup.method, "bf16" if setup.method == "qlora" else setup.dtype)


def dense_weight_bytes(m: ModelSpec, dtype: str) -> int:
    """Bytes of every parameter at `dtype` (2 bytes for bf16): the model as a merged or dequantized folder holds it."""
    return weights.count_params(m).total * weights.DTYPE_BYTES[dtype]


def _dense_dtype(setup: TrainSetup) -> str:
    """The dtype merged and exported weights have: the run's, bf16 for QLoRA (fitune/infer/merge.py)."""
    return "bf16" if setup.method == "qlora" else setup.dtype


# ---- load -------------------------------------------------------------------------------------------------------


def load_host_bytes(m: ModelSpec, setup: TrainSetup, source: str, device: str = "cuda") -> int:
    """Host memory while the model loads (fitune/runtime/model.py `build_model`), baseline included.

    - folder / hub (a Hub id is read from its cache snapshot, a folder): `from_pretrained(device_map={"": device})`
      copies each tensor from the memory-mapped safetensors file to the GPU; the model is never whole in host RAM.
      The mapped file's pages count in the process's RSS but are page cache, which the kernel drops under pressure
      (16 GB of them for an 8B model): not counted. Measured (bench/results/pretrained_load/phases): bf16 weights
      add 22 MB of anonymous memory; QLoRA's quantize-on-load about 0.1 GB more than bf16, about the largest linear
      in bf16 (117 MB for Llama 3 8B's MLP), which is what is counted on `HOST_LOAD_BASELINE_BYTES`.
    - gguf: transformers dequantizes every tensor on the CPU first (modeling_gguf_pytorch_utils.py
      `load_gguf_checkpoint`: `dequantize` to an fp32 numpy array, `np.copy`, `.to(dtype)`), so the whole state
      dict at the run's dtype is in host memory, plus the fp32 array and its copy of the largest tensor. (This is
      transformers' legacy GGUF loader, the one fitune/specs/sources.py `dequantize_note` describes; the
      `GgufHfQuantizer` of transformers 5.17 reads the packed blocks of the architectures it supports from the
      mapped file, and may need less: not measured.)
    - random: the weights are drawn on the device (`from_config` under `torch.device(device)`): the baseline.
    - device "cpu": the model lives in host memory: its weights on top.
    """
    if source not in SOURCES:
        raise ValueError(f"source {source!r} is not one of {', '.join(SOURCES)}")
    dense = _dense_dtype(setup)
    on_cpu = dense_weight_bytes(m, dense) if device == "cpu" else 0
    if source == "random":
        return HOST_LOAD_BASELINE_BYTES + on_cpu
    if source == "gguf":
        fp32_pair = 2 * 4 * largest_tensor_numel(m)
        return HOST_LOAD_BASELINE_BYTES + dense_weight_bytes(m, dense) + fp32_pair
    quantizing = 2 * largest_linear_numel(m) if setup.method == "qlora" else 0
    return HOST_LOAD_BASELINE_BYTES + on_cpu + quantizing


def load_gpu_bytes(m: ModelSpec, setup: TrainSetup, source: str) -> int:
    """GPU memory at the end of loading (fitune/runtime/model.py `build_model`), its peak.

    bf16 / fp16 / fp32: every tensor is copied to its parameter's place, no transient: the weights. QLoRA
    (`BitsAndBytesConfig`, `device_map={"": 0}`): each decoder linear arrives in bf16 on the GPU and is quantized
    there (bitsandbytes `Params4bit`), one at a time: the NF4 weights plus the largest linear in bf16. Random QLoRA
    weights (`materialize_randomly(each_layer=quantize_layer_to_nf4)`): one whole layer in bf16 at a time.
    """
    resident = model_weight_bytes(m, setup)
    if setup.method != "qlora":
        return resident
    if source == "random":
        layer_bf16 = 2 * sum(lin.in_features * lin.out_features for lin in m.linears(bool(m.moe_layers)))
        return resident + layer_bf16
    return resident + 2 * largest_linear_numel(m)


def load_phase(m: ModelSpec, setup: TrainSetup, source: str, device: str = "cuda") -> PhasePeak:
    """The load phase: `load_gpu_bytes` (allocated = reserved: the allocator keeps the freed bf16 transient) and
    `load_host_bytes`."""
    gpu = load_gpu_bytes(m, setup, source) if device == "cuda" else 0
    how = {"folder": "read tensor by tensor from the folder's safetensors straight onto the GPU",
           "hub": "read from the Hub cache snapshot straight onto the GPU",
           "gguf": "every GGUF tensor dequantized on the CPU first (the whole state dict in host memory)",
           "random": "random weights drawn on the device"}[source]
    if device == "cpu":
        how = {"gguf": how}.get(source, "on the CPU: the whole model in host memory")
    elif setup.method == "qlora" and source != "random":
        how += ", each linear quantized to NF4 on the GPU as it arrives"
    if setup.num_gpus > 1 or setup.strategy != "ddp":
        how += (f"; per rank, as one GPU loads (the strategy's own loading is not modelled; {setup.num_gpus} ranks "
                "share the host)")
    return PhasePeak("load", gpu, gpu, load_host_bytes(m, setup, source, device), how)


# ---- the training step -------------------------------------------------------------------------------------------


def train_step_host_bytes(m: ModelSpec, setup: TrainSetup, est, host_pinned_bytes: int | None = None) -> int:
    """Host memory during the training step: the baseline, the pinned buffers of offloaded checkpoints and ZeRO
    offload (`MemoryEstimate.host_bytes`; fitune/runtime/techniques/offload.py `PinnedPool`: exact-size page-locked
    buffers kept from step to step, so they stay held for the rest of the run) and an
    offloaded embedding table (fitune/runtime/techniques/offload_embeddings.py). `host_pinned_bytes` overrides the
    pinned figure."""
    pinned = est.host_bytes if host_pinned_bytes is None else host_pinned_bytes
    return HOST_RUNTIME_BASELINE_BYTES + pinned + weights.offloaded_embedding_bytes(m, setup)


def train_step_phase(m: ModelSpec, setup: TrainSetup, est, host_pinned_bytes: int | None = None) -> PhasePeak:
    """The training step as `estimate()` models it (its allocated and reserved peaks), with its host memory."""
    return PhasePeak("train_step", est.peak_allocated_bytes, est.peak_reserved_bytes,
                     train_step_host_bytes(m, setup, est, host_pinned_bytes),
                     f"one optimizer step, peak in {est.peak_phase}")


# ---- evaluation --------------------------------------------------------------------------------------------------


def eval_forward_events(m: ModelSpec, setup: TrainSetup, rows_tokens: int) -> list:
    """The tape of one eval micro-batch (fitune/train/loop.py `_evaluate`: `model.eval()`, `torch.no_grad()`,
    `forward_loss` with `use_cache=False`): `setup.batch_size` rows of `rows_tokens` tokens through the same
    layer ops as the training step (layers.py `decoder_layer`), but nothing is saved for backward (an Autograd
    with `keep_saved=False`, as inside a checkpointed forward) and no layer is checkpointed (transformers
    checkpoints only in training mode). The loss is the run's: hf (loss.py `hf_loss`: the model-dtype logits, their
    fp32 copy and the fp32 log-softmax live at once) or chunked (loss.py `chunked_loss(grads=False)`: under no_grad
    nothing needs a gradient, so each chunk's logits and their fp32 copy, eager even with `compile: layers`)."""
    s = setup.replace(seq_len_tokens=rows_tokens)
    w = 2 if s.method == "qlora" else weights.DTYPE_BYTES[s.dtype]
    tape = Tape()
    ag = Autograd(tape, keep_saved=False)
    tokens = s.batch_size * rows_tokens
    ctx = LayerContext(
        model=m, batch_size=s.batch_size, seq_len_tokens=rows_tokens, act_bytes=w,
        lora_targets=adapters.lora_targets(m, s), lora_rank=s.lora_rank, qlora=s.method == "qlora",
        trainable_base=False, attn=s.attn, use_cache=False,
        tiled_mlp_tokens=TILE_TOKENS if s.tiled_mlp else 0, lean_lora=s.lean_lora,
        lean_norm_rows=LEAN_NORM_ROWS if s.lean_norm else 0, liger=s.kernels == "liger",
        compiled=s.compile == "layers")
    inputs = [tape.alloc(8 * tokens, TRANSIENTS, "input_ids"), tape.alloc(8 * tokens, TRANSIENTS, "labels"),
              tape.alloc(overheads.rope_cache_bytes(m, rows_tokens, w), TRANSIENTS, "rope cos/sin"),
              tape.alloc(overheads.attention_mask_bytes(m, s), TRANSIENTS, "attention mask")]
    x = ag.new(w * m.hidden_size * tokens, False, "embeddings")
    sliding = _sliding_layers(m)
    for layer in range(m.num_layers):
        y = decoder_layer(ag, ctx, x, layer in sliding)
        ag.drop(x)
        x = y
    h = rms_norm(ag, ctx, x, m.hidden_size, "final_norm", m.rms_norm_one_plus_weight)
    ag.drop(x)
    if s.loss == "chunked":
        loss = loss_terms.chunked_loss(ag, m, h, tokens, w, compiled=s.compile == "layers", grads=False)
    else:
        loss = loss_terms.hf_loss(ag, m, h, tokens, w, lm_head_trainable=False)
    ag.drop(h)
    ag.drop(*ag.forward_end)
    tape.free(loss.tid, *inputs)
    return tape.events


def eval_forward_peak_bytes(m: ModelSpec, setup: TrainSetup, rows_tokens: int, resident: dict[str, int]) -> int:
    """Peak allocated bytes of one eval micro-batch: `eval_forward_events` replayed from what stays resident
    between steps (weights, adapters, optimizer state, workspaces: the optimizer is not freed for evaluation;
    gradients are, by `zero_grad(set_to_none=True)`)."""
    peaks = replay(eval_forward_events(m, setup, rows_tokens), {k: v for k, v in resident.items() if k in CATEGORIES})
    return max(p.peak_bytes for p in peaks.values())


def eval_new_block_bytes(m: ModelSpec, setup: TrainSetup, rows_tokens: int) -> int:
    """Cache the eval step adds to what training left: with the chunked loss, one block of a chunk's fp32 logits
    (`CHUNK_TOKENS` x vocabulary x 4 bytes). Measured, not derived: in both 8B runs of
    bench/results/pretrained_load/phases/call3 (LoRA 1 x 2048, QLoRA 2 x 2048, the 24 GB cap), reserved grew from
    the training steps' to the eval step's by 0.491 and 0.490 GiB, one such block (0.489 GiB for Llama 3's
    128,256 words), though the cache then held over 6 GiB free: the caching allocator found no free block of that
    size. The rule is fitted to those two records (tests/test_phase_records.py checks them), not checked by an
    independent run. The hf loss's full logits were not measured this way (0 here)."""
    if setup.loss != "chunked":
        return 0
    return min(loss_terms.CHUNK_TOKENS, setup.batch_size * rows_tokens) * m.vocab_size * 4


def eval_reserved_bytes(eval_allocated_bytes: int, est, new_block_bytes: int = 0) -> int:
    """Reserved during evaluation: the cache the training steps left (nothing empties it before `_evaluate`) plus
    the block evaluation adds (`eval_new_block_bytes`), or the eval peak with the training step's own
    fragmentation (reserved - allocated) when it is larger. The eval tape is not replayed through the allocator
    model."""
    fragmentation = est.peak_reserved_bytes - est.peak_allocated_bytes
    return max(est.peak_reserved_bytes + new_block_bytes, eval_allocated_bytes + fragmentation)


def eval_step_phase(m: ModelSpec, setup: TrainSetup, est, rows_tokens: int | None = None,
                    host_pinned_bytes: int | None = None) -> PhasePeak:
    """The eval step: `eval_forward_peak_bytes` of `setup.batch_size` rows of the longest eval row (default: the
    training sequence length, which eval rows are truncated to), host as during the training step."""
    rows = rows_tokens or setup.seq_len_tokens
    allocated = eval_forward_peak_bytes(m, setup, rows, est.resident_bytes)
    note = (f"no_grad forward of {setup.batch_size} x {rows} tokens, {setup.loss} loss: "
            f"{'the full logits in fp32' if setup.loss == 'hf' else 'one chunk of logits at a time'}")
    if setup.num_gpus > 1 or setup.strategy != "ddp":
        note += "; one rank, without the layer weights FSDP / ZeRO-3 gather during the forward (not modelled)"
    return PhasePeak("eval_step", allocated, eval_reserved_bytes(allocated, est, eval_new_block_bytes(m, setup, rows)),
                     train_step_host_bytes(m, setup, est, host_pinned_bytes), note)


def eval_choice(m: ModelSpec, setup: TrainSetup, est, budget_bytes: int, rows_tokens: int | None = None,
                host_pinned_bytes: int | None = None) -> tuple[TrainSetup, PhasePeak] | None:
    """How `fitune train` evaluates within `budget_bytes`, the GPU budget its training fits (fitune/train/loop.py
    `_evaluate`): the setup whose `batch_size` is the rows per eval forward and whose `loss` is the eval loss, with
    its phase. The first that fits of: the training micro-batch with the run's loss, the same rows with the chunked
    loss (the same loss value; one chunk of logits at a time), then one row fewer each time. It fits when its
    allocated peak plus the training step's fragmentation (reserved - allocated) is within the budget. None: not
    even one row with the chunked loss fits (then the run's own is used, and `fitune train` warns before it
    starts)."""
    fragmentation = est.peak_reserved_bytes - est.peak_allocated_bytes
    losses = (setup.loss,) if setup.loss == "chunked" else (setup.loss, "chunked")
    for rows in range(setup.batch_size, 0, -1):
        for loss in losses:
            s = setup.replace(batch_size=rows, loss=loss)
            phase = eval_step_phase(m, s, est, rows_tokens, host_pinned_bytes)
            if phase.gpu_allocated_bytes + fragmentation <= budget_bytes:
                return s, phase
    return None


# ---- save ----------------------------------------------------------------------------------------------------------


def checkpoint_host_bytes(m: ModelSpec, setup: TrainSetup, est=None) -> int:
    """Host memory a periodic checkpoint adds (fitune/train/checkpoint.py `save`): the trainable parameters copied
    to the host (`p.detach().contiguous().cpu()`, held in `trainable` until `save` returns; safetensors 0.8 writes
    CPU tensors without another copy), then the optimizer state one shard of at most `CHECKPOINT_SHARD_BYTES` at a
    time (`_write_tree`: `{k: v.cpu()}` per shard). (A state tensor larger than a shard would be a shard of its
    own; no catalog model has one: Llama 3 8B's largest, the embedding's fp32 moment, is 1.96 GiB.) Without an
    estimate `est` (fitune plan's host check, before one exists), the state is AdamW's at fp32, the largest of
    fitune/specs/optimizers.py: a bound."""
    trainable = adapters.trainable_param_bytes(m, setup)
    if est is not None:
        state = est.resident_bytes.get("optimizer_states", 0)
    else:
        state = optimizer_specs.get("adamw").state_bytes((adapters.trainable_param_count(m, setup),), 4)
    return trainable + min(state, CHECKPOINT_SHARD_BYTES)


def save_added_host_bytes(m: ModelSpec, setup: TrainSetup, est=None) -> int:
    """What saving adds to the training step's host memory: a checkpoint's copies or the final outputs, the
    larger (`save_phase`). The run's host peak is the training step's plus this (a 122,880-token QLoRA plan held
    to 32 GiB of host RAM by its training step alone peaked at 32.8 GiB while saving:
    bench/results/issue33/rows)."""
    return max(checkpoint_host_bytes(m, setup, est), final_output_host_bytes(m, setup))


def final_output_host_bytes(m: ModelSpec, setup: TrainSetup) -> int:
    """Host memory of the outputs written at the end (fitune/train/loop.py `_write_outputs`): LoRA / QLoRA write
    the adapter (PEFT `save_pretrained`: the fp32 adapter tensors copied to the host by safetensors); full / freeze
    write the whole model with transformers' `save_pretrained` default shard of `SAVE_PRETRAINED_SHARD_BYTES`, so
    up to the whole model is copied to the host at once."""
    if setup.method in ("lora", "qlora"):
        return adapters.trainable_param_bytes(m, setup)
    return min(dense_weight_bytes(m, setup.dtype), SAVE_PRETRAINED_SHARD_BYTES)


def save_phase(m: ModelSpec, setup: TrainSetup, est, host_pinned_bytes: int | None = None) -> PhasePeak:
    """Writing a checkpoint, and the final outputs: the GPU holds what stays between steps (nothing is copied on
    it: `.cpu()` reads the parameters in place), the cache as the steps left it; the host holds the copies above
    on top of the training step's host memory (the pinned buffers stay cached)."""
    resident = sum(est.resident_bytes.values())
    ckpt = checkpoint_host_bytes(m, setup, est)
    final = final_output_host_bytes(m, setup)
    what = "a checkpoint: the trainable weights and one optimizer shard copied to the host" if ckpt >= final else \
        "the final model folder: save_pretrained copies a whole shard to the host"
    return PhasePeak("save", resident, max(resident, est.peak_reserved_bytes),
                     train_step_host_bytes(m, setup, est, host_pinned_bytes) + save_added_host_bytes(m, setup, est),
                     what)


# ---- merge and export ------------------------------------------------------------------------------------------------


def merge_phase(m: ModelSpec, setup: TrainSetup) -> PhasePeak | None:
    """`fitune merge` (fitune/infer/merge.py `merge_run`), a process of its own; None for full / freeze (nothing to
    merge).

    LoRA: on the CPU (`device=None` -> "cpu"): the base loaded at the run's dtype (`load_run`) stays in the
    memory-mapped safetensors files (page cache, not counted, as in `load_host_bytes`; a base stored in another
    dtype than the run's would be converted into anonymous memory, whole: not modelled, Hub checkpoints of the
    catalog are bf16); PEFT's `merge_and_unload` writes the merged weight of every targeted linear (copy on write:
    those become anonymous memory), one fp32 delta at a time (`get_delta_weight`: B @ A, out x in), beside the
    fp32 adapter; `save_pretrained` of CPU tensors copies nothing more. Measured (bench/results/pretrained_load/
    phases/call3, 8B r8 on q,v): 2.34 GiB at the peak, 1.95 GiB of it anonymous.
    QLoRA: on CUDA (bitsandbytes dequantizes there): the NF4 base (`build_model`), then `dequantize_nf4` replaces
    each NF4 linear with a bf16 one, freeing the NF4 block as it goes: the whole model becomes bf16 on the GPU; the
    adapter (fp32) and PEFT's fp32 delta of one linear on top. Reserved as allocated: the cache reuses the freed
    NF4 blocks for the smaller bf16 weights (measured: reserved 3 % over allocated, bench/results/pretrained_load/
    phases/call3). `save_pretrained(max_shard_size="5GB")` copies one shard of the GPU tensors to the host
    (`MERGE_SHARD_BYTES`).
    """
    if setup.method not in ("lora", "qlora"):
        return None
    adapter = adapters.trainable_param_bytes(m, setup)
    delta = 4 * largest_linear_numel(m)
    dense = dense_weight_bytes(m, _dense_dtype(setup))
    if setup.method == "lora":
        merged = merged_linear_bytes(m, setup)
        return PhasePeak("merge", 0, 0, HOST_CPU_BASELINE_BYTES + merged + adapter + delta,
                         f"fitune merge on the CPU: the {setup.dtype} base mapped from its files, the merged "
                         "linears rewritten in host memory")
    allocated = dense + adapter + delta
    host = HOST_LOAD_BASELINE_BYTES + min(dense, MERGE_SHARD_BYTES)
    return PhasePeak("merge", allocated, allocated, host,
                     "fitune merge on the GPU: the NF4 base dequantized, the whole model in bf16 on the GPU")


def merged_linear_bytes(m: ModelSpec, setup: TrainSetup) -> int:
    """The weights `merge_and_unload` rewrites: every linear LoRA targets, over all layers, at the run's dtype."""
    targets = adapters.lora_targets(m, setup)
    w = weights.DTYPE_BYTES[_dense_dtype(setup)]

    def per_layer(moe: bool) -> int:
        return sum(lin.in_features * lin.out_features for lin in m.linears(moe) if lin.name in targets)

    return w * (per_layer(False) * m.dense_layers + per_layer(True) * m.moe_layers)


def export_phase(m: ModelSpec, setup: TrainSetup, qtype: str = "f16") -> PhasePeak:
    """`fitune export` (fitune/export/gguf.py `_write`), a process of its own on the CPU: the merged (or full)
    model's safetensors read one tensor at a time (`_tensor_data`: `f.get_tensor(...)` at its dtype, `.to(float32)`,
    `np.abs(...).max()`, then the f16 or q8_0 array) and written at once; the largest tensor's working set
    (`EXPORT_F16_BYTES_PER_ELEMENT` or `EXPORT_Q8_0_BYTES_PER_ELEMENT` per element) is the peak."""
    per = EXPORT_F16_BYTES_PER_ELEMENT if qtype == "f16" else EXPORT_Q8_0_BYTES_PER_ELEMENT
    return PhasePeak("export", 0, 0, HOST_CPU_BASELINE_BYTES + per * largest_tensor_numel(m),
                     f"fitune export ({qtype}) on the CPU, one tensor at a time")


# ---- all of them -------------------------------------------------------------------------------------------------


def phase_peaks(setup: TrainSetup, spec: ModelSpec, est, source: str = "folder", eval_rows_tokens: int | None = None,
                host_pinned_bytes: int | None = None, device: str = "cuda",
                gpu_budget_bytes: int | None = None) -> list[PhasePeak]:
    """The peak of every phase of a run of `setup` on `spec`, in the order they happen (merge only for LoRA /
    QLoRA). `est`: the training step's `MemoryEstimate` (estimate.py). `source`: one of SOURCES.
    `eval_rows_tokens`: the longest eval row (default: the training sequence length). `host_pinned_bytes`: the
    pinned host memory of the step (default: `est.host_bytes`). `gpu_budget_bytes`: the GPU's budget, where known:
    the eval step is then the one `fitune train` chooses to fit it (`eval_choice`)."""
    evaluation = eval_step_phase(spec, setup, est, eval_rows_tokens, host_pinned_bytes)
    if gpu_budget_bytes is not None and device == "cuda":
        chosen = eval_choice(spec, setup, est, gpu_budget_bytes, eval_rows_tokens, host_pinned_bytes)
        evaluation = chosen[1] if chosen is not None else evaluation
    save = save_phase(spec, setup, est, host_pinned_bytes)
    save = replace(save, gpu_reserved_bytes=max(save.gpu_reserved_bytes, evaluation.gpu_reserved_bytes))
    out = [load_phase(spec, setup, source, device),
           train_step_phase(spec, setup, est, host_pinned_bytes),
           evaluation,
           save]  # the cache keeps what evaluation added (reserved never shrinks without empty_cache)
    merge = merge_phase(spec, setup)
    if merge is not None:
        out.append(merge)
    out.append(export_phase(spec, setup))
    return out


def worst_phase(peaks: list[PhasePeak]) -> PhasePeak:
    """The phase with the largest GPU allocated peak (the one that decides whether the run fits the card; ties go
    to the earlier phase)."""
    return max(peaks, key=lambda p: p.gpu_allocated_bytes)


def host_peak(peaks: list[PhasePeak], names: tuple[str, ...] = ("load", "train_step", "eval_step", "save")) -> PhasePeak:
    """The phase of `names` (default: those of `fitune train`'s own process) with the most host memory."""
    return max((p for p in peaks if p.name in names), key=lambda p: p.host_bytes)


# ---- this machine ------------------------------------------------------------------------------------------------


def meminfo_bytes(key: str, text: str | None = None, path: str = "/proc/meminfo") -> int | None:
    """A /proc/meminfo value in bytes ("MemTotal", "MemAvailable"), or None where there is none (not Linux). `text`:
    the file's contents (tests)."""
    if text is None:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read()
        except OSError:
            return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            parts = rest.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1)
    return None


def local_nvidia_gpu(driver_dir: str = "/proc/driver/nvidia/gpus") -> bool:
    """Whether this machine has an NVIDIA GPU, seen by the driver (without importing torch)."""
    try:
        return bool(os.listdir(driver_dir))
    except OSError:
        return False


def source_of(model: str) -> str:
    """The load source `fitune train` would use for `model:` (fitune/runtime/model.py `_has_weights`): a .gguf
    file -> gguf; a folder with weight files -> folder (one without -> random); a Hub id -> hub; a config.json ->
    random; a catalog name -> hub (its weights come from the Hub: download, or the cache)."""
    from ..specs.sources import is_gguf_path

    text = str(model)
    if is_gguf_path(text):
        return "gguf"
    if os.path.isdir(text):
        has = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(text))
        return "folder" if has else "random"
    if os.path.isfile(text):
        return "random"
    return "hub"  # a Hub id or a catalog name


def run_host_floor(m: ModelSpec, setup: TrainSetup, source: str) -> tuple[int, str, str]:
    """The host memory every run of `setup`'s method needs, without a training-step estimate: (bytes, phase, why).
    The larger of loading (`load_host_bytes`) and the outputs written at the end (`final_output_host_bytes` with the
    baseline); `fitune plan` leaves out methods over its host RAM with it (the pinned buffers of offloaded
    checkpoints are judged per setup)."""
    load = load_host_bytes(m, setup, source)
    final = HOST_RUNTIME_BASELINE_BYTES + final_output_host_bytes(m, setup)
    if load >= final:
        why = ("the GGUF file dequantized on the CPU" if source == "gguf"
               else "the process, the weights read from their mapped files straight to the GPU")
        return load, "loading", why
    if setup.method in ("lora", "qlora"):
        return final, "saving", "the trained process writing its adapter"
    return final, "saving", "save_pretrained copies the whole model to the host"
