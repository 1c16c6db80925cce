"""The optimizers a TrainSetup can name (`optimizer:`): one `OptimizerSpec` per optimizer, read by every layer.

Adding an optimizer is one entry in `REGISTRY` plus its measurements: the setup's choices and aliases, the memory
model's state and step temporaries, the speed model's bytes per step, the planner's preference, the emitted
Hugging Face name, the runtime's class and needs, the doctor's labels, the trace engine's note and `--resume`'s
policy (`state_format`) all read it (tests/test_optimizer_registry.py proves each entry complete). Pure Python: the
classes are dotted names that `fitune.runtime.optim.build_optimizer` imports when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError

#: bitsandbytes 8-bit optimizers: one uint8 per state element plus one fp32 absmax per 256-element block
#: (bitsandbytes/optim/optimizer.py, blockwise quantisation, block size 256); tensors under 4,096 elements keep
#: 32-bit state (`min_8bit_size=4096`).
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096

#: How an optimizer's step makes its temporaries (the estimate writes them onto its tape accordingly).
STEP_LAYOUTS = ("foreach", "per_tensor", "in_place")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- state bytes per parameter (each a named formula with its source) ------------------------------------------


def adamw_state_tensor_bytes(shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """AdamW: exp_avg and exp_avg_sq at the parameter's dtype (torch/optim/adamw.py `_init_group`:
    `torch.zeros_like(p)`); `step` is a CPU scalar unless capturable/fused, so not counted."""
    n = _numel(shape)
    return [n * param_bytes, n * param_bytes]


def bnb_8bit_state_tensor_bytes(shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """bitsandbytes' 8-bit AdamW: state1, absmax1, state2, absmax2 (uint8 codes and one fp32 absmax per
    `BNB_BLOCK` elements; bitsandbytes `Optimizer2State.init_state`); tensors under `BNB_MIN_8BIT_SIZE` elements
    keep two fp32 states. `param_bytes` is unused: the states' dtypes are fixed."""
    n = _numel(shape)
    if n < BNB_MIN_8BIT_SIZE:
        return [4 * n, 4 * n]
    blocks = -(-n // BNB_BLOCK)
    return [n, 4 * blocks, n, 4 * blocks]


def adafactor_state_tensor_bytes(shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """Factored second moment (Shazeer & Stern 2018; transformers' `Adafactor`, beta1=None: no first moment): for
    a tensor of 2 or more dimensions an fp32 row vector (`shape[:-1]`) and column vector (`shape[:-2] +
    shape[-1:]`); a vector (or a flat partition, as ZeRO's) keeps a full fp32 second moment."""
    n = _numel(shape)
    if len(shape) == 1:
        return [4 * n]
    lead = n // (shape[-1] * shape[-2])
    return [4 * lead * shape[-2], 4 * lead * shape[-1]]


def no_state_tensor_bytes(shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """SGD without momentum (torch.optim.SGD, momentum=0): no state."""
    return []


# ---- the optimizer step's temporaries -----------------------------------------------------------------------------


def adafactor_step_transient_bytes(largest_numel: int, param_bytes: int) -> int:
    """The peak temporaries of transformers' `Adafactor.step`, which updates one parameter at a time: for the
    largest tensor, `grad.float()` and `p.float()` (fp32 copies when the parameter is 16-bit), `update = grad**2 +
    eps` and, before that one is released, the new `update = _approx_sq_grad(...)`: four fp32 copies of a 16-bit
    tensor, two of an fp32 one. Measured: 3.915 GiB for Llama-3.2-1B's bf16 embedding (262.7 M elements: 4 x 4
    bytes each; bench/results/issue12/options.jsonl case 4, the optimizer phase)."""
    copies = 4 if param_bytes < 4 else 2
    return copies * 4 * largest_numel


def foreach_step_transient_bytes(trainable_bytes: int, largest_numel: int | None, param_bytes: int) -> int:
    """torch's default foreach AdamW: the step builds intermediate tensor lists over all parameters at once, ~1 x
    the trainable bytes. Measured: +640 MiB above the gradients for 640 MiB of fp32 LoRA weights (llama-3.1-8b
    all-linear r64; bench/results/hf_recipe/hf_recipe.jsonl)."""
    return trainable_bytes


def per_tensor_step_transient_bytes(trainable_bytes: int, largest_numel: int | None, param_bytes: int) -> int:
    """Adafactor, one parameter at a time: `adafactor_step_transient_bytes` of the largest tensor; with no tensor
    sizes known (a sharded flat state) the old bound, 1 x the trainable bytes."""
    if largest_numel is None:
        return trainable_bytes
    return adafactor_step_transient_bytes(largest_numel, param_bytes)


def in_place_step_transient_bytes(trainable_bytes: int, largest_numel: int | None, param_bytes: int) -> int:
    """bitsandbytes' fused 8-bit kernels and SGD update in place: 0."""
    return 0


# ---- the registry ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer fitune can train, estimate, plan and emit."""

    name: str
    """fitune's name (`optimizer: adamw8bit`)."""
    aliases: tuple[str, ...]
    """What Hugging Face Trainer / TRL / Axolotl users type for it (`adamw_bnb_8bit`), read as `name`."""
    family: str
    """The update it makes: "adam" (the planner keeps Adam plans first), "adafactor", "sgd"."""
    state_bits: int
    """Precision of its state (32 or 8; 0: no state): translate maps other trainers' optimizers to the same one."""
    state_tensor_bytes: Callable[[tuple[int, ...], int], list[int]]
    """(parameter shape, bytes per parameter element) -> bytes of each state tensor it creates, in order."""
    factored: bool
    """The state depends on the tensor's shape, not only its element count (Adafactor's row and column)."""
    in_allocator: bool
    """The state lives in PyTorch's caching allocator (False: CUDA managed memory, outside the peaks)."""
    step_layout: str
    """How the step makes its temporaries: "foreach" (one list over all tensors), "per_tensor", "in_place"."""
    step_transient_bytes: Callable[[int, int | None, int], int]
    """(trainable bytes, elements of the largest trainable tensor or None, bytes per element) -> peak bytes of
    the step's temporaries."""
    step_state_bytes_per_param: int
    """Bytes of state the step reads and writes per trainable parameter (the speed model's, physical count)."""
    build: str
    """Dotted name of the class `build_optimizer` makes (`torch.optim.AdamW`)."""
    build_kwargs: tuple[tuple[str, object], ...]
    """Fixed constructor arguments (`relative_step=False`)."""
    takes_foreach: bool
    """The class accepts `foreach=` (torch's own optimizers)."""
    packages: tuple[str, ...]
    """Packages beyond torch + transformers it needs (runtime/needs.py)."""
    cuda: str | None
    """What needs a CUDA GPU, or None when it runs anywhere."""
    hf_optim: str
    """transformers' TrainingArguments(optim=...) name (plan --emit hf)."""
    label: str
    """What the plan and the doctor call it ("8-bit AdamW states")."""
    script_classes: tuple[str, ...]
    """Class names a training script constructs it by (torch.optim / bitsandbytes / transformers), for the doctor."""
    trace_note: str | None
    """The trace engine's note on how it runs it; None when the trace engine cannot (CUDA kernels)."""
    state_format: str
    """What its saved state is (`optimizer.state_dict()`: the keys, dtypes and shapes of each parameter's state and
    the param groups' hyperparameters). Optimizers of the same state format load each other's saved state, so
    `--resume` applies a change between them and refuses any other (train/checkpoint.py `check_config_changes`).
    Two entries share one only when the library's source shows the same state: bitsandbytes' AdamW8bit and
    PagedAdamW8bit are both `Optimizer2State("adam", ..., optim_bits=8)`, differing only in `is_paged`, which
    decides where `init_state` allocates state1 / state2 (bitsandbytes/optim/adamw.py, optimizer.py
    `get_state_buffer`; `load_state_dict` is Optimizer8bit's for both). torch's AdamW (exp_avg, exp_avg_sq, step)
    and bitsandbytes' (state1, state2, qmap1, qmap2, absmax1, absmax2, step) are not: torch's `load_state_dict`
    takes the other's keys without complaint, and the next step fails (a KeyError) or ignores them. An alias is
    the same optimizer, never a change."""
    doc: str = field(default="", compare=False)
    """One line for --help."""

    def state_bytes(self, shape: tuple[int, ...], param_bytes: int) -> int:
        """Total bytes of state one parameter of `shape` gets (in or out of PyTorch's allocator)."""
        return sum(self.state_tensor_bytes(shape, param_bytes))


_BNB_CUDA = "bitsandbytes' 8-bit optimizer kernels"
BNB_ADAM_8BIT_STATE = "bitsandbytes 8-bit Adam"
"""The state of bitsandbytes' AdamW8bit and PagedAdamW8bit: the same class underneath (see `state_format`)."""

REGISTRY: tuple[OptimizerSpec, ...] = (
    OptimizerSpec(
        "adamw", ("adamw_torch", "adamw_torch_fused", "adamw_hf"), "adam", 32, adamw_state_tensor_bytes,
        factored=False, in_allocator=True, step_layout="foreach", step_transient_bytes=foreach_step_transient_bytes,
        step_state_bytes_per_param=16, build="torch.optim.AdamW", build_kwargs=(), takes_foreach=True, packages=(),
        cuda=None, hf_optim="adamw_torch", label="AdamW (fp32 states)", script_classes=("AdamW", "Adam"),
        trace_note="AdamW runs with foreach=True (the CUDA default); the 'step' state is counted in optimizer state",
        state_format="torch AdamW", doc="adamw (fp32 states)"),
    OptimizerSpec(
        "adamw8bit", ("adamw_bnb_8bit", "adamw_8bit", "bnb_adamw8bit"), "adam", 8, bnb_8bit_state_tensor_bytes,
        factored=False, in_allocator=True, step_layout="in_place", step_transient_bytes=in_place_step_transient_bytes,
        step_state_bytes_per_param=4, build="bitsandbytes.optim.AdamW8bit", build_kwargs=(), takes_foreach=False,
        packages=("bitsandbytes",), cuda=_BNB_CUDA, hf_optim="adamw_bnb_8bit", label="8-bit AdamW states",
        script_classes=("AdamW8bit", "Adam8bit"), trace_note=None, state_format=BNB_ADAM_8BIT_STATE,
        doc="adamw8bit"),
    OptimizerSpec(
        "paged_adamw8bit", ("paged_adamw_8bit", "pagedadamw8bit"), "adam", 8, bnb_8bit_state_tensor_bytes,
        factored=False, in_allocator=False, step_layout="in_place", step_transient_bytes=in_place_step_transient_bytes,
        step_state_bytes_per_param=4, build="bitsandbytes.optim.PagedAdamW8bit", build_kwargs=(),
        takes_foreach=False, packages=("bitsandbytes",), cuda=_BNB_CUDA, hf_optim="paged_adamw_8bit",
        label="paged 8-bit AdamW states (managed memory)", script_classes=("PagedAdamW8bit", "PagedAdam8bit"),
        trace_note=None, state_format=BNB_ADAM_8BIT_STATE, doc="paged_adamw8bit (bitsandbytes)"),
    OptimizerSpec(
        "adafactor", (), "adafactor", 32, adafactor_state_tensor_bytes, factored=True, in_allocator=True,
        step_layout="per_tensor", step_transient_bytes=per_tensor_step_transient_bytes, step_state_bytes_per_param=4,
        build="transformers.optimization.Adafactor",
        build_kwargs=(("relative_step", False), ("scale_parameter", False)), takes_foreach=False, packages=(),
        cuda=None, hf_optim="adafactor", label="Adafactor (factored second moment; changes the update)",
        script_classes=("Adafactor",),
        trace_note="Adafactor as transformers.optimization.Adafactor(relative_step=False, scale_parameter=False): "
                   "a factored fp32 second moment, no first moment",
        state_format="transformers Adafactor", doc="adafactor"),
    OptimizerSpec(
        "sgd", (), "sgd", 0, no_state_tensor_bytes, factored=False, in_allocator=True, step_layout="in_place",
        step_transient_bytes=in_place_step_transient_bytes, step_state_bytes_per_param=0, build="torch.optim.SGD",
        build_kwargs=(), takes_foreach=True, packages=(), cuda=None, hf_optim="sgd",
        label="SGD without momentum (no state; changes the update)", script_classes=("SGD",),
        trace_note="SGD (momentum 0: no state) runs with foreach=True (the CUDA default)",
        state_format="torch SGD", doc="sgd"),
)
"""Every optimizer, in the planner's order of preference: the Adam family first (the same update; 8-bit states
quantise it), then those that change the training."""


def names() -> tuple[str, ...]:
    """fitune's optimizer names, in preference order."""
    return tuple(s.name for s in REGISTRY)


def aliases() -> dict[str, str]:
    """{alias: fitune name} over every entry."""
    return {a: s.name for s in REGISTRY for a in s.aliases}


def canonical_name(name: str) -> str | None:
    """fitune's name for `name`: itself, or the entry an alias (`adamw_bnb_8bit`) reads as; None for a name no
    entry knows."""
    if name in names():
        return name
    return aliases().get(name)


def get(name: str) -> OptimizerSpec:
    """The entry named `name`.

    Raises:
        ConfigError: no such optimizer (the message lists the known ones).
    """
    for s in REGISTRY:
        if s.name == name:
            return s
    raise ConfigError(f"optimizer: {name!r} is not one of: {', '.join(names())}; add an OptimizerSpec to "
                      "fitune/specs/optimizers.py to teach fitune a new one")


def preference() -> tuple[str, ...]:
    """The planner's order of preference (the registry's order)."""
    return names()


def adam_family() -> tuple[str, ...]:
    """The optimizers that make Adam's update (a plan keeps them ahead of the others)."""
    return tuple(s.name for s in REGISTRY if s.family == "adam")


def by_allocator_memory() -> tuple[str, ...]:
    """Lightest to heaviest state in PyTorch's allocator, for a 4096 x 4096 fp32 matrix (ties: the lighter total
    state first): where the planner starts when it only needs a floor."""
    shape = (4096, 4096)

    def weight(s: OptimizerSpec) -> tuple[int, int]:
        total = s.state_bytes(shape, 4)
        return (total if s.in_allocator else 0, total)

    return tuple(s.name for s in sorted(REGISTRY, key=weight))


def help_text() -> str:
    """`adamw (fp32 states) | adamw8bit | ...`: the `optimizer` key's help."""
    return " | ".join(s.doc or s.name for s in REGISTRY)
