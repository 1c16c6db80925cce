"""Resumable checkpoints without pickle, written atomically: into `step-000010.tmp/`, then renamed to `step-000010/`.

    checkpoints/step-000010/
        trainable.safetensors      the trainable weights
        optimizer-00001.safetensors  the optimizer's state tensors (Adam moments, step counts), in <= 2 GiB shards
        optimizer.json             the rest of its state (param groups: lr, betas, ...) and where each tensor is
        scheduler.json             the LR schedule's state (plain numbers: no tensor, so no shard)
        rng-00001.safetensors      torch's CPU (and CUDA) generator states
        rng.json                   Python's and NumPy's generator states (integers)
        trainer_state.json         format, run id, step, data position, the OOM guard's re-plans, the config in effect

A checkpoint holds what an uninterrupted run would still have in memory, so `--resume` reproduces its losses.
Nothing is unpickled on load (`torch.load` can run code hidden in a crafted file): tensors come from safetensors,
everything else from JSON, and files a checkpoint should not have (an `optimizer.pt`) are never read. The files and
the folder are fsync-ed before the rename, which is atomic on one filesystem: a folder without `.tmp` is complete,
and the previous complete checkpoint is never touched before the new one is in place.

Which config changes `--resume` applies and which it refuses: `RESUME_APPLIES`, `check_config_changes`.
"""

from __future__ import annotations

import json
import logging
import os
import random

from ..errors import ConfigError, FituneError
from ..units import GiB
from .outdir import METRICS_FILE, RunFolder, fsync_dir, fsync_tree, write_failed_message

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FORMAT = 2
"""trainer_state.json `format`: 2 = safetensors + JSON (fitune's first format, 1, was pickle and is not loaded)."""
SHARD_BYTES = 2 * GiB
"""Largest optimizer shard: safetensors builds a whole file in host memory, so a full fine-tune's moments are
written a shard at a time rather than all at once."""


class CheckpointError(FituneError):
    """A checkpoint that cannot be written or loaded; the message says which file and what to do."""


# ---- where checkpoints are ---------------------------------------------------------------------------------


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, CHECKPOINTS, f"step-{step:06d}")


def list_checkpoints(root: str, run_id: str | None = None) -> list[tuple[int, str]]:
    """(step, folder) of the complete checkpoints under `root` (of run `run_id` only, when given), oldest first."""
    folder = os.path.join(root, CHECKPOINTS)
    if not os.path.isdir(folder) or os.path.islink(folder):
        return []
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.startswith("step-") or name.endswith(".tmp") or os.path.islink(path):
            continue
        state = _read_json(os.path.join(path, "trainer_state.json"))
        if state is None or not isinstance(state.get("step"), int):
            continue
        if run_id is not None and state.get("run_id") != run_id:
            continue
        found.append((state["step"], path))
    return sorted(found)


def latest(root: str, run_id: str | None = None) -> str | None:
    """The newest complete checkpoint folder (of run `run_id`, when given), or None."""
    found = list_checkpoints(root, run_id)
    return found[-1][1] if found else None


def read_state(path: str) -> dict:
    """trainer_state.json of a checkpoint, refused when it is not this format."""
    state = _read_json(os.path.join(path, "trainer_state.json"))
    if state is None:
        raise CheckpointError(f"{path}/trainer_state.json is missing or not JSON; resume from another checkpoint "
                              "(delete this folder) or start a new run with --overwrite")
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in format {state.get('format', 1)!r} (fitune reads format {FORMAT}: safetensors + "
            "JSON); older checkpoints were pickles, which fitune no longer loads because a crafted one runs code: "
            "finish that run with the fitune that wrote it, or start a new run with --overwrite")
    return state


# ---- save ------------------------------------------------------------------------------------------------


