"""Sharded checkpoints (FSDP2): each rank writes its own shards with torch.distributed.checkpoint (DCP).

    checkpoints/step-000010/
        sharded/shard-0000N-model-00001-of-00001.safetensors   rank N's shards: trainable weights ("model.<fqn>")
                                                                and optimizer state ("optim.state.<fqn>.exp_avg")
        sharded/optimizer-groups.json                          the optimizer's param groups (lr, betas, ...) per fqn
        scheduler.json, rng-*.safetensors, trainer_state.json   as every fitune checkpoint (rank 0)

DCP's safetensors storage (`HuggingFaceStorageWriter/Reader`) records each shard's offsets in the safetensors
header (JSON), so loading unpickles nothing (fitune's rule for checkpoints, train/checkpoint.py) and reshards:
a run resumes on another number of GPUs, or on one process without FSDP, from the same files. The state dicts
are keyed by parameter name (`get_state_dict(..., flatten_optimizer_state_dict=True)`), not by engine.
"""

from __future__ import annotations

import dataclasses
import json
import os

from . import ZERO_STRATEGIES, ranks as ranks_mod
from .deepspeed_engine import full_state_dict as zero3_state_dict

SHARDED_DIR = "sharded"
GROUPS_FILE = "optimizer-groups.json"


def is_sharded(path: str) -> bool:
    """Whether the checkpoint folder `path` holds sharded (DCP) weights and optimizer state."""
    return os.path.isdir(os.path.join(path, SHARDED_DIR))


def _options():
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen base weights are the model's, not the run's: only trainable parameters are saved (as the DDP and
    # one-GPU checkpoints do)
    return StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)


def _flat_state(model, optimizer) -> tuple[dict, dict]:
    """(tensors, other values) of the model's trainable weights and the optimizer, keyed by name."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())  # initialises empty optimizer state
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    others = {}
    for k, v in optim_sd.items():
        if isinstance(v, torch.Tensor):
            tensors[f"optim.{k}"] = v
        else:
            others[k] = v
    return tensors, others


def save_sharded(folder: str, model, optimizer) -> None:
    """Every rank: write this rank's shards into `folder/sharded` (a collective: all ranks call it together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, others = _flat_state(model, optimizer)
    path = os.path.join(folder, SHARDED_DIR)
    if ranks_mod.is_main():
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, GROUPS_FILE), "x", encoding="utf-8") as f:
            json.dump(others, f, indent=1)
    ranks_mod.barrier()  # the folder exists before the other ranks write into it
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True),
             no_dist=not ranks_mod.current().distributed)


def load_sharded(folder: str, model, optimizer) -> None:
    """Every rank: read its shards (whatever the number of ranks that wrote them) into `model` and `optimizer`.

    Raises:
        ValueError: the checkpoint lacks a weight or optimizer tensor this model has, or has other shapes.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(folder, SHARDED_DIR)
    tensors, others = _flat_state(model, optimizer)  # the templates DCP reads into, sharded as this run shards
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(path), no_dist=not ranks_mod.current().distributed)
    except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException / RuntimeError with per-rank details
        raise ValueError(f"sharded weights in {path} do not fit this model ({str(exc)[:300]})") from None
    with open(os.path.join(path, GROUPS_FILE), encoding="utf-8") as f:
        saved = json.load(f)
    missing = sorted(set(others) - set(saved))
    if missing:
        raise ValueError(f"{path}/{GROUPS_FILE} lacks {missing[:3]}")
    for k, now in others.items():  # JSON made tuples (betas) lists
        others[k] = tuple(saved[k]) if isinstance(now, tuple) else saved[k]
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    optim_sd = {k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")} | others
    # strict=False: the frozen weights are the model's (not in the checkpoint); every trainable one was read above
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=dataclasses.replace(_options(), strict=False))


def full_state_dict(model, strategy: str) -> dict | None:
    """Every rank calls it; rank 0 gets the whole (unsharded) state dict on the CPU (writing the adapter / model of
    a sharded run from rank 0). None when the parameters are whole on every rank (one process, DDP, ZeRO-2)."""
    if not ranks_mod.current().distributed:
        return None
    if strategy in ZERO_STRATEGIES:
        return zero3_state_dict(model)
    if strategy != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_on_ranks(save, model, optimizer, sharded: bool, strategy: str = "ddp"):
    """Rank 0 runs `save(writer)` (fitune.train.checkpoint.save: the .tmp folder, the shared files, the rename);
    with `sharded`, `writer(tmp)` has every rank write its shards into `tmp` first. Returns the checkpoint's path
    on every rank; None for a ZeRO run, which writes none (fitune/parallel/deepspeed_engine.py)."""
    if strategy in ZERO_STRATEGIES:
        return None
    if not sharded:  # DDP / one process: the weights are the same on every rank, rank 0 writes them
        path = save(None) if ranks_mod.is_main() else None
        ranks_mod.barrier()
        return ranks_mod.broadcast(path)
    written = []

    def writer(tmp: str) -> None:
        written.append(tmp)
        ranks_mod.broadcast(tmp)  # the other ranks learn where to write
        save_sharded(tmp, model, optimizer)

    if ranks_mod.is_main():
        path = save(writer)
        if not written:  # this step's checkpoint was already complete: the others write nothing either
            ranks_mod.broadcast(None)
    else:
        path = None
        tmp = ranks_mod.broadcast(None)
        if tmp is not None:
            save_sharded(tmp, model, optimizer)
    ranks_mod.barrier()  # the checkpoint is complete (renamed) before any rank goes on
    return ranks_mod.broadcast(path)
