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
import re
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

#: Device memory the kernels a training run loads after its first matmul take outside PyTorch's allocator: CUDA loads
#: kernel images lazily, as each kernel is first used (more of cuBLAS's GEMMs, the Triton kernels of compiled layers
#: and Liger, bitsandbytes', flash attention's), and each stays resident; on a card they come out of what the
#: allocator had. Measured on an H100 (QLoRA r32 all-linear 8B, compiled layers, offloaded checkpoints, 131,072 tokens;
#: bench/results/issue33/ballast_131k): 946,051,482 B outside the allocator after each step, 227,973,530 B more than
#: the context with cuBLAS up (HOPPER_CONTEXT_BYTES, measured on an H200 with the same PyTorch and CUDA).
KERNEL_IMAGES_BYTES = 946_051_482 - HOPPER_CONTEXT_BYTES


def kernel_images_bytes() -> int:
    """Bytes a training run's kernel images take outside the allocator beyond the card's context constant
    (`cuda_context_bytes`, the context with cuBLAS up): a plan leaves them room (its reserved peak plus these stays
    within the card's budget).

    Formula: a constant, the growth measured on one Hopper configuration (above), taken for every generation (the
    kernels are the same code; their images' sizes differ by architecture: expect +-100 MiB, and other kernels,
    another attention or no Triton, load other images).
    """
    return KERNEL_IMAGES_BYTES


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
    note: str = ""
    """How the name given was read, when it was not a catalog name as written (`RTX 4090` -> rtx4090, `24GB` -> a
    24 GB card, `24GiB` -> exactly that for the allocator): printed beside the verdict."""

    kernel_images_bytes: int = 0
    """Bytes the kernels a run loads after cuBLAS is up take outside the allocator, out of `allocator_budget_bytes`:
    a catalog card's `kernel_images_bytes()`; 0 for a budget given in bytes (`23.4GiB` is what the allocator has
    once the run's kernels are loaded)."""

    @property
    def training_budget_bytes(self) -> int:
        """What a training step's reserved peak may reach: the allocator's budget less `kernel_images_bytes`. Plans
        and fit verdicts use it."""
        return self.allocator_budget_bytes - self.kernel_images_bytes

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

    Names as people write them resolve to the catalog card too (`catalog_gpu_key`): `4090`, `RTX 4090`, the name
    `nvidia-smi` prints (`NVIDIA GeForce RTX 4090`, `NVIDIA A100-SXM4-80GB`, `NVIDIA H100 80GB HBM3`). A card's size
    as it is sold, `24GB`, is the smallest catalog card of that size (the budget its CUDA context leaves), while
    `24GiB` is exactly what the allocator may use; the GpuSpec's `note` says which reading was taken.

    `flag` is how errors name the value (`--gpu`, `--cap`, `cap:`)."""
    if not text.strip():
        raise UnknownGpuError(f"{flag} is empty; name a GPU (rtx4090, a100-80gb, ...: fitune estimate --list-gpus) "
                              "or the memory PyTorch may use, e.g. 23.4GiB")
    key = text.strip().lower()
    catalog = gpu_catalog()
    found = catalog_gpu_key(text)
    if found is not None:
        note = "" if found == key else f"{text.strip()!r} read as {found} ({catalog[found].get('display_name', found)})"
        return _catalog_gpu(found, note)
    budget = parse_memory_bytes(text)
    if budget is not None:
        if budget <= 0:
            raise UnknownGpuError(f"{flag} {text}: a memory budget must be positive")
        name = "".join(text.split())  # `24 GiB` -> `24GiB`: the name is quoted in comments, one line
        return GpuSpec(name=name, total_bytes=budget, allocator_budget_bytes=budget, display_name=f"{name} budget",
                       note=_budget_note(name, budget))
    if is_decimal_unit(text):
        card = card_of_size(text)
        if card is not None:
            e = catalog[card]
            return _catalog_gpu(card, f"{text.strip()!r} read as a card sold as {text.strip()}: {card} "
                                      f"({e.get('display_name', card)}, {e['total_memory_mib']:,} MiB), the smallest "
                                      "catalog card of that size; give the card's name, or the allocator's budget "
                                      f"in GiB (`{flag} {_catalog_gpu(card).allocator_budget_bytes / GiB:.1f}GiB`), "
                                      "to be exact")
        raise UnknownGpuError(
            f"{flag} {text}: no catalog card is sold with that much memory; name the card (fitune estimate "
            f"--list-gpus), or give the memory PyTorch may use in GiB (fitune's budgets are 1024-based: e.g. "
            f"`{flag} 23.4GiB`)"
        )
    close = difflib.get_close_matches(key, list(catalog), n=4, cutoff=0.5)
    known = ", ".join(close or sorted(catalog))
    raise UnknownGpuError(
        f"{flag} {text!r} is not a known GPU; {'closest' if close else 'known'}: {known}; "
        f"or pass the memory PyTorch may use, e.g. `{flag} 23.4GiB`"
    )


def _catalog_gpu(key: str, note: str = "") -> GpuSpec:
    e = gpu_catalog()[key]
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
        note=note,
        kernel_images_bytes=kernel_images_bytes(),
    )


#: Words of a GPU's marketing or `nvidia-smi` name that do not tell cards of the catalog apart.
_NOISE_WORDS = re.compile(r"nvidia|geforce|tesla|generation|\(hgx\)|hgx|hbm3e?|sxm[0-9]?|graphics|gpu")


def _compact(name: str) -> str:
    """`NVIDIA GeForce RTX 4090` -> `rtx4090`; `NVIDIA A100-SXM4-80GB` -> `a10080gb`: letters and digits only."""
    return re.sub(r"[^a-z0-9]", "", _NOISE_WORDS.sub("", name.lower()))


def catalog_gpu_key(text: str) -> str | None:
    """The catalog key of a GPU named as people write it, or None.

    Tried in order: the key itself; the name without vendor words, spaces and dashes, against each key and each
    display name (`RTX 4090`, `NVIDIA GeForce RTX 4090`, `NVIDIA H100 80GB HBM3`, `NVIDIA A100-SXM4-80GB`); the same
    without a trailing memory size or `pcie` when that leaves one card (`RTX 4090 24GB`, `NVIDIA A100 80GB PCIe`);
    a bare model number (`4090` -> rtx4090). Never a guess between two cards: an ambiguous name gives None.
    """
    catalog = gpu_catalog()
    key = text.strip().lower()
    if key in catalog:
        return key
    compact = _compact(text)
    if not compact:
        return None
    index: dict[str, set[str]] = {}
    for k, e in catalog.items():
        for name in (k, e.get("display_name", "")):
            for form in (_compact(name), _compact(_SIZE.sub("", name.lower()))):
                if form:
                    index.setdefault(form, set()).add(k)
    unsized = _compact(_SIZE.sub("", text.lower()))
    tries = [compact, unsized, re.sub(r"pcie$", "", unsized)]
    if compact.isdigit():
        tries.append("rtx" + compact)
    size = _SIZE.search(text.lower())
    for form in tries:
        keys = index.get(form, set())
        if size and len(keys) > 1:  # `a100 80gb pcie` -> the 80 GB one
            keys = {k for k in keys if f"{size.group(1)}gb" in k} or keys
        if len(keys) == 1:
            return next(iter(keys))
    return None


#: A memory size inside a GPU's name: `80GB`, `-24GB`, ` 16 GB`.
_SIZE = re.compile(r"[-_ ]?(\d+)\s*gb\b")


def card_of_size(text: str) -> str | None:
    """The catalog card sold as `text` (`24GB`: its memory is within 1 GiB of 24 GiB, as a 24,564 MiB RTX 4090 is),
    the smallest if several are (its budget is the one a run of that size can count on); None when none is."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*gb\s*", text.lower())
    if not m:
        return None
    size_gib = float(m.group(1))
    cards = [(int(e["total_memory_mib"]), k) for k, e in gpu_catalog().items()
             if abs(int(e["total_memory_mib"]) / 1024 - size_gib) < 1.0]
    return min(cards)[1] if cards else None


def _budget_note(name: str, budget_bytes: int) -> str:
    """What a bare `NGiB` means, beside the card of that size (the CUDA context takes its share of a real card)."""
    card = card_of_size(f"{round(budget_bytes / GiB)}GB") if budget_bytes % GiB == 0 else None
    if card is None:
        return ""
    c = _catalog_gpu(card)
    if c.allocator_budget_bytes == budget_bytes:
        return ""
    return (f"{name} is the memory PyTorch's allocator may use, taken as given; a card of that size leaves less: "
            f"{card} ({c.total_bytes / GiB:.1f} GiB) leaves {c.allocator_budget_bytes / GiB:.1f} GiB after its CUDA "
            f"context (`--gpu {card}`)")
