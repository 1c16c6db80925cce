"""The DeepSpeed config fitune generates for zero2, zero3 and zero3_offload (plain Python: no torch, no DeepSpeed).

fitune's loop keeps its own step: every micro-batch's loss is already divided by the step's trained tokens, and
`train_step` calls `loss.backward()` per micro-batch and the optimizer once per step. So DeepSpeed is told one
micro-batch per step (gradient_accumulation_steps 1: it divides by nothing) with managed_gradient_accumulation
off (its backward accumulates locally; the reduction over the ranks and the update happen in `step()`, once per
fitune step). The optimizer is fitune's (torch AdamW, ...), hence zero_allow_untested_optimizer, and with
offloading zero_force_ds_cpu_optimizer off (DeepSpeedCPUAdam would need its C++ op built). Keys and meaning:
https://www.deepspeed.ai/docs/config-json/ ; the test validates the result with DeepSpeed's own DeepSpeedConfig.
"""

from __future__ import annotations

from . import ZERO_STRATEGIES

BUCKET_ELEMENTS = 500_000_000
"""reduce_bucket_size / allgather_bucket_size: DeepSpeed's defaults (elements, not bytes)."""


def deepspeed_config(s, num_gpus: int, max_grad_norm: float | None) -> dict:
    """The config dict for `deepspeed.initialize(config=...)` of TrainSetup `s` (strategy zero2 | zero3 |
    zero3_offload) on `num_gpus` ranks.

    Raises:
        ValueError: `s.strategy` is not a ZeRO strategy.
    """
    if s.strategy not in ZERO_STRATEGIES:
        raise ValueError(f"deepspeed_config: strategy {s.strategy!r} is not one of {', '.join(ZERO_STRATEGIES)}")
    zero: dict = {"stage": 2 if s.strategy == "zero2" else 3,
                  "overlap_comm": True,  # reduce a bucket while backward computes the next
                  "contiguous_gradients": True,  # gradients copied into one buffer as they come: no fragmentation
                  "reduce_bucket_size": BUCKET_ELEMENTS}
    if s.strategy == "zero2":
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    else:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # rank 0 can write the whole model / adapter
    if s.strategy == "zero3_offload":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}  # parameters live in host RAM between uses
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}  # Adam's moments and the update on the CPU
    return {
        "train_micro_batch_size_per_gpu": s.batch_size,
        "gradient_accumulation_steps": 1,  # fitune's train_step accumulates (see the module docstring)
        # train_batch_size is left to DeepSpeed: micro-batch x 1 x the ranks it finds (batch_size x num_gpus)
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(max_grad_norm or 0.0),  # DeepSpeed clips: its partitions hold the gradients
        "bf16": {"enabled": s.dtype == "bf16"},
        "fp16": {"enabled": s.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},  # 0: dynamic scaling
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,  # fitune logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
