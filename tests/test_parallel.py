"""`fitune train --gpus 2` on the CPU: two gloo ranks (FITUNE_CPU_RANKS=1) train the tiny Llama with DDP and FSDP2.

The global batch is batch_size x gpus, so two ranks of batch_size 2 train the same 4 rows per step as one process
of batch_size 4: the losses must agree to float rounding, and so must the adapters.
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from fitune.cli.main import main  # noqa: E402
from fitune.parallel import CPU_RANKS_ENV  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402

from tiny import make_chat_data, make_model_folder, write_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    model = make_model_folder(str(root / "model"))
    data = make_chat_data(str(root / "train.jsonl"), n=40)
    return root, model, data


def _config(workspace, name, **over) -> str:
    root, model, data = workspace
    doc = {"model": model, "data": {"path": data, "format": "chat"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "seq_len": 32, "batch_size": 2,
           "max_steps": STEPS, "lr": 5e-3, "output_dir": str(root / name), "dtype": "fp32", "schedule": "constant",
           "seed": 3}
    doc.update(over)
    return write_config(str(root / f"{name}.yaml"), **doc)


def _fitune_train(config: str, *flags: str, timeout: int = 240, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, CPU_RANKS_ENV: "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "fitune", "train", config, "--no-progress", *flags], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _losses(out_dir: str) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line and "eval_loss" not in line]


def _adapter(out_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def one_process(workspace):
    """The reference: one process, batch_size 4 (the two-rank runs' global batch)."""
    root = workspace[0]
    assert main(["train", _config(workspace, "one", batch_size=4), "--no-progress"]) == 0
    return str(root / "one")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_the_global_batch_as_one_process_does(workspace, one_process, strategy):
    out = str(workspace[0] / strategy)
    run = _fitune_train(_config(workspace, strategy), "--gpus", "2", "--strategy", strategy)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"trained {STEPS} steps" in run.stdout
    assert _losses(out) == pytest.approx(_losses(one_process), rel=1e-5)
    ref, got = _adapter(one_process), _adapter(out)
    assert sorted(got) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6)
    # rank 0 alone wrote: one metrics line per step, one run.json
    assert len(_losses(out)) == STEPS and os.path.isfile(os.path.join(out, "run.json"))
    ckpt = os.path.join(out, "checkpoints", f"step-{STEPS:06d}")
    if strategy == "fsdp":  # sharded: one safetensors file of shards per rank, no pickle
        shards = sorted(os.listdir(os.path.join(ckpt, "sharded")))
        assert [f for f in shards if f.endswith(".safetensors")] == [
            "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    else:
        assert os.path.isfile(os.path.join(ckpt, "trainable.safetensors"))


def test_fsdp_checkpoint_resumes_on_two_ranks_and_on_one(workspace, one_process):
    """Two ranks stop at step 2; resumed on two ranks the losses are the uninterrupted run's. The same sharded
    checkpoint loads into one process (DCP reshards): its weights are the two-rank run's at step 2."""
    root = workspace[0]
    cfg = _config(workspace, "cut", max_steps=2, save_every=1)
    run = _fitune_train(cfg, "--gpus", "2", "--strategy", "fsdp")
    assert run.returncode == 0, run.stderr[-3000:]
    import shutil

    shutil.copytree(root / "cut", root / "cut-one")
    run = _fitune_train(cfg, "--gpus", "2", "--strategy", "fsdp", "--resume", "--max-steps", str(STEPS))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "max_steps changed from 2 to 4" in run.stderr
    assert _losses(str(root / "cut")) == pytest.approx(_losses(one_process), rel=1e-5)
    # one process, same strategy: nothing left to train at step 2, so the adapter written is the loaded state
    one = _fitune_train(cfg, "--gpus", "1", "--strategy", "fsdp", "--resume", "--output-dir", str(root / "cut-one"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "--resume: gpus changed from 2 to 1" in one.stderr
    loaded, saved = _adapter(str(root / "cut-one")), _adapter(str(root / "cut"))
    assert loaded.keys() == saved.keys()
    # and training goes on there from the loaded optimizer state
    more = _fitune_train(cfg, "--gpus", "1", "--strategy", "fsdp", "--resume", "--max-steps", "3", "--output-dir",
                         str(root / "cut-one"))
    assert more.returncode == 0, more.stderr[-3000:]
    losses = _losses(str(root / "cut-one"))
    assert len(losses) == 3 and losses[:2] == _losses(str(root / "cut"))[:2]


def test_more_gpus_than_visible_is_refused_with_the_count(workspace, capsys, monkeypatch):
    monkeypatch.delenv(CPU_RANKS_ENV, raising=False)
    monkeypatch.setattr("fitune.parallel.launch.visible_gpus", lambda: 2)
    assert main(["train", _config(workspace, "four"), "--gpus", "4"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 4: this machine shows 2 CUDA GPUs" in err and "--gpus 2 or fewer" in err
    monkeypatch.setattr("fitune.parallel.launch.visible_gpus", lambda: 0)
    assert main(["train", _config(workspace, "four"), "--gpus", "2"]) == 2
    assert "no CUDA GPU is visible on this machine (0)" in capsys.readouterr().err


def test_unsupported_combinations_say_what_is_supported(workspace, capsys, monkeypatch):
    monkeypatch.setattr("fitune.parallel.launch.visible_gpus", lambda: 8)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "deepspeed" else object())
    assert main(["train", _config(workspace, "zero"), "--gpus", "2", "--strategy", "zero3"]) == 2
    assert "pip install deepspeed" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr("fitune.parallel.launch.visible_gpus", lambda: 8)
    assert main(["train", _config(workspace, "q"), "--gpus", "2", "--strategy", "fsdp", "--method", "qlora",
                 "--dtype", "bf16"]) == 2
    assert "supported: method qlora with strategy ddp" in capsys.readouterr().err
    assert main(["train", _config(workspace, "m", merge=True), "--gpus", "2", "--strategy", "fsdp"]) == 2
    assert "merge it afterwards" in capsys.readouterr().err


def test_train_help_teaches_gpus_and_strategy(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--gpus" in out and "--strategy" in out and "fitune train run.yaml --gpus 4 --strategy fsdp" in out
    assert "FITUNE_CPU_RANKS=1" in out


def test_launch_command_runs_the_ranks_under_torchrun():
    from fitune.parallel.launch import command

    cmd = command("/tmp/c.yaml", 4, resume=True, overwrite=False, progress=False)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:] == ["-m", "fitune", "train", "/tmp/c.yaml", "--resume", "--no-progress"]


def test_rank_slices_cover_the_global_batch_once(monkeypatch):
    """Rank r trains rows [r*per, (r+1)*per); a short last batch gives an empty rank label-free micro-batches, so
    every rank runs as many forwards as the others; the loss divisor is the global trained tokens / ranks."""
    from fitune import data as data_mod
    from fitune.data.encode import Example
    from fitune.parallel import data as pdata, ranks

    items = [Example(input_ids=tuple(range(1, 4 + i)), labels=tuple(range(1, 4 + i))) for i in range(5)]
    stream = data_mod.BatchStream(items, 5, seed=0, pad_token_id=0, packed=False, shuffle=False)
    batch = stream.next_batch()
    seen = []
    for rank in range(3):
        monkeypatch.setattr(ranks, "_CURRENT", ranks.Ranks(rank=rank, world_size=3, distributed=True))
        micro, num_items = pdata.rank_micro_batches(stream, [batch], micro_batch_size=1)
        assert len(micro) == 2  # ceil(5 / 3) rows each, one per micro-batch
        assert num_items == pytest.approx(batch.trained_tokens / 3)
        seen += [m.input_ids[0].tolist() for m in micro if m.trained_tokens]
        if rank == 2:
            assert micro[1].trained_tokens == 0 and (micro[1].labels == -100).all()
    assert sorted(seen) == sorted(list(e.input_ids) for e in items)  # every row once, on one rank


def test_deepspeed_config_is_valid_for_deepspeed():
    from fitune.parallel.deepspeed_config import deepspeed_config

    configs = {st: deepspeed_config(TrainSetup(strategy=st, batch_size=2, dtype="bf16"), 2, 1.0)
               for st in ("zero2", "zero3", "zero3_offload")}
    assert configs["zero2"]["zero_optimization"]["stage"] == 2
    assert configs["zero3"]["zero_optimization"]["stage"] == 3
    assert configs["zero3_offload"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert configs["zero3_offload"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="not one of"):
        deepspeed_config(TrainSetup(strategy="fsdp"), 2, 1.0)
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for strategy, config in configs.items():  # DeepSpeed's own parser and pydantic models accept every key
        parsed = DeepSpeedConfig(config)  # one process: train_batch_size = micro-batch x 1 x 1
        assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
        assert parsed.train_micro_batch_size_per_gpu == 2 and parsed.gradient_accumulation_steps == 1
        assert parsed.gradient_clipping == 1.0 and parsed.bfloat16_config.enabled
        assert (parsed.zero_config.offload_param is not None) == (strategy == "zero3_offload")


def test_zero3_on_two_cpu_ranks_trains_the_global_batch_as_one_process_does(workspace, one_process):
    """DeepSpeed ZeRO-3 through the same command (DeepSpeed's CPU accelerator, gloo; about 40 s with its
    shared-memory op built on the first run). The model is built partitioned (zero.Init), the adapters after it."""
    pytest.importorskip("deepspeed")
    out = str(workspace[0] / "zero3")
    run = _fitune_train(_config(workspace, "zero3"), "--gpus", "2", "--strategy", "zero3", timeout=400,
                        env_extra={"DS_ACCELERATOR": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ZeRO stage 3 over 2 ranks" in run.stdout + run.stderr
    # built under zero.Init (construction_context): the base model's 21 parameters were ZeRO parameters before
    # deepspeed.initialize, which partitioned only the 8 LoRA adapters PEFT added after construction
    assert "21 of 29 parameters" in run.stdout + run.stderr and "partitioned at construction" in run.stdout + run.stderr
    assert _losses(out) == pytest.approx(_losses(one_process), rel=1e-5)
    ref, got = _adapter(one_process), _adapter(out)
    assert sorted(got) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6)


_ZERO3_BUILD = """
import json, sys
from types import SimpleNamespace

import deepspeed
import torch
from safetensors.torch import load_file
from transformers.integrations import is_deepspeed_zero3_enabled

from fitune.parallel import ranks
from fitune.parallel.deepspeed_engine import construction_context, param_numel, release
from fitune.runtime.model import build_model_for_setup
from fitune.setup import TrainSetup

folder, strategy = sys.argv[1], sys.argv[2]
ranks.start(1, strategy)
saved = load_file(folder + "/model.safetensors")
out = {}
for init in ("pretrained", "random"):
    s = TrainSetup(strategy=strategy, dtype="fp32", batch_size=2)
    with construction_context(s, SimpleNamespace(max_grad_norm=1.0)):
        model = build_model_for_setup(folder, s, "cpu", init=init)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = model.get_parameter(name)
    seen = {"ds_id": hasattr(w, "ds_id"), "numel": w.numel(), "whole_numel": param_numel(w),
            "zero3_on": is_deepspeed_zero3_enabled()}
    with deepspeed.zero.GatheredParameters([w]):
        whole = w.detach().clone()
    seen["finite"] = bool(torch.isfinite(whole).all())
    seen["std"] = float(whole.std())
    seen["equals_saved"] = bool(torch.equal(whole, saved[name]))
    out[init] = seen
release()
out["zero3_on_after_release"] = is_deepspeed_zero3_enabled()
ranks.stop()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_zero3_builds_the_model_partitioned(workspace, strategy):
    """Under zero3 the model is built under zero.Init (transformers' HfDeepSpeedConfig): a decoder weight is a ZeRO
    parameter from construction (`ds_id`: DeepSpeed's engine then skips `module.to(device)`), its placeholder is empty
    and `ds_numel` holds its size; gathered, it holds the saved weights (pretrained) or transformers' init (random:
    std 0.02, not nn.Linear's kaiming default). `release` ends the ZeRO-3 config for later builds in the process."""
    pytest.importorskip("deepspeed")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, CPU_RANKS_ENV: "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _ZERO3_BUILD, workspace[1], strategy], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    whole = 64 * 64  # the tiny Llama's q_proj: hidden 64 x (4 heads x 16)
    for init in ("pretrained", "random"):
        seen = out[init]
        assert seen["ds_id"] and seen["zero3_on"] and seen["finite"], seen
        assert seen["numel"] == 0 and seen["whole_numel"] == whole, seen
    assert out["pretrained"]["equals_saved"]
    assert not out["random"]["equals_saved"] and out["random"]["std"] == pytest.approx(0.02, rel=0.2)
    assert out["zero3_on_after_release"] is False
