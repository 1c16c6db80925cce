"""Load what `fitune train` wrote (or any Hugging Face model / PEFT adapter folder) for inference.

    describe_folder(path)   what the folder holds and what would be loaded: pure Python, no torch (RunInfo)
    load_run(path)          (model, tokenizer, RunInfo): the base model through fitune's one builder
                            (`fitune.runtime.model.build_model`, which takes a folder, a Hub id or a .gguf file)
                            plus the adapter, or the merged / full weights; in eval mode

The folders understood:
    a run folder (output_dir of `fitune train`: run.json)  adapter/ (LoRA, QLoRA), merged/ (merge: true) or
                                                            model/ (full, freeze); checkpoints/step-N/ with
                                                            `checkpoint=`
    a PEFT adapter folder (adapter_config.json)             its base_model_name_or_path plus the adapter
    a model folder (config.json and weights), a .gguf file  the model itself
A run's adapter/, merged/ or model/ given directly is read with the run's settings (dtype, seq_len, data format)
from the run.json beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field

from ..errors import FituneError
from ..files import check_regular, open_regular
from ..train.checkpoint import latest, read_state

RUN_FILE = "run.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32"}
"""Accepted dtype spellings -> fitune's names."""


class RunLoadError(FituneError):
    """A folder that cannot be loaded for inference: not a run / model / adapter folder, no weights written yet, the
    base model missing. The message says what the folder holds and what to do."""


@dataclass(frozen=True)
class RunInfo:
    """What `describe_folder` found and `load_run` loads."""

    path: str
    """The folder (or .gguf file) given."""
    kind: str
    """run | adapter | model: a fitune run folder, a PEFT adapter folder, a model folder / .gguf file."""
    weights: str
    """adapter | merged | model | checkpoint: which weights are loaded."""
    weights_dir: str
    """Where they are (the adapter folder, the merged / model folder, the checkpoint folder)."""
    base_model: str | None
    """The base model under an adapter or a checkpoint (a folder, Hub id or .gguf); None for full weights."""
    tokenizer_dir: str
    """Where the tokenizer is loaded from."""
    method: str
    """lora | qlora | full | freeze (the run's), or "none" for a plain model folder."""
    dtype: str
    """bf16 | fp16 | fp32: the weights' dtype when loaded (the run's dtype unless asked otherwise)."""
    seq_len_tokens: int | None = None
    """The run's seq_len (tokens), None outside a run."""
    data_format: str | None = None
    """The run's data.format (chat | completion | text), None when it was detected or outside a run."""
    trust_remote_code: bool = False
    config: dict = field(default_factory=dict)
    """The run's saved config (run.json `config`: TrainConfig.to_dict()); {} outside a run."""
    notes: tuple[str, ...] = ()
    """Things the user should know about what was loaded (a QLoRA base loaded without NF4, ...)."""

    def describe(self) -> str:
        """One line: what is loaded, from where."""
        if self.weights == "adapter":
            return f"{self.weights_dir} ({self.method} adapter) over {self.base_model}, {self.dtype}"
        if self.weights == "checkpoint":
            return f"checkpoint {self.weights_dir} ({self.method}) over {self.base_model}, {self.dtype}"
        return f"{self.weights_dir} ({self.weights} weights), {self.dtype}"


# ---- what a folder holds (no torch) ------------------------------------------------------------------------


