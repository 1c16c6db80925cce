"""DeepSpeed ZeRO as the engine of fitune's loop: `deepspeed.initialize` with the config deepspeed_config.py writes.

The loop keeps its step (`train_step`): the micro-batches' `loss.backward()` go through DeepSpeed's hooks on the
engine's outputs (DeepSpeed >= 0.18 runs its backward prologue there, no `engine.backward` needed), and the
"optimizer" train_step steps is `ZeroOptimizer`, whose `step()` is the engine's: the reduction over the ranks,
clipping, the update and zeroing the gradients.

Construction (ZeRO-3): `construction_context` around the model's construction registers transformers'
`HfDeepSpeedConfig` of the run's config, so `from_pretrained` / `from_config` build the model under
`deepspeed.zero.Init`: each parameter is partitioned over the ranks (with zero3_offload: moved to pinned host
memory) as its module is created, and loaded weights go straight into the partitions. Without it the whole model is
built on the GPU first and `deepspeed.initialize` partitions it afterwards: an H200 run of Llama-3.1-8B LoRA with
zero3_offload peaked at 24.09 GiB reserved for 9.87 GiB allocated, the 15 GiB bf16 model's blocks left cached.
Adapters added after construction (PEFT's LoRA) are ordinary parameters; `deepspeed.initialize` partitions them.
While partitioned, a parameter's `numel()` / `shape` are those of an empty placeholder: `ds_numel` / `ds_shape`
hold the real sizes (`param_numel`).

Checkpoints: a ZeRO run writes its adapter / model at the end, but no resumable checkpoint (DeepSpeed's own are
pickles, which fitune does not load); --resume of a ZeRO run is refused. Use strategy fsdp for resumable sharded
runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ..errors import ConfigError
from .deepspeed_config import deepspeed_config
from .ranks import current, world_size

log = logging.getLogger(__name__)

ZERO3_STRATEGIES = ("zero3", "zero3_offload")
"""The strategies whose parameters are partitioned (ZeRO stage 3): built under zero.Init."""

_ENGINE = None
"""This process's DeepSpeed engine (one per run)."""

_HF_DS_CONFIG = None
"""transformers' HfDeepSpeedConfig of this run (ZeRO-3), from construction to `release`. transformers keeps only a
weak reference to it (`is_deepspeed_zero3_enabled`), so this module holds the object for the whole run."""


def _ds_config(s, cfg) -> dict:
    """The one DeepSpeed config of the run: zero.Init at construction and `deepspeed.initialize` must agree on it
    (stage, offload device, dtype)."""
    return deepspeed_config(s, world_size(), cfg.max_grad_norm)


def param_numel(p) -> int:
    """The elements of parameter `p`, whole: a ZeRO-3 partitioned parameter's `numel()` is its empty placeholder's
    (0), its real size is `ds_numel`."""
    return getattr(p, "ds_numel", p.numel())


@contextlib.contextmanager
def construction_context(s, cfg) -> Iterator[None]:
    """Enter around building the model: under zero3 / zero3_offload on torchrun's ranks, transformers builds it
    under `deepspeed.zero.Init` (see the module docstring); otherwise nothing changes.

    The HfDeepSpeedConfig stays registered after the block (transformers' and PEFT's ZeRO-3 paths consult it while
    the model lives) until `release`, which a new construction also calls first: a later run in this process never
    sees an earlier run's ZeRO-3 config.

    Raises:
        ConfigError: transformers cannot register the config (accelerate missing): says what to install.
    """
    release()
    if s.strategy not in ZERO3_STRATEGIES or not current().distributed:
        yield
        return
    global _HF_DS_CONFIG
    try:
        # transformers, torch, deepspeed: optional, imported where used
        from transformers.integrations import HfDeepSpeedConfig

        _HF_DS_CONFIG = HfDeepSpeedConfig(_ds_config(s, cfg))
    except (ImportError, TypeError) as exc:  # no accelerate: HfDeepSpeedConfig is a bare object, or the check fails
        raise ConfigError(f"strategy {s.strategy}: transformers cannot build the model partitioned (ZeRO-3 "
                          f"construction needs accelerate: pip install accelerate; {exc})") from exc
    log.info("deepspeed: the model is built under zero.Init (ZeRO-3: each parameter partitioned as it is created)")
    yield


def release() -> None:
    """Forget this process's engine and ZeRO-3 construction config (the end of a run; a new run's start)."""
    global _ENGINE, _HF_DS_CONFIG
    if _HF_DS_CONFIG is not None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    _ENGINE = _HF_DS_CONFIG = None


def _cast_added_parameters(params, config: dict) -> None:
    """Cast the parameters created after a zero.Init construction (PEFT's adapters, fp32) to the run's 16-bit dtype.

    DeepSpeed's engine casts every parameter of a model built whole to bf16 / fp16, but skips the cast when the model
    was built under zero.Init (its parameters already have the dtype), which would leave the adapters in fp32: the
    run would train other numbers, and hold other memory, than the same run built whole. `p.data` is replaced, so the
    optimizer created before keeps the same parameter objects (as DeepSpeed's own cast does)."""
    import torch

    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float16 if config["fp16"]["enabled"] else None
    if dtype is None:
        return
    for p in params:
        if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


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

    config = _ds_config(s, cfg)
    params = list(engine.step_model.parameters())
    built_partitioned = [p for p in params if hasattr(p, "ds_id")]  # zero.Init: DeepSpeed skips module.to(device)
    if built_partitioned:
        _cast_added_parameters(params, config)
    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=engine.step_model, optimizer=optimizer, config=config,
        dist_init_required=False)  # ranks.py joined the process group torchrun describes
    engine.step_model = ds_engine
    _ENGINE = ds_engine
    log.info("deepspeed: ZeRO stage %d over %d ranks", ds_engine.zero_optimization_stage(), world_size())
    if built_partitioned:
        log.info("deepspeed: %d of %d parameters (%d of %d elements) partitioned at construction; the other %d "
                 "(adapters added after it) partitioned by deepspeed.initialize", len(built_partitioned), len(params),
                 sum(map(param_numel, built_partitioned)), sum(map(param_numel, params)),
                 len(params) - len(built_partitioned))
    return ZeroOptimizer(ds_engine, ds_optimizer)


def full_state_dict(model) -> dict | None:
    """ZeRO-3: every rank calls it; rank 0 gets the whole 16-bit state dict (names of `model`). ZeRO-2: None (the
    parameters are whole on every rank: `model.save_pretrained` on rank 0 writes them)."""
    if _ENGINE is None or _ENGINE.zero_optimization_stage() < 3:
        return None
    state = _ENGINE._zero3_consolidated_16bit_state_dict()  # keys of LossForward: "model." + the model's names
    return {k[len("model."):]: v for k, v in (state or {}).items()}
