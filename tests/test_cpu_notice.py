"""`fitune train` without a CUDA GPU says so, and why, and how much slower this CPU is in the run's dtype
(fitune/runtime/device.py `cpu_training_notice`): a GPU plan run on a machine with a CPU-only PyTorch trained a
135M model at 5 tokens/s in bf16 without a word."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from fitune.cli.main import main  # noqa: E402
from fitune.runtime.device import cpu_training_notice, matmul_gflops  # noqa: E402
from fitune.train.quickstart import write_quickstart  # noqa: E402


def test_a_cpu_build_is_named_with_the_way_to_a_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    lines = cpu_training_notice("fp32", measure=lambda d: pytest.fail("fp32 needs no measurement"))
    assert lines == [f"no CUDA GPU is visible (torch {torch.__version__} is a CPU-only build; for the GPU install a "
                     "CUDA build (https://pytorch.org/get-started/locally/)): training runs on the CPU"]


def test_a_cuda_build_without_a_gpu_points_at_the_driver(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    (line,) = cpu_training_notice("fp32")
    assert "built for CUDA 13.0 but sees no GPU" in line and "nvidia-smi" in line


@pytest.mark.parametrize("rates, said", [
    ({"bf16": 1.4, "fp32": 156.0}, "this CPU multiplies bf16 matrices 111x slower than fp32 (1.4 against 156.0 GFLOP/s"),
    ({"bf16": 100.0, "fp32": 150.0}, None),  # a CPU with bf16 instructions: nothing to say
])
def test_half_precision_slowness_is_said_with_the_measured_rates(rates, said):
    lines = cpu_training_notice("bf16", measure=rates.__getitem__)
    if said is None:
        assert len(lines) == 1
    else:
        assert said in lines[1] and "`dtype: fp32` (--dtype fp32)" in lines[1]


def test_the_rate_is_measured():
    assert matmul_gflops("fp32", size=32, seconds=0.01) > 0


def test_fitune_train_on_the_cpu_says_it(tmp_path, caplog):
    """The quick start's tiny model, one step: the notice is in the run's log (CI has no GPU)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the run trains on it")
    run_yaml = write_quickstart(str(tmp_path / "qs"))
    with caplog.at_level(logging.WARNING, logger="fitune"):
        assert main(["train", run_yaml, "--max-steps", "1", "--no-progress", "--set", f"output_dir={tmp_path / 'out'}"]) == 0
    said = [r.getMessage() for r in caplog.records if "no CUDA GPU is visible" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("fitune train: no CUDA GPU is visible (torch ")
