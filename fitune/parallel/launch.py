"""`fitune train --gpus N`: check the machine, then start N ranks with torchrun, each running fitune's loop.

    fitune train run.yaml --gpus 4 --strategy fsdp     (the parent: resolves and validates the config once)
      torchrun's launcher, in the parent (elastic_launch), as this command would run it:
      python -m torch.distributed.run --standalone --nproc-per-node 4 \\
          -m fitune train /tmp/fitune-ranks-XXXX.yaml [--resume] [--allow-changed] [--overwrite] [--no-progress]
        rank r: `fitune train` on that config (torchrun's environment: it trains, joining the ranks in ranks.py)

The ranks get the config the parent resolved (the file, --set and flags applied), written as YAML, so every rank
trains exactly what the parent checked. torchrun (PyTorch's own launcher) runs DDP, FSDP2 and DeepSpeed alike:
deepspeed.initialize joins the process group torchrun's environment describes. One machine (--standalone).
Ctrl-C reaches every rank (one process group in the terminal): each finishes its step, they write the checkpoint
together, and the parent returns the ranks' exit code.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import tempfile
import uuid

from ..errors import ConfigError
from . import CPU_RANKS_ENV, ZERO_STRATEGIES
from .ranks import launched


def needs_launch(s) -> bool:
    """Whether `fitune train` runs this setup as torchrun ranks: several GPUs, or DeepSpeed (even on one GPU:
    zero3_offload puts parameters and optimizer state in CPU memory)."""
    return not launched() and (s.num_gpus > 1 or s.strategy in ZERO_STRATEGIES)


def visible_gpus() -> int:
    """CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applied)."""
    # torch, yaml: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def preflight(cfg, resume: bool = False) -> None:
    """Everything that would stop the ranks, checked once in the parent, so the user reads one message rather than
    N tracebacks.

    Raises:
        ConfigError (exit 2): more GPUs asked for than visible, DeepSpeed missing for a ZeRO strategy, or a method /
            technique the strategy does not run; each problem says what to do.
    """
    from .wrap import check_supported

    s = cfg.setup
    problems = []
    gpus = visible_gpus()
    cpu_ranks = os.environ.get(CPU_RANKS_ENV) == "1"
    if gpus == 0 and not cpu_ranks:
        problems.append(f"--gpus {s.num_gpus} (strategy {s.strategy}): no CUDA GPU is visible on this machine (0); "
                        f"run on a machine with {s.num_gpus} GPUs, or rehearse the run as {s.num_gpus} CPU processes "
                        f"(gloo, slow): {CPU_RANKS_ENV}=1 fitune train ...")
    elif gpus and s.num_gpus > gpus and not cpu_ranks:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        problems.append(f"--gpus {s.num_gpus}: this machine shows {gpus} CUDA GPU{'s' if gpus > 1 else ''}"
                        + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
                        + f"; give --gpus {gpus} or fewer")
    if s.strategy in ZERO_STRATEGIES and importlib.util.find_spec("deepspeed") is None:
        problems.append(f"strategy {s.strategy} runs on DeepSpeed, which is not installed: pip install deepspeed "
                        "(on the GPU machine; or use strategy fsdp, PyTorch's own sharding)")
    if resume and s.strategy in ZERO_STRATEGIES:
        problems.append(f"--resume with strategy {s.strategy}: ZeRO runs write no resumable checkpoint in fitune "
                        "(DeepSpeed's are pickles, which fitune does not load); use strategy fsdp for sharded runs "
                        "that resume")
    problems += check_supported(s, s.num_gpus, cfg.merge)
    if problems:
        raise ConfigError(problems)


def command(config_path: str, num_gpus: int, resume: bool, overwrite: bool, progress: bool,
            allow_changed: bool = False) -> list[str]:
    """The torchrun command line that runs the ranks (each rank checks the run's identity on --resume, so
    --allow-changed goes to every rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_gpus}",
           "-m", "fitune", "train", config_path]
    return cmd + (["--resume"] if resume else []) + (["--allow-changed"] if allow_changed else []) \
        + (["--overwrite"] if overwrite else []) + ([] if progress else ["--no-progress"])


def launch(cfg, resume: bool = False, overwrite: bool = False, progress: bool = True,
           allow_changed: bool = False) -> int:
    """Run `cfg` as `cfg.setup.num_gpus` ranks with torchrun's launcher (in this process, as `command` would in a
    subprocess); returns 0, or the exit code of the first rank that failed (2: a config / checkpoint error,
    130: interrupted, after its checkpoint)."""
    import yaml
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    preflight(cfg, resume)
    fd, path = tempfile.mkstemp(prefix="fitune-ranks-", suffix=".yaml")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    n = cfg.setup.num_gpus
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))  # the ranks share the cores
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # the ranks' own messages say it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          signals_to_handle="SIGTERM,SIGHUP,SIGQUIT")  # Ctrl-C goes to the ranks (_GracefulStop)
    args = command(path, n, resume, overwrite, progress, allow_changed)[5:]  # ["-m", "fitune", "train", path, flags...]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # this process waits for the ranks' exit
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
        return 0
    except ChildFailedError as exc:
        first = min(exc.failures.values(), key=lambda failure: failure.timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    finally:
        signal.signal(signal.SIGINT, old)
        os.unlink(path)
