"""Liger Kernel's fused RMSNorm, SwiGLU and RoPE in fitune's runner (`kernels: liger`).

transformers' modules run RMSNorm as five elementwise kernels with fp32 copies, the gated MLP's activation and
product as two more, and RoPE as several slices and concatenations. Liger Kernel (github.com/linkedin/Liger-Kernel)
replaces each by one Triton kernel that saves less: its RMSNorm keeps the input and one fp32 rstd per token, its
SwiGLU keeps the two projections and writes their gradients over them. Measured on the seeds' workload under a
24 GB budget (bench/results/issue5/): 14.3k tokens/s with these kernels against 11.3k with transformers' modules,
everything else equal. The loss stays fitune's chunked loss (Liger's fused linear cross-entropy is not used).

Applied to the loaded model before LoRA wraps it, through Liger's own `_apply_liger_kernel_to_instance`, which
patches the model's existing modules for the model types Liger supports.
"""

from __future__ import annotations

from ...errors import ConfigError
from ..needs import LIGER, cuda_problem, machine_problems

KWARGS = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def enable_liger_kernels(model) -> None:
    """Patch `model` (a transformers causal LM, not yet PEFT-wrapped) with Liger's kernels, or explain why not."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as exc:
        on_cuda = next(model.parameters()).device.type == "cuda"
        raise ConfigError(machine_problems([LIGER], on_cuda, has=lambda module: False)) from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"kernels: liger has no kernels for model type {model_type!r}; set kernels: torch")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(cuda_problem(LIGER))
    _apply_liger_kernel_to_instance(model=model, **KWARGS)
