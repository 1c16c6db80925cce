"""Build the model a run trains and prepare it for its method: the one model builder of fitune.

    build_model(source, ...)            pretrained weights (a model folder, a .gguf file, a Hub id from the Hub
                                        cache), or random weights from a config (catalog name, config.json,
                                        ModelSpec, dict); dtype; attention; NF4 (QLoRA)
    build_model_for_setup(source, s)    the same with the dtype / attention / quantisation a TrainSetup implies
    prepare_model(model, s)             PEFT LoRA / freeze / full, fitune's techniques, checkpointing

The HF recipe (what `fitune estimate --stack hf` models and bench/hf_recipe.py measures) is the same builder with
transformers' defaults: bf16, `attn_implementation`, PEFT `get_peft_model(model, LoraConfig(r, lora_alpha=16,
target_modules, lora_dropout=0.0, task_type="CAUSAL_LM"))` (PEFT keeps the adapter weights in fp32) and, when
checkpointing, `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})` with
`enable_input_require_grads()`; `prepare_model` of a `stack: hf` setup does exactly that and nothing more.

QLoRA: the decoder's `nn.Linear` layers become bitsandbytes `Linear4bit` (NF4, double quantisation, bf16
compute); embeddings and lm_head stay bf16.

Imports torch at import; transformers, peft and bitsandbytes inside the functions that use them. Callers import
this module where they need it (never at their own import).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from ..data.encode import load_tokenizer as load_data_tokenizer
from ..errors import ConfigError, DataError, FituneError
from ..setup import unknown_targets_problem
from ..specs.model import resolve_model_source
from ..specs.sources import (announce_remote_code, cached_hub_snapshot, config_json_problem, is_gguf_path, is_hub_id,
                             local_model, short_error)
from .device import torch_dtype
from .layers import find_decoder_layers
from .needs import FLASH, QLORA, cuda_problem, flash_dtype_problem, machine_problems
# the techniques as modules: `prepare_model` looks each `enable_*` up when it runs (tests/test_runner_parity.py wraps
# them to count the calls)
from .techniques import (compile_layers, fused_kernels, lean_lora, lean_norm, offload, offload_embeddings,
                         tiled_mlp)

if TYPE_CHECKING:
    from ..setup import TrainSetup

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
INITS = ("auto", "pretrained", "random")
"""auto: load the weights when `source` is a folder holding them, else random; pretrained; random."""

_CONFIG_KEYS_NOT_FOR_INIT = ("architectures", "torch_dtype", "model_type", "dtype")


def build_model(source: Any, *, dtype_name: str = "bf16", attn: str = "sdpa", device: str = "cpu",
                quantize: str | None = None, init: str = "auto", trust_remote_code: bool = False):
    """The causal LM of `source` in training mode on `device`.

    Args:
        source: where pretrained weights are loaded from: a model folder, a .gguf file (dequantized to
            `dtype_name` on load) or a Hub id (its snapshot in the Hub cache; downloaded when not there and not
            offline); or a config to draw random weights from: a config.json dict, a ModelSpec, a catalog name, a
            config.json path (or any of the former). Memory does not depend on the weights' values.
        dtype_name: bf16 | fp16 | fp32, the weights' dtype (NF4 layers compute in bf16).
        attn: sdpa | eager | flash (flash-attention 2: transformers' "flash_attention_2", which needs the
            flash_attn package; off CUDA sdpa stands in: `hf_attn_implementation`), or any attn_implementation
            transformers knows.
        quantize: None, or "nf4": the decoder's linears become bitsandbytes NF4 (CUDA only). A pretrained folder
            is loaded through transformers' BitsAndBytesConfig; random weights are quantised on the GPU after init.
        init: "pretrained", "random", or "auto" (pretrained when `source` is a folder with weight files, a .gguf
            file or a Hub id whose cached snapshot has them).
    Raises:
        ConfigError: NF4 without a CUDA GPU, flash attention without the flash_attn package or in fp32, an unknown
            `init`, a Hub id that is neither cached nor downloadable, a folder whose weights are pickle files only,
            or anything transformers / safetensors refuse while building or loading it (a damaged .safetensors
            file, a config.json value: the message names the file and the key).
    """
    from transformers import AutoModelForCausalLM

    if init not in INITS:
        raise ConfigError(f"init: {init!r} is not one of: {', '.join(INITS)}")
    if quantize not in (None, "nf4"):
        raise ConfigError(f"quantize: {quantize!r} is not one of: nf4 (or none)")
    if quantize == "nf4" and device != "cuda":
        raise ConfigError(cuda_problem(QLORA))
    attn = hf_attn_implementation(attn, device, "bf16" if quantize == "nf4" else dtype_name)
    if init == "auto":
        init = "pretrained" if _has_weights(source) else "random"
    if init == "random":
        config = _hf_config(source)
        kwargs = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_NOT_FOR_INIT}
        from transformers import AutoConfig

        with _load_errors(source, None, config):
            hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
        if quantize == "nf4":
            # built on the meta device, then made real one part at a time, each decoder layer quantised as soon as
            # it exists: the whole bf16 model never is (an 8B one, 15 GiB, does not fit an 8 or 12 GB card)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype(dtype_name),
                                                         attn_implementation=attn)
            materialize_randomly(model, device, each_layer=quantize_layer_to_nf4)
            torch.cuda.empty_cache()
        else:
            with torch.device(device), _load_errors(source, None, config):  # weights made where they live
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype(dtype_name),
                                                         attn_implementation=attn)
    else:
        model = _from_pretrained(source, dtype_name=dtype_name, attn=attn, device=device, quantize=quantize,
                                 trust_remote_code=trust_remote_code)
    model.train()
    return model


def _refuse_pickle_weights(source: str, folder: str) -> None:
    """Refuse a model folder whose weights are pickle files only (pytorch_model.bin, *.pt): unpickling runs code,
    and torch's own refusal tells the user to turn its safety off (`weights_only=False`)."""
    names = sorted(os.listdir(folder))
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickles:
        raise ConfigError(
            f"model: {source}: its weights are pickle files only ({', '.join(pickles[:3])}); fitune loads "
            "safetensors only (a pickle .bin can run code when it is read); convert it, if you trust the file, with "
            "python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}', use_safetensors=False).save_pretrained('{folder}')\" (writes "
            "model.safetensors), or download the model's safetensors files")


