"""The engine around the model: DistributedDataParallel, FSDP2 (`fully_shard`) or DeepSpeed ZeRO.

Each engine must see the whole forward, the loss included: DDP arms its gradient all-reduce in its forward, FSDP2
gathers the root's parameters (embeddings, final norm, lm_head) in the root's forward, and fitune's chunked loss
runs the decoder and multiplies by lm_head's weight itself. So the engine wraps `LossForward`, the model and its
configured loss as one module, and `train_step` calls it as it calls a transformers model (labels in, `.loss`
out) with `loss="hf"`: every technique inside the model (checkpointing, offloaded checkpoints, tiled MLP, lean
LoRA / RMSNorm, Liger) runs unchanged inside the engine.

Memory per GPU: DDP keeps a whole copy of the model, its gradients and optimizer state on each (LoRA: the adapters
are the only gradients); FSDP2 shards the parameters (all-gathered one decoder layer at a time), gradients and
optimizer state over the GPUs; ZeRO-2 shards gradients and optimizer state, ZeRO-3 parameters too, and
zero3_offload keeps parameters and optimizer state in CPU memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..runtime.device import torch_dtype
from . import ZERO_STRATEGIES
from .deepspeed_engine import initialize
from .ranks import Ranks

log = logging.getLogger(__name__)


class LossForward(torch.nn.Module):
    """The model and its loss as one module: `forward(input_ids, labels, num_items_in_batch=, **inputs)` returns an
    object whose `.loss` is fitune's loss (`fitune.runtime.step.forward_loss`'s "hf" or "chunked")."""

    def __init__(self, model: torch.nn.Module, loss: str):
        super().__init__()
        self.model = model
        self.loss_name = loss

    def forward(self, input_ids, labels, num_items_in_batch=None, **inputs):
        # transformers, torch: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
        from transformers.modeling_outputs import CausalLMOutput

        if self.loss_name == "chunked":  # the decoder, then the loss a chunk of tokens at a time through lm_head
            from ..runtime.techniques.chunked_loss import causal_lm_chunked_loss

            loss = causal_lm_chunked_loss(self.model, input_ids, labels, num_items=num_items_in_batch, **inputs)
        else:
            loss = self.model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch,
                              **inputs).loss
        return CausalLMOutput(loss=loss)


@dataclass
class Engine:
    """The model as the loop uses it."""

    model: Any
    """The prepared model (PEFT's wrapper for LoRA): its state dict, checkpointing switch and save_pretrained."""
    step_model: Any
    """What `train_step` and evaluation run: the engine's wrapper of `LossForward(model)`, or `model` itself."""
    step_loss: str
    """The `loss` argument of `train_step`: "hf" when the wrapper computes the configured loss in its forward."""
    strategy: str | None = None
    """ddp, fsdp, zero2, zero3 or zero3_offload; None on one process without an engine."""

    @property
    def sharded(self) -> bool:
        """Parameters / optimizer state split over the ranks: checkpoints go through torch.distributed.checkpoint."""
        return self.strategy is not None and self.strategy != "ddp"


def check_supported(s, ranks_count: int, merge: bool = False) -> list[str]:
    """What this TrainSetup cannot run with its strategy, each problem naming the keys and what to use instead."""
    problems = []
    if ranks_count == 1 and s.strategy not in ZERO_STRATEGIES:
        return problems
    if merge and s.strategy != "ddp":
        problems.append(f"merge: true with strategy {s.strategy}: the weights are sharded over the GPUs, so fitune "
                        "writes the adapter only; merge it afterwards (PeftModel.from_pretrained(base, "
                        "'output_dir/adapter').merge_and_unload()), or use strategy ddp")
    if s.method == "qlora" and s.strategy != "ddp":
        problems.append(f"method qlora with strategy {s.strategy}: bitsandbytes' 4-bit base weights cannot be "
                        "sharded here; supported: method qlora with strategy ddp (each GPU holds the 4-bit base), "
                        f"or method lora / full with strategy {s.strategy}")
    if s.strategy in ZERO_STRATEGIES and s.kernels == "liger":
        problems.append(f"kernels liger with strategy {s.strategy}: not tried with DeepSpeed's partitioned parameters; "
                        "use strategy fsdp or ddp with liger, or kernels torch with ZeRO")
    return problems


def wrap(model, s, ranks: Ranks) -> Engine:
    """`model` (prepared: LoRA, techniques, checkpointing) inside the engine `s.strategy` names.

    One process without ZeRO: no engine, the model itself. DeepSpeed's engine also needs the optimizer: it is
    created in `attach_optimizer`.
    """
    if not ranks.distributed:
        return Engine(model=model, step_model=model, step_loss=s.loss)
    problems = check_supported(s, ranks.world_size)
    if problems:
        raise ConfigError(problems)
    step = LossForward(model, s.loss)
    if s.strategy == "fsdp":
        _fully_shard(step, model, s, ranks)
        return Engine(model=model, step_model=step, step_loss="hf", strategy="fsdp")
    if s.strategy in ZERO_STRATEGIES:
        return Engine(model=model, step_model=step, step_loss="hf", strategy=s.strategy)  # attach_optimizer wraps
    from torch.nn.parallel import DistributedDataParallel

    # the adapters start equal on every rank: DDP broadcasts rank 0's parameters and buffers here
    ddp = DistributedDataParallel(step, device_ids=[ranks.local_rank] if ranks.device == "cuda" else None)
    return Engine(model=model, step_model=ddp, step_loss="hf", strategy="ddp")


def _fully_shard(step: LossForward, model, s, ranks: Ranks) -> None:
    """FSDP2: each decoder layer its own unit (its parameters are gathered just before its forward and backward,
    freed after), then the root (embeddings, final norm, lm_head and LoRA outside the layers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..runtime.layers import find_decoder_layers

    layers = find_decoder_layers(model)
    if not layers:
        raise ConfigError(f"strategy fsdp: found no repeated decoder layers in {type(model).__name__} to shard; use "
                          "strategy ddp")
    # bf16 / fp16: the gathered parameters in that dtype (PEFT's fp32 adapters included), gradients reduced in fp32;
    # fp32: no policy
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(s.dtype), reduce_dtype=torch.float32) \
        if s.dtype != "fp32" else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(step, mp_policy=mp)
    log.info("fsdp: %d decoder layers and the root sharded over %d ranks", len(layers), ranks.world_size)


def attach_optimizer(engine: Engine, optimizer, s, cfg) -> Any:
    """The optimizer `train_step` steps: `optimizer` itself, or for ZeRO an adapter around DeepSpeed's engine (which
    is created here, with the config `deepspeed_config` writes)."""
    if engine.strategy not in ZERO_STRATEGIES:
        return optimizer
    return initialize(engine, optimizer, s, cfg)


def step_loss(step_model, loss: str) -> str:
    """The `loss` argument `train_step` takes for `step_model`: "hf" for an engine's wrapper of `LossForward`,
    whose forward computes the configured `loss` itself; `loss` for the model itself."""
    inner = getattr(step_model, "module", step_model)  # DDP and DeepSpeed keep the wrapped module in .module
    return "hf" if isinstance(inner, LossForward) else loss