def save(folder: RunFolder, step: int, model, optimizer, scheduler, stream_state: dict, extra: dict,
         keep: int = 2, sharded_writer=None) -> str:
    """Write this run's checkpoint for `step` atomically, then delete this run's older ones beyond `keep`.

    A complete checkpoint of this run for `step` already there (the end-of-run or Ctrl-C save right after a
    periodic one) is kept as it is: the state is the same, and replacing it would open a moment with none.
    """
    from safetensors.torch import save_file

    parent = folder.real_dir(CHECKPOINTS)
    final = folder.inside(CHECKPOINTS, f"step-{step:06d}")
    if os.path.isdir(final):
        state = _read_json(os.path.join(final, "trainer_state.json")) or {}
        if state.get("run_id") == folder.run_id and state.get("step") == step:
            return final
        aside = folder.inside(CHECKPOINTS, f"step-{step:06d}.run-{state.get('run_id', 'unknown')}")
        os.replace(final, aside)  # another run's folder: moved out of the way, never deleted
        log.warning("moved %s (of run %s) to %s", final, state.get("run_id"), aside)
    tmp = folder.fresh_dir(CHECKPOINTS, f"step-{step:06d}")
    try:
        if sharded_writer is not None:  # FSDP2: every rank writes its shards of weights and optimizer (fitune/parallel)
            sharded_writer(tmp)
        else:
            trainable = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
            save_file(trainable, os.path.join(tmp, "trainable.safetensors"))
            _write_tree(tmp, "optimizer", optimizer.state_dict())
        _write_tree(tmp, "scheduler", scheduler.state_dict())
        _write_tree(tmp, "rng", _rng_state())
        _write_json(os.path.join(tmp, "trainer_state.json"),
                    {"format": FORMAT, "run_id": folder.run_id, "step": step, "data": stream_state, **extra})

        _before_publish(tmp)
        fsync_tree(tmp)  # the contents are on disk before the name says "complete"
    except Exception as exc:  # a full disk, mostly (safetensors reports it as its own error, not OSError)
        _discard(folder, tmp)  # its space back; the previous checkpoints were never touched
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(write_failed_message(final, exc, latest(folder.root, folder.run_id))) from None
    os.replace(tmp, final)
    fsync_dir(parent)
    prune(folder, keep)
    return final


def prune(folder: RunFolder, keep: int) -> list[str]:
    """Delete this run's checkpoints but the `keep` newest (at least 1); other runs' checkpoints are never touched."""
    own = list_checkpoints(folder.root, folder.run_id)
    doomed = [path for _, path in own[: -max(1, keep)]]
    for path in doomed:
        dying = folder.inside(CHECKPOINTS, os.path.basename(path) + ".tmp")
        folder.remove_tree(dying)
        os.replace(folder.inside(CHECKPOINTS, os.path.basename(path)), dying)  # a delete cut short leaves a .tmp
        folder.remove_tree(dying)
    return doomed


def remove_partial(folder: RunFolder) -> None:
    """Delete `.tmp` folders (and metrics.jsonl.tmp): writes cut short by a crash or a third Ctrl-C (the lock says
    nobody writes now)."""
    stray = os.path.join(folder.root, METRICS_FILE + ".tmp")  # a rewrite of metrics.jsonl cut short
    if os.path.lexists(stray):
        os.unlink(stray)  # a link itself, never its target
    parent = os.path.join(folder.root, CHECKPOINTS)
    if not os.path.isdir(parent):
        return
    for name in sorted(os.listdir(parent)):
        if name.endswith(".tmp"):
            log.info("removing %s/%s: an unfinished checkpoint write", parent, name)
            folder.remove_tree(folder.inside(CHECKPOINTS, name))


def _discard(folder: RunFolder, tmp: str) -> None:
    try:
        folder.remove_tree(tmp)
    except OSError:  # pragma: no cover - left as a .tmp folder, which the next start removes
        log.warning("could not remove %s; the next start removes it", tmp)


def _before_publish(tmp: str) -> None:
    """Called when the `.tmp` folder is written, just before it is renamed (tests inject signals here)."""


# ---- load ------------------------------------------------------------------------------------------------