def describe_folder(path: str, *, merged: bool | None = None, checkpoint: str | None = None) -> RunInfo:
    """What `path` holds and which weights `load_run` would load.

    Args:
        merged: None: a run's adapter when it has one, else its merged/ or model/ weights; True: merged/ (or a
            full run's model/) only; False: the adapter only.
        checkpoint: a run's checkpoints/step-N folder: the base plus that checkpoint's trainable weights (a run
            that has not finished yet).
    Raises:
        RunLoadError: not a run / model / adapter folder (says what it holds), the asked-for weights are not
            there (names the newest checkpoint and how to load it), the base model is missing.
    """
    if not path or not os.path.exists(path):
        raise RunLoadError(f"{path!r} does not exist; give the output_dir of a `fitune train` run, a model folder or "
                           "a PEFT adapter folder")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            _no_choice(path, merged, checkpoint, "a .gguf file")
            return RunInfo(path=path, kind="model", weights="model", weights_dir=path, base_model=None,
                           tokenizer_dir=path, method="none", dtype="fp32")
        raise RunLoadError(f"{path} is a file, not a run folder; give the output_dir of a `fitune train` run (it holds "
                           "run.json), a model folder (config.json) or a PEFT adapter folder (adapter_config.json)")
    if os.path.isfile(os.path.join(path, RUN_FILE)):
        return _describe_run(path, merged, checkpoint)
    if checkpoint is not None:
        raise RunLoadError(f"--checkpoint {checkpoint}: {path} is not a run folder (no {RUN_FILE}); give the run's "
                           "output_dir with --checkpoint")
    run = _parent_run_config(path)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if merged:
            raise RunLoadError(f"--merged: {path} is a PEFT adapter folder, not merged weights; leave out --merged, "
                               f"or write merged weights with `fitune merge {path} --out DIR`")
        return _describe_adapter(path, run)
    if os.path.isfile(os.path.join(path, "config.json")) and _has_weights(path):
        if merged is False:
            raise RunLoadError(f"--adapter: {path} is a model folder (config.json and weights), not an adapter; leave "
                               "out --adapter")
        return _with_run_settings(RunInfo(path=path, kind="model", weights="model", weights_dir=path, base_model=None,
                                          tokenizer_dir=path, method="none", dtype=_config_dtype(path)), run)
    raise RunLoadError(_not_a_run_message(path))


def _describe_run(root: str, merged: bool | None, checkpoint: str | None) -> RunInfo:
    config = _read_run_config(root)
    method = str(config.get("method") or "lora")
    adapter, merged_dir, model_dir = (os.path.join(root, n) for n in ("adapter", "merged", "model"))
    base = str(config.get("model") or "")
    common = dict(path=root, kind="run", method=method, dtype=_run_dtype(config),
                  seq_len_tokens=config.get("seq_len") if isinstance(config.get("seq_len"), int) else None,
                  data_format=_data_format(config), trust_remote_code=config.get("trust_remote_code") is True,
                  config=config)
    tokenizer = str(config.get("tokenizer") or base)
    if checkpoint is not None:
        return _describe_checkpoint(root, checkpoint, config, common, base, tokenizer)
    lora = method in ("lora", "qlora")
    if lora and merged is not True and os.path.isdir(adapter):
        _check_base(base, f"{root}/{RUN_FILE} (model:)", config)
        return RunInfo(weights="adapter", weights_dir=adapter, base_model=base,
                       tokenizer_dir=adapter if _has_tokenizer(adapter) else tokenizer, **common)
    if merged is False:
        if not lora:
            raise RunLoadError(f"--adapter: run {root} trained with method {method}, which writes the whole model "
                               "(model/), not an adapter; leave out --adapter")
        raise RunLoadError(_no_weights_message(root, config, "adapter/"))
    full = merged_dir if lora else model_dir
    if os.path.isdir(full):
        return RunInfo(weights="merged" if lora else "model", weights_dir=full, base_model=None,
                       tokenizer_dir=full if _has_tokenizer(full) else tokenizer, **common)
    if merged and lora and os.path.isdir(adapter):
        raise RunLoadError(f"--merged: run {root} has no merged/ (a run writes it with `merge: true`); write it with "
                           f"`fitune merge {root} --out DIR` and load DIR, or load the adapter (leave out --merged)")
    raise RunLoadError(_no_weights_message(root, config, "adapter/" if lora else "model/"))


