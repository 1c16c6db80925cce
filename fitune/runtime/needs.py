"""What a run needs from the machine: packages and a CUDA GPU, checked before anything is loaded.

    needs_of(setup, report_to)            [Need("method: qlora", ("bitsandbytes",), cuda="bitsandbytes' NF4 kernels",
                                           instead="method: lora"), ...]
    machine_problems(needs, on_cuda)      one problem per option that needs a GPU this machine lacks, and one for
                                          every missing package together, with one pip command

`fitune train` calls these in its preflight (`fitune.config.preflight_problems`), before the tokenizer, the data
and the model load; the runtime's own checks (`build_model`, `build_optimizer`, `enable_liger_kernels`, the
loggers) raise the same messages, from the same functions, when they are reached another way. Pure Python: torch
is imported only by `cuda_available`, and only when it is installed.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

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
    """The 8-bit optimizers: bitsandbytes, on CUDA."""
    return Need(f"optimizer: {name}", ("bitsandbytes",), cuda="bitsandbytes' 8-bit optimizer kernels",
                instead="optimizer: adamw")


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
    if s.optimizer in ("adamw8bit", "paged_adamw8bit"):
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

