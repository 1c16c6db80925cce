"""Which process of the run this is, and the few collectives the training loop needs.

A process started by torchrun (`fitune.parallel.launch`) finds RANK, LOCAL_RANK and WORLD_SIZE in its environment;
`start` joins the process group (NCCL on CUDA GPUs, gloo on CPU processes) and pins the process to its GPU. A
process started any other way is the only rank: every function here is then a no-op that returns its input, so
the loop calls them unconditionally.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from ..errors import ConfigError
from . import CPU_RANKS_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run."""

    rank: int = 0
    world_size: int = 1
    """Processes in the run, one per GPU."""
    local_rank: int = 0
    """The GPU index of this process on its machine."""
    device: str | None = None
    """"cuda" (pinned to cuda:local_rank) or "cpu"; None when not distributed (the loop picks)."""
    distributed: bool = False
    """Launched by torchrun: a process group exists (even with one rank: DeepSpeed needs one)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes metrics, logs, run.json, checkpoints' shared files and outputs."""
        return self.rank == 0


_CURRENT = Ranks()


def launched() -> bool:
    """Whether torchrun started this process (its environment names the rank and the world)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def start(num_gpus: int, strategy: str) -> Ranks:
    """Join the run's process group when torchrun started this process; else the single rank.

    Raises:
        ConfigError: gpus: N > 1 without torchrun's environment (run `fitune train`, which launches the ranks), or
            a torchrun world that is not the config's gpus.
    """
    global _CURRENT
    if not launched():
        if num_gpus > 1:
            raise ConfigError(f"gpus: {num_gpus} runs one process per GPU; start it with `fitune train CONFIG.yaml "
                              f"--gpus {num_gpus}` (which launches them with torchrun), not by calling train() in "
                              "one process")
        _CURRENT = Ranks()
        return _CURRENT
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import torch
    import torch.distributed as dist

    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if world != num_gpus:
        raise ConfigError(f"gpus: {num_gpus} but torchrun started {world} processes; give --gpus {world} (or let "
                          f"`fitune train --gpus N` launch the processes)")
    on_cuda = torch.cuda.is_available() and os.environ.get(CPU_RANKS_ENV) != "1"
    if on_cuda:
        torch.cuda.set_device(local_rank)  # "cuda" now means this rank's GPU everywhere in fitune
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_cuda else "gloo",
                                device_id=torch.device("cuda", local_rank) if on_cuda else None)
    _CURRENT = Ranks(rank=rank, world_size=world, local_rank=local_rank, device="cuda" if on_cuda else "cpu",
                     distributed=True)
    log.info("rank %d of %d (%s, %s)", rank, world, strategy, _CURRENT.device)
    return _CURRENT


def stop() -> None:
    """Leave the process group (the end of a distributed run)."""
    global _CURRENT
    if _CURRENT.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            try:  # every rank leaves together: a gloo rank whose peer already tore its pairs down can abort
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer that died already: leave anyway
                pass
            dist.destroy_process_group()
    _CURRENT = Ranks()


def current() -> Ranks:
    """This process's ranks (the single rank before `start` or outside torchrun)."""
    return _CURRENT


def world_size() -> int:
    return _CURRENT.world_size


def is_main() -> bool:
    return _CURRENT.is_main


def barrier() -> None:
    """Wait for every rank (rank 0's writes are complete when the others go on)."""
    if _CURRENT.distributed:
        import torch.distributed as dist

        dist.barrier()


def broadcast(obj):
    """Rank 0's `obj` on every rank (any picklable value; small: paths, run ids)."""
    if not _CURRENT.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean(value: float) -> float:
    """The mean of `value` over the ranks (each rank's loss covers its slice of the global batch, weighted so
    that the mean is the loss of the whole batch: `fitune.parallel.data`)."""
    if _CURRENT.world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda" if _CURRENT.device == "cuda" else "cpu")
    dist.all_reduce(t)
    return float(t.item()) / _CURRENT.world_size


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (a Ctrl-C seen by one rank stops all of them after the same step)."""
    if _CURRENT.world_size == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device="cuda" if _CURRENT.device == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class _FollowerFolder:
    """Rank 0's output folder as the other ranks see it: they read its checkpoints and write nothing."""

    def __init__(self, root: str, run_id: str):
        self.root, self.run_id = root, run_id

    def open_metrics(self, through_step: int):
        return open(os.devnull, "a", encoding="utf-8")  # rank 0 alone writes metrics.jsonl

    def close(self) -> None:
        pass


def share_folder(folder):
    """Rank 0's RunFolder (opened and locked by rank 0 alone); the other ranks get a follower of it."""
    if not _CURRENT.distributed:
        return folder
    root, run_id = broadcast((folder.root, folder.run_id) if folder is not None else None)
    return folder if _CURRENT.is_main else _FollowerFolder(root, run_id)


def exit_process(code: int) -> None:
    """End the process with `code`. A rank of `fitune train --gpus N` (torchrun's worker) has written everything and
    left its process group: it leaves without the interpreter's teardown, where gloo's worker threads can still hold
    tensors and abort the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch PR
    179291 describes it). Anything else exits normally."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_RANK") is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
