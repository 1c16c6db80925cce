"""The host-RAM model of every phase (fitune/memory/phases.py, issue 33) against the host peaks measured on the GPU
machine: the process's peak RSS of fitune's long-context probes (bench/results/issue5/call4/, bench/max_context.py,
random weights drawn on the GPU, offloaded checkpoints). Only runs that had their process to themselves count: the
143,360-token probe ran after the 131,072-token one in the same process (docs/phases.md says why it is left out).
The goal is 10 %; docs/phases.md quotes each figure, and the miss."""

import json
import os

import pytest

from fitune.memory.estimate import estimate
from fitune.memory.phases import phase_peaks
from fitune.setup import TrainSetup, parse_targets
from fitune.specs import load_model_spec, resolve_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "bench", "results", "issue5", "call4", "fitune_max_context.jsonl")
FRESH_PROCESS = {("qlora", 131072), ("lora", 57344)}  # each the first probe of its process (COMMAND.txt)


def _runs() -> list[tuple[dict, float]]:
    """(record, host estimate / measured - 1) for each fresh-process probe, with bench/max_context.py's setup."""
    out = []
    for line in open(RECORDS, encoding="utf-8"):
        r = json.loads(line)
        if (r["method"], r["seq_len_tokens"]) not in FRESH_PROCESS:
            continue
        s = TrainSetup(method=r["method"], lora_rank=r["lora_rank"], lora_targets=parse_targets(r["lora_targets"]),
                       batch_size=r["batch_size"], seq_len_tokens=r["seq_len_tokens"], grad_checkpointing="offload",
                       loss="chunked", tiled_mlp=True, lean_lora=True, lean_norm=True, expandable_segments=True,
                       stack="fitune")
        model = load_model_spec(r["model"])
        peaks = {p.name: p for p in phase_peaks(s, model, estimate(model, s, resolve_gpu(r["cap"])), source="random")}
        host = max(peaks[name].host_bytes for name in ("load", "train_step"))
        out.append((r, host / r["host_rss_peak_bytes"] - 1))
    return out


def test_both_fresh_process_probes_are_read():
    assert sorted((r["method"], r["seq_len_tokens"]) for r, _ in _runs()) == sorted(FRESH_PROCESS)


def test_the_qlora_probe_host_peak_is_within_the_goal():
    (err,) = [e for r, e in _runs() if r["method"] == "qlora"]
    assert abs(err) <= 0.10, f"{err:+.1%}"


@pytest.mark.parametrize("method", ["qlora", "lora"])
def test_docs_quote_each_probes_error(method):
    """docs/phases.md quotes every figure, the LoRA probe's miss of the 10 % goal included (the 2 GiB process
    baseline is a guess; that run's process held about 1.9 GiB more)."""
    (err,) = [e for r, e in _runs() if r["method"] == method]
    text = " ".join(open(os.path.join(ROOT, "docs", "phases.md"), encoding="utf-8").read().split())
    assert f"{err * 100:+.1f} %" in text, f"docs/phases.md should quote {err * 100:+.1f} % for the {method} probe"
