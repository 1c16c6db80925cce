"""GpuSpec: a named GPU from the catalog, or a bare memory budget such as `24GiB`.

`allocator_budget_bytes` is what PyTorch's caching allocator can really get: the card's memory minus the CUDA
context and the handles the driver and libraries keep outside the allocator. It is the number
`torch.cuda.set_per_process_memory_fraction(budget / total)` reproduces on a bigger card, and the number an
estimate's `peak_reserved_bytes` is compared with.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import lru_cache

from ..errors import UnknownGpuError
from ..units import GiB, MiB, is_decimal_unit, parse_memory_bytes

#: Memory outside PyTorch's allocator once CUDA, cuBLAS and the first kernels are up, on a Hopper GPU
#: (measured on an H200, torch 2.11 + CUDA 13: total 150,109,880,320 B; free 149,356,150,784 B and
#: reserved 35,651,584 B after `torch.zeros(1)` and a first bf16 matmul -> 718,077,952 B outside the
#: allocator. bench/results/hf_recipe/cuda_context.json).
HOPPER_CONTEXT_BYTES = 718_077_952

#: The same on a 24 GB consumer card: a 24,564 MiB RTX 4090 leaves about 23.4 GiB to the allocator
#: (../shared/GPU.md, the project's reference for simulating the user's card) -> 24,564 MiB - 23.4 GiB.
CONSUMER_CONTEXT_BYTES = 24_564 * MiB - int(23.4 * GiB)


#: Effective GB/s each way of a PCIe x16 link (about 80 % of the raw 16 / 32 / 64 GB/s): an assumption, not
#: measured. A GPU whose catalog entry names no PCIe generation is taken as 5.0.
PCIE_GB_S = {"3.0 x16": 12.0, "4.0 x16": 25.0, "5.0 x16": 50.0}


def cuda_context_bytes(compute_capability: str) -> int:
    """Device memory the CUDA context, cuBLAS/cuDNN handles and kernel images take outside the allocator.

    Formula: a constant per GPU generation. Source: the two measurements above (Hopper measured here;
    pre-Hopper from the project's 24 GB reference). The context grows with the number of SMs and with the
    CUDA version; expect +-100 MiB on other set-ups.
    """
    major = int(str(compute_capability).split(".")[0]) if compute_capability else 8
    return HOPPER_CONTEXT_BYTES if major >= 9 else CONSUMER_CONTEXT_BYTES


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the estimator sees it."""

    name: str
    """Catalog name (`rtx4090`) or the budget text (`24GiB`)."""
    total_bytes: int
    """The card's memory as `nvidia-smi` reports it, in bytes."""
    allocator_budget_bytes: int
    """Bytes PyTorch's allocator can get: total minus `cuda_context_bytes` (or exactly the `NGiB` given)."""
    display_name: str = ""
    compute_capability: str = ""
    peak_bf16_tflops: float | None = None
    """Dense bf16 tensor-core peak (fp32 accumulate), TFLOP/s, from the vendor's datasheet."""
    memory_bandwidth_gb_s: float | None = None
    supports_bf16: bool = True
    source: str = ""
    link_gb_s: float | None = None
    """GB/s one GPU sends to its peers, each way (NVLink through NVSwitch, or PCIe without it): the bandwidth of
    the collectives of multi-GPU training. An assumption from the datasheet until measured (`link_source`)."""
    link_source: str = ""
    host_link_gb_s: float | None = None
    """GB/s between the GPU and host memory, each way (its PCIe link): what ZeRO-Offload's transfers run at.
    Assumed from the PCIe generation (`PCIE_GB_S`)."""

    @property
    def cublas_workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.compute_capability)


def cublas_workspace_bytes(compute_capability: str) -> int:
    """Bytes of one cuBLAS workspace, which PyTorch takes from its caching allocator per (handle, stream).

    Formula: 32 MiB on compute capability >= 9.0 (Hopper), else 4096 KiB x 2 + 16 KiB x 8 = 8,320 KiB
    (PyTorch's default CUBLAS_WORKSPACE_CONFIG sizes, aten/src/ATen/cuda/CublasHandlePool.cpp). A training step
    uses two: one for the forward (main thread) and one for autograd's backward thread - measured on the H200
    as 64 MiB allocated after the first step (bench/results/hf_recipe/hf_recipe.jsonl, `before_steps` vs
    `model_only`).
    """
    major = int(str(compute_capability).split(".")[0]) if compute_capability else 9
    return 32 * MiB if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, dict]:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpus.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def catalog_gpu_names() -> list[str]:
    return sorted(gpu_catalog())


def resolve_gpu(text: str, flag: str = "--gpu") -> GpuSpec:
    """`rtx4090` -> the catalog entry; `24GiB` / `23.4GiB` -> that many bytes for the allocator.

    `flag` is how errors name the value (`--gpu`, `--cap`, `cap:`)."""
    if not text.strip():
        raise UnknownGpuError(f"{flag} is empty; name a GPU (rtx4090, a100-80gb, ...: fitune estimate --list-gpus) "
                              "or the memory PyTorch may use, e.g. 23.4GiB")
    key = text.strip().lower()
    catalog = gpu_catalog()
    if key in catalog:
        e = catalog[key]
        total = int(e["total_memory_mib"]) * MiB
        cc = str(e.get("compute_capability", ""))
        return GpuSpec(
            name=key,
            total_bytes=total,
            allocator_budget_bytes=total - cuda_context_bytes(cc),
            display_name=e.get("display_name", key),
            compute_capability=cc,
            peak_bf16_tflops=e.get("peak_bf16_dense_tflops"),
            memory_bandwidth_gb_s=e.get("memory_bandwidth_gb_s"),
            supports_bf16=bool(e.get("supports_bf16", True)),
            source=e.get("source", ""),
            link_gb_s=e.get("link_gb_s"),
            link_source=e.get("link_source", ""),
            host_link_gb_s=PCIE_GB_S.get(e.get("pcie") or "", PCIE_GB_S["5.0 x16"]),
        )
    budget = parse_memory_bytes(text)
    if budget is not None:
        if budget <= 0:
            raise UnknownGpuError(f"{flag} {text}: a memory budget must be positive")
        name = "".join(text.split())  # `24 GiB` -> `24GiB`: the name is quoted in comments, one line
        return GpuSpec(name=name, total_bytes=budget, allocator_budget_bytes=budget, display_name=f"{name} budget")
    if is_decimal_unit(text):
        raise UnknownGpuError(
            f"{flag} {text}: fitune's budgets are 1024-based; write GiB or MiB (e.g. `{flag} 23.4GiB`), not GB/MB"
        )
    close = difflib.get_close_matches(key, list(catalog), n=4, cutoff=0.5)
    known = ", ".join(close or sorted(catalog))
    raise UnknownGpuError(
        f"{flag} {text!r} is not a known GPU; {'closest' if close else 'known'}: {known}; "
        f"or pass the memory PyTorch may use, e.g. `{flag} 23.4GiB`"
    )
