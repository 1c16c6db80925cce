"""Resumable checkpoints without pickle, written atomically: into `step-000010.tmp/`, then renamed to `step-000010/`.

    checkpoints/step-000010/
        trainable.safetensors      the trainable weights
        optimizer-00001.safetensors  the optimizer's state tensors (Adam moments, step counts), in <= 2 GiB shards
        optimizer.json             the rest of its state (param groups: lr, betas, ...) and where each tensor is
        scheduler.json             the LR schedule's state (plain numbers: no tensor, so no shard)
        rng-00001.safetensors      torch's CPU (and CUDA) generator states
        rng.json                   Python's and NumPy's generator states (integers)
        trainer_state.json         format, run id, step, data position, the OOM guard's re-plans, the config in effect
        manifest.json              written last: every other file's size and SHA-256 (`verify` checks them on resume)

A checkpoint holds what an uninterrupted run would still have in memory, so `--resume` reproduces its losses.
Nothing is unpickled on load (`torch.load` can run code hidden in a crafted file): tensors come from safetensors,
everything else from JSON, and files a checkpoint should not have (an `optimizer.pt`) are never read. The files and
the folder are fsync-ed before the rename, which is atomic on one filesystem: a folder without `.tmp` is complete,
and the previous complete checkpoint is never touched before the new one is in place.

Which config changes `--resume` applies and which it refuses: `RESUME_APPLIES`, `check_config_changes` (an
`optimizer` change: the registry's `state_format`, fitune/specs/optimizers.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import stat

from ..errors import ConfigError, FituneError
from ..parallel.checkpoint import is_sharded, load_sharded
from ..runtime import optim
from ..specs import optimizers as optimizer_specs
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
        if not STEP_NAME.fullmatch(name) or os.path.islink(path):  # not .tmp, .damaged, .run-<id> set aside
            continue
        state = _read_json(os.path.join(path, "trainer_state.json"))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
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
    """trainer_state.json of a checkpoint, refused when it is not this format or a key is missing or of a wrong
    type (a crafted file stops with its name and the key, never a traceback later)."""
    file = os.path.join(path, "trainer_state.json")
    state = _read_json(file)
    if state is None:
        raise CheckpointError(f"{file} is missing, not a regular file, or not JSON; resume from another checkpoint "
                              "(delete this folder) or start a new run with --overwrite")
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not an object; resume from another "
                              "checkpoint (delete this folder) or start a new run with --overwrite")
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in format {state.get('format', 1)!r} (fitune reads format {FORMAT}: safetensors + "
            "JSON); older checkpoints were pickles, which fitune no longer loads because a crafted one runs code: "
            "finish that run with the fitune that wrote it, or start a new run with --overwrite")
    problem = _state_problem(state)
    if problem:
        raise CheckpointError(f"{file}: {problem}; resume from another checkpoint (delete this folder) or start a "
                              "new run with --overwrite")
    return state


MAX_STEP = 2**53
"""Largest step a checkpoint may name (beyond it a crafted number, not a run's step)."""


def _state_problem(state: dict) -> str | None:
    """What is wrong with a trainer_state.json's keys, naming the key; None when every key resume reads is sound."""
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return f"key 'step' is {_show_short(step)}, not a step number (0 to {MAX_STEP})"
    if not isinstance(state.get("run_id"), str):
        return f"key 'run_id' is {_show_short(state.get('run_id'))}, not a run id"
    if not isinstance(state.get("data"), dict):
        return f"key 'data' is {_show_short(state.get('data'))}, not the data position (an object)"
    if not isinstance(state.get("config", {}), dict):
        return f"key 'config' is {_show_short(state.get('config'))}, not an object"
    changes = state.get("plan_changes", [])
    if not isinstance(changes, list):
        return f"key 'plan_changes' is {_show_short(changes)}, not a list"
    for i, change in enumerate(changes):
        size = change.get("micro_batch_size") if isinstance(change, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 2**31 or \
                not isinstance(change.get("grad_checkpointing"), bool):
            return (f"key 'plan_changes[{i}]' is {_show_short(change)}, not "
                    "{micro_batch_size: N, grad_checkpointing: B}")
    return None


def _show_short(value) -> str:
    text = "missing" if value is None else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- verify: a manifest of every file, checked before a resume trusts a checkpoint --------------------------

MANIFEST = "manifest.json"
STEP_NAME = re.compile(r"step-(\d{6,})")


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(_open_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_of(folder: str) -> dict:
    """{relative path: {size_bytes, sha256}} of every file under `folder` (FSDP2's shard subfolders included)."""
    files = {}
    for dirpath, _, filenames in os.walk(folder):
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, folder)
            if rel != MANIFEST:
                files[rel] = {"size_bytes": os.lstat(full).st_size, "sha256": _sha256_of(full)}
    return {"files": files}


def reseal(path: str) -> None:
    """Rewrite the manifest of a checkpoint edited on purpose (a benchmark that changes its `plan_changes`): after
    this, `verify` vouches for the edited files. Never called by a run."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.lexists(manifest):
        os.unlink(manifest)
    _write_json(manifest, _manifest_of(path))


def verify(path: str, contents: bool = True) -> str | None:
    """Why the checkpoint folder `path` cannot be trusted ("FILE: reason"), or None when it can.

    Every entry must be a regular file or folder (no link, FIFO or device, whatever it points to), and every file
    the manifest lists must have its size and SHA-256. A checkpoint without a manifest (an earlier fitune's) is
    accepted after the link check, with a note: its contents cannot be checked. `contents=False` checks links and
    sizes only (no file is read but the manifest)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                return f"{os.path.relpath(os.path.join(dirpath, name), path)}: {kind}"
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        log.warning("checkpoint %s has no %s (written by an earlier fitune): its files are not verified", path,
                    MANIFEST)
        return None
    manifest = _read_json(os.path.join(path, MANIFEST))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST}: not a manifest"
    for rel, want in sorted(files.items()):
        problem = _file_problem(path, rel, want, contents)
        if problem:
            return f"{rel}: {problem}"
    return None


def _file_problem(path: str, rel: str, want, contents: bool = True) -> str | None:
    if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/") or not isinstance(want, dict):
        return "a manifest entry that is not a file of this folder"
    full = os.path.join(path, rel)
    try:
        size = os.lstat(full).st_size
        if size != want.get("size_bytes"):
            return f"{size} bytes, the manifest says {want.get('size_bytes')}"
        if contents and _sha256_of(full) != want.get("sha256"):
            return "its SHA-256 differs from the manifest's (the contents changed)"
    except FileNotFoundError:
        return "missing"
    except (OSError, CheckpointError) as exc:
        return str(exc)
    return None


def newest_verified(root: str, run_id: str) -> tuple[str | None, dict, list[str]]:
    """The newest checkpoint of run `run_id` that verifies, its trainer_state.json, and one sentence per newer
    checkpoint passed over ("checkpoint step-N is damaged (FILE: reason)"); (None, {}, []) when the run has none.

    Raises:
        CheckpointError: none verifies; the message lists each one and why.
    """
    folder = os.path.join(root, CHECKPOINTS)
    names = [n for n in (os.listdir(folder) if os.path.isdir(folder) and not os.path.islink(folder) else [])
             if STEP_NAME.fullmatch(n)]
    skipped = []
    for name in sorted(names, key=lambda n: int(n[5:]), reverse=True):
        path = os.path.join(folder, name)
        peek = _read_json(os.path.join(path, "trainer_state.json"))
        if isinstance(peek, dict) and peek.get("format") != FORMAT and peek.get("run_id") in (run_id, None):
            read_state(path)  # another format (an earlier fitune's pickles): refused by name, never passed over
        problem = verify(path)
        state = None
        if problem is None:
            try:
                state = read_state(path)
            except CheckpointError as exc:
                problem = str(exc)
        if state is not None and state["run_id"] != run_id:
            continue  # another run's checkpoint: not this run's to resume (and never deleted)
        if problem is None:
            return path, state, skipped
        skipped.append(f"checkpoint {name} is damaged ({problem})")
    if not skipped:
        return None, {}, []
    raise CheckpointError(f"--resume: no checkpoint of run {run_id} in {root} can be trusted: {'; '.join(skipped)}; "
                          "start a new run with --overwrite")


# ---- save ------------------------------------------------------------------------------------------------


def save(folder: RunFolder, step: int, model, optimizer, scheduler, stream_state: dict, extra: dict,
         keep: int = 2, sharded_writer=None) -> str:
    """Write this run's checkpoint for `step` atomically, then delete this run's older ones beyond `keep`.

    A complete checkpoint of this run for `step` already there (the end-of-run or Ctrl-C save right after a
    periodic one) is kept as it is: the state is the same, and replacing it would open a moment with none.
    """
    # safetensors, torch, numpy: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    from safetensors.torch import save_file

    parent = folder.real_dir(CHECKPOINTS)
    final = folder.inside(CHECKPOINTS, f"step-{step:06d}")
    if os.path.isdir(final):
        state = _read_json(os.path.join(final, "trainer_state.json"))
        state = state if isinstance(state, dict) else {}
        damaged = verify(final, contents=False)  # sizes and links only: a full re-hash here would cost a read
        if state.get("run_id") == folder.run_id and state.get("step") == step and damaged is None:
            return final
        tag = "damaged" if state.get("run_id") == folder.run_id else f"run-{state.get('run_id', 'unknown')}"
        aside = folder.inside(CHECKPOINTS, f"step-{step:06d}.{tag}")
        if tag == "damaged":
            folder.remove_tree(aside)  # this run's own damaged copy of a step it has just trained again
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
        _write_json(os.path.join(tmp, MANIFEST), _manifest_of(tmp))  # last: it vouches for everything above

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
    optim.page_loaded_state(optimizer)  # a paged optimizer's state goes back outside the allocator, as before
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
    "packing_attention", "oom_guard", "cap", "compile", "offload_embeddings",
})
"""Config keys a resumed run takes from the new config (and says so). Every other key (model, method, lora.*,
dtype, data.path, data.format, batch_size, grad_accum, seq_len, schedule, warmup_steps, seed, optimizer, packing,
init, tokenizer, ...) shapes the trained state or the data order, so a change is refused by name; a key fitune
does not know yet is refused too. One exception, decided by the optimizer registry: `optimizer` changed to one that
keeps the same state (`OptimizerSpec.state_format`: adamw8bit <-> paged_adamw8bit) is applied
(`optimizer_change`)."""


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
        changed = f"--resume: {key} changed from {_show(before)} to {_show(after)} since the checkpoint; "
        verdict, why = optimizer_change(before, after) if key == "optimizer" else ("", "")
        if verdict == "same":  # two names of one optimizer (an alias): no change
            continue
        if verdict == "applied":
            applied.append(f"{changed}applied: both keep the same optimizer state ({why})")
        elif key in RESUME_APPLIES:
            applied.append(f"{changed}applied")
        else:
            refused.append(f"{changed}{why + '; ' if why else ''}a resumed run keeps the saved value: start a new run "
                           f"with --overwrite, or restore {key}: {_show(before)}")
    if refused:
        raise ConfigError(refused)
    return applied


