"""Multi-GPU training, per rank: what each strategy divides over the GPUs, and the buffers it adds.

`estimate()` models ONE rank (one GPU, one process). With `num_gpus` = 1 and `ddp` nothing here applies (a plain
single-GPU step). Otherwise `RankLayout.of` says what stays resident on the rank (weights, adapters, optimizer
state, gradient partitions, communication buffers, each divided as the strategy divides it), what lives in host
memory, and what the driver's libraries take outside PyTorch's allocator; `RankStep` writes the strategy's
temporaries onto the step's tape (all-gathered parameters, reduce-scatter buffers, ZeRO's buckets), so the same
phase-wise replay and allocator model find the peak.

The strategies (TrainSetup.strategy), N = num_gpus:
- ddp (torch DistributedDataParallel, N > 1): nothing divided; the gradient buckets are a full extra copy of the
  trainable gradients (`ddp_bucket_bytes`).
- fsdp (PyTorch FSDP2, `fully_shard` on each decoder layer and on the root): parameters, gradients and optimizer
  state / N; the current and the prefetched layer's parameters all-gathered (`fsdp_gathered_layers`), the root's
  (embeddings, lm_head, final norm) gathered from forward to the end of backward, one layer's gradients in a
  reduce-scatter buffer.
- zero2 (DeepSpeed ZeRO stage 2): gradients and optimizer state (with its fp32 master copy) / N, the reduce bucket.
- zero3 (ZeRO stage 3): parameters / N too, the current layer and the prefetch bucket gathered.
- zero3_offload (ZeRO-3 with offload_param and offload_optimizer to the CPU): parameters, gradients and optimizer
  state in pinned host memory (`host_bytes`); the GPU holds the working set.

Categories added to the breakdown: `gathered_weights` (parameters all-gathered for compute) and `comm_buffers`
(DDP buckets, reduce-scatter inputs, ZeRO's buckets).

ZeRO-3 keeps the last layers gathered across the forward/backward turn, up to `stage3_max_live_parameters`
(`zero3_live_after_forward_bytes`, measured with offload on one GPU). For the reserved peak, DeepSpeed's initialisation
is replayed request by request (`zero_setup_allocations`: flat buffers, fp32 master partitions, the freed
per-parameter tensors and temporaries it leaves cached), and the allocations DeepSpeed makes on its side streams are
marked so (`zero_reduction_stream`, `zero3_fetch_stream`): the caching allocator keeps one cache per stream. With
offload, each gradient partition goes to the host through GPU copies on the reduction stream
(`zero3_offload_grad_copies`).

Not modelled: FSDP's per-parameter padding to a multiple of N (under N elements per tensor); ZeRO-3's small
persistent parameters (`stage3_param_persistence_threshold`: the norms, kilobytes); the all-gather input copies (1/N
of a layer). None of the multi-GPU numbers has been measured yet: the CLI and the planner mark them unvalidated.

Pure Python; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..setup import TrainSetup
from ..specs.model import ModelSpec
from ..units import MiB
from . import weights
from .allocator import EMPTY_CACHE
from .optimizer import flat_state_bytes, optimizer_step_transient_bytes, state_tensor_bytes
from .tape import ADAPTERS, GRADIENTS, OPTIMIZER, TRANSIENTS, WEIGHTS, Tape

GATHERED = "gathered_weights"
COMM = "comm_buffers"
#: The categories multi-GPU strategies add to the breakdown (after tape.CATEGORIES).
PARALLEL_CATEGORIES = (GATHERED, COMM)

SHARDED_PARAMS = ("fsdp", "zero3", "zero3_offload")
ZERO = ("zero2", "zero3", "zero3_offload")

#: DDP's `bucket_cap_mb` default (torch.nn.parallel.DistributedDataParallel: 25 MiB) and the first bucket's size
#: (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB).
DDP_BUCKET_CAP_BYTES = 25 * MiB
DDP_FIRST_BUCKET_BYTES = 1 * MiB
#: DeepSpeed defaults (deepspeed/runtime/zero/config.py; https://www.deepspeed.ai/docs/config-json/): elements.
#: Hugging Face's Trainer writes `auto` as hidden_size^2 (reduce) and 0.9 x hidden_size^2 (prefetch) instead.
ZERO_REDUCE_BUCKET_ELEMENTS = 500_000_000
ZERO3_PREFETCH_BUCKET_ELEMENTS = 50_000_000
#: `stage3_max_live_parameters` (DeepSpeed config docs: "The maximum number of parameters resident per GPU before
#: releasing", default 1e9; fitune's config leaves it at that).
ZERO3_MAX_LIVE_ELEMENTS = 1_000_000_000
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
#: `overlap_comm` as fitune's DeepSpeed config sets it (fitune/parallel/deepspeed_config.py: on for every stage;
#: DeepSpeed's own default is off for stage 2). Stage 2 then double-buffers its reduce bucket (two buffers).
ZERO_OVERLAP_COMM = {"zero2": True, "zero3": True, "zero3_offload": True}
#: ZeRO-3's optimizer runs over sub-groups of at most this many elements, one after the other (DeepSpeed config
#: docs, "sub_group_size": 1e9): the fp32 gradient of one sub-group exists at a time.
ZERO3_SUB_GROUP_ELEMENTS = 1_000_000_000
#: ZeRO keeps an fp32 master copy of the trainable parameters next to the optimizer state (ZeRO paper, 3.1: K = 12
#: bytes per parameter for mixed-precision Adam = 4 master + 4 momentum + 4 variance).
ZERO_MASTER_BYTES = 4

#: Device memory NCCL takes outside PyTorch's allocator once a communicator exists (its channel buffers,
#: NCCL_BUFFSIZE = 4 MiB per channel and peer, and its proxy state). A GUESS until measured on the multi-GPU
#: machine: public reports range from 200 MiB to 1 GiB per process; with NVLink SHARP (NVLS) it is larger.
NCCL_OUTSIDE_ALLOCATOR_BYTES = 512 * MiB
#: DeepSpeed's own device memory outside the allocator (the kernel images of its JIT-built ops: fused Adam,
#: multi-tensor apply). A GUESS until measured.
DEEPSPEED_OUTSIDE_ALLOCATOR_BYTES = 64 * MiB
#: ZeRO-Offload's CPU Adam keeps, per trainable parameter and rank partition: the fp32 master (4), Adam's two fp32
#: moments (8) and the fp32 gradient (4) in pinned host memory (ZeRO-Offload paper, arXiv:2101.06840, section 4.1).
OFFLOAD_HOST_GRAD_BYTES = 4


def is_parallel(setup: TrainSetup) -> bool:
    """Anything but one GPU without a strategy: the single-GPU estimate stays exactly as it is."""
    return setup.num_gpus > 1 or setup.strategy != "ddp"


def sharded(nbytes: int, num_gpus: int) -> int:
    """One rank's share of a tensor split N ways: ceil(bytes / N)."""
    return -(-int(nbytes) // num_gpus)


def ddp_bucket_bytes(trainable_grad_bytes: int) -> int:
    """DDP's gradient buckets: with `gradient_as_bucket_view=False` (the default) a flat copy of every trainable
    gradient, allocated when the model is wrapped and kept.

    Source: torch.nn.parallel.DistributedDataParallel docs, `gradient_as_bucket_view`: "When set to True,
    gradients will be views pointing to different offsets of allreduce communication buckets. This can reduce peak
    memory usage, where the saved memory size will be equal to the total gradients size."
    """
    return int(trainable_grad_bytes)


def ddp_bucket_sizes(trainable_grad_bytes: int) -> list[int]:
    """The buckets one by one (the allocator rounds each): 1 MiB first, then `bucket_cap_mb` = 25 MiB each."""
    left = ddp_bucket_bytes(trainable_grad_bytes)
    sizes = []
    cap = DDP_FIRST_BUCKET_BYTES
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = DDP_BUCKET_CAP_BYTES
    return sizes


def fsdp_gathered_layers() -> int:
    """Decoder layers whose unsharded parameters FSDP2 holds at once: the one computing and the one prefetched.

    Source: PyTorch FSDP2 docs (torch.distributed.fsdp.fully_shard; the FSDP2 tutorial, "Prefetching"): forward
    all-gathers the next layer while the current one computes (implicit prefetching through the all-gather stream),
    and `reshard_after_forward=True` frees a layer's parameters after its forward; backward prefetches the previous
    layer (explicit backward prefetch of 1) and frees each layer after its backward.
    """
    return 2


def fsdp_root_gathered_bytes(model: ModelSpec, param_bytes: int) -> int:
    """The root module's parameters (embeddings, lm_head when untied, final norm), unsharded from the forward's
    start to the end of backward: FSDP2 does not reshard the root after forward ("the root FSDP state has its value
    specially set to False", fully_shard docs, `reshard_after_forward`)."""
    counts = weights.count_params(model)
    return (counts.embedding + counts.lm_head + counts.final_norm) * param_bytes


def zero_optimizer_state_bytes(optimizer: str, trainable_params: int, num_gpus: int, on_host: bool = False) -> int:
    """One rank's ZeRO optimizer partition: the fp32 master copy plus the optimizer's state at fp32, over N.

    Formula: ceil(n / N) x (4 + state bytes per element); adamw: 4 + 8 = 12 = the ZeRO paper's K
    (Rajbhandari et al. 2019, arXiv:1910.02054, section 3.1 and 5: "ZeRO-DP ... K = 12"). The partition is one flat
    tensor, so Adafactor keeps an unfactored fp32 second moment (4 bytes). Paged 8-bit states live in managed
    memory, outside the allocator (the master copy does not); `on_host` (ZeRO-Offload) counts them: on the CPU
    nothing is paged.
    """
    n = sharded(trainable_params, num_gpus)
    return ZERO_MASTER_BYTES * n + flat_state_bytes(optimizer, n, allocator_only=not on_host)


def zero_reduce_bucket_bytes(strategy: str, grad_bytes_per_element: int) -> int:
    """ZeRO's gradient reduce buffer(s): `reduce_bucket_size` elements in the gradients' (16-bit) dtype.

    Stage 2 allocates them when the first gradient of a backward arrives, two with `overlap_comm` (source:
    deepspeed/runtime/zero/stage_1_and_2.py `setup_buckets`: `buf_0 = torch.empty(int(self.reduce_bucket_size),
    ...)`, `buf_1` when overlap_comm). Stage 3 allocates one flat buffer per dtype once, at initialisation, and keeps
    it (stage3.py: `bucket.buffer = torch.empty(self.reduce_bucket_size, dtype=dtype, ...)`).
    Measured on one H200 (bench/results/zero/): Llama-3.1-8B LoRA under zero3 peaks 0.98 GiB above the same step
    without DeepSpeed, the 0.93 GiB of one bf16 buffer of 5e8 elements plus the fp32 master and its partitions.
    """
    buffers = 2 if strategy == "zero2" and ZERO_OVERLAP_COMM.get(strategy) else 1
    return buffers * ZERO_REDUCE_BUCKET_ELEMENTS * grad_bytes_per_element


#: The stream id the allocator model gives DeepSpeed's reduction stream (allocator.py: 0 is the default stream).
REDUCTION_STREAM = 1


def zero_reduction_stream(strategy: str) -> int:
    """The stream ZeRO-2's gradient reduction allocates on: with `overlap_comm` a side stream of its own
    (stage_1_and_2.py `reduce_ipg_grads`: `stream = self.reduction_stream` if `self.overlap_comm`, then
    `with get_accelerator().stream(stream): ... self.copy_grads_in_partition(param)`), so the flat 16-bit gradient
    partition it creates there cannot reuse the blocks the default stream left cached (allocator.py). Measured: the
    Llama-3.2-1B full fine-tune under zero2 reserves 32.24 GiB in its first step, one 2.30 GiB partition more than
    the same requests on one stream (bench/results/zero/history2/full1b-zero2.memory.json)."""
    return REDUCTION_STREAM if ZERO_OVERLAP_COMM.get(strategy) else 0


#: The stream id the allocator model gives ZeRO-3's parameter all-gather stream.
ALLGATHER_STREAM = 2


def zero3_fetch_stream(strategy: str) -> int:
    """The stream ZeRO-3 gathers (or, with offload, fetches from the host) parameters on: its own
    (partitioned_param_coordinator.py `__all_gather_params`: `with get_accelerator().stream(self.__allgather_stream):
    ... all_gather_coalesced(...)`, whose buffers `torch.empty` there), so the gathered parameters come from blocks
    cached for that stream only (allocator.py). Measured: Llama-3.1-8B LoRA, zero3_offload built under zero.Init,
    reserved 12.49 GiB; the estimate 11.86 GiB with the gathers on the default stream, 12.26 GiB on their own
    (bench/results/zero/zero_init/)."""
    return ALLGATHER_STREAM if strategy in ("zero3", "zero3_offload") else 0


def zero3_sub_groups(tensor_numels: list[int], num_gpus: int) -> list[int]:
    """ZeRO-3's optimizer sub-groups in order, in elements of one rank's partition: parameters are taken in order
    and a sub-group closes once it holds at least `sub_group_size` (stage3.py `_create_fp16_sub_groups`).
    Llama-3.2-1B: 1,003,012,096 and 232,802,304 elements (measured: the fp32 blocks of 4,012,048,384 and
    931,209,216 bytes live at the peak, bench/results/zero/history2/full1b-zero3.memory.json)."""
    groups, current = [], 0
    for n in tensor_numels:
        current += sharded(n, num_gpus)
        if current >= ZERO3_SUB_GROUP_ELEMENTS:
            groups.append(current)
            current = 0
    return groups + [current] if current or not groups else groups


def zero3_sub_group_elements(tensor_numels: list[int], num_gpus: int) -> int:
    """The largest of ZeRO-3's optimizer sub-groups (`zero3_sub_groups`)."""
    return max(zero3_sub_groups(tensor_numels, num_gpus))


#: Keys of `zero_setup_allocations`' requests (allocator.py `replay_reserved`: below -2**40).
ZERO_SETUP_KEY = -(1 << 41)


def zero_setup_allocations(strategy: str, param_blocks: list[int], trainable: list[bool], param_bytes_per_element: int,
                           partition_elements: int, sub_groups: list[int], reduce_bucket_bytes: int
                           ) -> list[tuple[int, int]]:
    """DeepSpeed's allocations and frees from the loaded model to the first step, request by request, for the
    caching allocator model (allocator.py `replay_reserved`: (key, bytes) allocates, (key, -bytes) frees,
    `EMPTY_CACHE` empties the cache). What stays is the flat 16-bit buffer, the fp32 master partition(s) and, for
    ZeRO-3, its gradient partitions and reduce bucket; what the allocator keeps cached from the rest (the freed
    per-parameter tensors, temporary copies) is what the first step's large blocks then reuse or cannot.

    `param_blocks`: the parameters as loaded (one request each, in loading order; ZeRO-3: partitioned at
    construction by zero.Init); `trainable`: which ones the optimizer owns (DeepSpeed flattens only those).

    zero2 (deepspeed/runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__`, DeepSpeed 0.19):
    `empty_cache()`; the trainable parameters flattened into one buffer (`flatten_dense_tensors_aligned`) and
    freed (`_update_model_bit16_weights` points them into it); the fp32 master partition as
    `partition.clone().to(fp32)` (a 16-bit copy, freed); `initialize_optimizer_states` makes a zero fp32 gradient
    of the partition and drops it.
    zero3 (stage3.py `DeepSpeedZeroOptimizer_Stage3.__init__`): `defragment` copies the trainable partitions to the
    host, frees them, empties the cache and copies them back as one flat buffer; `_create_fp32_partitions` makes per
    sub-group `converted = flat.to(fp32)` (the previous sub-group's `converted` freed as the name is rebound, after
    the new one exists) and the master `converted.clone()`; `initialize_optimizer_states` a zero fp32
    gradient of the largest sub-group, dropped; then the reduce bucket and `grad_partitions_flat_buffer`, kept.

    Measured (bench/results/zero/history2/*.memory.json, the `deepspeed.initialize` phase's peak reserved):
    Llama-3.2-1B full, zero2 16.121 GiB, zero3 14.389 GiB; this sequence through the allocator model: 16.121 and
    14.387 GiB.
    """
    lp = param_bytes_per_element
    events = [(ZERO_SETUP_KEY - i, b) for i, b in enumerate(param_blocks)]
    flat_bytes = sum(b for b, t in zip(param_blocks, trainable) if t)
    frees = [(ZERO_SETUP_KEY - i, -b) for i, (b, t) in enumerate(zip(param_blocks, trainable)) if t]
    key = ZERO_SETUP_KEY - len(param_blocks)
    if strategy == "zero2":
        n = partition_elements
        return events + [EMPTY_CACHE, (key, flat_bytes)] + frees + [
            (key - 1, lp * n), (key - 2, 4 * n), (key - 1, -lp * n),  # clone, fp32 master, the clone freed
            (key - 3, 4 * n), (key - 3, -4 * n)]  # initialize_optimizer_states' zero gradient
    events += frees + [EMPTY_CACHE, (key, flat_bytes)]
    prev: list[tuple[int, int]] = []
    for j, sub in enumerate(sub_groups):
        converted = key - 1 - 2 * j
        # `converted = ....to(fp32)` (the previous one freed as the name is rebound), the master `converted.clone()`
        events += [(converted, 4 * sub)] + prev + [(converted - 1, 4 * sub)]
        prev = [(converted, -4 * sub)]
    events += prev
    largest = key - 1 - 2 * len(sub_groups)
    events += [(largest, 4 * max(sub_groups)), (largest, -4 * max(sub_groups))]
    if reduce_bucket_bytes:
        events.append((largest - 1, reduce_bucket_bytes))
    return events + [(largest - 2, lp * sum(sub_groups))]


#: `_constant_buffered_norm2`'s chunk (stage3.py: `buffer_size=250000000` elements).
ZERO3_NORM_CHUNK_ELEMENTS = 250_000_000


def zero3_offload_grad_copies(numel: int, lp_bytes: int) -> list[int]:
    """The GPU temporaries ZeRO-3 with `offload_optimizer` makes for ONE parameter's gradient partition as it hands it
    to the host, in order: a positive size allocates, the same size negative frees it (DeepSpeed 0.19,
    deepspeed/runtime/zero/stage3.py `partition_grads`, l. 1886-1933: the partition is copied into the pinned host
    `grad_partitions_flat_buffer`, then `grad_buffer = grad_buffer.to(grad_partition.device)` brings a 16-bit copy
    back to the GPU; at the accumulation boundary `_offload_grad_partition_at_boundary`, l. 1393-1407, takes its norm
    with `_constant_buffered_norm2`, l. 1842-1849, `part.data.double()` per chunk of at most 2.5e8 elements, and
    copies it to the fp32 host gradient through `grad_buffer.to(dtype=fp32)`; the 16-bit copy goes when the next
    parameter rebinds `grad_buffer`). All of it runs inside `__reduce_and_partition_ipg_grads`' `with
    stream(self.reduce_and_partition_stream)` (l. 1591), DeepSpeed's own stream with overlap_comm
    (`zero_reduction_stream`), so these blocks are cached for that stream alone. The tied embedding of Llama-3.2-1B
    (2.6e8 elements) needs its 525 MB copy and a 2.0 GB float64 chunk there at once. Measured: Llama-3.2-1B full
    fine-tune, zero3_offload built under zero.Init, reserved 12.83 GiB; the estimate 10.44 GiB without these copies,
    12.95 GiB with them (bench/results/zero/zero_init/)."""
    events = [lp_bytes * numel]
    left = numel
    while left > 0:
        chunk = 8 * min(left, ZERO3_NORM_CHUNK_ELEMENTS)
        events += [chunk, -chunk]
        left -= ZERO3_NORM_CHUNK_ELEMENTS
    return events + [4 * numel, -4 * numel, -lp_bytes * numel]


def zero3_prefetch_bytes(next_layer_param_bytes: int, param_bytes_per_element: int) -> int:
    """ZeRO-3's prefetch: up to `stage3_prefetch_bucket_size` elements (5e7) of the next module's parameters are
    gathered while the current one computes (DeepSpeed config docs, "stage3_prefetch_bucket_size")."""
    return min(next_layer_param_bytes, ZERO3_PREFETCH_BUCKET_ELEMENTS * param_bytes_per_element)


def zero3_live_after_forward_bytes(head_bytes: int, layer_bytes: int, num_layers: int,
                                   param_bytes_per_element: int) -> int:
    """Bytes of the last decoder layers' parameters ZeRO-3 still holds gathered when forward ends: it releases a
    module's parameters only once more than `stage3_max_live_parameters` are live, so the lm_head and the last layers
    up to that many elements stay for backward, which uses them first.

    Measured (bench/results/zero/zero_init/*.memory.json, the blocks live at the peak, the loss's backward):
    Llama-3.1-8B LoRA with offload held the lm_head and 2.3 layers (2 x 436 MB and one MLP matrix more), Llama-3.2-1B
    full with offload the tied embedding and about 12.3 layers of 122 MB: both close to 1e9 elements in all,
    against 1e9 here (2.18 and 12.1 layers)."""
    live = max(0, ZERO3_MAX_LIVE_ELEMENTS * param_bytes_per_element - head_bytes)
    return min(live, layer_bytes * num_layers)


def zero_offload_host_bytes(param_bytes: int, trainable_params: int, optimizer: str, num_gpus: int) -> dict[str, int]:
    """Pinned host memory of one rank under ZeRO-3 with offload_param and offload_optimizer to the CPU.

    weights: the rank's partition of the 16-bit parameters (ceil(bytes / N)); optimizer_states: the fp32 master
    and the optimizer's fp32 state (`zero_optimizer_state_bytes`, paged 8-bit counted at 8-bit size here: on the CPU
    nothing is paged); gradients: the fp32 gradient partition the CPU optimizer reads.
    Source: ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840) section 4.1; DeepSpeed config docs, "offload_param",
    "offload_optimizer".
    """
    return {
        WEIGHTS: sharded(param_bytes, num_gpus),
        OPTIMIZER: zero_optimizer_state_bytes(optimizer, trainable_params, num_gpus, on_host=True),
        GRADIENTS: OFFLOAD_HOST_GRAD_BYTES * sharded(trainable_params, num_gpus),
    }


def outside_allocator_bytes(setup: TrainSetup) -> int:
    """Device memory the communication libraries take outside PyTorch's allocator (they shrink its budget):
    NCCL's communicator when N > 1, DeepSpeed's kernels under ZeRO. Both GUESSES (the constants above)."""
    out = NCCL_OUTSIDE_ALLOCATOR_BYTES if setup.num_gpus > 1 else 0
    if setup.strategy in ZERO:
        out += DEEPSPEED_OUTSIDE_ALLOCATOR_BYTES
    return out


# ---- the layout of one rank ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds, in bytes, for a setup with a multi-GPU strategy (or ZeRO / FSDP on one GPU)."""

    strategy: str
    num_gpus: int
    resident: dict[str, int]
    """Bytes per category resident on the GPU before the step (weights and adapters divided or not, optimizer state
    and gradient partitions, DDP buckets)."""
    host: dict[str, int]
    """Pinned host bytes per category (zero3_offload)."""
    outside_allocator_bytes: int
    layer_gather_bytes: int
    """Unsharded parameters of one decoder layer (base weights and adapters), bytes."""
    root_gather_bytes: int
    head_gather_bytes: int
    """ZeRO-3: lm_head (or the tied embedding) and the final norm, gathered around the loss."""
    embed_gather_bytes: int
    prefetch_bytes: int
    """ZeRO-3: the prefetch bucket of the next layer."""
    live_after_forward_bytes: int
    """ZeRO-3: the window of the latest layers' parameters left gathered, in forward and backward, and so the last
    layers' at the forward/backward turn (`zero3_live_after_forward_bytes`)."""
    reduce_bucket_bytes: int
    trainable_params: int
    trainable_bytes: int
    extra_blocks: tuple[int, ...] = field(default_factory=tuple)
    grad_partition_bytes: int = 0
    """ZeRO-2: the 16-bit gradient partition the reduced gradients land in during backward (freed once the step
    has its fp32 copy)."""
    sub_group_elements: int = 0
    """ZeRO-3: the largest optimizer sub-group (its fp32 gradient and the step's temporaries are per sub-group)."""
    sub_groups: tuple[int, ...] = ()
    """ZeRO-3: every optimizer sub-group in order, elements (`zero3_sub_groups`)."""
    trainable_numels: tuple[int, ...] = ()
    """The trainable tensors' sizes in order, elements, where known (full fine-tunes): ZeRO's gradient norm takes
    a float64 copy of each."""
    lp_bytes: int = 2
    """ZeRO: bytes per element of the 16-bit parameters and gradients DeepSpeed keeps."""

    """Resident allocations beyond the model's own tensors (DDP buckets, ZeRO's flat partitions), one per request."""

    @property
    def shards_params(self) -> bool:
        return self.strategy in SHARDED_PARAMS

    @property
    def weight_divisor(self) -> int:
        """1 (replicated), N (sharded), 0 (offloaded: none on the GPU)."""
        if self.strategy == "zero3_offload":
            return 0
        return self.num_gpus if self.shards_params else 1

    @classmethod
    def of(cls, model: ModelSpec, setup: TrainSetup, weight_bytes: int, adapter_bytes: int, optimizer_bytes: int,
           trainable_params: int, trainable_bytes: int, param_bytes: int,
           trainable_numels: list[int] | None = None) -> "RankLayout":
        """The layout of one rank (`trainable_numels`: the trainable tensors' sizes in order, for ZeRO-3's
        optimizer sub-groups). `weight_bytes`, `adapter_bytes`, `optimizer_bytes`: the single-GPU residents;
        `trainable_bytes`: bytes of the trainable parameters (= of their gradients); `param_bytes`: bytes per
        element of the non-quantised weights (2 for bf16)."""
        s, n = setup.strategy, setup.num_gpus
        L = max(1, model.num_layers)
        root = fsdp_root_gathered_bytes(model, param_bytes)
        layer = (weight_bytes - root) // L + adapter_bytes // L
        counts = weights.count_params(model)
        grad_elem = max(1, trainable_bytes // max(1, trainable_params))
        resident = {WEIGHTS: weight_bytes, ADAPTERS: adapter_bytes, OPTIMIZER: optimizer_bytes,
                    GRADIENTS: 0, COMM: 0}
        host: dict[str, int] = {}
        extra: list[int] = []
        if s == "ddp":
            if n > 1:
                resident[COMM] = ddp_bucket_bytes(trainable_bytes)
                extra += ddp_bucket_sizes(trainable_bytes)
        elif s == "fsdp":
            resident[WEIGHTS] = sharded(weight_bytes, n)
            resident[ADAPTERS] = sharded(adapter_bytes, n)
            resident[OPTIMIZER] = sharded(optimizer_bytes, n)
        else:  # ZeRO
            # DeepSpeed casts every parameter to the 16-bit dtype (engine.py `_configure_distributed_model`): LoRA's
            # fp32 adapters become bf16, their gradients too; the fp32 copy is the optimizer's master
            lp = 2 if setup.dtype in ("bf16", "fp16") else 4
            grad_elem = lp
            adapter_lp = adapter_bytes * lp // 4 if setup.method in ("lora", "qlora") else adapter_bytes
            part = sharded(trainable_params, n) * lp
            if s == "zero2":
                resident[OPTIMIZER] = zero_optimizer_state_bytes(setup.optimizer, trainable_params, n)
                resident[ADAPTERS] = adapter_lp
            elif s == "zero3":
                resident[OPTIMIZER] = zero_optimizer_state_bytes(setup.optimizer, trainable_params, n)
                resident[WEIGHTS] = sharded(weight_bytes, n)
                resident[ADAPTERS] = sharded(adapter_lp, n)
                # the gradient partitions, one flat buffer kept for the run (stage3.py
                # `grad_partitions_flat_buffer`), and the reduce bucket, kept as well
                resident[GRADIENTS] = part
                resident[COMM] = zero_reduce_bucket_bytes(s, grad_elem) if trainable_params else 0
                extra += [b for b in (resident[GRADIENTS], resident[COMM]) if b]
            else:  # zero3_offload: parameters, gradient partitions and optimizer on the host
                resident[WEIGHTS] = resident[ADAPTERS] = resident[OPTIMIZER] = 0
                resident[COMM] = zero_reduce_bucket_bytes(s, grad_elem) if trainable_params else 0
                extra += [resident[COMM]] if resident[COMM] else []
                host = zero_offload_host_bytes(weight_bytes + adapter_lp, trainable_params, setup.optimizer, n)
        # ZeRO-3 on one GPU gathers nothing: the rank's partition is the whole parameter, used in place (measured:
        # bench/results/zero/, Llama-3.1-8B LoRA zero3 peaks no higher than its buffers explain). With offload the
        # parameters still come from the host into GPU buffers around each use.
        zero3 = s == "zero3_offload" or (s == "zero3" and n > 1)
        return cls(
            strategy=s, num_gpus=n, resident=resident, host=host, outside_allocator_bytes=outside_allocator_bytes(setup),
            layer_gather_bytes=layer if s == "fsdp" or zero3 else 0,
            root_gather_bytes=root if s == "fsdp" else 0,
            head_gather_bytes=(counts.lm_head or counts.embedding) * param_bytes + counts.final_norm * param_bytes
            if zero3 else 0,
            embed_gather_bytes=counts.embedding * param_bytes if zero3 else 0,
            prefetch_bytes=zero3_prefetch_bytes(layer, param_bytes) if zero3 else 0,
            live_after_forward_bytes=zero3_live_after_forward_bytes(
                (counts.lm_head or counts.embedding) * param_bytes, layer, L, param_bytes) if zero3 else 0,
            reduce_bucket_bytes=zero_reduce_bucket_bytes(s, grad_elem) if s == "zero2" and trainable_params else 0,
            trainable_params=trainable_params, trainable_bytes=trainable_bytes, extra_blocks=tuple(extra),
            grad_partition_bytes=sharded(trainable_params, n) * grad_elem if s == "zero2" else 0,
            sub_group_elements=zero3_sub_group_elements(trainable_numels or [trainable_params], n)
            if s == "zero3" else 0,
            sub_groups=tuple(zero3_sub_groups(trainable_numels or [trainable_params], n)) if s == "zero3" else (),
            trainable_numels=tuple(trainable_numels or ()),
            lp_bytes=2 if setup.dtype in ("bf16", "fp16") else 4,
        )


# ---- the step of one rank, on the tape ----------------------------------------------------------------------------


class RankStep:
    """Writes a strategy's temporaries onto the tape around the single-GPU step `estimate()` records.

    Call order (estimate.py): `start_forward`, `after_embedding`, then per decoder layer `before_layer(i)` and
    `after_layer(i)`, `before_head`, `start_backward`, `ag.backward()`, `end_backward`, and `optimizer_step` in
    the optimizer phase. The hooks that must act during backward are recorded as custom autograd nodes, so they run
    in backward's (reversed) order: after layer i's backward comes the node recorded before its forward.
    """

    def __init__(self, layout: RankLayout, ag, num_layers: int, optimizer: str):
        self.lay = layout
        self.ag = ag
        self.optimizer = optimizer
        self.tape: Tape = ag.tape
        self.L = num_layers
        self._gathered: dict[int, int] = {}  # layer -> tensor id of its gathered parameters
        self._root: int | None = None
        self._head: int | None = None
        self._bucket: list[int] | None = None
        self._grad_partition: int | None = None
        self._rs_held: int | None = None  # FSDP2 keeps the last reduce-scatter input until the next one is issued
        self._sharded_grads: list[int] = []
        self._done: set[int] = set()  # parameter gradients already reduced (per-layer hooks)
        self._fs = zero3_fetch_stream(layout.strategy)  # the stream gathered parameters are allocated on
        self.state_points: list[tuple[int, int]] = []
        """ZeRO: (tape index, bytes) of the optimizer state the first step creates just before that event
        (allocator.py `replay_reserved`, `first_step_state_at`)."""

    # ---- forward ----
    def start_forward(self) -> None:
        lay = self.lay
        if lay.root_gather_bytes:
            self._root = self.tape.alloc(lay.root_gather_bytes, GATHERED, "fsdp root: embeddings, lm_head, norm")
        if lay.embed_gather_bytes:
            self._root = self.tape.alloc(lay.embed_gather_bytes, GATHERED, "zero3: embedding gathered", stream=self._fs)

    def after_embedding(self) -> None:
        if self.lay.embed_gather_bytes:
            self.tape.free(self._root)  # ZeRO-3 releases a module's parameters after its forward
            self._root = None

    def _gather(self, layer: int, label: str) -> None:
        if 0 <= layer < self.L and layer not in self._gathered:
            nbytes = self.lay.layer_gather_bytes
            if self.lay.prefetch_bytes and label == "prefetch":
                nbytes = self.lay.prefetch_bytes  # ZeRO-3 prefetches a bucket, not the whole layer
            self._gathered[layer] = self.tape.alloc(nbytes, GATHERED, f"layer {layer} parameters ({label})",
                                                    stream=self._fs)

    def _release(self, layer: int) -> None:
        self.tape.free(self._gathered.pop(layer, None))

    def _regather(self, layer: int) -> None:
        """A layer whose prefetch bucket was partial (ZeRO-3) is completed when it runs."""
        if self.lay.prefetch_bytes and layer in self._gathered \
                and self.tape.size(self._gathered[layer]) < self.lay.layer_gather_bytes:
            self._release(layer)
        self._gather(layer, "gathered")

    def before_layer(self, i: int) -> None:
        if self.lay.strategy == "ddp":
            return  # DDP's buckets are resident; autograd's gradients stay as on one GPU
        if self.lay.layer_gather_bytes:
            self._regather(i)
            self._gather(i + 1, "prefetch")
        mark = {}
        self.ag.custom(lambda main, _o: self._after_layer_backward(main, i, mark), None, f"rank: layer {i} reduce")
        self._mark = mark

    def after_layer(self, i: int) -> None:
        if self.lay.strategy == "ddp":
            return
        if self.lay.live_after_forward_bytes:  # ZeRO-3: a window of the latest layers stays gathered
            self._trim_live(i)
        elif self.lay.layer_gather_bytes and i < self.L - 1:
            self._release(i)  # resharded after forward; the last layer is used at once by backward
        mark = self._mark
        self.ag.custom(lambda main, _o: self._before_layer_backward(main, i, mark), None, f"rank: layer {i} gather")

    def _trim_live(self, i: int, backward: bool = False) -> None:
        """ZeRO-3 releases gathered parameters only once more than `stage3_max_live_parameters` are live: after
        layer i's forward (backward), the layers used longest ago go until the rest fit `live_after_forward_bytes`
        (the last of them in part); the prefetched next layer is not counted."""
        budget = self.lay.live_after_forward_bytes
        used = (k for k in self._gathered if (k >= i if backward else k <= i))
        for layer in sorted(used, reverse=not backward):
            size = self.tape.size(self._gathered[layer])
            if size <= budget:
                budget -= size
                continue
            self._release(layer)
            if budget:
                self._gathered[layer] = self.tape.alloc(budget, GATHERED, f"layer {layer} parameters (kept, part)",
                                                        stream=self._fs)
            budget = 0

    def before_head(self) -> None:
        if self.lay.head_gather_bytes:
            self._head = self.tape.alloc(self.lay.head_gather_bytes, GATHERED, "zero3: lm_head and norm gathered",
                                         stream=self._fs)

    # ---- backward ----
    def start_backward(self) -> None:
        """ZeRO-2's buckets come with the first gradient (`_reduce`), not here: the loss's backward, the logits'
        peak, runs before any parameter has a gradient."""

    def _before_layer_backward(self, main, i: int, mark: dict) -> None:
        if self.lay.layer_gather_bytes:
            self._regather(i)
            self._gather(i - 1, "prefetch")
        mark["start"] = len(main.param_grads)

    def _after_layer_backward(self, main, i: int, mark: dict) -> None:
        if self.lay.live_after_forward_bytes:  # ZeRO-3: the same window of live parameters in backward
            self._trim_live(i, backward=True)
        elif self.lay.layer_gather_bytes:
            self._release(i)
        self._reduce(main.param_grads[mark.get("start", len(main.param_grads)):], f"layer {i}")

    def _reduce(self, grads: list[int], label: str) -> None:
        """The gradients of one FSDP group (or ZeRO's bucketed ones) leave their full-size tensors."""
        grads = [t for t in grads if t not in self._done]
        self._done.update(grads)
        live = [t for t in grads if self.tape.category_of(t) is not None]
        nbytes = sum(self.tape.size(t) for t in live)
        if not nbytes or self.lay.strategy == "ddp":
            return
        if self.lay.strategy == "fsdp":
            # foreach_reduce: the unsharded gradients are copied into one reduce-scatter input, freed, and the
            # output (1/N) becomes (or is added into) the sharded .grad
            rs = self.tape.alloc(nbytes, COMM, f"reduce-scatter input ({label})")
            self.tape.free(*live)
            self._sharded_grads.append(self.tape.alloc(sharded(nbytes, self.lay.num_gpus), GRADIENTS,
                                                       f"sharded gradient ({label})"))
            self.tape.free(self._rs_held)
            self._rs_held = rs
        else:
            if self.lay.reduce_bucket_bytes and self._bucket is None:  # ZeRO-2 `setup_buckets` at the first gradient
                # `buf_0`, and `buf_1` with overlap_comm: one request each
                buffers = 2 if ZERO_OVERLAP_COMM.get(self.lay.strategy) else 1
                self._bucket = [self.tape.alloc(self.lay.reduce_bucket_bytes // buffers, COMM, "zero reduce bucket")
                                for _ in range(buffers)]
            if self.lay.grad_partition_bytes and self._grad_partition is None:
                # made by the first bucket's reduction (stage_1_and_2.py `reduce_ipg_grads` ->
                # `copy_grads_in_partition`: `self.grads_in_partition = torch.empty(...)`), which runs on the reduction
                # stream with overlap_comm
                self._grad_partition = self.tape.alloc(self.lay.grad_partition_bytes, GRADIENTS,
                                                       "zero2 16-bit gradient partition",
                                                       stream=zero_reduction_stream(self.lay.strategy))
            # the tape's gradients in the single-GPU dtype; ZeRO's are 16-bit, so count elements
            elem = max(1, self.lay.trainable_bytes // max(1, self.lay.trainable_params))
            numels = [sharded(self.tape.size(t) // elem, self.lay.num_gpus) for t in live]  # each rank's partition
            self.tape.free(*live)  # ZeRO copies each gradient into its reduce bucket and drops it
            if self.lay.strategy == "zero3_offload" and self.lay.trainable_params:
                self._offload_grads(numels)

    def _offload_grads(self, numels: list[int]) -> None:
        """ZeRO-3 with offload hands each gradient partition to the host through GPU copies on the reduction
        stream (`zero3_offload_grad_copies`)."""
        stream = zero_reduction_stream(self.lay.strategy)
        for numel in numels:
            held: dict[int, list[int]] = {}
            for b in zero3_offload_grad_copies(numel, self.lay.lp_bytes):
                if b > 0:
                    held.setdefault(b, []).append(self.tape.alloc(b, TRANSIENTS, "zero3 offload gradient copy",
                                                                  stream=stream))
                else:
                    self.tape.free(held[-b].pop())

    def end_backward(self) -> None:
        self._reduce(list(self.ag.param_grads), "root")
        for layer in list(self._gathered):
            self._release(layer)
        self.tape.free(self._root, self._head, self._rs_held, *(self._bucket or ()))
        self._root = self._head = self._rs_held = self._bucket = None

    # ---- optimizer ----
    def _grad_norm_copies(self) -> None:
        """ZeRO's gradient norm (`get_grad_norm_direct`, stage 2 and 3) takes a float64 copy of each gradient in
        turn (`g.data.double()`), dropped once its norm is taken: 8 bytes per element of the largest tensor."""
        for numel in self.lay.trainable_numels:
            copy = self.tape.alloc(8 * sharded(numel, self.lay.num_gpus), TRANSIENTS, "gradient norm (float64)")
            self.tape.free(copy)

    def _state_created_here(self, elements: int) -> None:
        """The optimizer's state over a flat fp32 partition of `elements`, created lazily by the first step
        (torch's AdamW `_init_group`) just before its temporaries."""
        at = len(self.tape.events)
        self.state_points += [(at, b) for b in state_tensor_bytes(self.optimizer, (elements,), 4) if b]

    def optimizer_step(self) -> None:
        """The optimizer phase of one rank (the tape's phase is already OPTIMIZER_STEP)."""
        lay, tape, n = self.lay, self.tape, self.lay.num_gpus
        opt = self.optimizer
        if lay.strategy == "ddp":
            tmp = tape.alloc(optimizer_step_transient_bytes(opt, lay.trainable_bytes), TRANSIENTS, "optimizer step")
            tape.free(tmp)
        elif lay.strategy == "fsdp":
            tmp = tape.alloc(optimizer_step_transient_bytes(opt, sharded(lay.trainable_bytes, n)), TRANSIENTS,
                             "optimizer step (sharded)")
            tape.free(tmp)
        elif lay.strategy == "zero2":
            # the 16-bit gradient partition is flattened into a copy, converted to fp32 for the step and both dropped
            # (stage_1_and_2.py `step`: `flat_grad_partition = self.flatten(self.averaged_gradients[i])`,
            # `single_grad_partition = flat_grad_partition.to(...)`, `del flat_grad_partition`,
            # `self.averaged_gradients[i] = None`); the optimizer runs on the flat fp32 partition and the updated
            # 16-bit parameters are all-gathered into the flat parameter buffer in place
            part = sharded(lay.trainable_params, n)
            self._grad_norm_copies()
            flat = tape.alloc(lay.lp_bytes * part, TRANSIENTS, "zero2 flattened gradient partition (16-bit copy)")
            fp32_grads = tape.alloc(4 * part, TRANSIENTS, "zero fp32 gradient partition")
            tape.free(flat, self._grad_partition)
            self._grad_partition = None
            self._state_created_here(part)
            tmp = tape.alloc(optimizer_step_transient_bytes(opt, 4 * part), TRANSIENTS,
                             "optimizer step (fp32 partition)")
            tape.free(tmp, fp32_grads)
        elif lay.strategy == "zero3":
            # one optimizer sub-group after the other: its gradients flattened (a 16-bit copy) and converted to
            # fp32, the copy dropped, then the step on its fp32 partition (stage3.py `_prepare_fp32_grad_for_sub_group`:
            # `self.flatten(self.averaged_gradients[sub_group_id]).to(fp32)`; `_optimizer_step(sub_group_id)`;
            # `_release_sub_group` drops the fp32 gradient); the first step creates each sub-group's state in turn
            self._grad_norm_copies()
            for sub in lay.sub_groups or (sharded(lay.trainable_params, n),):
                flat = tape.alloc(lay.lp_bytes * sub, TRANSIENTS, "zero3 flattened gradient (one sub-group, 16-bit)")
                fp32_grads = tape.alloc(4 * sub, TRANSIENTS, "zero3 fp32 gradient (one sub-group)")
                tape.free(flat)
                self._state_created_here(sub)
                tmp = tape.alloc(optimizer_step_transient_bytes(opt, 4 * sub), TRANSIENTS, "optimizer step (sub-group)")
                tape.free(tmp, fp32_grads)
        # zero3_offload: the CPU runs the step; nothing on the GPU
        tape.free(*self.ag.param_grads)  # zero_grad(set_to_none=True)
        tape.free(*self._sharded_grads)
        self._sharded_grads = []
