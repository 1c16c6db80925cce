"""Planning policy: the defaults `fitune plan` picks for what the user did not say, and why.

Which kernels and compilation a plan turns on by default, which attention implementations it may propose, and
which host RAM it holds plans to. Each default rests on a measurement on the architectures named, and falls back
to the plain path elsewhere. Pure Python: packages are found without importing them, so planning stays fast.
"""

from __future__ import annotations

import importlib.util

from ..errors import ConfigError
from ..memory.phases import DEFAULT_HOST_RAM_BYTES, local_nvidia_gpu, meminfo_bytes
from ..setup import TrainSetup
from ..specs.model import ModelSpec
from ..units import GiB, parse_memory_bytes



def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def default_kernels(kept: TrainSetup, model: ModelSpec, kernels_given: bool) -> tuple[str, list[str]]:
    """(kernels, notes): as given; without it, liger when liger-kernel is installed and the architecture is one
    whose Liger kernels were measured, else torch. `--keep-outputs` plans the user's own loop: no Liger unless
    asked."""
    if kernels_given or kept.keep_outputs:
        return kept.kernels, []
    if model.liger_measured and _installed("liger_kernel"):
        return "liger", ["kernels: liger (liger-kernel is installed; --kernels torch leaves it out)"]
    return "torch", []


def default_compile(kept: TrainSetup, model: ModelSpec, kernels: str, compile_given: bool,
                    kernels_given: bool) -> tuple[str, str, list[str]]:
    """(compile, kernels, notes): as given; without it and without --kernels, compiled layers when Triton is
    installed on an architecture where they were measured (faster than Liger there: Llama-3.1-8B 1 x 2 x 2048
    without checkpointing 17.4k vs 15.3k tokens/s, docs/speed.md). Liger and the lean RMSNorm are then left out
    (the compiled layer fuses the same operations)."""
    if compile_given and kept.compile != "none" and not kernels_given and kernels != "torch":
        # --compile layers asked for, Liger only picked by default: the compiled layer fuses what Liger would
        return kept.compile, "torch", [f"kernels: torch (--compile {kept.compile} fuses what Liger's kernels fuse)"]
    if compile_given or kept.keep_outputs:
        return kept.compile, kernels, []
    if kernels_given:
        return "none", kernels, []  # --kernels liger / torch asked for: as asked, no compile on top
    if model.compile_measured and _installed("triton"):
        return "layers", "torch", ["compile: layers (Triton is installed; --compile none leaves it out, --kernels "
                                   "liger uses Liger's kernels instead)"]
    return "none", kernels, []


def available_attns() -> tuple[str, ...]:
    """sdpa and eager always; flash when flash-attn is installed."""
    return ("sdpa", "eager") + (("flash",) if _installed("flash_attn") else ())


def resolve_host_ram(flag: str | None, has_gpu=None, mem_total=None) -> tuple[int, str, str]:
    """The host RAM plans are held to: (bytes, how rejections quote it, the line the output says it with).
    `--host-ram` when given; else this machine's MemTotal when its GPU is here (an NVIDIA driver: the plan is for
    this computer); else `DEFAULT_HOST_RAM_BYTES` (64 GiB), assumed. `has_gpu` / `mem_total`: stand-ins (tests)."""
    if flag:
        value = parse_memory_bytes(flag)
        if value is None:
            raise ConfigError(f"--host-ram {flag}: write a 1024-based amount, e.g. 64GiB")
        return value, "--host-ram", f"host RAM: {_gib(value)} (--host-ram)"
    if (has_gpu or local_nvidia_gpu)():
        total = (mem_total or (lambda: meminfo_bytes("MemTotal")))()
        if total:
            return total, "host RAM (this machine's)", f"host RAM: {_gib(total)}, this machine's (--host-ram to change)"
    return (DEFAULT_HOST_RAM_BYTES, "host RAM (assumed; --host-ram to change)",
            f"host RAM: {_gib(DEFAULT_HOST_RAM_BYTES)} assumed (--host-ram to change)")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
