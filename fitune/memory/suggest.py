"""The cheapest changes that make a setup fit: each candidate is one change, estimated in full."""

from __future__ import annotations

from dataclasses import dataclass

from ..setup import TrainSetup
from ..specs.gpu import GpuSpec, catalog_gpu_names, resolve_gpu
from ..specs.model import ModelSpec
from ..units import GiB
from .estimate import MemoryEstimate, estimate


@dataclass(frozen=True)
class Suggestion:
    change: str  # the flags to change, e.g. "--grad-checkpointing full"
    why: str  # what it costs
    peak_reserved_bytes: int
    fits: bool
    retries: bool = False  # fits, but only with the allocator flushing its cache mid-step


def _candidates(s: TrainSetup) -> list[tuple[str, str, TrainSetup]]:
    out = []
    if s.grad_checkpointing == "none":
        out.append(("--grad-checkpointing full", "recomputes each layer in backward: slower steps",
                    s.replace(grad_checkpointing="full")))
    if s.batch_size > 1:
        b = max(1, s.batch_size // 2)
        out.append((f"--batch-size {b} (and {s.grad_accum * s.batch_size // b}x gradient accumulation)",
                    "same effective batch, smaller steps", s.replace(batch_size=b, grad_accum=s.grad_accum * s.batch_size // b)))
    if s.loss == "hf":
        if s.keep_outputs:  # fitune's runner never keeps the output: the change drops --keep-outputs too
            out.append(("--stack fitune --loss chunked (no --keep-outputs)",
                        "fitune train: the output is not kept and the full fp32 logits never exist",
                        s.replace(stack="fitune", loss="chunked", keep_outputs=False)))
        else:
            out.append(("--stack fitune --loss chunked", "fitune train's chunked loss: the full fp32 logits never exist",
                        s.replace(stack="fitune", loss="chunked")))
    if s.method == "lora":
        out.append(("--method qlora", "4-bit NF4 base weights: slower matmuls, a small quality cost", s.replace(method="qlora")))
    if s.method in ("full", "freeze") and s.optimizer == "adamw":
        out.append(("--optimizer adamw8bit", "8-bit optimizer states", s.replace(optimizer="adamw8bit")))
    if s.seq_len_tokens >= 512:
        out.append((f"--seq-len {s.seq_len_tokens // 2}", "shorter sequences: long examples are truncated",
                    s.replace(seq_len_tokens=s.seq_len_tokens // 2)))
    return out


def suggest_changes(model: ModelSpec, setup: TrainSetup, gpu: GpuSpec, base: MemoryEstimate | None = None,
                    limit: int = 3) -> list[Suggestion]:
    """One-change alternatives that fit `gpu`, cheapest first (those needing allocator retries say so); then the
    smallest catalog GPU whose budget holds the reserved peak as is."""
    out: list[Suggestion] = []
    for change, why, s in _candidates(setup)[:limit]:
        e = estimate(model, s, gpu, allocator_steps=1)  # a screen: the first step's reserved peak
        if e.fits:
            out.append(Suggestion(change, why, e.peak_reserved_bytes, True, bool(e.retries_expected)))
    need = (base or estimate(model, setup, gpu)).peak_reserved_bytes
    bigger = sorted((resolve_gpu(n) for n in catalog_gpu_names()), key=lambda g: g.allocator_budget_bytes)
    for g in bigger:
        if g.training_budget_bytes >= need and g.supports_bf16:
            out.append(Suggestion(f"--gpu {g.name}", f"{g.allocator_budget_bytes / GiB:.1f} GiB for the allocator", need, True))
            break
    return out