def optimizer_change(before, after) -> tuple[str, str]:
    """`--resume`'s verdict on `optimizer` changed from `before` (the checkpoint's) to `after`, read from the registry
    (fitune/specs/optimizers.py `state_format`): ("same", "") for two names of one optimizer (an alias: no change),
    ("applied", the state format) for two optimizers that load each other's saved state, ("refused", why) for any
    other pair, a name the registry does not know included."""
    names = [optimizer_specs.canonical_name(v) if isinstance(v, str) else None for v in (before, after)]
    unknown = [_show(v) for v, n in zip((before, after), names) if n is None]
    if unknown:
        are = "is" if len(unknown) == 1 else "are"
        return "refused", f"{' and '.join(unknown)} {are} not an optimizer fitune knows"
    if names[0] == names[1]:
        return "same", ""
    was, now = (optimizer_specs.get(n) for n in names)
    if was.state_format == now.state_format:
        return "applied", was.state_format
    return "refused", (f"the saved optimizer state is {was.name}'s ({was.state_format}), which {now.name} "
                       f"({now.state_format}) cannot load")


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


MAX_JSON_BYTES = 1 << 30
"""Largest checkpoint JSON read (optimizer.json of a large full fine-tune is tens of MiB): a bound, not a size."""


def _open_regular(path: str, max_bytes: int | None = None) -> int:
    """A read-only fd of `path`, refused (CheckpointError) unless it is a regular file (no link, FIFO or device: a
    FIFO would block the read and /dev/zero never end it) of at most `max_bytes`."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CheckpointError(f"{path} is not a regular file (a link, FIFO or device); fitune reads only regular "
                                  "files in a checkpoint")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (max_bytes is not None and st.st_size > max_bytes):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file of at most {max_bytes} bytes")
    return fd


def _read_json(path: str):
    """The JSON in `path`, or None when it is missing, not a regular file, too large, or not JSON."""
    try:
        with open(_open_regular(path, MAX_JSON_BYTES), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, CheckpointError, RecursionError):
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
