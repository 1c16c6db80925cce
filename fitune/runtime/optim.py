"""The one optimizer factory: the optimizers a TrainSetup can name (`optimizer:`), built over the trainable
parameters. torch, transformers and bitsandbytes are imported when called."""

from __future__ import annotations

import importlib

from ..errors import ConfigError, FituneError
from ..specs import optimizers as optimizer_specs

OPTIMIZERS = optimizer_specs.names()


def build_optimizer(name: str, params, lr: float, weight_decay: float | None = None, foreach: bool | None = None):
    """The optimizer `name` over `params`: its registry entry's class (fitune/specs/optimizers.py `build`) with the
    entry's fixed arguments (`build_kwargs`).

    Args:
        name: adamw (torch.optim.AdamW), sgd (torch.optim.SGD), adafactor (transformers' Adafactor with a fixed
            lr: relative_step=False, scale_parameter=False), adamw8bit / paged_adamw8bit (bitsandbytes, CUDA).
        lr: learning rate.
        weight_decay: None keeps each library's default (AdamW and the 8-bit AdamWs: 0.01; SGD, Adafactor: 0).
        foreach: torch optimizers only: None lets PyTorch choose (the multi-tensor kernels on CUDA).
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
    # The classes are named here as well as resolved from `spec.build`: tests/test_layering.py recognises the one
    # optimizer factory by these references (tests/test_optimizer_registry.py checks each matches `spec.build`).
    if spec.build == "torch.optim.AdamW":
        import torch

        return torch.optim.AdamW(params, lr=lr, **kwargs)
    if spec.build == "torch.optim.SGD":
        import torch

        return torch.optim.SGD(params, lr=lr, **kwargs)
    if spec.build == "transformers.optimization.Adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, **kwargs)
    return optimizer_class(spec)(params, lr=lr, **kwargs)  # any other entry: its dotted name (bitsandbytes' 8-bit)


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
        from .needs import optimizer_need, packages_problem

        need = optimizer_need(spec.name)
        raise FituneError(f"{packages_problem([need], list(spec.packages))} (on a machine with a CUDA GPU: "
                          f"{need.cuda}), or use {need.instead}") from exc
