"""Every phase of a real 8B run (issue 33) measured on the GPU machine against today's estimate of the same config:
bench/results/pretrained_load/phases/call3 (bench/pretrained_load.py; Llama-3.1-8B-shaped folder of sharded
safetensors, `fitune plan --write` then `fitune train` under the 24 GB card's cap, 4 steps, an eval pass, a
checkpoint, the adapter, then `fitune merge` in a process of its own). The estimate is recomputed here from each
record's own train config with the code as it is now, so a change to the model is checked against what was
measured. Goals: 2 % allocated, 5 % reserved, 10 % host; docs/phases.md quotes each figure and each miss."""

import json
import os

import pytest

from fitune.config import config_keys_in
from fitune.memory.estimate import estimate
from fitune.memory.phases import phase_peaks
from fitune.setup import TrainSetup
from fitune.specs import load_model_spec, resolve_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = os.path.join(ROOT, "bench", "results", "pretrained_load", "phases", "call3")
GiB = 1024**3


def _records() -> dict[str, dict]:
    with open(os.path.join(CALL, "pretrained_load.jsonl"), encoding="utf-8") as f:
        return {r["case"]: r for r in map(json.loads, f)}


def _estimate(case: str) -> dict:
    """Today's phase peaks of the config the case ran, as `fitune estimate --config` reads it (its model folder
    held the catalog's llama-3.1-8b config.json, the source of its weights: a folder)."""
    _, values = config_keys_in(_records()[case]["train_config"], f"{case}'s train_config")
    setup = TrainSetup(**{"stack": "fitune", **values})
    spec = load_model_spec("llama-3.1-8b")
    est = estimate(spec, setup, resolve_gpu("rtx4090"))
    return {p.name: p for p in phase_peaks(setup, spec, est, source="folder")}


def _measured(rec: dict) -> dict[str, dict]:
    """Each measured phase: GPU allocated / reserved peaks and host memory without the mapped weight files."""
    out = {"load": {"gpu_allocated_bytes": rec["load"]["gpu_peak_allocated_bytes"],
                    "gpu_reserved_bytes": rec["load"]["gpu_peak_reserved_bytes"],
                    "host_bytes": rec["load"]["host_no_weight_files_peak_bytes"]},
           "train_step": {"gpu_allocated_bytes": rec["peak_allocated_bytes"],
                          "gpu_reserved_bytes": rec["peak_reserved_bytes"]}}
    for name in ("eval_step", "save"):
        p = rec["phases"][name]
        out[name] = {"gpu_allocated_bytes": p["gpu_allocated_bytes"], "gpu_reserved_bytes": p["gpu_reserved_bytes"],
                     "host_bytes": p["host_no_weight_files_bytes"]}
    w = rec["phases"]["write_outputs"]  # the estimate's save is the larger of a checkpoint and the final outputs
    out["save"]["host_bytes"] = max(out["save"]["host_bytes"], w["host_no_weight_files_bytes"])
    return out


def test_the_records_are_the_8b_runs_of_one_commit():
    recs = _records()
    assert set(recs) == {"lora", "qlora"}
    assert {r["commit"] for r in recs.values()} == {"c09075a434768c922e5cdc36cf7b5a259ae0376f"}
    for r in recs.values():
        assert r["exit"] == 0 and r["child_exit"] == 0 and r["steps_done"] == 4
        assert r["versions"]["gpu"].startswith("NVIDIA") and r["cap"] == "rtx4090"
        assert r["merge"]["child_exit"] == 0


@pytest.mark.parametrize("case", ["lora", "qlora"])
@pytest.mark.parametrize("phase", ["load", "train_step", "eval_step", "save"])
def test_each_phase_of_fitune_train_is_within_the_goal(case, phase):
    est, got = _estimate(case)[phase], _measured(_records()[case])[phase]
    alloc = got["gpu_allocated_bytes"] / est.gpu_allocated_bytes - 1
    reserved = got["gpu_reserved_bytes"] / est.gpu_reserved_bytes - 1
    assert abs(alloc) <= 0.02, f"allocated {alloc:+.2%}"
    # eval and save: the block evaluation adds to the cache (phases.py `eval_new_block_bytes`) is fitted to these
    # two records, so their check is not independent (docs/phases.md)
    assert abs(reserved) <= 0.05, f"reserved {reserved:+.2%}"
    if "host_bytes" in got:
        host = got["host_bytes"] / est.host_bytes - 1
        assert abs(host) <= 0.10, f"host {host:+.2%}"