def _describe_checkpoint(root: str, checkpoint: str, config: dict, common: dict, base: str,
                         tokenizer: str) -> RunInfo:
    if not os.path.isdir(checkpoint):
        guess = os.path.join(root, "checkpoints", checkpoint)  # `--checkpoint step-000010`
        if not os.path.isdir(guess):
            raise RunLoadError(f"--checkpoint {checkpoint}: no such folder (nor {guess}); the run's checkpoints: "
                               f"{', '.join(_checkpoint_names(root)) or 'none'}")
        checkpoint = guess
    read_state(checkpoint)  # CheckpointError (a FituneError) for a folder that is not a complete checkpoint
    if not os.path.isfile(os.path.join(checkpoint, "trainable.safetensors")):
        raise RunLoadError(f"--checkpoint {checkpoint} has no trainable.safetensors (a sharded checkpoint of a "
                           "several-GPU FSDP run); let the run finish (`fitune train CONFIG --resume`) and load "
                           "its adapter/ or model/")
    _check_base(base, f"{root}/{RUN_FILE} (model:)", config)
    return RunInfo(weights="checkpoint", weights_dir=checkpoint, base_model=base, tokenizer_dir=tokenizer, **common)


def _describe_adapter(path: str, run: dict | None) -> RunInfo:
    try:
        with open_regular(os.path.join(path, "adapter_config.json"), what="the adapter's") as f:
            adapter_config = json.load(f)
        base = adapter_config["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RunLoadError(f"{path}/adapter_config.json is not a PEFT adapter config ({exc!r}); give the folder "
                           "PEFT's save_pretrained wrote") from None
    named = f"{path}/adapter_config.json"
    if run is not None:  # RUN/adapter: the run's own model
        base = str(run.get("model") or base or "")
        named = f"{os.path.dirname(os.path.abspath(path))}/{RUN_FILE} (model:)"
    if not base:
        raise RunLoadError(f"{path}/adapter_config.json names no base model (base_model_name_or_path is empty); "
                           "set it to the base model's folder or Hub id")
    _check_base(str(base), named, run or {})
    dtype = _config_dtype(base) if os.path.isdir(str(base)) else "fp32"
    info = RunInfo(path=path, kind="adapter", weights="adapter", weights_dir=path, base_model=str(base),
                   tokenizer_dir=path if _has_tokenizer(path) else str(base), method="lora", dtype=dtype)
    return _with_run_settings(info, run)


def _with_run_settings(info: RunInfo, run: dict | None) -> RunInfo:
    """A run's adapter/, merged/ or model/ given directly: the run's dtype, method, seq_len and data format."""
    if run is None:
        return info
    return dataclasses.replace(
        info, method=str(run.get("method") or info.method), dtype=_run_dtype(run),
        seq_len_tokens=run.get("seq_len") if isinstance(run.get("seq_len"), int) else None,
        data_format=_data_format(run), trust_remote_code=run.get("trust_remote_code") is True, config=run)


def _read_run_config(root: str) -> dict:
    path = os.path.join(root, RUN_FILE)
    try:
        with open_regular(path, what="the run's") as f:
            config = json.load(f)["config"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RunLoadError(f"{path} is not a fitune run file ({exc!r}); it should hold the run's config under "
                           "\"config\" (fitune train writes it at the start of a run)") from None
    if not isinstance(config, dict):
        raise RunLoadError(f"{path}: \"config\" is not a mapping; this is not a run file fitune train wrote")
    return config


def _parent_run_config(path: str) -> dict | None:
    """The run.json config of the run folder `path` sits in (RUN/adapter, RUN/merged, RUN/model), or None."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.basename(os.path.abspath(path)) in ("adapter", "merged", "model") and \
            os.path.isfile(os.path.join(parent, RUN_FILE)):
        try:
            return _read_run_config(parent)
        except RunLoadError:
            return None
    return None


def _run_dtype(config: dict) -> str:
    if config.get("method") == "qlora":
        return "bf16"  # NF4 layers compute in bf16; the rest of the model is bf16
    return DTYPE_NAMES.get(str(config.get("dtype", "bf16")), "bf16")


def _data_format(config: dict) -> str | None:
    data = config.get("data")
    fmt = data.get("format") if isinstance(data, dict) else None
    return fmt if isinstance(fmt, str) else None


def _config_dtype(folder: str) -> str:
    """The dtype a model folder's config.json declares (fp32 when it declares none)."""
    try:
        with open_regular(os.path.join(folder, "config.json"), what="the model's") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "fp32"
    declared = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return DTYPE_NAMES.get(str(declared), "fp32")


def _has_weights(folder: str) -> bool:
    return any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(folder))


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _looks_like_a_path(source: str) -> bool:
    """A local path rather than a Hugging Face Hub id ("org/name")."""
    return (os.path.isabs(source) or source.startswith((".", "~")) or source.endswith(".gguf")
            or source.count("/") != 1 or "\\" in source)


