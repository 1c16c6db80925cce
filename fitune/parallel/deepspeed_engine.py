"""DeepSpeed ZeRO as the engine of fitune's loop: `deepspeed.initialize` with the config deepspeed_config.py writes.

The loop keeps its step (`train_step`): the micro-batches' `loss.backward()` go through DeepSpeed's hooks on the
engine's outputs (DeepSpeed >= 0.18 runs its backward prologue there, no `engine.backward` needed), and the
"optimizer" train_step steps is `ZeroOptimizer`, whose `step()` is the engine's: the reduction over the ranks,
clipping, the update and zeroing the gradients.

Checkpoints: a ZeRO run writes its adapter / model at the end, but no resumable checkpoint (DeepSpeed's own are
pickles, which fitune does not load); --resume of a ZeRO run is refused. Use strategy fsdp for resumable sharded
runs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_ENGINE = None
"""This process's DeepSpeed engine (one per run)."""


class ZeroOptimizer:
    """What `train_step` steps under ZeRO: DeepSpeed's engine reduces, clips, updates and zeroes the gradients."""

    def __init__(self, engine, optimizer):
        self.engine = engine
        self.optimizer = optimizer

    @property
    def param_groups(self):  # the schedule and a resumed lr set the rate here; DeepSpeed's optimizer reads it
        return self.optimizer.param_groups

    def step(self):
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True):
        pass  # engine.step() zeroed them

    def state_dict(self):
        raise NotImplementedError("a ZeRO run's optimizer state is not checkpointed by fitune (see "
                                  "fitune/parallel/deepspeed_engine.py)")


def initialize(engine, optimizer, s, cfg) -> ZeroOptimizer:
    """Create DeepSpeed's engine around `engine.step_model` (LossForward) and `optimizer`; `engine.step_model`
    becomes DeepSpeed's engine (its forward runs LossForward's)."""
    global _ENGINE
    import deepspeed

    from .deepspeed_config import deepspeed_config
    from .ranks import world_size

    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=engine.step_model, optimizer=optimizer, config=deepspeed_config(s, world_size(), cfg.max_grad_norm),
        dist_init_required=False)  # ranks.py joined the process group torchrun describes
    engine.step_model = ds_engine
    _ENGINE = ds_engine
    log.info("deepspeed: ZeRO stage %d over %d ranks", ds_engine.zero_optimization_stage(), world_size())
    return ZeroOptimizer(ds_engine, ds_optimizer)


def full_state_dict(model) -> dict | None:
    """ZeRO-3: every rank calls it; rank 0 gets the whole 16-bit state dict (names of `model`). ZeRO-2: None (the
    parameters are whole on every rank: `model.save_pretrained` on rank 0 writes them)."""
    if _ENGINE is None or _ENGINE.zero_optimization_stage() < 3:
        return None
    state = _ENGINE._zero3_consolidated_16bit_state_dict()  # keys of LossForward: "model." + the model's names
    return {k[len("model."):]: v for k, v in (state or {}).items()}
