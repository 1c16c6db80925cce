"""`fitune estimate --engine trace` end to end: any architecture transformers builds, every setting modelled as
given or refused by name (exit 2, one message, no traceback). CPU only, no network."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.cli.main import main  # noqa: E402

#: A small GPT-NeoX (Pythia's architecture): a model_type the analytic engine does not model.
GPT_NEOX = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
            "max_position_embeddings": 256, "rotary_pct": 0.25, "use_parallel_residual": True}


@pytest.fixture
def neox_config(tmp_path):
    path = tmp_path / "tiny-neox" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(GPT_NEOX))
    return str(path)


def _run(capsys, *argv):
    rc = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_gpt_neox_answers_with_a_breakdown(capsys, neox_config):
    rc, out, err = _run(capsys, neox_config, "--engine", "trace", "--seq-len", "128", "--lora-targets",
                        "query_key_value", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["engine"] == "trace" and doc["model"] == "tiny-neox" and doc["model_type"] == "gpt_neox"
    b = doc["breakdown"]
    assert doc["peak_allocated_bytes"] > b["weights"] > 0
    assert b["adapter_weights"] == 4 * doc["trainable_params"]  # fp32 LoRA adapters
    assert doc["trainable_params"] == 2 * 8 * (64 + 3 * 64)  # query_key_value, rank 8, 2 layers
    assert doc["total_params"] > doc["trainable_params"]
    assert set(doc["phases"]) == {"forward", "backward", "optimizer"}
    assert sum(doc["peak_by_category"].values()) == doc["peak_allocated_bytes"]


def test_the_setup_reported_is_the_one_modelled(capsys, neox_config):
    rc, out, err = _run(capsys, neox_config, "--engine", "trace", "--seq-len", "64", "--batch-size", "1",
                        "--method", "freeze", "--attn", "eager", "--grad-checkpointing", "selective:1",
                        "--optimizer", "sgd", "--dtype", "fp32", "--json")
    assert rc == 0, err
    s = json.loads(out)["setup"]
    assert (s["method"], s["attn"], s["grad_checkpointing"], s["optimizer"], s["dtype"]) == (
        "freeze", "eager", "selective:1", "sgd", "fp32")
    assert (s["seq_len_tokens"], s["batch_size"]) == (64, 1)


def test_human_output_shows_its_assumptions(capsys, neox_config):
    rc, out, err = _run(capsys, neox_config, "--engine", "trace", "--seq-len", "64", "--method", "full",
                        "--grad-checkpointing", "full", "--gpu", "rtx4090")
    assert rc == 0, err
    assert "trace engine" in out and "gpt_neox" in out and "checkpointing full" in out and "FITS" in out


def test_the_analytic_engine_still_rejects_it_and_points_to_trace(capsys, neox_config):
    rc, out, err = _run(capsys, neox_config, "--seq-len", "128")
    assert rc == 2
    assert "gpt_neox" in err and "--engine trace" in err and "Traceback" not in err


def test_lora_targets_given_that_the_model_lacks_are_named(capsys, neox_config):
    rc, out, err = _run(capsys, neox_config, "--engine", "trace", "--seq-len", "128", "--lora-targets", "q_proj,k_proj")
    assert rc == 2
    assert "lora.targets: q_proj,k_proj" in err and "query_key_value" in err and "Traceback" not in err


def test_without_lora_targets_peft_default_for_the_model_type_is_modelled(capsys, tmp_path):
    cfg = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
           "max_position_embeddings": 128}
    path = tmp_path / "small-neox" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    rc = main(["estimate", str(path), "--engine", "trace", "--seq-len", "32", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["setup"]["lora_targets"] == ["query_key_value"]
    assert "--lora-targets not given: PEFT's default for gpt_neox, query_key_value" in doc["notes"]
    assert doc["trainable_params"] == 2 * 8 * (64 + 3 * 64)  # query_key_value, rank 8, 2 layers


UNSUPPORTED = [
    (["--method", "qlora"], "--method qlora"),
    (["--attn", "flash"], "--attn flash"),
    (["--grad-checkpointing", "offload"], "--grad-checkpointing offload"),
    (["--optimizer", "adamw8bit"], "--optimizer adamw8bit"),
    (["--optimizer", "paged_adamw8bit"], "--optimizer paged_adamw8bit"),
    (["--stack", "fitune"], "--stack fitune"),
    (["--stack", "fitune", "--loss", "chunked"], "--loss chunked"),
    (["--stack", "fitune", "--tiled-mlp"], "--tiled-mlp"),
    (["--stack", "fitune", "--lean-lora"], "--lean-lora"),
    (["--stack", "fitune", "--lean-norm"], "--lean-norm"),
    (["--stack", "fitune", "--kernels", "liger"], "--kernels liger"),
    (["--stack", "fitune", "--expandable-segments"], "--expandable-segments"),
]


@pytest.mark.parametrize("flags,named", UNSUPPORTED, ids=[n for _, n in UNSUPPORTED])
def test_each_setting_it_cannot_model_exits_2_naming_it(capsys, neox_config, flags, named):
    rc, out, err = _run(capsys, neox_config, "--engine", "trace", "--lora-targets", "query_key_value", *flags)
    assert rc == 2
    assert "cannot model" in err and named in err and "analytic" in err
    assert out == "" and "Traceback" not in err


def test_qlora_on_a_catalog_model_exits_2_without_a_traceback(capsys):
    rc, out, err = _run(capsys, "llama-3.1-8b", "--engine", "trace", "--method", "qlora")
    assert rc == 2
    assert err.startswith("fitune estimate: error: --engine trace cannot model --method qlora")


@pytest.mark.parametrize("content,message", [
    ("{not json", "cannot read"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"hidden_size": 64}), "no 'model_type'"),
    (json.dumps({"model_type": "no_such_arch"}), "does not know model_type 'no_such_arch'"),
    (json.dumps({"model_type": "t5", "d_model": 64}), "cannot build a causal LM"),
    (json.dumps({**GPT_NEOX, "hidden_size": 65}), "cannot build a causal LM"),
])
def test_bad_config_json_is_one_clear_message(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    rc, out, err = _run(capsys, str(path), "--engine", "trace", "--seq-len", "16")
    assert rc == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
