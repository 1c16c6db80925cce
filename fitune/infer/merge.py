"""Merge a run's LoRA adapter into its base weights: one standalone model folder any tool loads.

    merge_run(run_dir, out_dir)   base + adapter -> PEFT `merge_and_unload` -> safetensors shards, tokenizer,
                                  config.json, generation_config.json in `out_dir`

The folder is written into a fresh temporary folder beside `out_dir` (`.NAME.XXXXXXXX.tmp`, fitune/files.py
`atomic_folder`) and renamed at the end: `out_dir` is either absent or complete. An existing `out_dir` that is
not empty is refused (never mixed with, never overwritten), and so is a link or anything but a folder.

QLoRA: the adapter was trained against the NF4 (4-bit) base. Merging needs real-valued weights, so the NF4
weights are dequantized to bf16 first (bitsandbytes, CUDA only) and the adapter is added to those: the merged
model reproduces the trained one (base as it was quantized + adapter), not the original bf16 base + adapter, and it
is a bf16 model, 2 bytes per weight (about 4x the NF4 file). Quantizing it again (to NF4 or GGUF) rounds the
merged weights anew: a small further change.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..files import atomic_folder, check_folder_target
from ..runtime.device import torch_dtype
from .load import RunInfo, RunLoadError, describe_folder, dtype_name
from .load import RUN_FILE, _read_run_config, _with_checkpoint, load_run

QLORA_NOTE = ("QLoRA: the base's NF4 (4-bit) weights were dequantized to bf16 and the adapter merged into them, so the "
              "merged model computes what the trained QLoRA model computed (not the original bf16 base + adapter); it "
              "is a bf16 model (2 bytes per weight, about 4x the NF4 size), and quantizing it again rounds the merged "
              "weights anew")


class MergeError(RunLoadError):
    """A merge that cannot be done: nothing to merge, an output folder in the way, QLoRA without CUDA."""


def check_out_dir(out_dir: str) -> None:
    """Refuse, before any work, an output folder that exists and is not empty, a symbolic link (even to a folder),
    a file, a FIFO or a device, or an unwritable place."""
    if not out_dir or not out_dir.strip():
        raise MergeError(f"--out needs a folder name, got {out_dir!r}")
    if os.path.lexists(out_dir) and (os.path.islink(out_dir) or not os.path.isdir(out_dir)):
        check_folder_target(out_dir, "--out")  # a link, a file, a FIFO, a device: named as such
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        names = sorted(os.listdir(out_dir))
        raise MergeError(f"--out {out_dir} exists and is not empty ({', '.join(names[:5])}"
                         f"{', ...' if len(names) > 5 else ''}); merged weights go into a new or empty folder: choose "
                         "another --out, or remove that folder first")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise MergeError(f"--out {out_dir}: the folder {parent} does not exist; create it (mkdir -p {parent}) or "
                         "write somewhere else")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MergeError(f"--out {out_dir}: {parent} is not writable by this user; write somewhere else")


def mergeable(run_dir: str, checkpoint: str | None = None) -> RunInfo:
    """What `merge_run` would merge: the run's adapter (or a checkpoint of a LoRA run).

    Raises:
        MergeError: a full / freeze run, a model folder (nothing to merge), and describe_folder's errors.
    """
    info = describe_folder(run_dir, merged=False if checkpoint is None and _is_lora_run(run_dir) else None,
                           checkpoint=checkpoint)
    if info.weights not in ("adapter", "checkpoint") or info.method not in ("lora", "qlora"):
        raise MergeError(f"{run_dir} holds whole-model weights ({info.weights_dir}: method {info.method}), not a LoRA "
                         "adapter: there is nothing to merge; load that folder directly (`fitune chat "
                         f"{info.weights_dir}`), or convert it with `fitune export`")
    return info


def _is_lora_run(run_dir: str) -> bool:
    if not os.path.isfile(os.path.join(run_dir, RUN_FILE)):
        return os.path.isfile(os.path.join(run_dir, "adapter_config.json"))
    return str(_read_run_config(run_dir).get("method") or "lora") in ("lora", "qlora")


def merge_run(run_dir: str, out_dir: str, *, dtype: str | None = None, max_shard_size: str = "5GB",
              device: str | None = None, checkpoint: str | None = None) -> str:
    """Write the run's adapter merged into its base as a standalone model folder; returns `out_dir`.

    Args:
        run_dir: a fitune run folder (its adapter/), or a PEFT adapter folder.
        out_dir: a new or empty folder.
        dtype: bf16 | fp16 | fp32 of the merged weights; None: the run's dtype (QLoRA: bf16).
        max_shard_size: the largest safetensors file ("5GB", "500MB": transformers' units).
        device: where the merge runs; None: CUDA for QLoRA (required), else the CPU.
        checkpoint: merge a checkpoint's adapter (checkpoints/step-N) instead of the finished adapter/.
    Raises:
        MergeError: `out_dir` in the way, nothing to merge, QLoRA without CUDA; RunLoadError for the run.
    """
    check_out_dir(out_dir)
    info = mergeable(run_dir, checkpoint)
    name = dtype_name(dtype) if dtype is not None else info.dtype
    # what the libraries print on their own (deepspeed announces its accelerator when PEFT's merge imports it)
    # goes to stderr: stdout carries the caller's answer only
    with contextlib.redirect_stdout(sys.stderr):
        return _merge(run_dir, out_dir, info, name, max_shard_size, device, checkpoint)


def _merge(run_dir: str, out_dir: str, info: RunInfo, name: str, max_shard_size: str, device: str | None,
           checkpoint: str | None) -> str:
    # torch, peft, bitsandbytes: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch

    if info.method == "qlora":
        if not torch.cuda.is_available():
            raise MergeError(f"{run_dir} is a QLoRA run: its adapter was trained against the NF4 (4-bit) base, which "
                             "must be dequantized before merging, and bitsandbytes dequantizes on CUDA only; run "
                             "`fitune merge` on a machine with an NVIDIA GPU (the merged folder then loads anywhere). "
                             "The adapter itself loads on the CPU (`fitune chat` / `generate` over a bf16 base)")
        model = _qlora_merged(info, name)
    else:
        model, _, info = load_run(run_dir, merged=None if checkpoint else False, device=device or "cpu",
                                  dtype=name, checkpoint=checkpoint)
        model = model.merge_and_unload()
    from ..runtime.model import load_tokenizer

    tokenizer = load_tokenizer(info.tokenizer_dir, info.trust_remote_code)
    _write(model, tokenizer, out_dir, name, max_shard_size)
    return out_dir


def _qlora_merged(info: RunInfo, name: str):
    """CUDA: the base built in NF4 as in training, each NF4 linear replaced by a plain linear holding its
    dequantized weights (in `name`), then the adapter loaded and merged."""
    from peft import PeftModel

    from ..runtime.model import build_model

    base = build_model(info.base_model, dtype_name="bf16", device="cuda", quantize="nf4", init="pretrained",
                       trust_remote_code=info.trust_remote_code)
    dequantize_nf4(base, torch_dtype(name))
    _forget_quantization(base)  # transformers refuses `.to(dtype)` and save_pretrained of a model marked quantized
    base.to(torch_dtype(name))
    if info.weights == "adapter":
        model = PeftModel.from_pretrained(base, info.weights_dir)
    else:
        model = _with_checkpoint(base, info)
    return model.merge_and_unload()


def _forget_quantization(model) -> None:
    """Clear what marks a transformers model as bitsandbytes-quantized (`hf_quantizer`, `quantization_method`,
    `is_quantized`, `config.quantization_config`) once its weights are plain: `.to(dtype)` raises ("You cannot
    cast a bitsandbytes model in a new `dtype`") and save_pretrained writes a quantized folder while they stay."""
    model.hf_quantizer = None
    model.quantization_method = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def dequantize_nf4(model, dtype) -> int:
    """Replace every bitsandbytes `Linear4bit` in `model` with an `nn.Linear` holding its dequantized weights (in
    place, on the layer's device); how many. CUDA only (bitsandbytes' dequantize kernels). Each NF4 block is freed
    as soon as its linear is replaced: the modules are found by name (no list of them is kept), and the reference
    cycle bitsandbytes makes (`Linear4bit.weight.module` is the Linear4bit itself, bitsandbytes/nn/modules.py
    `Params4bit(module=self)`) is broken, since reference counting alone never frees a cycle and the garbage
    collector runs when it likes: kept, every NF4 weight stayed allocated to the end, 3.5 GiB more at the merge's
    peak for 8B (bench/results/pretrained_load/phases, call 2)."""
    import bitsandbytes as bnb
    import torch

    names = [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        weight = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state).to(dtype)
        plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                device=weight.device, dtype=dtype)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if child.bias is not None:
                plain.bias.copy_(child.bias.to(dtype))
        setattr(parent, child_name, plain)
        if getattr(child.weight, "module", None) is child:
            child.weight.module = None  # the cycle Linear4bit -> Params4bit -> Linear4bit
        del child, weight, plain
    return len(names)


def _write(model, tokenizer, out_dir: str, name: str, max_shard_size: str) -> None:
    """The merged model into a fresh temporary folder beside `out_dir` (mkdtemp: an unpredictable name no planted
    link can take), then renamed to `out_dir` (an empty `out_dir` is replaced; a link or anything else refused)."""
    import torch

    try:
        with atomic_folder(out_dir, what="--out") as tmp:
            model.to(torch_dtype(name))
            model.config.use_cache = True  # training turned the KV cache off; generation wants it
            model.config.dtype = torch_dtype(name)
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
            tokenizer.save_pretrained(tmp)
            if not os.path.isfile(os.path.join(tmp, "generation_config.json")) and \
                    getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
    except (OSError, RuntimeError, ValueError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        raise MergeError(f"could not write {out_dir}: {type(exc).__name__}: {exc}; nothing was left behind (check "
                         "the free space and permissions, then run fitune merge again)") from None
