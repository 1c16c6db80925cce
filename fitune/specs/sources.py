"""Where a model's files are: a Hugging Face Hub id (through the local Hub cache) or a GGUF file. No torch.

    hub_cache_dir(), hub_offline()      huggingface_hub's cache folder and offline switch, read from the
                                        environment at each call (HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE)
    is_hub_id(text)                     `org/name` that is not a local path
    cached_hub_file / cached_hub_snapshot / download_hub_snapshot
                                        huggingface_hub's `try_to_load_from_cache` and `snapshot_download`
    read_gguf(path)                     a GGUF file's architecture as a config.json dict, and its weights' type
    local_model(source)                 what `fitune train` loads: a folder, and the GGUF file inside it if any

huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported (huggingface_hub/constants.py);
this module reads them itself at each call and passes `cache_dir` explicitly, so a value set later (a test's
monkeypatch, a CLI that sets it) is honoured. huggingface_hub is imported inside the functions that use it.

GGUF: the header is read here (format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), not with the
`gguf` package's GGUFReader, which parses every tokenizer string into numpy views (2 s for a 100 MB file with a
49,152-token vocabulary; this reader skips them: ~0.1 s). Its key mapping follows transformers'
`GGUF_CONFIG_MAPPING` (transformers/integrations/ggml.py) and `load_gguf_checkpoint`
(transformers/modeling_gguf_pytorch_utils.py), which is what loads the weights for training.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass, field

from ..errors import ConfigError, UnknownModelError

# ---- the Hub cache ------------------------------------------------------------------------------------------

#: huggingface_hub's truthy spellings of an environment switch (constants.ENV_VARS_TRUE_VALUES).
_TRUE = {"1", "ON", "YES", "TRUE"}
#: A Hub repository id: `org/name` (huggingface_hub.utils.validate_repo_id: letters, digits, `-_.`, at most 96).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
#: What the Hub's own CLI (huggingface_hub 1.x: `hf`; `huggingface-cli` before) downloads a repository with.
DOWNLOAD_CLI = "hf download"


def hub_cache_dir() -> str:
    """The Hub cache folder, as huggingface_hub computes it (constants.py), read from the environment now:
    HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    home = os.getenv("HF_HOME") or os.path.join(os.getenv("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                                          ".cache"), "huggingface")
    path = os.getenv("HF_HUB_CACHE") or os.getenv("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(path))


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to 1 / true / yes / on, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def is_hub_id(text: str) -> bool:
    """Whether `text` reads as a Hub repository id (`org/name`) and names no local file or folder."""
    text = text.strip()
    return (bool(_HUB_ID.match(text)) and len(text) <= 96 and "--" not in text and ".." not in text
            and not text.lower().endswith((".json", ".gguf")) and not os.path.exists(text))


def download_command(repo_id: str) -> str:
    """The shell command that puts `repo_id` into the Hub cache."""
    return f"{DOWNLOAD_CLI} {repo_id}"


def cached_hub_file(repo_id: str, filename: str = "config.json") -> str | None:
    """The path of `filename` of `repo_id`'s main revision in the Hub cache, or None when it is not there (or
    huggingface_hub is not installed). Never touches the network (`try_to_load_from_cache`)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir())
    except ValueError:  # an id huggingface_hub refuses (validate_repo_id)
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def cached_hub_snapshot(repo_id: str) -> str | None:
    """The snapshot folder of `repo_id`'s main revision in the Hub cache (`snapshot_download(...,
    local_files_only=True)`: no network), or None when it is not cached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        folder = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, a refused id: not cached, either way
        return None
    return folder if os.path.isdir(folder) else None


def download_hub_snapshot(repo_id: str, key: str = "model:") -> str:
    """Download `repo_id` into the Hub cache (huggingface_hub's progress bars) and return its snapshot folder.

    Raises:
        ConfigError: offline (HF_HUB_OFFLINE), no network, a gated or unknown repository: the message gives the
            command that downloads it.
    """
    if hub_offline():
        raise ConfigError(not_cached_message(repo_id, key))
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ConfigError(f"{key} {repo_id} is a Hub id, and downloading it needs huggingface_hub "
                          "(pip install huggingface_hub)") from exc
    try:
        return snapshot_download(repo_id, cache_dir=hub_cache_dir())
    except Exception as exc:  # noqa: BLE001 - network, authentication, 404: all mean "get it yourself"
        raise ConfigError(f"{key} {repo_id} could not be downloaded from the Hub ({type(exc).__name__}: {exc}); "
                          f"download it with `{download_command(repo_id)}` (after `hf auth login` for a gated "
                          f"model), or point {key} at a local folder") from exc


def not_cached_message(repo_id: str, key: str = "model:") -> str:
    """Why a Hub id cannot be loaded offline, and the command that fixes it; `key` names the YAML key or flag."""
    return (f"{key} {repo_id} is not in the Hub cache ({hub_cache_dir()}) and HF_HUB_OFFLINE is set, so it cannot "
            f"be downloaded; run `{download_command(repo_id)}` with network access (or unset HF_HUB_OFFLINE), or "
            f"point {key} at a local folder")


# ---- GGUF ---------------------------------------------------------------------------------------------------

GGUF_SUFFIX = ".gguf"
_GGUF_MAGIC = b"GGUF"
#: GGUF value types (gguf.constants.GGUFValueType): struct format of the fixed-size ones.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: Arrays longer than this are kept as their length only (tokenizer vocabularies, merges, scores).
_ARRAY_KEEP = 4096
#: ggml tensor types (gguf.constants.GGMLQuantizationType), used when the gguf package is not installed.
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
               18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
               26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

#: GGUF architecture -> transformers model_type (transformers' load_gguf_checkpoint renames these).
_GGUF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
#: `<arch>.<key>` -> config.json key: transformers' GGUF_CONFIG_MAPPING, the entries common to the decoders the
#: analytic engine models (llama, mistral, qwen2, qwen3, the MoEs, gemma, phi3).
_GGUF_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attention.sliding_window": "sliding_window",
}
#: head_dim: rope.dimension_count for llama / mistral, attention.key_length for qwen3 and gemma (ggml.py's notes).
_HEAD_DIM_KEY = {"llama": "rope.dimension_count", "mistral": "rope.dimension_count", "gemma": "attention.key_length",
                 "qwen3": "attention.key_length",
                 "qwen3_moe": "attention.key_length", "gemma2": "attention.key_length",
                 "gemma3_text": "attention.key_length"}


@dataclass(frozen=True)
class GgufModel:
    """What a GGUF file says about the model in it, read from its header (no tensor data)."""

    path: str
    hf_config: dict = field(repr=False)
    """The architecture as a config.json dict (the keys transformers' GGUF loader sets)."""
    weights_type: str
    """The most common ggml type of the 2-D weight tensors, e.g. "Q4_1", "Q8_0", "F16"."""

    @property
    def weights_bits(self) -> int | None:
        return weights_bits(self.weights_type)


def weights_bits(weights_type: str) -> int | None:
    """Bits per weight a ggml type's name gives (Q4_1 -> 4, IQ3_S -> 3, F16 / BF16 -> 16, F32 -> 32), or None."""
    m = re.match(r"^(?:I|T)?Q(\d)", weights_type) or re.match(r"^B?F(\d+)$", weights_type)
    return int(m.group(1)) if m else None


def is_gguf_path(text: str) -> bool:
    return text.strip().lower().endswith(GGUF_SUFFIX)


def read_gguf(path: str) -> GgufModel:
    """The architecture (a config.json dict) and the weights' type of the GGUF file `path`.

    Raises:
        UnknownModelError: not a readable GGUF file, or its metadata lacks what a config needs.
    """
    fields, tensors = read_gguf_header(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UnknownModelError(f"{path}: the GGUF metadata has no general.architecture; is this a model file?")
    model_type = _GGUF_ARCH.get(arch, arch)
    name = fields.get("general.name")
    if model_type == "llama" and isinstance(name, str) and "mistral" in name.lower():
        model_type = "mistral"  # llama.cpp writes Mistral as llama (load_gguf_checkpoint does the same)
    cfg: dict = {"model_type": model_type}
    if isinstance(name, str):
        cfg["_name_or_path"] = name
    for key, hf_key in _GGUF_KEYS.items():
        value = fields.get(f"{arch}.{key}")
        if value is not None:
            cfg[hf_key] = value
    head_dim_key = _HEAD_DIM_KEY.get(model_type)
    if head_dim_key and fields.get(f"{arch}.{head_dim_key}") is not None:
        cfg["head_dim"] = fields[f"{arch}.{head_dim_key}"]
    if "vocab_size" not in cfg and isinstance(fields.get("tokenizer.ggml.tokens"), _Length):
        cfg["vocab_size"] = fields["tokenizer.ggml.tokens"].n  # transformers: the tokenizer's length (issue 32526)
    if model_type == "qwen2_moe" and "moe_intermediate_size" in cfg:
        cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
    # no separate output.weight: lm_head shares the embedding (load_gguf_checkpoint's rule)
    cfg["tie_word_embeddings"] = all(t[0] != "output.weight" for t in tensors)
    for token in ("bos", "eos", "pad"):
        if isinstance(fields.get(f"tokenizer.ggml.{token}_token_id"), int):
            cfg[f"{token}_token_id"] = fields[f"tokenizer.ggml.{token}_token_id"]
    types = Counter(t[2] for t in tensors if len(t[1]) == 2)
    weights_type = types.most_common(1)[0][0] if types else "unknown"
    return GgufModel(path=path, hf_config=cfg, weights_type=weights_type)


class _Length:
    """A long GGUF array kept as its length only."""

    def __init__(self, n: int):
        self.n = n

    def __repr__(self) -> str:
        return f"<{self.n} items>"


def read_gguf_header(path: str) -> tuple[dict, list[tuple[str, tuple[int, ...], str]]]:
    """({key: value}, [(tensor name, shape, ggml type name)]) from a GGUF file's header; long arrays are `_Length`.

    Raises:
        UnknownModelError: the file cannot be read or is not GGUF (version 2 or 3, little-endian).
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(path, buf)
    except OSError as exc:
        raise UnknownModelError(f"cannot read {path}: {exc.strerror or exc}; check the path and its permissions") \
            from exc
    except ValueError as exc:  # mmap of an empty file
        raise UnknownModelError(f"{path} is not a GGUF file ({exc}); point MODEL at a .gguf model file") from exc


def _parse_header(path: str, buf) -> tuple[dict, list]:
    if buf[:4] != _GGUF_MAGIC:
        raise UnknownModelError(f"{path} is not a GGUF file (it does not start with 'GGUF'); point MODEL at a .gguf "
                                "model file, a model folder or a config.json")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version not in (2, 3):
        raise UnknownModelError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian: "
                                "llama.cpp's convert_hf_to_gguf.py writes 3)")
    pos = 8
    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos)
        pos += 16
        fields = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            fields[key], pos = _value(buf, pos, vtype)
        tensors = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ttype, _offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append((name, tuple(shape), _ggml_type_name(ttype)))
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise UnknownModelError(f"{path}: the GGUF header is cut short or damaged ({exc}); download the file "
                                "again") from exc
    return fields, tensors


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if pos + 8 + n > len(buf):
        raise struct.error(f"a string of {n} bytes runs past the end of the file")
    return bytes(buf[pos + 8: pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(buf, pos: int, vtype: int):
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR and n > _ARRAY_KEEP:  # skipped in one step
            return _Length(n), pos + n * struct.calcsize(_SCALAR[etype])
        if etype == _STRING and n > _ARRAY_KEEP:  # each string's length must be read to find the next one
            for _ in range(n):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            return _Length(n), pos
        out = []
        for _ in range(n):
            item, pos = _value(buf, pos, etype)
            out.append(item)
        return out, pos
    raise struct.error(f"unknown GGUF value type {vtype}")


def _ggml_type_name(ttype: int) -> str:
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(ttype).name
    except (ImportError, ValueError):
        return _GGML_TYPES.get(ttype, f"type {ttype}")


def dequantize_note(weights_type: str, dtype_name: str, method: str = "") -> str:
    """What happens to a GGUF's weights in a run: transformers dequantizes every tensor on load
    (modeling_gguf_pytorch_utils.load_gguf_checkpoint: `dequantize(tensor.data, tensor.tensor_type)`), then casts
    them to the run's dtype; QLoRA quantizes them again to NF4."""
    to = "bf16, then NF4 for QLoRA" if method == "qlora" else dtype_name
    bits = weights_bits(weights_type)
    precision = f"{bits}-bit" if bits else weights_type
    return (f"weights dequantized from {weights_type} to {to} on load: the GGUF's {precision} precision is not what "
            "trains")


# ---- what train loads ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    """A model source as transformers loads it: `from_pretrained(folder, gguf_file=gguf_file)`."""

    folder: str
    gguf_file: str | None = None
    """The GGUF file's name inside `folder` (None for a Hugging Face folder)."""
    hub_id: str | None = None
    """The Hub id the folder is the cached snapshot of, if any."""

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def local_model(source: str, *, download: bool = False, key: str = "model:") -> LocalModel:
    """Where the files of `source` (a model folder, a .gguf file or a Hub id) are on this machine.

    A Hub id is looked up in the Hub cache; when it is not there it is downloaded if `download` (and not
    offline), else refused.

    Raises:
        ConfigError: `source` is none of those, or a Hub id is not cached and cannot be downloaded (the message
            gives the `hf download` command).
    """
    source = str(source)
    if os.path.isdir(source):
        return LocalModel(folder=source)
    if os.path.isfile(source) and is_gguf_path(source):
        folder, name = os.path.split(os.path.abspath(source))
        return LocalModel(folder=folder, gguf_file=name)
    if is_hub_id(source):
        folder = cached_hub_snapshot(source)
        if folder is None and download:
            folder = download_hub_snapshot(source, key)
        if folder is None:
            raise ConfigError(not_cached_message(source, key) if hub_offline() else
                              f"{key} {source} is not in the Hub cache ({hub_cache_dir()}); download it with "
                              f"`{download_command(source)}`")
        return LocalModel(folder=folder, hub_id=source)
    raise ConfigError(f"{key} {source!r} is not a model folder, a .gguf file or a Hub id (org/name); point it at "
                      "one of those")


# ---- code a model folder ships ---------------------------------------------------------------------------------

#: The files of a model folder whose `auto_map` names the classes transformers imports from the folder's own .py
#: files when trust_remote_code is true.
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")


def remote_code_files(folder: str) -> list[str]:
    """The .py files of `folder` that transformers runs with trust_remote_code true: the modules the `auto_map` of
    its config.json and tokenizer_config.json name ("modeling_x.XForCausalLM" -> modeling_x.py), in order, once
    each. Entries of another repository ("org/repo--modeling_x.X") are named as they are written. Empty when no
    auto_map (transformers then builds its own classes and runs no code of the folder)."""
    files: list[str] = []
    for name in AUTO_MAP_FILES:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable or damaged: the loader names the file when it reads it
        if not isinstance(auto_map, dict):
            continue
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "." in ref:
                    module = ref.rsplit(".", 1)[0]
                    shown = module.replace("--", ":") + ".py" if "--" in module else module + ".py"
                    if shown not in files:
                        files.append(shown)
    return files


_ANNOUNCED: set[str] = set()


def announce_remote_code(source: str, folder: str, log) -> None:
    """Log, once per folder and before anything loads, which .py files of `folder` trust_remote_code will run."""
    files = remote_code_files(folder)
    key = os.path.abspath(folder)
    if files and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        log.warning("running code from %s: %s (trust_remote_code: true)", source, ", ".join(files))


# ---- what transformers says about a config.json ----------------------------------------------------------------

#: Words transformers' errors use for a config.json key they do not name.
_CONFIG_KEY_ALIASES = {"padding_idx": "pad_token_id"}


def short_error(exc: BaseException, limit: int = 300) -> str:
    """"TypeName: message" of an exception, cut to `limit` characters, on one line."""
    text = " ".join(str(exc).split())
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."


def config_json_problem(folder: str, exc: BaseException, config: dict | None = None) -> str | None:
    """"FOLDER/config.json: transformers refuses KEY: VALUE (its error); ..." when `exc` (raised by transformers
    reading the folder's model or tokenizer) is about keys of config.json (`config`, else the folder's file); None
    when no key can be told."""
    if config is None:
        config = _read_json_object(os.path.join(folder, "config.json")) if os.path.isdir(folder) else None
    named = _config_keys_in(config or {}, exc)
    if not named:
        return None
    where = os.path.join(folder, "config.json") if os.path.isdir(folder) else f"{folder} (config)"
    shown = ", ".join(f"{k}: {config[k]!r}" for k in named)
    return f"{where}: transformers refuses {shown} ({short_error(exc)}); fix the value (compare the model's " \
           "original config.json)"


def _read_json_object(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _config_keys_in(config: dict, exc: BaseException) -> list[str]:
    """The config.json keys `exc` is about: those its message names (or names by another word: padding_idx), else
    (a KeyError of a lookup table, like ACT2FN["bogus"]) those whose value is the missing key."""
    text = str(exc)
    for word, key in _CONFIG_KEY_ALIASES.items():
        if word.lower() in text.lower():
            text += f" {key}"
    named = [k for k in config if isinstance(k, str) and len(k) > 3 and re.search(rf"\b{re.escape(k)}\b", text)]
    if named:
        return named[:3]
    if isinstance(exc, KeyError) and exc.args:
        missing = exc.args[0]
        return [k for k, v in config.items()
                if v == missing or isinstance(v, dict) and missing in v.values()][:3]
    return []
