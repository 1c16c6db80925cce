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
