"""`fitune train` end to end on the CPU with a tiny random Llama and a tokenizer the test builds."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from fitune.cli.main import main  # noqa: E402
from fitune.errors import ConfigError  # noqa: E402
from fitune.config import config_from_dict  # noqa: E402
from fitune.train.loop import TrainingInterrupted, train  # noqa: E402

from tiny import make_chat_data, make_model_folder, write_config  # noqa: E402


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = make_model_folder(str(root / "model"))
    data = make_chat_data(str(root / "train.jsonl"), n=48)
    eval_data = make_chat_data(str(root / "eval.jsonl"), n=8, seed=1)
    return root, model, data, eval_data


def _cfg(workspace, out, **over):
    root, model, data, eval_data = workspace
    doc = {"model": model, "data": {"path": data, "format": "chat", "eval_path": eval_data}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "seq_len": 32, "batch_size": 4,
           "grad_accum": 1, "max_steps": 30, "lr": 5e-3, "output_dir": str(root / out), "dtype": "fp32",
           "schedule": "constant", "eval_every": 10, "seed": 3}
    doc.update(over)
    return config_from_dict(doc, "test")


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line and "eval_loss" not in line]


def test_thirty_steps_of_lora_loss_falls_and_adapter_reloads(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _cfg(workspace, "run", lora={"rank": 8, "alpha": 16, "targets": "all-linear"}, lr=1e-2)
    result = train(cfg, progress=False)
    lines = _losses(cfg.output_dir)
    assert [line["step"] for line in lines] == list(range(1, 31))
    assert set(lines[0]) >= {"step", "loss", "lr", "tokens", "tokens_per_s", "peak_allocated_bytes"}
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    # a 2-layer random model whose lm_head stays frozen learns slowly through LoRA; full fine-tuning of the
    # same model drops the loss 20x in 30 steps (test_full_fine_tuning_learns_the_pattern)
    assert last < 0.9 * first, (first, last)
    assert result.eval_losses and min(result.eval_losses.values()) < max(result.eval_losses.values())
    assert os.path.isfile(os.path.join(result.adapter_dir, "adapter_model.safetensors"))
    assert not any(f.endswith(".bin") for f in os.listdir(result.adapter_dir))
    # the adapter, loaded with PEFT onto a fresh base, reproduces the trained model's logits
    base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    ids = torch.tensor([[5, 14, 15, 16, 17, 8, 10, 2]])
    trained = result.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained(input_ids=ids).logits)
        plain = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
        assert not torch.allclose(plain(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_merge_writes_weights_that_match_the_adapter(workspace):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(workspace, "merge", max_steps=3, eval_every=None, merge=True)
    result = train(cfg, progress=False)
    assert os.path.isfile(os.path.join(result.merged_dir, "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(result.merged_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 14, 15, 16, 17, 8, 10, 2]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, result.model.eval()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_full_fine_tuning_learns_the_pattern(workspace):
    cfg = _cfg(workspace, "full", method="full", lr=3e-3, eval_every=None)
    result = train(cfg, progress=False)
    assert sum(result.losses[-5:]) / 5 < 0.25 * sum(result.losses[:5]) / 5
    assert os.path.isfile(os.path.join(result.merged_dir, "model.safetensors"))


def test_resume_reproduces_an_uninterrupted_run(workspace):
    ref = _cfg(workspace, "ref", max_steps=10, save_every=5, eval_every=None)
    train(ref, progress=False)
    cut = _cfg(workspace, "cut", max_steps=10, save_every=5, eval_every=None)

    def interrupt(step, micro):
        if step == 7:  # Ctrl-C during the 8th step: the checkpoint of step 7 is written
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train(cut, fault=interrupt, progress=False)
    assert os.path.isdir(os.path.join(cut.output_dir, "checkpoints", "step-000007"))
    train(cut, resume=True, progress=False)
    a = [line["loss"] for line in _losses(ref.output_dir)]
    b = [line["loss"] for line in _losses(cut.output_dir)]
    assert len(b) == 10
    assert b == pytest.approx(a, rel=1e-6, abs=1e-7)


def test_injected_oom_is_survived_without_losing_or_repeating_data(workspace):
    ref = _cfg(workspace, "oom-ref", max_steps=6, eval_every=None)
    train(ref, progress=False)
    cfg = _cfg(workspace, "oom", max_steps=6, eval_every=None)
    raised = []

    def oom(step, micro):
        if step == 2 and not raised:
            raised.append(micro)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    result = train(cfg, fault=oom, progress=False)
    assert raised and result.steps == 6
    assert result.plan.changes[0]["why"].startswith("micro-batch 4 -> 2")
    lines = _losses(cfg.output_dir)
    assert [line["micro_batch_size"] for line in lines] == [4, 4, 2, 2, 2, 2]
    # same data, same effective batch: the same losses as a run that never ran out of memory
    assert [line["loss"] for line in lines] == pytest.approx([line["loss"] for line in _losses(ref.output_dir)], rel=1e-5)


def test_chunked_loss_trains_like_the_plain_loss(workspace):
    plain = train(_cfg(workspace, "plain", max_steps=4, eval_every=None), progress=False)
    chunked = train(_cfg(workspace, "chunked", max_steps=4, eval_every=None, loss="chunked"), progress=False)
    assert chunked.losses == pytest.approx(plain.losses, rel=1e-4)


@pytest.mark.parametrize("mode", ["offload", "selective:1", "tiled_mlp", "lean_lora", "lean_norm"])
def test_memory_techniques_train_like_the_plain_step(workspace, mode):
    plain = train(_cfg(workspace, f"ck-plain-{mode}", max_steps=3, eval_every=None), progress=False)
    change = {mode: True} if mode in ("tiled_mlp", "lean_lora", "lean_norm") else {"grad_checkpointing": mode}
    other = train(_cfg(workspace, f"ck-{mode}", max_steps=3, eval_every=None, **change), progress=False)
    assert other.losses == pytest.approx(plain.losses, rel=1e-5)


def test_packed_rows_train_the_same_with_and_without_the_mask(workspace, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="fitune")
    masked = train(_cfg(workspace, "pack-mask", max_steps=3, eval_every=None, packing=True, packing_attention="mask",
                        seq_len=64, batch_size=2), progress=False)
    varlen = train(_cfg(workspace, "pack-varlen", max_steps=3, eval_every=None, packing=True, seq_len=64,
                        batch_size=2), progress=False)
    assert "examples attended one by one" in caplog.text
    assert varlen.losses == pytest.approx(masked.losses, rel=1e-5)


def test_config_errors_are_listed_together(workspace):
    root, model, data, _ = workspace
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": model, "data": {"path": data}, "method": "lorra", "lr": -1, "bogus": 1,
                          "max_steps": 5}, "test")
    msg = str(info.value)
    # a config file's problems name its YAML keys, not CLI flags
    assert "bogus: not a fitune key" in msg and "method: 'lorra'" in msg and "lr: must be above 0" in msg
    assert "--method" not in msg


def test_bad_data_line_is_reported_by_number(workspace, tmp_path, capsys):
    root, model, data, _ = workspace
    bad = tmp_path / "bad.jsonl"
    lines = open(data).read().splitlines()
    lines[2] = "{not json"
    bad.write_text("\n".join(lines) + "\n")
    cfg = write_config(str(tmp_path / "run.yaml"), model=model, data={"path": str(bad)}, max_steps=2, seq_len=32,
                       output_dir=str(tmp_path / "out"))
    assert main(["train", cfg, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "Traceback" not in err


def test_a_run_whose_first_step_trains_nothing_stops_with_what_to_do(workspace, tmp_path, capsys, monkeypatch):
    """The first step's gradients are checked (fitune.runtime.step.require_gradients), once per process: a model
    whose LoRA gradients all come out zero - the compiled-layer bug of torch 2.11 on CUDA - ends the run with one
    message and exit code 2 before its optimizer steps, not 30 steps of a loss that looks fine."""
    import fitune.runtime.step as step_mod

    calls = []
    real = step_mod.require_gradients
    monkeypatch.setattr(step_mod, "require_gradients", lambda model: (calls.append(1), real(model))[1])
    root, model, data, _ = workspace
    cfg = write_config(str(tmp_path / "ok.yaml"), model=model, data={"path": data}, max_steps=3, seq_len=32,
                       output_dir=str(tmp_path / "ok"))
    assert main(["train", cfg, "--no-progress"]) == 0
    assert calls == [1]  # the first step only

    from fitune.runtime import model as model_mod

    wrap = model_mod.wrap_lora

    def zero_gradient_lora(*args, **kwargs):
        wrapped = wrap(*args, **kwargs)
        for p in wrapped.parameters():
            if p.requires_grad:
                p.register_hook(torch.zeros_like)
        return wrapped

    monkeypatch.setattr(model_mod, "wrap_lora", zero_gradient_lora)
    cfg = write_config(str(tmp_path / "zero.yaml"), model=model, data={"path": data}, max_steps=3, seq_len=32,
                       output_dir=str(tmp_path / "zero"))
    assert main(["train", cfg, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "zero gradient" in err and "compile: none" in err and "Traceback" not in err
    assert not os.path.exists(os.path.join(tmp_path, "zero", "metrics.jsonl")) or not _losses(str(tmp_path / "zero"))