def _check_base(base: str, named: str, config: dict) -> None:
    """The base model under an adapter must be loadable: present on disk, or a Hub id. `named`: the file (and key)
    that names it, for the message."""
    if config.get("init") == "random":
        raise RunLoadError(f"the run was trained on random weights (init: random, model: {base}, in {named}): there "
                           "is no pretrained base to load the adapter onto; train on a pretrained model folder to use "
                           "the result")
    if not base:
        raise RunLoadError(f"{named} names no base model; set it to the base model's folder or Hub id")
    if os.path.exists(base) or not _looks_like_a_path(base):
        return
    raise RunLoadError(f"the base model {base} named by {named} is not there (moved or deleted?); the adapter holds "
                       "only the trained low-rank weights and needs it: put the base model back at that path, or "
                       "load a merged copy if the run wrote one (merged/, --merged)")


def _no_choice(path: str, merged: bool | None, checkpoint: str | None, what: str) -> None:
    if merged is not None or checkpoint is not None:
        flag = "--checkpoint" if checkpoint is not None else ("--merged" if merged else "--adapter")
        raise RunLoadError(f"{flag}: {path} is {what}, which holds one set of weights; leave out {flag}")


def _checkpoint_names(root: str) -> list[str]:
    folder = os.path.join(root, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.startswith("step-") and not n.endswith(".tmp"))


def _live_pid(root: str) -> int | None:
    """The pid in the run's lock file when that process is alive on this machine (the run is still going)."""
    try:
        with open_regular(os.path.join(root, "fitune.lock"), what="the run's") as f:
            holder = json.loads(f.read() or "{}")
        pid = int(holder["pid"])
        if holder.get("host") not in (None, socket.gethostname()):
            return None
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _no_weights_message(root: str, config: dict, wanted: str) -> str:
    """A run without its end-of-run weights: still going, or interrupted; the newest checkpoint and how to use it."""
    pid = _live_pid(root)
    state = f"the run is still going (pid {pid})" if pid else "the run was interrupted or has not finished"
    newest = latest(root)
    if newest is None:
        then = ("and it has no complete checkpoint yet, so nothing trained can be loaded; wait for its first "
                "checkpoint (save_every) or for the end of the run")
    else:
        then = (f"its newest complete checkpoint is {newest}: load it with `--checkpoint {newest}`"
                + ("" if pid else ", or finish the run with `fitune train CONFIG --resume`"))
    return f"run {root} has no {wanted} yet ({wanted} is written at the end of a run): {state}, {then}"