@contextlib.contextmanager
def _load_errors(source: Any, folder: str | None, config: dict | None):
    """Turn what transformers / safetensors raise while reading a model into one ConfigError naming the file (and
    the config.json key) that caused it. Out-of-memory errors and fitune's own errors pass through as they are."""
    try:
        yield
    except (FituneError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError, SafetensorError...
        if folder is None and isinstance(source, dict):
            raise  # a config given as a mapping (the trace engine): its callers word the error themselves
        raise ConfigError(_load_problem(str(source), folder, config, exc)) from exc


def _load_problem(source: str, folder: str | None, config: dict | None, exc: Exception) -> str:
    """What `_load_errors` says about `exc`: a damaged .safetensors file, weights whose shapes config.json does not
    give, or a config.json value transformers refuses."""
    detail = short_error(exc)
    if folder is not None and type(exc).__name__ == "SafetensorError":
        damaged = _damaged_safetensors(folder) or "its .safetensors files"
        return (f"model: {source}: {damaged} is damaged or not a safetensors file ({detail}); download it again "
                "or save the model again")
    where = os.path.join(folder, "config.json") if folder else f"{source} (config)"
    if folder is not None and "ignore_mismatched_sizes" in str(exc):
        return (f"model: {source}: the weights' shapes are not those {where} gives (a size in it was changed: "
                "hidden_size, head_dim, num_attention_heads, ...); restore the model's original config.json")
    found = config_json_problem(folder if folder is not None else source, exc, config)
    if found:
        return f"model: {found}"
    return f"model: {source}: transformers could not load the model from {where} ({detail}); check its files"


def _damaged_safetensors(folder: str) -> str | None:
    """The first .safetensors file of `folder` whose header safetensors cannot read."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    f.keys()
            except Exception:  # noqa: BLE001 - any failure to read it is the damage reported
                return os.path.join(folder, name)
    return None


def _from_pretrained(source: Any, *, dtype_name: str, attn: str, device: str, quantize: str | None,
                     trust_remote_code: bool):
    """`build_model` of pretrained weights: the folder, .gguf file or Hub id `source` names, read by transformers
    (safetensors only; a folder of pickle weights is refused), its errors wrapped with the file they are about."""
    from transformers import AutoModelForCausalLM

    where = local_model(str(source), download=True)  # a Hub id not in the cache is downloaded here
    if not where.gguf_file:
        _refuse_pickle_weights(str(source), where.folder)
    if trust_remote_code:
        announce_remote_code(str(source), where.folder, log)
    kwargs = {"dtype": torch_dtype(dtype_name), "attn_implementation": attn,
              "trust_remote_code": trust_remote_code, **where.from_pretrained_kwargs()}
    if quantize == "nf4":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    elif device != "cpu" and not _zero3_construction():
        # each tensor is read straight onto the GPU: an 8B bf16 model (16 GB) is never whole in host RAM first.
        # (ZeRO-3 partitions the parameters as they are made; transformers refuses a device_map with it.)
        kwargs["device_map"] = {"": device}
    with _load_errors(source, where.folder, None):
        model = AutoModelForCausalLM.from_pretrained(where.folder, **kwargs)  # safetensors first when both
    if where.gguf_file:
        _forget_gguf_quantization(model)
    if where.gguf_file or where.hub_id:
        # PEFT writes this as the adapter's base_model_name_or_path: the .gguf file or Hub id `model:` named,
        # which build_model loads again, rather than the folder it was read from
        model.name_or_path = model.config.name_or_path = str(source)
    if quantize is None and "device_map" not in kwargs:
        model.to(device)
    return model


def hf_attn_implementation(attn: str, device: str, dtype_name: str = "bf16") -> str:
    """transformers' attn_implementation for fitune's `attn`. flash is flash-attention 2 ("flash_attention_2", what
    the estimator and `fitune plan` mean by it) on a CUDA GPU, refused without its package or in fp32. Off CUDA,
    where flash-attention 2 cannot run, a model built here (tests, the trace engine's CPU rehearsals) gets sdpa,
    whose CPU flash kernel saves what flash-attention does, and a warning says so; `fitune train` refuses `attn:
    flash` without a GPU before it gets here (`fitune.train.preflight.preflight_problems`)."""
    if attn != "flash":
        return attn
    if device != "cuda":
        log.warning("attn: flash (flash-attention 2) runs on CUDA only; this %s model uses sdpa", device)
        return "sdpa"
    problems = machine_problems([FLASH], on_cuda=True) + [p for p in [flash_dtype_problem(dtype_name)] if p]
    if problems:
        raise ConfigError(problems)
    return "flash_attention_2"


def _zero3_construction() -> bool:
    """Whether the model is being built under DeepSpeed ZeRO-3 (`fitune.parallel.deepspeed_engine`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def _forget_gguf_quantization(model) -> None:
    """Clear what marks a model loaded from a GGUF file as quantized.

    transformers dequantizes every GGUF tensor on load (modeling_gguf_pytorch_utils.load_gguf_checkpoint) and the
    weights are plain tensors of the run's dtype, but it keeps a GGUF `hf_quantizer` and `quantization_config`,
    which make `save_pretrained` refuse to save and PEFT's merge refuse to merge. Nothing quantized is left to
    describe, so they go (tests/real_model.py's `model_folder` does the same).
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def build_model_for_setup(source: Any, s: TrainSetup, device: str, *, init: str = "auto",
                          trust_remote_code: bool = False):
    """`build_model` with what `s` implies: NF4 and bf16 for QLoRA, else `s.dtype`; `s.attn`."""
    qlora = s.method == "qlora"
    return build_model(source, dtype_name="bf16" if qlora else s.dtype, attn=s.attn, device=device,
                       quantize="nf4" if qlora else None, init=init, trust_remote_code=trust_remote_code)


def build_random_model(hf_config: dict, attn: str = "sdpa", device: str = "cuda", dtype_name: str = "bf16"):
    """A causal LM with random weights from a config.json dict, directly on `device` (`build_model`, init random)."""
    return build_model(hf_config, dtype_name=dtype_name, attn=attn, device=device, init="random")


def _has_weights(source: Any) -> bool:
    """Whether `source` holds pretrained weights: a folder with weight files, a .gguf file, a cached Hub id's
    snapshot with weight files."""
    if not isinstance(source, str):
        return False
    if os.path.isfile(source) and is_gguf_path(source):
        return True
    folder = cached_hub_snapshot(source) if is_hub_id(source) else source
    return folder is not None and os.path.isdir(folder) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))


def _hf_config(source: Any) -> dict:
    """The config.json dict of a dict, a ModelSpec, a catalog name, a config.json, a model folder, a .gguf file or a
    Hub id (whatever its architecture: `--engine trace` and random init build any that transformers knows)."""
    if isinstance(source, dict):
        return source
    if hasattr(source, "hf_config"):
        return source.hf_config
    return resolve_model_source(str(source)).hf_config


def materialize_randomly(model, device, each_layer=None) -> None:
    """Give a model built on the meta device real tensors on `device`, drawn as transformers initialises them
    (the model's own `_init_weights`: normal linears and embeddings, norms at one, rotary tables computed).

    The parts outside the decoder layers come first, then each decoder layer in order, `each_layer(layer)` called
    on it before the next is made (QLoRA quantises there), so at most one layer exists at full precision. Tensors
    shared between modules (tied embeddings) stay shared.
    """
    layers = find_decoder_layers(model)
    in_layers = {id(m) for layer in layers for m in layer.modules()}

    def make(module, made: dict) -> None:
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:  # the meta tensor is kept with it: its id cannot be reused meanwhile
                    real = torch.empty_like(t, device=device)
                    made[id(t)] = (t, torch.nn.Parameter(real, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else real)
                store[name] = made[id(t)][1]
        model._init_weights(module)

    with torch.no_grad():
        outside: dict = {}
        for m in model.modules():
            if id(m) not in in_layers:
                make(m, outside)
        for layer in layers:
            mine: dict = {}  # dropped after the layer: nothing here may keep its full-precision weights alive
            for m in layer.modules():
                make(m, mine)
            del mine
            if each_layer is not None:
                each_layer(layer)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:  # a tensor outside every module's own store: nothing here could give it a value
        raise RuntimeError(f"random init left tensors on the meta device: {', '.join(leftover[:5])}")


def quantize_layer_to_nf4(layer) -> int:
    """Replace every `nn.Linear` inside one decoder layer with a bitsandbytes NF4 `Linear4bit` (in place), quantised
    on the weights' own device (fast on a GPU); how many. Embeddings and lm_head stay as they are."""
    import bitsandbytes as bnb

    replaced = 0
    for _, parent in list(layer.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", module=q)
            q.weight = weight.to(child.weight.device)  # quantises here, on the GPU
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, child_name, q)
            del child, weight  # the bf16 weight is freed once nothing refers to it
            replaced += 1
    return replaced


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of `path` (a model or tokenizer folder, a .gguf file, a Hub id: downloaded when not in the Hub
    cache and not offline), with a pad token (its eos when it has none). Loads it with the data path's loader
    (`fitune.data.encode.load_tokenizer`), so train, plan --data and doctor --data read the same tokenizer.

    Raises:
        ConfigError: no tokenizer can be loaded from `path`, or it has neither a pad nor an eos token.
    """
    try:
        tok = load_data_tokenizer(str(path), trust_remote_code, key="tokenizer:", download=True)
    except DataError as exc:
        raise ConfigError(str(exc)) from exc
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {path}: it has neither a pad nor an eos token; add a pad token")
        tok.pad_token = tok.eos_token  # padding positions carry label -100 and attention 0: any id will do
    return tok


# ---- the method and the techniques ---------------------------------------------------------------------


def prepare_model(model, s: TrainSetup):
    """The method's trainable parameters (LoRA adapters, the last layers for freeze, everything for full) and the
    memory techniques of `s`: Liger kernels, lean LoRA, lean RMSNorm, tiled MLP, checkpointing (full, offloaded,
    selective), compiled layers. A `stack: hf` setup has no techniques (TrainSetup.validate): PEFT's LoRA and transformers'
    checkpointing only, the HF recipe.
    Shared by train, profile and the GPU benchmarks. (The allocator's settings are made before CUDA starts:
    `fitune.runtime.device.configure_allocator`.) Returns the model to train (PEFT's wrapper for LoRA)."""
    if s.kernels == "liger":  # before LoRA wraps the projections: Liger patches the base model's modules
        fused_kernels.enable_liger_kernels(model)
    model = make_trainable(model, s)
    if s.lean_lora:
        lean_lora.enable_lean_lora(model)
    if s.lean_norm:
        lean_norm.enable_lean_norm(model)
    if s.tiled_mlp:
        tiled_mlp.enable_tiled_mlp(model)
    if s.grad_checkpointing != "none":
        set_checkpointing(model, True)
        if s.checkpointed_layers_mode == "offload":
            offload.enable_offloaded_checkpointing(model)
        elif s.checkpointed_layers_mode == "selective":
            offload.enable_selective_checkpointing(model, s.selective_k())
    if s.offload_embeddings:
        offload_embeddings.enable_offloaded_embeddings(model)
    if s.compile == "layers":  # last: the compiled layers trace the LoRA branch and norms set above
        compile_layers.enable_compiled_layers(model)
    return model


def make_trainable(model, s: TrainSetup):
    """The method's trainable parameters: LoRA adapters (PEFT, `wrap_lora`), the last `freeze_trainable_layers`
    decoder layers for freeze, every parameter for full. The one preparation of the runner and of the trace engine
    (fitune/trace/engine.py). Returns the model to train (PEFT's wrapper for LoRA)."""
    if s.method in ("lora", "qlora"):
        targets = ALL_LINEAR if s.all_linear else list(s.lora_targets)
        return wrap_lora(model, s.lora_rank, targets, alpha=s.lora_alpha, dropout=s.lora_dropout)
    if s.method == "freeze":
        layers = find_decoder_layers(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in list(layers)[-s.freeze_trainable_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    else:  # full (a loaded model's parameters already require grad: said, not assumed)
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def wrap_lora(model, rank: int, targets: list[str] | str, alpha: int = 16, dropout: float = 0.0):
    """PEFT's `get_peft_model` as the recipe writes it: `lora.dropout` (PEFT's `lora_dropout`: an `nn.Dropout` on
    each adapter's input; 0, the recipe's value, is PEFT's `nn.Identity`), the adapters in fp32 (PEFT's default)."""
    from peft import LoraConfig, get_peft_model

    target_modules = ALL_LINEAR if targets == ALL_LINEAR or targets == [ALL_LINEAR] else list(targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=float(dropout),
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # PEFT's NoMatchingPeftModuleError: no module has any of these names
        if "not found in the base model" not in str(exc):
            raise
        names = layer_linear_names(model)
        asked = [target_modules] if isinstance(target_modules, str) else target_modules
        unknown = [t for t in asked if t not in names] or asked
        raise ConfigError(unknown_targets_problem("lora.targets:", unknown, names)) from None


def layer_linear_names(model) -> list[str]:
    """The names of the `nn.Linear` modules inside the model's decoder layers (q_proj, ..., down_proj), in order:
    what LoRA targets can name (the same list `ModelSpec.linear_names` gives for the architectures it models)."""
    names: list[str] = []
    for layer in find_decoder_layers(model):
        for path, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] not in names:
                names.append(path.rsplit(".", 1)[-1])
    return names


def set_checkpointing(model, on: bool) -> None:
    """Turn transformers' activation checkpointing on (non-reentrant, as the recipe does) or off completely."""
    if on:
        enable_checkpointing(model)
    else:
        disable_checkpointing(model)


def enable_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()  # the embeddings' output requires grad: checkpointed layers get gradients


def disable_checkpointing(model) -> None:
    """Undo `enable_checkpointing` completely.

    transformers' `gradient_checkpointing_enable` already registers an input-requires-grad hook on a PEFT model,
    and the recipe's own `enable_input_require_grads()` registers a second one that replaces the first in
    `_require_grads_hooks`, so `disable_input_require_grads()` leaves one behind. Remove every such hook.
    """
    model.gradient_checkpointing_disable()
    model.disable_input_require_grads()
    embeddings = model.get_input_embeddings()
    for key, hook in list(embeddings._forward_hooks.items()):
        if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
            del embeddings._forward_hooks[key]
