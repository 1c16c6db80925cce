"""The one optimizer factory: the optimizers a TrainSetup can name (`optimizer:`), built over the trainable
parameters. torch, transformers and bitsandbytes are imported when called."""

from __future__ import annotations

from ..errors import FituneError

OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd")


def build_optimizer(name: str, params, lr: float, weight_decay: float | None = None, foreach: bool | None = None):
    """The optimizer `name` over `params`.

    Args:
        name: adamw (torch.optim.AdamW), sgd (torch.optim.SGD), adafactor (transformers' Adafactor with a fixed
            lr: relative_step=False, scale_parameter=False), adamw8bit / paged_adamw8bit (bitsandbytes, CUDA).
        lr: learning rate.
        weight_decay: None keeps each library's default (AdamW and the 8-bit AdamWs: 0.01; SGD, Adafactor: 0).
        foreach: torch optimizers only: None lets PyTorch choose (the multi-tensor kernels on CUDA).
    Raises:
        FituneError: an unknown name, or an 8-bit optimizer without bitsandbytes installed.
    """
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    if name in ("adamw", "sgd"):
        import torch

        cls = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
        return cls(params, lr=lr, **decay, **({} if foreach is None else {"foreach": foreach}))
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False, **decay)
    if name not in OPTIMIZERS:
        raise FituneError(f"optimizer: {name!r} is not one of: {', '.join(OPTIMIZERS)}")
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        from .needs import optimizer_need, packages_problem

        need = optimizer_need(name)
        raise FituneError(f"{packages_problem([need], ['bitsandbytes'])} (on a machine with a CUDA GPU: "
                          f"{need.cuda}), or use {need.instead}") from exc
    cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, lr=lr, **decay)