def _not_a_run_message(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return f"cannot read {path}: {exc}"
    holds = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"
    return (f"{path} is not a fitune run folder, a model folder or a PEFT adapter folder: it holds {holds} (no "
            f"{RUN_FILE}, config.json with weights, or adapter_config.json); give the output_dir of a `fitune train` "
            "run")


def dtype_name(value: str) -> str:
    """fitune's name (bf16 | fp16 | fp32) for a dtype spelling (bfloat16, float32, ...).

    Raises:
        RunLoadError: not a dtype fitune loads weights in.
    """
    name = DTYPE_NAMES.get(str(value).strip().lower())
    if name is None:
        raise RunLoadError(f"--dtype {value!r} is not a dtype for weights; use bf16, fp16 or fp32")
    return name


# ---- loading (torch) -------------------------------------------------------------------------------------


def load_run(run_dir: str, *, merged: bool | None = None, device: str = "cpu", dtype: str | None = None,
             checkpoint: str | None = None):
    """(model, tokenizer, RunInfo) of a run folder, a model folder or a PEFT adapter folder, in eval mode.

    The base model is built by `fitune.runtime.model.build_model` (a folder, Hub id or .gguf file) and the tokenizer
    by `load_tokenizer` (with a pad token). A QLoRA run's base is NF4 on CUDA as in training; elsewhere it is
    loaded in bf16 (not the 4-bit values the adapter saw: `info.notes` says so).

    Args:
        merged: see `describe_folder`.
        device: "cpu" or "cuda".
        dtype: bf16 | fp16 | fp32 (other spellings accepted); None: the run's dtype (a model folder's own).
        checkpoint: a run's checkpoint folder (checkpoints/step-N, or just step-N) to load instead of its outputs.
    Raises:
        RunLoadError, CheckpointError, ConfigError: the message says what to do.
    """
    info = describe_folder(run_dir, merged=merged, checkpoint=checkpoint)
    for folder in {info.weights_dir, info.tokenizer_dir, info.base_model}:
        _check_files_are_regular(folder)
    # torch, peft, safetensors: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    from ..runtime.model import build_model, load_tokenizer

    name = dtype_name(dtype) if dtype is not None else info.dtype
    notes = list(info.notes)
    tokenizer = load_tokenizer(info.tokenizer_dir, info.trust_remote_code)
    if info.weights in ("merged", "model"):
        model = build_model(info.weights_dir, dtype_name=name, device=device, init="pretrained",
                            trust_remote_code=info.trust_remote_code)
    else:
        nf4 = info.method == "qlora" and device == "cuda" and dtype is None
        if info.method == "qlora" and not nf4:
            notes.append(f"QLoRA run loaded without NF4 ({'on ' + device if device != 'cuda' else 'dtype ' + name}): "
                         f"the base is {name}, not the 4-bit weights the adapter was trained against, so outputs "
                         "differ slightly from the trained model's")
        model = build_model(info.base_model, dtype_name=name, device=device, init="pretrained",
                            quantize="nf4" if nf4 else None, trust_remote_code=info.trust_remote_code)
        if info.weights == "adapter":
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, info.weights_dir)
        else:
            model = _with_checkpoint(model, info)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer, dataclasses.replace(info, dtype=name, notes=tuple(notes))


def _check_files_are_regular(folder: str | None) -> None:
    """Refuse a FIFO, socket or device among a local folder's files before transformers, PEFT or safetensors open
    them by name (a FIFO would block the load forever)."""
    if not folder or not os.path.isdir(folder):
        return  # a Hub id or a .gguf file: build_model reads it
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            check_regular(path, "the model folder's")


def _with_checkpoint(model, info: RunInfo):
    """The base with a checkpoint's trainable weights: LoRA wrapped as the run wrapped it, then the tensors copied
    in by name (the names `model.named_parameters()` had in training)."""
    import torch
    from safetensors.torch import load_file

    from ..runtime.model import wrap_lora

    if info.method in ("lora", "qlora"):
        lora = info.config.get("lora") or {}
        targets = lora.get("targets") or ["q_proj", "v_proj"]
        model = wrap_lora(model, int(lora.get("rank", 8)), list(targets), alpha=int(lora.get("alpha", 16)))
    path = os.path.join(info.weights_dir, "trainable.safetensors")
    try:
        weights = load_file(path)
    except Exception as exc:  # safetensors' own error for a damaged file
        raise RunLoadError(f"{path} cannot be read ({type(exc).__name__}: {exc}); load an older checkpoint") from None
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    reshaped = sorted(n for n in set(weights) & set(params) if weights[n].shape != params[n].shape)
    if unknown or reshaped:
        names = (unknown or reshaped)[:3]
        raise RunLoadError(f"checkpoint {info.weights_dir} does not fit the run's model and config ({len(unknown)} "
                           f"tensors not in the model, {len(reshaped)} of other shapes: {names}); was run.json "
                           "edited after the run started?")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    return model
