"""The figures doctor findings quote are the committed measurements and fitune's own estimates; docs/evidence.md
covers every claim and every rule."""

import json
import os
import re

import pytest

from fitune.doctor import evidence
from fitune.doctor.rules import ALL_RULES
from fitune.units import gib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe_rows() -> dict:
    with open(os.path.join(ROOT, evidence.HF_RECIPE), encoding="utf-8") as f:
        return {(r["group"], r["case"]): r for r in map(json.loads, f)}


def label_of(r: dict) -> str:
    method = {"lora": "LoRA", "qlora": "QLoRA"}[r["method"]]
    targets = "q,v" if r["lora_targets"] == "q_proj,v_proj" else r["lora_targets"]
    ckpt = "checkpointing full" if r["grad_checkpointing"] == "full" else "no checkpointing"
    shape = f"{r['batch_size']}x{r['seq_len_tokens']}"
    return f"{r['model']} {method} r{r['lora_rank']} {targets}, {shape}, {ckpt}, {r['attn']}"


@pytest.mark.parametrize("case", evidence.MEASURED_CASES, ids=lambda c: f"{c.group}-{c.case}")
def test_measured_cases_match_the_benchmark_file(case):
    r = recipe_rows()[(case.group, case.case)]
    now = (label_of(r), r["peak_allocated_bytes"], r["peak_reserved_bytes"], r["steps"][-1]["saved_tensor_bytes"],
           round(r["tokens_per_s"]))
    quoted = (case.label, case.peak_allocated_bytes, case.peak_reserved_bytes, case.saved_tensor_bytes,
              case.tokens_per_s)
    assert quoted == now, f"{evidence.HF_RECIPE} changed: update fitune/doctor/evidence.py to {now}"


@pytest.mark.parametrize("run", evidence.MEASURED_PROFILES, ids=lambda p: os.path.basename(p.file))
def test_measured_profiles_match_their_files(run):
    with open(os.path.join(ROOT, run.file), encoding="utf-8") as f:
        doc = json.load(f)
    now = (doc["cap_bytes"], doc["peak_allocated_bytes"], doc["peak_reserved_bytes"], doc["num_alloc_retries"],
           doc["oom"] is not None)
    assert (run.cap_bytes, run.peak_allocated_bytes, run.peak_reserved_bytes, run.num_alloc_retries, run.oom) == now


def test_retries_verdict_outcomes_are_the_measured_scripts():
    """Recount, from the committed runs, how the scripts estimated "fits only with allocator retries" ended."""
    counts = {"completed": 0, "out_of_memory": 0}
    with open(os.path.join(ROOT, evidence.DOCTOR_SCRIPTS), encoding="utf-8") as f:
        for r in map(json.loads, f):
            e = r["estimate"]
            if e["fits"] and e["retries_expected"] and r["status"] in ("ok", "oom"):
                counts["completed" if r["status"] == "ok" else "out_of_memory"] += 1
    assert counts == evidence.RETRIES_VERDICT_OUTCOMES
    assert "1 completed and 3 ran out of memory" in evidence.retries_verdict_evidence("rtx4090")


def test_estimated_evidence_is_computed_by_the_estimator():
    from fitune.memory import estimate
    from fitune.setup import TrainSetup
    from fitune.specs import load_model_spec

    m = load_model_spec("qwen2.5-7b")
    qv = estimate(m, TrainSetup())
    al = estimate(m, TrainSetup(lora_targets=("all-linear",)))
    text = evidence.lora_all_linear("qwen2.5-7b")
    assert f"peak {gib(qv.peak_allocated_bytes)} vs {gib(al.peak_allocated_bytes)}" in text
    assert "measured: llama-3.1-8b LoRA r8 q,v, 2x2048, no checkpointing, sdpa" in text


def test_catalog_names_from_hub_ids():
    assert evidence.catalog_name("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert evidence.catalog_name("Qwen/Qwen2.5-7B") == "qwen2.5-7b"
    assert evidence.catalog_name("./my-model") is None


def test_docs_cover_every_claim_and_every_rule():
    with open(os.path.join(ROOT, "docs", "evidence.md"), encoding="utf-8") as f:
        doc = f.read()
    for n in range(1, 28):
        assert re.search(rf"^\*\*C{n:02d} - ", doc, re.M), f"C{n:02d} missing from docs/evidence.md"
    for rule in ALL_RULES:
        assert f"`{rule.id}`" in doc, f"rule {rule.id} missing from docs/evidence.md"
        for claim in rule.claims:
            section = doc[doc.index(f"**{claim} - "):]
            section = section[: section.index("\n**C", 5)] if "\n**C" in section[5:] else section
            assert f"`{rule.id}`" in section, f"{claim}'s section does not link rule {rule.id}"


def test_docs_quote_the_measured_figures():
    with open(os.path.join(ROOT, "docs", "evidence.md"), encoding="utf-8") as f:
        doc = f.read()
    for case in (evidence.LLAMA_QV_FULL, evidence.LLAMA_QV_NONE, evidence.LLAMA_ALL_NONE, evidence.LLAMA_ALL_FULL):
        assert gib(case.peak_allocated_bytes) in doc
    assert gib(evidence.LLAMA_EAGER_NONE.saved_tensor_bytes) in doc
