"""The one optimizer factory: the optimizers a TrainSetup can name (`optimizer:`), built over the trainable
parameters from their registry entries alone (fitune/specs/optimizers.py): adding an optimizer needs no edit here.
The class an entry names (`build`, a dotted name) is imported when called: torch, transformers, bitsandbytes."""

from __future__ import annotations

import importlib

from ..errors import ConfigError, FituneError
from ..specs import optimizers as optimizer_specs
from .needs import optimizer_need, packages_problem

OPTIMIZERS = optimizer_specs.names()


def build_optimizer(name: str, params, lr: float, weight_decay: float | None = None, foreach: bool | None = None):
    """The optimizer `name` over `params`: its registry entry's class (fitune/specs/optimizers.py `build`, imported
    by `optimizer_class`) with the entry's fixed arguments (`build_kwargs`).

    Args:
        name: a registry name (adamw: torch.optim.AdamW, adamw8bit: bitsandbytes.optim.AdamW8bit, ...; each entry's
            `build` and `build_kwargs` say what it makes).
        lr: learning rate.
        weight_decay: None keeps each library's default (AdamW and the 8-bit AdamWs: 0.01; SGD, Adafactor: 0).
        foreach: for entries that take it (`takes_foreach`: torch's own optimizers); None lets PyTorch choose (the
            multi-tensor kernels on CUDA).
    Raises:
        FituneError: an unknown name, or an 8-bit optimizer without bitsandbytes installed.
    """
    try:
        spec = optimizer_specs.get(name)
    except ConfigError:
        raise FituneError(f"optimizer: {name!r} is not one of: {', '.join(optimizer_specs.names())}") from None
    kwargs = dict(spec.build_kwargs)
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    if spec.takes_foreach and foreach is not None:
        kwargs["foreach"] = foreach
    return optimizer_class(spec)(params, lr=lr, **kwargs)


def optimizer_class(spec: optimizer_specs.OptimizerSpec):
    """The class `spec.build` names, imported now.

    Raises:
        FituneError: a package it needs (bitsandbytes) is not installed.
    """
    module, _, attr = spec.build.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        if not spec.packages:
            raise
        need = optimizer_need(spec.name)
        raise FituneError(f"{packages_problem([need], list(spec.packages))} (on a machine with a CUDA GPU: "
                          f"{need.cuda}), or use {need.instead}") from exc


#: bitsandbytes pages a state tensor only from this many elements (bitsandbytes/optim/optimizer.py
#: `get_state_buffer`: `p.numel() < 1e5` keeps an ordinary tensor).
BNB_PAGED_MIN_NUMEL = 100_000


def page_loaded_state(optimizer, get_paged=None) -> int:
    """Put a paged bitsandbytes optimizer's loaded state back in paged (CUDA managed) memory; returns how many
    tensors moved.

    bitsandbytes pages a state tensor only when it creates it (`init_state` -> `get_state_buffer`: `F.get_paged`
    for parameters of `BNB_PAGED_MIN_NUMEL` elements or more); `load_state_dict` moves the saved `state1` / `state2`
    onto the parameter's GPU as ordinary tensors (bitsandbytes 0.50.2 optim/optimizer.py `load_state_dict`,
    `cast`: `v.to(param.device)`). A resumed `paged_adamw8bit` run would then hold its whole 8-bit state in the
    allocator, which the estimate (and the run before the resume) kept outside it. `get_paged`: bitsandbytes'
    `functional.get_paged` (a stand-in in tests)."""
    if not getattr(optimizer, "is_paged", False):
        return 0
    if get_paged is None:
        from bitsandbytes.functional import get_paged
    moved = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            if p.device.type != "cuda" or p.numel() < BNB_PAGED_MIN_NUMEL:
                continue
            for key in ("state1", "state2"):
                tensor = state.get(key)
                if tensor is None or getattr(tensor, "is_paged", False):
                    continue
                paged = get_paged(*tensor.shape, dtype=tensor.dtype, device=p.device)
                paged.copy_(tensor)
                optimizer.page_mng.paged_tensors.append(paged)
                state[key] = paged
                moved += 1
    return moved