def load(path: str, model, optimizer, scheduler) -> dict:
    """Restore a checkpoint into `model` / `optimizer` / `scheduler` and the RNGs; returns trainer_state.json.

    Raises:
        CheckpointError: not this format, a file missing or damaged, or weights of another model / LoRA config.
    """
    import torch

    state = read_state(path)
    foreign = sorted(f for f in os.listdir(path) if f.endswith((".pt", ".pth", ".pkl", ".pickle", ".bin")))
    if foreign:  # fitune never writes these; whoever did, they stay unread
        log.warning("checkpoint %s: ignoring %s (fitune's checkpoints hold no pickle; these files are not read)",
                    path, ", ".join(foreign))
    from ..parallel.checkpoint import is_sharded, load_sharded

    if is_sharded(path):  # written by an FSDP2 run, on any number of GPUs: DCP reshards for this one
        try:
            load_sharded(path, model, optimizer)
            scheduler.load_state_dict(_read_tree(path, "scheduler"))
        except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run ({exc}); resume with the config the run "
                                  "started with, or start a new run with --overwrite") from None
        _set_rng_state(_read_tree(path, "rng"), path)
        return state
    weights = _load_safetensors(os.path.join(path, "trainable.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    unknown = sorted(set(weights) - set(params))
    missing = sorted(set(params) - set(weights))
    reshaped = sorted(n for n in set(weights) & set(params) if weights[n].shape != params[n].shape)
    if unknown or missing or reshaped:
        what = "; ".join(f"{label}: {names[:3]}{'...' if len(names) > 3 else ''}" for label, names in
                         (("not in this model", unknown), ("not in the checkpoint", missing),
                          ("other shapes", reshaped)) if names)
        raise CheckpointError(f"checkpoint {path} does not match this model and config ({what}); resume with the "
                              "config the run started with, or start a new run with --overwrite")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    try:
        optimizer.load_state_dict(_read_tree(path, "optimizer"))
        scheduler.load_state_dict(_read_tree(path, "scheduler"))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {path}: the optimizer / schedule state does not fit this run ({exc}); "
                              "resume with the config the run started with") from None
    _set_rng_state(_read_tree(path, "rng"), path)
    return state


# ---- resume: which config changes can apply ----------------------------------------------------------------

RESUME_APPLIES = frozenset({
    # how long and how often: the trained state does not depend on them
    "max_steps", "epochs", "eval_every", "save_every", "save_every_minutes", "keep_checkpoints", "log_every",
    # the next steps' hyperparameters: applied to the optimizer and the schedule from the resumed step on
    "lr", "weight_decay", "max_grad_norm",
    # the number of GPUs: the global batch (batch_size x gpus) changes from the resumed step on; sharded checkpoints
    # reshard (fitune/parallel/checkpoint.py)
    "gpus",
    # outputs, logging and where the run lives
    "merge", "report_to", "output_dir", "data.eval_path",
    # how a step is executed, not what it computes (the OOM guard changes these itself): memory only
    "grad_checkpointing", "attn", "loss", "tiled_mlp", "lean_lora", "lean_norm", "kernels", "expandable_segments",
    "packing_attention", "oom_guard", "cap",
})
"""Config keys a resumed run takes from the new config (and says so). Every other key (model, method, lora.*,
dtype, data.path, data.format, batch_size, grad_accum, seq_len, schedule, warmup_steps, seed, optimizer, packing,
init, tokenizer, ...) shapes the trained state or the data order, so a change is refused by name; a key fitune
does not know yet is refused too."""


def flat_config(config: dict) -> dict:
    """A config's YAML form (TrainConfig.to_dict()) as `{dotted YAML key: JSON value}`: `lora.rank`, `data.path`."""
    return _flatten(json.loads(json.dumps(config)))


def check_config_changes(saved: dict, now: dict) -> list[str]:
    """Compare the checkpoint's flat config with the new one: returns the applied changes as sentences.

    Raises:
        ConfigError: one problem per refused key, each naming the key, both values and the two ways out.
    """
    applied, refused = [], []
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key), now.get(key)
        if before == after:
            continue
        if key in RESUME_APPLIES:
            applied.append(f"--resume: {key} changed from {_show(before)} to {_show(after)} since the checkpoint; "
                           "applied")
        else:
            refused.append(f"--resume: {key} changed from {_show(before)} to {_show(after)} since the checkpoint; a "
                           f"resumed run keeps the saved value: start a new run with --overwrite, or restore "
                           f"{key}: {_show(before)}")
    if refused:
        raise ConfigError(refused)
    return applied


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _show(value) -> str:
    return "(unset)" if value is None else json.dumps(value)


