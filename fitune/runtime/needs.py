"""What a run needs from the machine: packages and a CUDA GPU, checked before anything is loaded.

    needs_of(setup, report_to)            [Need("method: qlora", ("bitsandbytes",), cuda="bitsandbytes' NF4 kernels",
                                           instead="method: lora"), ...]
    machine_problems(needs, on_cuda)      one problem per option that needs a GPU this machine lacks, and one for
                                          every missing package together, with one pip command

`fitune train` calls these in its preflight (`fitune.train.preflight.preflight_problems`), before the tokenizer, the data
and the model load; the runtime's own checks (`build_model`, `build_optimizer`, `enable_liger_kernels`, the
loggers) raise the same messages, from the same functions, when they are reached another way. Pure Python: torch
is imported only by `cuda_available`, and only when it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass

from ..errors import FituneError
from ..memory import estimate, phases as phase_terms
from ..memory.phases import (HOST_LOAD_BASELINE_BYTES, HOST_RUNTIME_BASELINE_BYTES, SAVE_PRETRAINED_SHARD_BYTES,
                             dense_weight_bytes, eval_choice, phase_peaks, source_of)
from ..specs import optimizers as optimizer_specs
from ..specs.gpu import cuda_context_bytes, kernel_images_bytes, resolve_gpu
from ..specs.model import load_model_spec
from ..units import gib

#: pip's name of each module fitune may import for a run (the import name is the key).
PIP_NAMES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "bitsandbytes": "bitsandbytes",
             "liger_kernel": "liger-kernel", "flash_attn": "flash-attn", "tensorboard": "tensorboard",
             "wandb": "wandb"}
#: The packages `pip install 'fitune[torch]'` brings (pyproject.toml); named as that one extra when missing.
TORCH_EXTRA = ("torch", "transformers", "peft")


@dataclass(frozen=True)
class Need:
    """One option of a run and what it needs of the machine."""

    option: str
    """The option as the config writes it: "optimizer: adamw8bit"."""
    modules: tuple[str, ...] = ()
    """Modules it imports (keys of PIP_NAMES)."""
    cuda: str | None = None
    """Why it needs a CUDA GPU (None: it runs anywhere)."""
    instead: str = ""
    """What to use on a machine without one."""


QLORA = Need("method: qlora", ("bitsandbytes",), cuda="bitsandbytes' 4-bit NF4 kernels", instead="method: lora")
FLASH = Need("attn: flash", ("flash_attn",), cuda="flash-attention 2 is a CUDA kernel",
             instead="attn: sdpa, PyTorch's scaled_dot_product_attention, which runs its own flash kernel on a GPU")
LIGER = Need("kernels: liger", ("liger_kernel",), cuda="Liger's kernels are Triton kernels", instead="kernels: torch")
COMPILE = Need("compile: layers", (), cuda="Inductor's Triton kernels; on the CPU, compiling takes minutes and gives "
               "no speed-up", instead="compile: none")


def flash_dtype_problem(dtype: str) -> str | None:
    """flash-attention 2 computes in bf16 / fp16 only: the problem with `dtype` fp32 (None for the others)."""
    if dtype != "fp32":
        return None
    return ("attn: flash runs flash-attention 2, which computes in bf16 or fp16 only; with dtype: fp32 use attn: sdpa "
            "(or dtype: bf16)")


def optimizer_need(name: str) -> Need:
    """What the optimizer `name` needs beyond torch + transformers (its registry entry: the 8-bit optimizers need
    bitsandbytes, on CUDA)."""
    spec = optimizer_specs.get(name)
    return Need(f"optimizer: {name}", spec.packages, cuda=spec.cuda,
                instead=f"optimizer: {optimizer_specs.names()[0]}")


def logger_need(name: str) -> Need:
    """A `report_to` logger: its package (tensorboard's event writer, wandb)."""
    return Need(f"report_to: {name}", (name,))


def needs_of(s, report_to: tuple[str, ...] = ()) -> list[Need]:
    """What fitune's runner needs for the TrainSetup `s` and the loggers `report_to`: torch, transformers (and
    peft for LoRA / QLoRA) always; then one Need per option that asks more."""
    base = ("torch", "transformers") + (("peft",) if s.method in ("lora", "qlora") else ())
    out = [Need("fitune train", base)]
    if s.method == "qlora":
        out.append(QLORA)
    if optimizer_specs.get(s.optimizer).packages:
        out.append(optimizer_need(s.optimizer))
    if s.attn == "flash":
        out.append(FLASH)
    if s.kernels == "liger":
        out.append(LIGER)
    if s.compile == "layers":
        out.append(COMPILE)
    out += [logger_need(n) for n in dict.fromkeys(report_to) if n in ("tensorboard", "wandb")]
    return out


def has_module(name: str) -> bool:
    """Whether `name` can be imported, found without importing it (a module set to None in sys.modules, as tests
    do to hide one, counts as missing)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    """Whether this process would train on a CUDA GPU (torch sees one); False without torch. Imports torch."""
    if not has_module("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def cuda_problem(need: Need) -> str:
    """The message for an option that needs a CUDA GPU on a machine without one."""
    return (f"{need.option} needs a CUDA GPU ({need.cuda}) and this machine has none; run it on a machine with an "
            f"NVIDIA GPU, or use {need.instead}")


def packages_problem(needs: list[Need], missing: list[str]) -> str:
    """One message for every missing module in `missing` (import names): each package with the options that need
    it, then one pip command that installs them all."""
    users: dict[str, list[str]] = {}
    for need in needs:
        for module in need.modules:
            if module in missing:
                users.setdefault(PIP_NAMES.get(module, module), []).append(need.option)
    listed = ", ".join(f"{pkg} (for {', '.join(options)})" for pkg, options in users.items())
    pip = [pkg for pkg in users if pkg not in TORCH_EXTRA]
    if any(pkg in users for pkg in TORCH_EXTRA):
        pip.insert(0, "'fitune[torch]'")
    noun, it = ("this package is", "it") if len(users) == 1 else ("these packages are", "them")
    return f"{noun} not installed: {listed}; install {it} with: pip install {' '.join(pip)}"


def machine_problems(needs: list[Need], on_cuda: bool, has=None) -> list[str]:
    """Every option of `needs` this machine cannot run: one problem per option that needs CUDA (when `on_cuda` is
    False), then one for all missing packages together. `has(module)`: whether a module is installed (default
    `has_module`)."""
    has = has or has_module
    problems = [cuda_problem(n) for n in needs if n.cuda and not on_cuda]
    missing = [m for m in dict.fromkeys(m for n in needs for m in n.modules) if not has(m)]
    if missing:
        problems.append(packages_problem(needs, missing))
    return problems



# ---- memory: the host's RAM and every phase of the run (issue 33) ----------------------------------------------

#: A host shortfall is "clear" when the need is this much over what is available: MemAvailable moves by a few
#: percent while other programs run, and the baseline in the need is a guess (fitune/memory/phases.py).
HOST_SHORTFALL_RATIO = 1.1
#: ... and when the model's own share (the need less the process's baseline) is at least this: a tiny test model
#: is never refused on a busy machine.
HOST_MODEL_SHARE_MIN_BYTES = 1 << 30


def _spec_and_estimate(cfg, on_cuda: bool):
    """(ModelSpec, MemoryEstimate) of the run's training step, or None when fitune cannot model its architecture."""
    try:
        spec = load_model_spec(cfg.model)
        return spec, estimate(spec, cfg.setup, device="cuda" if on_cuda else "cpu")
    except (FituneError, ValueError, KeyError, ZeroDivisionError, TypeError):
        return None  # an architecture or config the estimator cannot model: the runtime's own checks apply


def run_phases_for(cfg, on_cuda: bool, gpu_budget_bytes: int | None = None):
    """(ModelSpec, source, phase peaks) of the run `cfg` describes, or None when fitune cannot model its
    architecture (then nothing is checked); with the GPU's budget, the eval step as `eval_setting` runs it. Pure
    Python: the analytic estimator (no torch)."""
    modelled = _spec_and_estimate(cfg, on_cuda)
    if modelled is None:
        return None
    spec, est = modelled
    source = "random" if cfg.init == "random" else source_of(cfg.model)
    return spec, source, phase_peaks(cfg.setup, spec, est, source=source, device="cuda" if on_cuda else "cpu",
                                     gpu_budget_bytes=gpu_budget_bytes)


def eval_setting(cfg, gpu_budget_bytes: int | None) -> tuple[int, str, str | None]:
    """The eval step's rows per forward and loss within the GPU budget the training fits (fitune/memory/phases.py
    `eval_choice`), and the line that says so when they differ from the training micro-batch and loss (None when
    they do not). Without a budget (no GPU) or a model fitune cannot model: the training micro-batch and loss."""
    s = cfg.setup
    modelled = _spec_and_estimate(cfg, True) if gpu_budget_bytes is not None else None
    chosen = eval_choice(modelled[0], s, modelled[1], gpu_budget_bytes) if modelled is not None else None
    if chosen is None or (chosen[0].batch_size, chosen[0].loss) == (s.batch_size, s.loss):
        return s.batch_size, s.loss, None
    es, phase = chosen
    return es.batch_size, es.loss, (
        f"evaluation runs {es.batch_size} row(s) per forward with the {es.loss} loss ({gib(phase.gpu_allocated_bytes)} "
        f"of GPU memory): {s.batch_size} row(s) with the {s.loss} loss would not fit the {gib(gpu_budget_bytes)} "
        "budget the training fits; the eval loss is the same")


def host_ram_problems(cfg, on_cuda: bool, mem_available_bytes: int | None = None, phases=None) -> list[str]:
    """What stops the run for host memory, said before loading: the load phase's or the training step's host bytes
    (fitune/memory/phases.py) clearly over MemAvailable (`HOST_SHORTFALL_RATIO`, `HOST_MODEL_SHARE_MIN_BYTES`).
    `mem_available_bytes`: /proc/meminfo MemAvailable when None (no check where there is none)."""
    available = phase_terms.meminfo_bytes("MemAvailable") if mem_available_bytes is None else mem_available_bytes
    phases = phases if phases is not None else run_phases_for(cfg, on_cuda)
    if not available or phases is None:
        return []
    _, source, peaks = phases
    problems = []
    for p in peaks:
        if p.name not in ("load", "train_step"):
            continue
        clear = (p.host_bytes > HOST_SHORTFALL_RATIO * available
                 and p.host_bytes - (HOST_LOAD_BASELINE_BYTES if p.name == "load" else HOST_RUNTIME_BASELINE_BYTES)
                 >= HOST_MODEL_SHARE_MIN_BYTES)
        if clear:
            problems.append(f"{'loading' if p.name == 'load' else 'the training step'} needs ~{gib(p.host_bytes)} of "
                            f"host RAM ({p.note}), {gib(available)} available: {_host_fix(cfg, p.name, source, on_cuda)}")
    return problems


def _host_fix(cfg, phase: str, source: str, on_cuda: bool) -> str:
    """What to change when `phase` needs more host memory than the machine has."""
    close = "or close other programs (MemAvailable in /proc/meminfo)"
    if phase == "train_step":
        return ("grad_checkpointing: full keeps the checkpoints on the GPU instead of pinned host memory "
                "(or a shorter seq_len / batch_size), " + close)
    if not on_cuda:
        return "train on a machine with a GPU (the weights load straight onto it), or a smaller model, " + close
    if source == "gguf":
        return ("point model: at the model's safetensors folder or Hub id instead of the .gguf file (transformers "
                "dequantizes a whole GGUF on the CPU first; a folder loads straight onto the GPU), " + close)
    return close


def phase_warnings(cfg, gpu_budget_bytes: int | None, phases=None) -> list[str]:
    """Phases of the run other than the training step whose GPU peak is over `gpu_budget_bytes` (the eval step
    when data.eval_path is set, saving), said before the run; and `merge: true`, whose merged model goes
    through host memory when it is written."""
    phases = phases if phases is not None else run_phases_for(cfg, gpu_budget_bytes is not None, gpu_budget_bytes)
    if phases is None:
        return []
    spec, _, peaks = phases
    out = []
    checked = ("eval_step", "save") if cfg.data.eval_path else ("save",)
    for p in peaks:
        if gpu_budget_bytes is not None and p.name in checked and p.gpu_allocated_bytes > gpu_budget_bytes:
            out.append(f"the {p.name} phase needs {gib(p.gpu_allocated_bytes)} of GPU memory > {gib(gpu_budget_bytes)} "
                       f"budget ({p.note}): the run may stop there; "
                       + ("even one row per forward with the chunked loss does not fit: a shorter seq_len (eval rows "
                          "are cut to it) or no data.eval_path" if p.name == "eval_step"
                          else "fewer trainable parameters"))
    if getattr(cfg, "merge", False) and cfg.setup.method in ("lora", "qlora"):
        merged = min(dense_weight_bytes(spec, "bf16" if cfg.setup.method == "qlora" else cfg.setup.dtype),
                     SAVE_PRETRAINED_SHARD_BYTES)
        out.append(f"merge: true writes the merged model at the end through host memory (~{gib(merged)} copied "
                   "from the GPU by save_pretrained); `fitune merge` afterwards does the same with 5 GB shards")
    return out


def gpu_budget_bytes() -> int | None:
    """A training step's budget on this machine's first CUDA GPU: its memory less the CUDA context and the kernel
    images the run loads (fitune/specs/gpu.py `cuda_context_bytes`, `kernel_images_bytes`); None without one.
    Imports torch."""
    if not cuda_available():
        return None
    import torch

    props = torch.cuda.get_device_properties(0)
    cc = f"{props.major}.{props.minor}"
    return int(props.total_memory) - cuda_context_bytes(cc) - kernel_images_bytes()


def run_budget_bytes(cfg, on_cuda: bool) -> int | None:
    """The GPU budget a training step has in the run: the `cap:` card's (less the kernel images the run loads), else
    this GPU's (`gpu_budget_bytes`); None without CUDA."""
    if not on_cuda:
        return None
    if getattr(cfg, "cap", None):  # the run caps the allocator at a smaller card's budget
        return resolve_gpu(str(cfg.cap), "cap").training_budget_bytes
    return gpu_budget_bytes()


def memory_problems(cfg, on_cuda: bool, warn=None) -> list[str]:
    """`fitune train`'s memory preflight, before anything loads: the problems that stop the run
    (`host_ram_problems`), after handing every `phase_warnings` line to `warn` (default: logging.warning)."""
    warn = warn or logging.getLogger(__name__).warning
    budget = run_budget_bytes(cfg, on_cuda)
    phases = run_phases_for(cfg, on_cuda, budget)
    for line in phase_warnings(cfg, budget, phases):
        warn(f"fitune train: {line}")
    return host_ram_problems(cfg, on_cuda, phases=phases)
