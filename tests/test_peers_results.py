"""The README's side-by-side table (issue 14) is the committed GPU record of bench/results/peers/: every figure in
it is recomputed here from the raw lines."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "bench", "results", "peers")


def _lines(name):
    return [json.loads(x) for x in open(os.path.join(FOLDER, name), encoding="utf-8")]


def _best(stack):
    """The stack's fastest case that fit."""
    fits = [r for r in _lines("peers.jsonl") if r["stack"] == stack and r["fits"]]
    return max(fits, key=lambda r: r["tokens_per_s"])


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def test_every_stack_ran_its_candidates_in_one_call():
    rows = _lines("peers.jsonl")
    assert {r["stack"] for r in rows} == {"hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"}
    assert all(r["fits"] in (True, False) for r in rows)  # every case ended in a result, none in an error
    assert all(r["cap"] == "rtx4090" and r["seq_len_tokens"] == 2048 for r in rows)
    for r in rows:
        assert r["micro_batch_size"] * r["grad_accum"] == 2  # 2 x 2048 tokens per optimizer step, every stack
        if r["fits"]:
            assert r["steps_done"] == 12 and r["peak_allocated_bytes"] <= 23.4 * 2**30


def test_readme_table_is_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    fitune = _lines("fitune.jsonl")[0]
    assert fitune["exit"] == 0 and fitune["plan"] == 1
    assert f"| **{fitune['tokens_per_s_median']:,.0f}** | {_gib(fitune['peak_allocated_bytes'])} | " \
           f"{_gib(fitune['peak_reserved_bytes'])} |" in readme
    for stack in ("hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"):
        r = _best(stack)
        assert f"| {r['tokens_per_s']:,.0f} | {_gib(r['peak_allocated_bytes'])} | {_gib(r['peak_reserved_bytes'])}" \
            in readme, stack
    hf_liger = max(_best("hf_trainer_liger")["tokens_per_s"], _best("hf_loop_liger")["tokens_per_s"])
    ratio_liger = fitune["tokens_per_s_median"] / hf_liger
    ratio_unsloth = fitune["tokens_per_s_median"] / _best("unsloth")["tokens_per_s"]
    assert f"fitune is {ratio_liger:.2f}x the fastest HF + Liger stack and {ratio_unsloth:.2f}x Unsloth" in readme


def test_readme_unsloth_against_the_trainer_is_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    u, t = _best("unsloth"), _best("hf_trainer")
    less = 1 - u["peak_allocated_bytes"] / t["peak_allocated_bytes"]
    assert (f"Unsloth made {u['tokens_per_s'] / t['tokens_per_s']:.2f}x\nthe tokens/s of the HF Trainer "
            f"({u['tokens_per_s']:,.0f} against {t['tokens_per_s']:,.0f}) at {less:.0%} less peak allocated memory"
            ).replace("%", " %") in readme


def test_readme_summary_line_is_the_record():
    """The README's summary row quotes the second (compiled layers) call and the first call's ratios beside it."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    f = _lines("run2/rank_check.jsonl")[0]["tokens_per_s_median"]
    peers = {r["stack"]: r["tokens_per_s"] for r in _lines("run2/peers.jsonl")}
    hf_liger = max(peers["hf_trainer_liger"], peers["hf_loop_liger"])
    first = _lines("fitune.jsonl")[0]["tokens_per_s_median"]
    first_liger = max(_best("hf_trainer_liger")["tokens_per_s"], _best("hf_loop_liger")["tokens_per_s"])
    assert (f"{f / peers['hf_trainer']:.2f}x the HF Trainer, {f / hf_liger:.2f}x HF + Liger, "
            f"{f / peers['unsloth']:.2f}x Unsloth (compiled layers; {first / first_liger:.2f}x and "
            f"{first / _best('unsloth')['tokens_per_s']:.2f}x with Liger in the call before)") in readme


def test_readme_second_call_is_the_record():
    """The compiled-layers call (bench/results/peers/run2/): fitune along the user's path, then each peer at the
    setup that was its fastest in the first call; the ratios the README states."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    fitune = _lines("run2/rank_check.jsonl")[0]
    assert fitune["exit"] == 0 and fitune["plan"] == 1 and fitune["steps"] == 12
    assert f"| **{fitune['tokens_per_s_median']:,.0f}** | {_gib(fitune['peak_allocated_bytes'])} | " \
           f"{_gib(fitune['peak_reserved_bytes'])} |" in readme
    peers = {r["stack"]: r for r in _lines("run2/peers.jsonl")}
    assert set(peers) == {"hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"}
    for r in peers.values():
        assert r["fits"] and r["cap"] == "rtx4090" and r["steps_done"] == 12
        assert f"| {r['tokens_per_s']:,.0f} | {_gib(r['peak_allocated_bytes'])} | {_gib(r['peak_reserved_bytes'])}" \
            in readme, r["stack"]
    hf_liger = max(peers["hf_trainer_liger"]["tokens_per_s"], peers["hf_loop_liger"]["tokens_per_s"])
    assert f"fitune is {fitune['tokens_per_s_median'] / hf_liger:.2f}x the fastest HF + Liger stack (the plain loop) " \
           f"and {fitune['tokens_per_s_median'] / peers['unsloth']['tokens_per_s']:.2f}x Unsloth" in readme


def test_readme_real_length_figures_are_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")
    rows = _lines("real_length.jsonl")
    trainer = [r for r in rows if r["stack"] == "hf_trainer" and r["fits"]]
    packing = [r for r in rows if r["stack"] == "trl_packing" and r["fits"]]
    fitune = [r for r in rows if r["stack"] == "fitune" and r["fits"]]
    assert len(trainer) == len(packing) == 1 and len(fitune) == 2
    assert f"{trainer[0]['trained_tokens_per_s']:,.0f} at micro-batch 2 x 2" in readme
    assert f"packing {packing[0]['trained_tokens_per_s']:,.0f}" in readme
    assert (f"`fitune train` {fitune[0]['trained_tokens_per_s']:,.0f} and {fitune[1]['trained_tokens_per_s']:,.0f} "
            "in two calls") in readme
    assert all(r["setup"]["packing"] is False for r in fitune)  # what the README says the plan chose


def test_readme_real_length_same_call_is_the_record():
    """The real-length call after the packing rule: the Trainer default and `fitune train` in one GPU call."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")
    rows = _lines(os.path.join("real_length2", "real_length.jsonl"))
    trainer = [r for r in rows if r["stack"] == "hf_trainer" and r["fits"]]
    fitune = [r for r in rows if r["stack"] == "fitune" and r["fits"]]
    assert len(trainer) == len(fitune) == 1
    t, f = trainer[0], fitune[0]
    assert f["setup"]["packing"] is True and f["setup"]["packing_attention"] == "varlen"
    assert (t["micro_batch_size"], t["grad_accum"]) == (2, 2)
    assert f"default {t['trained_tokens_per_s']:,.0f} trained tokens/s (micro-batch 2 x 2" in readme
    assert f"`fitune train` {f['trained_tokens_per_s']:,.0f} (packing" in readme
    ratio = f["trained_tokens_per_s"] / t["trained_tokens_per_s"]
    assert f"**{ratio:.2f}x** the Trainer default" in readme and ratio >= 2
