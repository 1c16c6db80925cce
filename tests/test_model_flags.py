"""Issue 34: architectures reach the memory model as ModelSpec flags, set in one place (specs/model.py) from the
config.json's model_type; the analytic engine never reads model_type itself."""

import dataclasses
import pathlib

import pytest

from fitune.memory import estimate
from fitune.setup import TrainSetup
from fitune.specs.model import catalog_model_names, load_model_spec, model_spec_from_hf_config

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 13, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "sliding_window": 32}


@pytest.mark.parametrize("model_type,extra,one_plus_weight,every_n,sliding_layers", [
    ("llama", {}, False, 0, 0),
    ("mistral", {}, False, 0, 13),  # every layer slides
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 10}, False, 0, 3),  # the last 13 - 10
    ("gemma", {}, True, 0, 0),
    ("gemma2", {}, True, 2, 7),  # layers 0, 2, ..., 12 slide (transformers: layer_idx % 2 == 0)
    ("gemma3_text", {}, True, 6, 11),  # layers 5 and 11 attend fully (pattern 6, the default)
    ("gemma3_text", {"sliding_window_pattern": 4}, True, 4, 10),  # layers 3, 7, 11 attend fully
])
def test_flags_follow_the_model_type(model_type, extra, one_plus_weight, every_n, sliding_layers):
    spec = model_spec_from_hf_config({"model_type": model_type, **SMALL, **extra})
    assert spec.rms_norm_one_plus_weight is one_plus_weight
    assert spec.full_attention_every_n_layers == every_n
    assert spec.sliding_window_layers == sliding_layers


def test_every_catalog_gemma_has_gemma_norms_and_nothing_else_does():
    for name in catalog_model_names():
        spec = load_model_spec(name)
        assert spec.rms_norm_one_plus_weight == spec.model_type.startswith("gemma"), name
        assert (spec.full_attention_every_n_layers > 0) == (spec.model_type in ("gemma2", "gemma3_text")), name


@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-3-1b", "qwen3-0.6b", "mistral-7b", "mixtral-8x7b", "phi-3-mini",
                                  "llama-3.2-1b"])
def test_the_estimate_reads_flags_not_the_model_type_name(name):
    """Renaming the model_type changes no number: the memory model sees only the flags and shapes."""
    spec = load_model_spec(name)
    renamed = dataclasses.replace(spec, model_type="renamed")
    for setup in (TrainSetup(batch_size=1, seq_len_tokens=8192, attn="eager", lora_targets=("all-linear",)),
                  TrainSetup(batch_size=2, seq_len_tokens=2048, stack="fitune", loss="chunked", lean_norm=True,
                             lora_targets=("all-linear",))):
        a, b = estimate(spec, setup), estimate(renamed, setup)
        assert (a.peak_allocated_bytes, a.breakdown) == (b.peak_allocated_bytes, b.breakdown)


def test_gemma_norm_flag_changes_the_layer_estimate():
    """The flag is what the layer model reads: Gemma's (1 + weight) norm keeps one more fp32 temporary."""
    spec = model_spec_from_hf_config({"model_type": "llama", **SMALL})
    setup = TrainSetup(batch_size=1, seq_len_tokens=256)
    plain = estimate(spec, setup)
    gemma_norms = estimate(dataclasses.replace(spec, rms_norm_one_plus_weight=True), setup)
    assert plain.timeline() != gemma_norms.timeline()


def test_the_layer_model_never_reads_model_type():
    source = (pathlib.Path(__file__).parents[1] / "fitune" / "memory" / "layers.py").read_text()
    assert "model_type" not in source
