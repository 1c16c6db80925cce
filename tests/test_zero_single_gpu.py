"""The estimator against the single-H200 DeepSpeed runs of issue 15 (bench/zero_single_gpu.py,
bench/results/zero/zero.jsonl): `fitune train --gpus 1 --strategy S` for the seeds' Llama-3.1-8B LoRA and a
Llama-3.2-1B full fine-tune, no allocator cap.

The goal is 2 % on peak allocated and 5 % on peak reserved. Where the estimate is outside it the run is listed
below with the error the README states, so that a change in either direction shows here."""

import json
import os

import pytest

from fitune.memory import estimate
from fitune.setup import TrainSetup
from fitune.specs.model import load_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "zero", "zero.jsonl")

OUTSIDE_ALLOCATED: dict[str, float] = {}
"""None since ZeRO-3 keeps the last layers gathered up to `stage3_max_live_parameters` in the estimate
(fitune/memory/parallel.py `zero3_live_after_forward_bytes`); before, offload was -5.6 % and -14.3 %."""
OUTSIDE_RESERVED = {"lora8b-zero3_offload": -0.508, "full1b-zero3_offload": -0.270, "full1b-zero2": 0.087,
                    "full1b-zero3": -0.052}
"""Reserved: with offload, the blocks of the model built on the GPU before DeepSpeed moved it, still cached (these
runs predate the zero.Init build; ZERO_INIT_RESERVED below are the runs since); the full fine-tunes' flat buffers are
not replayed block for block."""
ZERO_INIT = os.path.join(ROOT, "bench", "results", "zero", "zero_init", "zero.jsonl")
ZERO_INIT_RESERVED = {"lora8b-zero3_offload": -0.051, "full1b-zero3_offload": -0.184}
"""The offload runs built under zero.Init: the caching allocator keeps more than the estimate replays (the
parameters are fetched module by module into blocks of many sizes); allocated is within the goal."""


def runs() -> list[dict]:
    with open(RESULTS, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def setup_of(cfg: dict) -> TrainSetup:
    kw = dict(method=cfg["method"], dtype=cfg["dtype"], seq_len_tokens=cfg["seq_len"], batch_size=cfg["batch_size"],
              grad_checkpointing=cfg["grad_checkpointing"], attn=cfg["attn"], optimizer=cfg["optimizer"])
    if cfg["method"] == "lora":
        lora = cfg["lora"]
        kw.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_targets=tuple(lora["targets"]))
    if "strategy" in cfg:
        kw.update(num_gpus=cfg["gpus"], strategy=cfg["strategy"])
    return TrainSetup(**kw)


@pytest.mark.parametrize("run", runs(), ids=lambda r: r["run"])
def test_estimate_against_the_single_gpu_zero_runs(run):
    assert run["exit"] == 0 and len(run["steps"]) == 10
    e = estimate(load_model_spec(run["config"]["model"]), setup_of(run["config"]))
    alloc = e.peak_allocated_bytes / run["peak_allocated_bytes"] - 1
    reserved = e.peak_reserved_bytes / run["peak_reserved_bytes"] - 1
    name = run["run"]
    if name in OUTSIDE_ALLOCATED:
        assert alloc == pytest.approx(OUTSIDE_ALLOCATED[name], abs=0.002)
    else:
        assert abs(alloc) <= 0.02, f"{name}: allocated {alloc:+.1%}"
    if name in OUTSIDE_RESERVED:
        assert reserved == pytest.approx(OUTSIDE_RESERVED[name], abs=0.002)
    else:
        assert abs(reserved) <= 0.05, f"{name}: reserved {reserved:+.1%}"


def test_estimate_against_the_zero_init_offload_runs():
    """The offload runs again after zero3 / zero3_offload began to build the model under deepspeed.zero.Init
    (bench/results/zero/zero_init/): allocated within 2 %, reserved as stated."""
    with open(ZERO_INIT, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert {r["run"] for r in rows} == set(ZERO_INIT_RESERVED)
    for run in rows:
        assert run["exit"] == 0 and len(run["steps"]) == 6
        e = estimate(load_model_spec(run["config"]["model"]), setup_of(run["config"]))
        assert abs(e.peak_allocated_bytes / run["peak_allocated_bytes"] - 1) <= 0.02, run["run"]
        reserved = e.peak_reserved_bytes / run["peak_reserved_bytes"] - 1
        assert reserved == pytest.approx(ZERO_INIT_RESERVED[run["run"]], abs=0.002), run["run"]


def test_the_runs_carry_what_the_readme_quotes():
    """C14 / C24's figures (README, docs/evidence.md): steady tokens/s and peaks per run."""
    by = {r["run"]: r for r in runs()}
    assert set(by) == {f"{w}-{s}" for w in ("lora8b", "full1b") for s in ("none", "zero2", "zero3", "zero3_offload")}
    assert round(by["lora8b-none"]["tokens_per_s_median"], -2) == 10000
    assert round(by["full1b-zero3_offload"]["tokens_per_s_median"], -2) == 1800


def test_throughput_model_charges_zero3_its_measured_fetch_cost():
    """The throughput model (fitune/plan/throughput.py) against the same runs: ZeRO-3's per-tensor fetch cost is
    calibrated on these two runs (in-sample), so its predictions land within 10 % of them; the runs without
    DeepSpeed show the model's own error on this GPU."""
    from fitune.plan.throughput import predict
    from fitune.specs.gpu import resolve_gpu

    by = {r["run"]: r for r in runs()}
    h200 = resolve_gpu("h200")
    for name in ("lora8b-zero3", "full1b-zero3"):
        r = by[name]
        p = predict(load_model_spec(r["config"]["model"]), setup_of(r["config"]), h200)
        assert abs(p.tokens_per_s / r["tokens_per_s_median"] - 1) <= 0.10, name
