"""Resumable checkpoints, written atomically: into `step-000010.tmp/`, then renamed to `step-000010/`.

A checkpoint holds what an uninterrupted run would still have in memory: the trainable weights
(safetensors), the optimizer and scheduler states, every RNG state, the data stream's position and the step,
plus the re-plans the OOM guard made. A folder without `.tmp` is complete by construction (rename is atomic on
one filesystem), so `latest()` never returns a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil

CHECKPOINTS = "checkpoints"


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, CHECKPOINTS, f"step-{step:06d}")


def latest(output_dir: str) -> str | None:
    """The newest complete checkpoint folder, or None."""
    root = os.path.join(output_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp")
                  and os.path.isfile(os.path.join(root, d, "trainer_state.json")))
    return os.path.join(root, done[-1]) if done else None


def save(output_dir: str, step: int, model, optimizer, scheduler, stream_state: dict, extra: dict, keep: int = 2) -> str:
    """Write a checkpoint for `step` atomically; keep the `keep` newest."""
    import torch
    from safetensors.torch import save_file

    final = checkpoint_dir(output_dir, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    trainable = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, os.path.join(tmp, "trainable.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    torch.save(rng, os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": step, "data": stream_state, **extra}, f, indent=2)
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic: the folder is complete or absent
    root = os.path.join(output_dir, CHECKPOINTS)
    olds = sorted(d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))
    for d in olds[:-keep]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return final


def load(path: str, model, optimizer, scheduler) -> dict:
    """Restore a checkpoint into `model` / `optimizer` / `scheduler` and the RNGs; returns trainer_state.json."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        from ..errors import ConfigError

        raise ConfigError(f"checkpoint {path} does not match this model/config (unknown parameters: {missing[:3]}...); "
                          "resume with the config the run started with")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=False))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