@pytest.mark.parametrize("case", ["lora", "qlora"])
def test_fitune_merge_is_within_the_goal(case):
    """QLoRA: on the GPU, once bitsandbytes' reference cycle is broken (call 2, before it: +21.7 % allocated, every
    NF4 linear kept); LoRA: on the CPU, its host memory counting the merged weights written through the files'
    private mappings (HOST_CPU_BASELINE_BYTES was fitted to this run: its check is not independent)."""
    rec, est = _records()[case], _estimate(case)["merge"]
    merge = rec["merge"]
    assert merge["child_exit"] == 0 and merge["merged_bytes"] > 14.9 * GiB  # the bf16 model written (14.96 GiB)
    assert abs(merge["host_no_weight_files_peak_bytes"] / est.host_bytes - 1) <= 0.10
    if case == "qlora":
        assert abs(merge["gpu_peak_allocated_bytes"] / est.gpu_allocated_bytes - 1) <= 0.02
        assert abs(merge["gpu_peak_reserved_bytes"] / est.gpu_reserved_bytes - 1) <= 0.05
        dequantized = next(x for x in merge["stages"] if x["stage"] == "NF4 dequantized")
        assert dequantized["gpu_allocated_after_bytes"] < 15 * GiB  # the NF4 linears gone: the bf16 model alone
    else:
        assert merge["gpu_peak_allocated_bytes"] < 0.1 * GiB  # the CPU


def test_the_recorded_longest_contexts_are_what_fitune_plan_says_today():
    """bench/results/issue33/context/plan_longest.jsonl (bench/plan_longest.py): the longest context `fitune plan`
    accepts on a 24 GB card per method and host RAM, the figures docs/phases.md quotes; one recomputed here."""
    import sys
    from types import SimpleNamespace

    path = os.path.join(ROOT, "bench", "results", "issue33", "context", "plan_longest.jsonl")
    with open(path, encoding="utf-8") as f:
        got = {(r["method"], r["host_ram"]): r["plan_longest_tokens"] for r in map(json.loads, f)}
    assert got == {("qlora", "32GiB"): 118784, ("qlora", "64GiB"): 140288, ("lora", "32GiB"): 60416,
                   ("lora", "64GiB"): 60416}
    sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
    import unsloth_max_context as probe

    args = SimpleNamespace(model="llama-3.1-8b", cap="rtx4090", method="qlora", lora_rank=32, resolution=1024,
                           limit=262144, fitune_host_ram="32GiB", fitune_optimizer="any", fitune_retries=False)
    assert probe.plan_longest(args) == got[("qlora", "32GiB")]


def test_the_export_phase_recomputed_against_its_cpu_record():
    """`fitune export` of an 8B-shaped folder (2 layers: 8B's largest tensors, so 8B's peak) measured in a fresh
    process on the CPU (bench/results/issue33/export, bench/export_host.py): the host peak without the mapped
    weight files against today's `export_phase` of the same model, within the 10 % goal, f16 and q8_0."""
    from fitune.memory.phases import export_phase
    from fitune.specs.model import model_spec_from_hf_config

    path = os.path.join(ROOT, "bench", "results", "issue33", "export", "export_host.jsonl")
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert sorted(r["qtype"] for r in records) == ["f16", "q8_0"]
    spec = model_spec_from_hf_config({**load_model_spec("llama-3.1-8b").hf_config, "num_hidden_layers": 2}, "2 layers")
    for r in records:
        assert r["exit"] == 0 and r["provenance"]["commit"]
        est = export_phase(spec, TrainSetup(), r["qtype"]).host_bytes
        assert abs(r["host_no_weight_files_peak_bytes"] / est - 1) <= 0.10, (r["qtype"], r["host_over_est"])


def test_the_longest_context_with_exact_size_host_buffers_is_within_the_goals():
    """bench/results/issue33/context_pool (bench/calls/issue33_context.sh, commit 9264dcb, H100): `fitune plan
    --host-ram 64GiB`'s longest QLoRA context trained by `fitune train` with the page-locked pool, beside Unsloth
    in the same call. Issue 33's goals: 2 % allocated, 5 % reserved, host peak within 10 %, and at least 1.5x
    Unsloth's context under the same card budget (against Unsloth's shortest out-of-memory length: the least the
    ratio can be)."""
    path = os.path.join(ROOT, "bench", "results", "issue33", "context_pool", "max_context.jsonl")
    with open(path, encoding="utf-8") as f:
        probes = [r for r in map(json.loads, f) if r.get("probe") and r["cap"] == "23.4GiB"]
    (fit,) = [r for r in probes if r["stack"] == "fitune"]
    assert fit["fits"] and fit["steps_done"] == 2 and fit["oom_guard_replans"] == 0
    assert fit["provenance"]["commit"].startswith("9264dcb") and fit["provenance"]["diff_sha256"] == ""
    assert abs(fit["peak_allocated_bytes"] / fit["est_peak_allocated_bytes"] - 1) <= 0.02
    assert abs(fit["peak_reserved_bytes"] / fit["est_peak_reserved_bytes"] - 1) <= 0.05
    assert abs(fit["host_peak_rss_bytes"] / fit["est_host_peak_bytes"] - 1) <= 0.10
    assert fit["host_registered_bytes"] > 30 * GiB  # the checkpoints went through fitune's pool, not PyTorch's blocks
    assert fit["host_pinned_peak_bytes"] < 0.01 * GiB
    unsloth = [r for r in probes if r["stack"] == "unsloth"]
    oom = min(r["seq_len_tokens"] for r in unsloth if r["fits"] is False)
    assert max(r["seq_len_tokens"] for r in unsloth if r["fits"]) < oom
    assert fit["seq_len_tokens"] / oom >= 1.5


