"""`fitune estimate` end to end through main(): output, JSON keys, errors and exit codes."""

import json

import pytest

from fitune.cli.main import main

SEEDS = ["estimate", "llama-3.1-8b", "--method", "lora", "--seq-len", "2048", "--batch-size", "2",
         "--grad-checkpointing", "full", "--gpu", "rtx4090"]

JSON_KEYS = {"model", "engine", "setup", "peak_allocated_bytes", "peak_reserved_bytes", "peak_phase", "breakdown",
             "phases", "resident_bytes", "trainable_params", "total_params", "host_bytes", "notes", "gpu", "fits",
             "headroom_bytes", "suggestions", "tight", "retries_expected", "source_note",
             # every phase of the run (issue 33, docs/phases.md)
             "run_phases", "worst_phase", "host_peak_phase", "host_peak_bytes", "run_fits"}
CATEGORIES = {"weights", "adapter_weights", "gradients", "optimizer_states", "saved_activations",
              "logits_and_loss", "transients", "workspaces", "allocator_overhead"}


def test_seeds_case_human_output(capsys):
    assert main(SEEDS) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b: lora r8 on q_proj,v_proj, 2 x 2048 tokens" in out
    assert "peak reserved" in out and "rtx4090: 23.40 GiB for PyTorch's allocator" in out
    assert "FITS ONLY WITH ALLOCATOR RETRIES" in out and "largest terms: weights" in out


def test_json_is_stable(capsys):
    assert main(SEEDS + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == JSON_KEYS
    assert set(doc["breakdown"]) == CATEGORIES
    assert set(doc["phases"]) == {"forward", "backward", "optimizer"}
    assert sum(v for k, v in doc["breakdown"].items() if k != "allocator_overhead") == doc["peak_allocated_bytes"]
    assert doc["peak_allocated_bytes"] + doc["breakdown"]["allocator_overhead"] == doc["peak_reserved_bytes"]
    assert doc["fits"] is True and doc["retries_expected"] is True and doc["headroom_bytes"] < 0
    assert all(k.endswith("_bytes") for k in ("peak_allocated_bytes", "peak_reserved_bytes", "headroom_bytes"))


def test_without_checkpointing_it_does_not_fit(capsys):
    argv = [a for a in SEEDS if a not in ("--grad-checkpointing", "full")] + ["--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is False
    ckpt = [s for s in doc["suggestions"] if s["change"] == "--grad-checkpointing full"]
    assert ckpt and ckpt[0]["retries_expected"] is True


def test_qlora_fits_and_breakdown_adds_up(capsys):
    assert main(["estimate", "llama-3.1-8b", "--method", "qlora", "--grad-checkpointing", "full", "--gpu", "rtx4090",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["breakdown"]["weights"] < 6 * 2**30


@pytest.mark.parametrize("argv, message", [
    (["estimate", "lama-3.1-8b"], "closest catalog names"),
    (["estimate", "llama-3.1-8b", "--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    (["estimate", "llama-3.1-8b", "--lora-rank", "5000"], "above the model's hidden size 4096"),
    (["estimate", "llama-3.1-8b", "--gpu", "rtx4090x"], "not a known GPU"),
    (["estimate", "llama-3.1-8b", "--method", "lorax", "--optimizer", "lion"], "2 problems"),
    (["estimate", "llama-3.1-8b", "--lora-targets", "q,v"], "not a Linear of this model"),
    (["estimate", "llama-3.1-8b", "--grad-checkpointing", "selective:x"], "selective:K"),
    (["estimate"], "MODEL is missing"),
])
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_list_models_and_gpus(capsys):
    assert main(["estimate", "--list-models"]) == 0
    assert "qwen2.5-7b" in capsys.readouterr().out
    assert main(["estimate", "--list-gpus"]) == 0
    assert "a100-80gb" in capsys.readouterr().out


def test_config_json_path(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "intermediate_size": 512}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert main(["estimate", str(p), "--seq-len", "128", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_params"] == 2 * 1000 * 256 + 2 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512 + 2 * 256) + 256
