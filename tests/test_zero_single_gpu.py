"""The estimator against the single-H200 DeepSpeed runs of issue 15 (bench/zero_single_gpu.py,
bench/results/zero/zero.jsonl): `fitune train --gpus 1 --strategy S` for the seeds' Llama-3.1-8B LoRA and a
Llama-3.2-1B full fine-tune, no allocator cap.

The goal is 2 % on peak allocated and 5 % on peak reserved. Where the estimate is outside it the run is listed
below with its error, so that a change in either direction shows here."""

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
OUTSIDE_RESERVED = {"lora8b-zero3_offload": -0.491, "full1b-zero3_offload": -0.097}
"""Reserved: with offload, the blocks of the model built on the GPU before DeepSpeed moved it, still cached (these
runs predate the zero.Init build; ZERO_INIT_RESERVED below are the runs since). The full fine-tunes' zero2 and zero3
(+8.7 % and -5.2 % before) are within the goal since the estimate replays DeepSpeed's initialisation request by
request and ZeRO-2's gradient partition on its reduction stream (fitune/memory/parallel.py `zero_setup_allocations`,
`zero_reduction_stream`)."""
ZERO_INIT = os.path.join(ROOT, "bench", "results", "zero", "zero_init", "zero.jsonl")
ZERO_INIT_RESERVED: dict[str, float] = {}
"""The offload runs built under zero.Init: allocated and reserved within the goal. Llama-3.1-8B LoRA's reserved was
-5.1 % before the gathered parameters came from their own stream's blocks (parallel.py `zero3_fetch_stream`); the
full fine-tune's -18.6 % before each gradient partition's GPU copies on the way to the host (16-bit copy, float64
norm chunk, fp32 copy) were replayed on DeepSpeed's reduction stream (parallel.py `zero3_offload_grad_copies`; the
tied embedding's 2.0 GB float64 chunk dominates; the full1b run of zero.jsonl above moved -27.2 % -> -9.7 %)."""
ZERO_INIT2 = os.path.join(ROOT, "bench", "results", "zero", "zero_init2", "zero.jsonl")
HISTORY2 = os.path.join(ROOT, "bench", "results", "zero", "history2", "zero.jsonl")


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
    (bench/results/zero/zero_init/): allocated within 2 %, reserved within 5 % or as stated."""
    with open(ZERO_INIT, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert {r["run"] for r in rows} == {"lora8b-zero3_offload", "full1b-zero3_offload"}
    for run in rows:
        assert run["exit"] == 0 and len(run["steps"]) == 6
        e = estimate(load_model_spec(run["config"]["model"]), setup_of(run["config"]))
        assert abs(e.peak_allocated_bytes / run["peak_allocated_bytes"] - 1) <= 0.02, run["run"]
        reserved = e.peak_reserved_bytes / run["peak_reserved_bytes"] - 1
        if run["run"] in ZERO_INIT_RESERVED:
            assert reserved == pytest.approx(ZERO_INIT_RESERVED[run["run"]], abs=0.002), run["run"]
        else:
            assert abs(reserved) <= 0.05, f"{run['run']}: reserved {reserved:+.1%}"


@pytest.mark.parametrize("path", [ZERO_INIT2, HISTORY2], ids=["zero_init2", "history2"])
def test_estimate_against_the_later_zero_runs(path):
    """zero3 built under zero.Init (bench/results/zero/zero_init2/) and the full fine-tune's zero2 / zero3 again with
    the allocator's history recorded (history2/), 6 steps each: allocated within 2 %, reserved within 5 %."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows
    for run in rows:
        assert run["exit"] == 0 and len(run["steps"]) == 6
        e = estimate(load_model_spec(run["config"]["model"]), setup_of(run["config"]))
        alloc = e.peak_allocated_bytes / run["peak_allocated_bytes"] - 1
        reserved = e.peak_reserved_bytes / run["peak_reserved_bytes"] - 1
        assert abs(alloc) <= 0.02, f"{run['run']}: allocated {alloc:+.1%}"
        assert abs(reserved) <= 0.05, f"{run['run']}: reserved {reserved:+.1%}"


def test_the_zero_initialisation_replay_lands_on_the_recorded_phase():
    """DeepSpeed's initialisation through the allocator model (parallel.py `zero_setup_allocations`) reserves what the
    recorded `deepspeed.initialize` phase peaked at (history2/*.memory.json): 16.121 GiB (zero2), 14.389 GiB (zero3)."""
    from fitune.memory import adapters, parallel
    from fitune.memory.allocator import replay_reserved
    from fitune.memory.estimate import _resident_blocks

    model = load_model_spec("llama-3.2-1b")
    for strategy in ("zero2", "zero3"):
        with open(os.path.join(ROOT, "bench", "results", "zero", "history2", f"full1b-{strategy}.memory.json"),
                  encoding="utf-8") as f:
            phase = {p["phase"]: p for p in json.load(f)["phases"]}["deepspeed.initialize"]
        setup = TrainSetup(method="full", strategy=strategy)
        blocks = _resident_blocks(model, setup, {})[:-2]
        numels = [b // 2 for b in blocks]
        n = adapters.trainable_param_count(model, setup)
        assert sum(numels) == n
        events = parallel.zero_setup_allocations(strategy, blocks, [True] * len(blocks), 2, n,
                                                 parallel.zero3_sub_groups(numels, 1),
                                                 parallel.zero_reduce_bucket_bytes(strategy, 2))
        reserved, _ = replay_reserved([], [], steps=0, setup_events=events)
        assert reserved == pytest.approx(phase["peak_reserved_bytes"], rel=0.001), strategy


def test_the_runs_carry_what_the_readme_quotes():
    """C14 / C24's figures (docs/multi_gpu.md, docs/evidence.md): steady tokens/s and peaks per run."""
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


def test_readme_zero_table_is_the_current_estimate():
    """Each run's row in docs/multi_gpu.md's ZeRO table (moved from the README, issue 34): measured peaks, the
    estimate as the estimator now makes it, errors."""
    GiB = 2**30
    readme = open(os.path.join(ROOT, "docs", "multi_gpu.md"), encoding="utf-8").read()
    rows = runs()
    with open(ZERO_INIT, encoding="utf-8") as f:
        rows += [json.loads(line) for line in f]
    for r in rows:
        e = estimate(load_model_spec(r["config"]["model"]), setup_of(r["config"]))
        a, v = e.peak_allocated_bytes / r["peak_allocated_bytes"] - 1, e.peak_reserved_bytes / r["peak_reserved_bytes"] - 1
        cell = (f"| {r['peak_allocated_bytes'] / GiB:.2f} / {r['peak_reserved_bytes'] / GiB:.2f} GiB | "
                f"{e.peak_allocated_bytes / GiB:.2f} / {e.peak_reserved_bytes / GiB:.2f} "
                f"({100 * a:+.1f} % / {100 * v:+.1f} %) | {r['tokens_per_s_median']:,.0f} |")
        assert cell in readme, (r["run"], cell)