def _rows() -> list[dict]:
    """bench/results/issue33/rows (bench/calls/issue33_rows.sh ROWS_SHORT=1, commit c6adc80, H100): `fitune plan
    --host-ram 32GiB`'s longest QLoRA and bf16 LoRA contexts of that commit, trained two steps by `fitune train`."""
    path = os.path.join(ROOT, "bench", "results", "issue33", "rows", "max_context.jsonl")
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("probe")]


def test_the_32gib_host_rows_fit_the_card_within_the_goals():
    for r in _rows():
        assert r["fits"] and r["steps_done"] == 2 and r["plan_host_ram"] == "32GiB"
        assert r["provenance"]["commit"].startswith("c6adc80") and r["provenance"]["diff_sha256"] == ""
        assert abs(r["peak_allocated_bytes"] / r["est_peak_allocated_bytes"] - 1) <= 0.02
        assert abs(r["host_peak_rss_bytes"] / r["est_host_peak_bytes"] - 1) <= 0.10
    assert {(r["method"], r["seq_len_tokens"]) for r in _rows()} == {("qlora", 122880), ("lora", 63488)}


def test_the_plan_holds_the_whole_run_to_the_host_ram_not_only_its_training_step():
    """The 32 GiB QLoRA row of commit c6adc80 was planned by its training step's host memory alone (32.0 GiB) and
    peaked at 32.8 GiB while saving, as its own estimate of the save phase said (32.9): over the 32 GiB it was
    planned for. Since then the plan adds what saving adds (phases.py `save_added_host_bytes`): its longest is
    shorter, and its whole run's estimated host peak is within the 32 GiB."""
    (r,) = [x for x in _rows() if x["method"] == "qlora"]
    assert r["est_train_step_host_bytes"] <= 32 * GiB < r["host_peak_rss_bytes"]  # the bug, as measured
    assert r["est_host_peak_phase"] == "save" and r["est_host_peak_bytes"] > 32 * GiB
    from fitune.memory.phases import host_peak

    setup = TrainSetup(stack="fitune", method="qlora", lora_rank=32, lora_targets=("all-linear",), batch_size=1,
                       seq_len_tokens=118784, grad_checkpointing="offload", optimizer="adamw", loss="chunked",
                       tiled_mlp=True, lean_lora=True, lean_norm=True, expandable_segments=True)
    spec = load_model_spec("llama-3.1-8b")
    est = estimate(spec, setup, resolve_gpu("rtx4090"))
    assert host_peak(phase_peaks(setup, spec, est, source="folder")).host_bytes <= 32 * GiB
    at_record = estimate(spec, setup.replace(seq_len_tokens=122880), resolve_gpu("rtx4090"))
    assert host_peak(phase_peaks(setup.replace(seq_len_tokens=122880), spec, at_record)).host_bytes > 32 * GiB


def test_plan_says_when_host_ram_rules_out_offloaded_checkpoints():
    """Where even one row's offloaded checkpoints (and a save) need more host RAM than given, the plan says so
    with the figure instead of dropping offloading silently: the 122,880-token QLoRA row with 32 GiB."""
    import dataclasses

    from fitune.plan.search import PlanRequest, plan

    req = PlanRequest(model=load_model_spec("llama-3.1-8b"), gpu=resolve_gpu("rtx4090"), seq_len_tokens=122880,
                      batch_size=1, methods=("qlora",), lora_rank=32, lora_targets=("all-linear",),
                      host_ram_bytes=32 * GiB)
    lines = [r for r in plan(req).rejected if r.reason == "host_ram"]
    assert len(lines) == 1 and "offloaded checkpoints" in lines[0].message and "32.94 GiB" in lines[0].message
    shorter = plan(dataclasses.replace(req, seq_len_tokens=118784))
    assert shorter.plans and not [r for r in shorter.rejected if r.reason == "host_ram"]
