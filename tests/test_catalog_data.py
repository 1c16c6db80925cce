"""Checks for the built-in catalogs fitune/specs/data/{models,gpus}.json.

CPU only, no network: every model is instantiated on the meta device, so no
weights are allocated and even the 405B entry builds in well under a second.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[1] / "fitune" / "specs" / "data"
MODELS_PATH = DATA_DIR / "models.json"
SEED_PATH = DATA_DIR / "models_seed.json"
GPUS_PATH = DATA_DIR / "gpus.json"

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]*[a-z0-9]$")
HF_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
PUBLISHED_TOLERANCE = 0.005  # 0.5 %

MODEL_REQUIRED = {"hf_id", "source", "config"}
MODEL_OPTIONAL = {"notes", "published_params", "published_params_source"}
GPU_REQUIRED = {
    "display_name",
    "total_memory_mib",
    "memory_bandwidth_gb_s",
    "peak_bf16_dense_tflops",
    "compute_capability",
    "supports_bf16",
    "pcie",
    "source",
    "notes",
}
GPU_OPTIONAL = {"peak_fp16_dense_tflops", "link", "link_gb_s", "link_source"}

# Entries the catalog promises to ship (catalog name -> model_type).
EXPECTED_MODELS = {
    "llama-2-7b": "llama",
    "llama-2-13b": "llama",
    "llama-2-70b": "llama",
    "llama-3-8b": "llama",
    "llama-3-70b": "llama",
    "llama-3.1-8b": "llama",
    "llama-3.1-70b": "llama",
    "llama-3.1-405b": "llama",
    "llama-3.2-1b": "llama",
    "llama-3.2-3b": "llama",
    "mistral-7b": "mistral",
    "mistral-7b-v0.1": "mistral",
    "mixtral-8x7b": "mixtral",
    "qwen2.5-0.5b": "qwen2",
    "qwen2.5-1.5b": "qwen2",
    "qwen2.5-3b": "qwen2",
    "qwen2.5-7b": "qwen2",
    "qwen2.5-14b": "qwen2",
    "qwen2.5-32b": "qwen2",
    "qwen2.5-72b": "qwen2",
    "qwen3-0.6b": "qwen3",
    "qwen3-1.7b": "qwen3",
    "qwen3-4b": "qwen3",
    "qwen3-8b": "qwen3",
    "qwen3-14b": "qwen3",
    "qwen3-32b": "qwen3",
    "qwen3-30b-a3b": "qwen3_moe",
    "gemma-2-2b": "gemma2",
    "gemma-2-9b": "gemma2",
    "gemma-2-27b": "gemma2",
    "gemma-3-1b": "gemma3_text",
    "gemma-3-4b": "gemma3_text",
    "phi-3-mini": "phi3",
    "phi-4": "phi3",
}
EXPECTED_GPUS = {
    "t4", "rtx3060", "rtx3090", "rtx4090", "rtx5090", "a10", "l4",
    "a100-40gb", "a100-80gb", "h100", "h200",
}


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate JSON key: {key!r}")
        out[key] = value
    return out


def _load(path: Path) -> dict:
    with path.open(encoding="utf-8") as fh:
        return json.load(fh, object_pairs_hook=_no_duplicate_keys)


MODELS = _load(MODELS_PATH)
GPUS = _load(GPUS_PATH)


def _is_pos_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_pos_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# --------------------------------------------------------------------------- #
# 1. structure and sane values
# --------------------------------------------------------------------------- #
def test_files_load_without_duplicate_keys():
    # _load already raised on duplicates; make sure the catalogs are non-trivial.
    assert len(MODELS) >= len(EXPECTED_MODELS)
    assert len(GPUS) >= len(EXPECTED_GPUS)


def test_expected_models_present_with_model_type():
    missing = sorted(set(EXPECTED_MODELS) - set(MODELS))
    assert not missing, f"missing catalog entries: {missing}"
    for name, model_type in EXPECTED_MODELS.items():
        assert MODELS[name]["config"]["model_type"] == model_type, name


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_entry_shape(name):
    entry = MODELS[name]
    assert NAME_RE.match(name), f"catalog name must be lowercase with dashes: {name!r}"
    assert name == name.lower()
    keys = set(entry)
    assert MODEL_REQUIRED <= keys, f"{name}: missing {MODEL_REQUIRED - keys}"
    unknown = keys - MODEL_REQUIRED - MODEL_OPTIONAL
    assert not unknown, f"{name}: unknown keys {unknown}"

    hf_id = entry["hf_id"]
    assert isinstance(hf_id, str) and HF_ID_RE.match(hf_id), hf_id
    assert entry["source"] == f"https://huggingface.co/{hf_id}/blob/main/config.json"

    if "notes" in entry:
        assert isinstance(entry["notes"], str) and entry["notes"].strip()
    if "published_params" in entry or "published_params_source" in entry:
        assert _is_pos_int(entry.get("published_params")), f"{name}: published_params must be a positive int"
        src = entry.get("published_params_source")
        assert isinstance(src, str) and src.strip(), f"{name}: published_params needs a source"

    cfg = entry["config"]
    assert isinstance(cfg, dict)
    assert isinstance(cfg.get("model_type"), str) and cfg["model_type"]
    archs = cfg.get("architectures")
    assert isinstance(archs, list) and len(archs) == 1 and archs[0].endswith("ForCausalLM"), archs
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "vocab_size", "max_position_embeddings"):
        assert _is_pos_int(cfg.get(field)), f"{name}: {field}={cfg.get(field)!r}"
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    assert _is_pos_int(kv) and heads % kv == 0, f"{name}: {heads} heads vs {kv} kv heads"
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        assert cfg["hidden_size"] % heads == 0, name
    else:
        assert _is_pos_int(head_dim), name
    if "tie_word_embeddings" in cfg:
        assert isinstance(cfg["tie_word_embeddings"], bool)
    for moe_field in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if moe_field in cfg:
            assert _is_pos_int(cfg[moe_field]), f"{name}: {moe_field}"
    n_exp = cfg.get("num_local_experts", cfg.get("num_experts"))
    if n_exp is not None:
        assert cfg["num_experts_per_tok"] <= n_exp
    if "torch_dtype" in cfg:
        assert cfg["torch_dtype"] in {"float32", "float16", "bfloat16"}


def test_hf_ids_unique():
    ids = [e["hf_id"] for e in MODELS.values()]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"several catalog names point at the same repo: {dupes}"


def test_expected_gpus_present():
    missing = sorted(EXPECTED_GPUS - set(GPUS))
    assert not missing, f"missing GPUs: {missing}"


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_entry_shape(name):
    gpu = GPUS[name]
    assert NAME_RE.match(name) and name == name.lower(), name
    keys = set(gpu)
    assert GPU_REQUIRED <= keys, f"{name}: missing {GPU_REQUIRED - keys}"
    unknown = keys - GPU_REQUIRED - GPU_OPTIONAL
    assert not unknown, f"{name}: unknown keys {unknown}"

    assert isinstance(gpu["display_name"], str) and gpu["display_name"].strip()
    mib = gpu["total_memory_mib"]
    assert _is_pos_int(mib) and 4_000 <= mib <= 300_000, f"{name}: total_memory_mib={mib!r}"
    assert _is_pos_num(gpu["memory_bandwidth_gb_s"]) and gpu["memory_bandwidth_gb_s"] < 20_000
    assert isinstance(gpu["supports_bf16"], bool)
    tflops = gpu["peak_bf16_dense_tflops"]
    if gpu["supports_bf16"]:
        assert _is_pos_num(tflops) and tflops < 10_000, f"{name}: peak_bf16_dense_tflops={tflops!r}"
    else:
        assert tflops is None, f"{name}: no bf16 support but a bf16 peak is given"
    if "peak_fp16_dense_tflops" in gpu:
        assert _is_pos_num(gpu["peak_fp16_dense_tflops"])
    cc = gpu["compute_capability"]
    assert isinstance(cc, str) and re.fullmatch(r"\d+\.\d", cc), cc
    # bf16 tensor cores arrived with Ampere (sm_80).
    assert gpu["supports_bf16"] == (float(cc) >= 8.0), f"{name}: supports_bf16 inconsistent with cc {cc}"
    pcie = gpu["pcie"]
    assert pcie is None or re.fullmatch(r"[3-6]\.0 x(8|16)", pcie), f"{name}: pcie={pcie!r}"
    sources = gpu["source"] if isinstance(gpu["source"], list) else [gpu["source"]]
    assert sources and all(isinstance(s, str) and s.startswith("https://") for s in sources)
    assert isinstance(gpu["notes"], str) and gpu["notes"].strip()


def test_gpu_display_names_unique():
    names = [g["display_name"] for g in GPUS.values()]
    assert len(names) == len(set(names))


def test_gpu_known_values():
    # Values quoted in the task brief / observed with nvidia-smi.
    assert GPUS["rtx4090"]["total_memory_mib"] == 24564
    assert GPUS["rtx3090"]["total_memory_mib"] == 24576
    assert GPUS["h200"]["total_memory_mib"] == 143771
    for name in ("t4", "v100-16gb", "v100-32gb"):
        if name in GPUS:
            assert GPUS[name]["supports_bf16"] is False, name


# --------------------------------------------------------------------------- #
# 2. every config builds on the meta device; counts match published numbers
# --------------------------------------------------------------------------- #
def _build_meta_model(cfg: dict):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    # deepcopy: transformers rewrites nested dicts such as rope_scaling in place.
    skip = ("model_type", "architectures", "torch_dtype")
    kwargs = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in skip}
    config = AutoConfig.for_model(cfg["model_type"], **kwargs)
    with torch.device("meta"):
        # AutoModelForCausalLM maps gemma3_text to Gemma3ForCausalLM (the text-only class).
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_builds_on_meta_and_matches_published_params(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    entry = MODELS[name]
    model = _build_meta_model(entry["config"])
    assert type(model).__name__ == entry["config"]["architectures"][0]
    params = list(model.parameters())  # unique tensors: tied embeddings count once
    assert all(p.device.type == "meta" for p in params)
    n_params = sum(p.numel() for p in params)
    assert n_params > 0
    published = entry.get("published_params")
    if published is not None:
        rel = abs(n_params - published) / published
        assert rel <= PUBLISHED_TOLERANCE, (
            f"{name}: built {n_params:,} parameters, published {published:,} "
            f"({rel:.2%} off, tolerance {PUBLISHED_TOLERANCE:.1%})"
        )


# --------------------------------------------------------------------------- #
# 3. the seed entries are carried over unchanged
# --------------------------------------------------------------------------- #
def test_seed_entries_equal_in_catalog():
    seed = _load(SEED_PATH)
    assert seed, "seed file is empty"
    for name, seed_entry in seed.items():
        assert name in MODELS, f"seed entry {name!r} missing from models.json"
        entry = MODELS[name]
        for key, value in seed_entry.items():
            assert entry.get(key) == value, f"{name}: field {key!r} differs from models_seed.json"
        # models.json may only add optional metadata (notes / published_params) on top.
        extra = set(entry) - set(seed_entry)
        assert extra <= MODEL_OPTIONAL, f"{name}: unexpected extra keys {extra}"