# ---- state trees: tensors to safetensors, the rest to JSON ---------------------------------------------------


def _encode(obj, tensors: dict, key: str):
    """A JSON-able copy of `obj`; tensors are replaced by {"__tensor__": name} and collected in `tensors`."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().contiguous()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{key}.{k}") for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, f"{key}.k{i}"), _encode(v, tensors, f"{key}.{k}")]
                              for i, (k, v) in enumerate(obj.items())]}
    raise CheckpointError(f"cannot store {key} (a {type(obj).__name__}) without pickle; this optimizer or schedule "
                          "keeps state fitune's checkpoints do not support: use optimizer adamw")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _write_tree(folder: str, name: str, tree) -> None:
    """`name.json` plus `name-0000N.safetensors` shards of at most SHARD_BYTES (host memory holds one at a time;
    none when the state has no tensor, like a schedule's)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    doc = _encode(tree, tensors, name)
    shards: list[dict] = [{}]
    shard_bytes = 0
    where = {}
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + size > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = t
        shard_bytes += size
        where[key] = f"{name}-{len(shards):05d}.safetensors"
    for i, shard in enumerate(s for s in shards if s):
        save_file({k: v.cpu() for k, v in shard.items()}, os.path.join(folder, f"{name}-{i + 1:05d}.safetensors"))
    _write_json(os.path.join(folder, f"{name}.json"), {"tree": doc, "tensors": where})


def _read_tree(path: str, name: str):
    doc = _read_json_required(path, f"{name}.json")
    tensors = {}
    try:
        for file in sorted(set(doc["tensors"].values())):
            if os.path.basename(file) != file or not file.startswith(f"{name}-") or not file.endswith(".safetensors"):
                raise CheckpointError(f"{path}/{name}.json names {file!r}, not a shard of this checkpoint")
            tensors.update(_load_safetensors(os.path.join(path, file)))
        return _decode(doc["tree"], tensors)
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}/{name}.json is damaged ({exc!r} missing); resume from another checkpoint "
                              "(delete this folder) or start a new run with --overwrite") from None


# ---- RNG ------------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    import torch

    version, internal, gauss = random.getstate()
    rng = {"python": {"version": version, "state": list(internal), "gauss_next": gauss},
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    return rng


def _set_rng_state(rng: dict, path: str) -> None:
    import torch

    try:
        py = rng["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            import numpy as np

            s = rng["numpy"]
            np.random.set_state((s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"],
                                 s["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}/rng.json: the random generator states are damaged ({exc!r}); resume from "
                              "another checkpoint (delete this folder) or start a new run with --overwrite") from None


# ---- files ----------------------------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    with open(path, "x", encoding="utf-8") as f:  # "x": the .tmp folder is fresh, so nothing (no link) is there
        json.dump(obj, f, indent=1)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_json_required(path: str, name: str):
    doc = _read_json(os.path.join(path, name))
    if doc is None:
        raise CheckpointError(f"{path}/{name} is missing or not JSON; resume from another checkpoint (delete this "
                              "folder) or start a new run with --overwrite")
    return doc


def _load_safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError besides OSError
        raise CheckpointError(f"{path} is missing or damaged ({exc}); resume from another checkpoint (delete this "
                              "folder) or start a new run with --overwrite") from None
