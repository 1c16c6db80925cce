"""The README's results tables, rendered from the committed records under bench/results/ (issue 34).

`python -m bench.readme_numbers` prints the markdown that README.md holds between
`<!-- generated: bench/readme_numbers.py -->` and `<!-- end generated -->`; tests/test_readme_numbers.py
regenerates it and compares exactly. Pure Python (no torch): the estimator rows use fitune's analytic engine.

Every speed or context figure is set against the strongest peer of the SAME GPU call (tokens/s: each run's median
over steps 3 and later, as the records hold it), and a row says where fitune is behind (issue 32).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join("bench", "results", "peers")

STACK_NAMES = {
    "hf_trainer": "transformers `Trainer`",
    "hf_trainer_liger": "transformers `Trainer` + Liger",
    "hf_loop_liger": "plain PyTorch loop + Liger",
    "unsloth": "Unsloth",
    "trl_packing": "TRL `SFTTrainer`, packing",
    "unsloth_packing": "Unsloth `SFTTrainer`, packing",
}
SEEDS = "Llama-3.1-8B LoRA r8 q,v, 2 x 2048 tokens a step, 24 GB cap: tokens/s"
CONTEXT = "QLoRA r32 all-linear, longest context that trains two steps"
CARDS = (("8 GB", "7.4GiB"), ("12 GB", "11.4GiB"), ("16 GB", "15.4GiB"), ("24 GB", "23.4GiB"), ("48 GB", "47.4GiB"))
QLORA = "QLoRA r16 all-linear, 2 x 2048 tokens a step, 24 GB cap: tokens/s"


@dataclass(frozen=True)
class Row:
    """One line of the results table: fitune's figure, the strongest peer of the same call, the records' folder."""
    what: str
    fitune: str
    peer: str
    ratio: str
    records: str


def _lines(root: str, *parts: str) -> list[dict]:
    with open(os.path.join(root, *parts), encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _link(folder: str) -> str:
    return f"[{folder.removeprefix('bench/results/')}]({folder})"


def _vs(fitune: float, peer: float) -> str:
    """fitune's figure over the peer's; where fitune is behind, the peer's lead, said in words."""
    if fitune >= peer:
        return f"{fitune / peer:.2f}x"
    return f"**behind**: the peer makes {peer / fitune:.2f}x"


def _strongest(rows: list[dict], key: str = "tokens_per_s") -> dict:
    """The peer's fastest case that fit in that call."""
    return max((r for r in rows if r["fits"]), key=lambda r: r[key])


def seeds_rows(root: str) -> list[Row]:
    """The seeds' workload: call 1 (every stack) and call 5 (after the compiled-layer fix); calls 2-4 are withdrawn
    for fitune (docs/history.md)."""
    out = []
    calls = ((("fitune.jsonl",), ("peers.jsonl",), "call 1", PEERS),
             (("run4", "rank_check.jsonl"), ("run4", "peers.jsonl"), "call 5", f"{PEERS}/run4"))
    for fitune_file, peers_file, call, folder in calls:
        fitune = _lines(root, PEERS, *fitune_file)[0]["tokens_per_s_median"]
        peers = _lines(root, PEERS, *peers_file)
        peer, ran = _strongest(peers), len({r["stack"] for r in peers})
        peer_s = peer["tokens_per_s"]
        out.append(Row(f"{SEEDS} ({call})", f"**{_n(fitune)}**",
                       f"{STACK_NAMES[peer['stack']]} {_n(peer_s)} (the fastest of the {ran} other stacks run)",
                       _vs(fitune, peer_s), _link(folder)))
    return out


UNSLOTH_CALL = os.path.join("bench", "results", "issue32", "unsloth")
"""Issue 32's call against Unsloth's setups: the seeds' LoRA and QLoRA r16 all-linear, fitune's plan 1 of each, and
three QLoRA setups of Unsloth (its SFTTrainer; its model in a plain loop with and without its checkpointing)."""
SAMEDAY_CALL = os.path.join("bench", "results", "issue32", "sameday")
"""Both workloads again in one call, each stack run twice (medians): fitune's plan 1 along the user's path (QLoRA's
now micro-batch 2 with checkpointing on its first layers only), Unsloth's fastest setup of each workload in
UNSLOTH_CALL, HF + Liger in a plain loop; and fitune's QLoRA at micro-batch 1 x 2 (the old plan's fallback)."""


def _unsloth_words(rec: dict) -> str:
    """An Unsloth setup in words: its loop, checkpointing, micro-batch x accumulation."""
    loop = "its model in a plain PyTorch loop" if rec["loop"] == "plain PyTorch loop" else f"its {rec['loop']}"
    gc = {"none": "no checkpointing", "unsloth": "its checkpointing"}[rec["grad_checkpointing"]]
    return f"{loop}, {gc}, micro-batch {rec['micro_batch_size']} x {rec['grad_accum']}"


def _runs_of(recs: list[dict], case: str, key: str) -> list[float]:
    """The figures of a case and its repeats (`case`, `case-r2`, ...) in one call, in run order."""
    return [r[key] for r in recs if r.get("case") is not None and r["case"].split("-r")[0] == case]


def _median_words(runs: list[float]) -> str:
    return f"{_n(statistics.median(runs))} (median of {len(runs)}: {', '.join(_n(x) for x in runs)})"


def mfu_words(tokens_per_s: float, rec: dict) -> str:
    """`MFU 56.4 %`: the model FLOP/s of `tokens_per_s` (fitune/perf/flops.py `mfu`: no recomputation counted, frozen
    weights without weight gradients) over the dense bf16 peak of the GPU the record names (fitune's catalog). `rec`
    is a fitune record of the workload: its setup gives the model, method and row length every stack trained."""
    from fitune.perf.flops import mfu
    from fitune.setup import TrainSetup
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    gpu = resolve_gpu(rec["provenance"]["gpu"]["name"])
    share = mfu(tokens_per_s, load_model_spec(rec["model"]), TrainSetup.from_dict(rec["setup"]), gpu.peak_bf16_tflops)
    return f"MFU {100 * share:.1f} %"


def linear_mfu_words(positions_per_s: float, model: str, gpu_name: str) -> str:
    """`MFU 55.1 % (linear layers)`: LoRA's FLOPs in the model's linear layers (a forward and an input gradient, 4
    FLOPs per weight per token: fitune/perf/flops.py `forward_flops_per_token`) at `positions_per_s` token positions
    a second, over the GPU's dense bf16 peak. For packed rows, whose attention FLOPs depend on each segment's length
    (about 1 % of the step at a median of 300 tokens), left out: a lower bound."""
    from fitune.perf.flops import forward_flops_per_token
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    linear, _ = forward_flops_per_token(load_model_spec(model), 0)
    return f"MFU {100 * positions_per_s * 2 * linear / (resolve_gpu(gpu_name).peak_bf16_tflops * 1e12):.1f} % " \
        "(linear layers)"


def unsloth_rows(root: str) -> list[Row]:
    """The seeds' workload and QLoRA r16 against Unsloth's strongest setups (issue 32), medians of one call: fitune's
    plan 1 along the user's path; Unsloth's fastest setup of each workload (searched in UNSLOTH_CALL); HF + Liger."""
    fitune = _lines(root, SAMEDAY_CALL, "rank_check.jsonl")
    peers = _lines(root, SAMEDAY_CALL, "peers.jsonl")
    searched = _lines(root, UNSLOTH_CALL, "peers.jsonl")
    rows = []
    for what, workload, method, case in ((SEEDS, "seeds", "lora", "fitune_seeds"),
                                         (QLORA, "qlora_seeds", "qlora", "fitune_qlora_seeds")):
        mine = _runs_of(fitune, case, "tokens_per_s_median")
        top = _strongest([r for r in searched if r["method"] == method])
        theirs = _runs_of(peers, top["case"], "tokens_per_s")
        (peer,) = [r for r in peers if r.get("case") == top["case"]]
        (first,) = [r for r in fitune if r.get("case") == case]
        setup = first["setup"]
        ckpt = setup["grad_checkpointing"]
        plan = (f"plan 1: micro-batch {setup['batch_size']} x {setup['grad_accum']}, "
                + ("no checkpointing" if ckpt == "none" else f"checkpointing {ckpt}"))
        others = []
        if method == "lora":
            liger = [r["tokens_per_s"] for r in peers if r["stack"] == "hf_loop_liger"]
            others.append(f"{STACK_NAMES['hf_loop_liger']} (no checkpointing, 1 x 2) {_n(liger[0])} "
                          f"({mfu_words(liger[0], first)}): fitune {statistics.median(mine) / liger[0]:.2f}x")
        else:
            old = _runs_of(fitune, "fitune_qlora_m1a2", "tokens_per_s_median")
            others.append(f"fitune at micro-batch 1 x 2 without checkpointing (the old plan's fallback) {_n(old[0])}")
        n_searched = len([r for r in searched if r["method"] == method])
        rows.append(Row(f"{what} ({_call_label('issue 32', first)})",
                        f"**{_median_words(mine)}** ({plan}; {mfu_words(statistics.median(mine), first)})",
                        f"Unsloth ({_unsloth_words(peer)}) {_median_words(theirs)} "
                        f"({mfu_words(statistics.median(theirs), first)}): its fastest of {n_searched} "
                        f"setups searched in {_link(UNSLOTH_CALL)}; " + "; ".join(others),
                        _vs(statistics.median(mine), statistics.median(theirs)), _link(SAMEDAY_CALL)))
    return rows


LEAN_NF4_CALLS = (os.path.join("bench", "results", "issue32", "lean_nf4", "call1"),
                  os.path.join("bench", "results", "issue32", "lean_nf4", "call2"))
"""QLoRA r16 again, on another H100, two calls one after the other: fitune's plan 1 with bitsandbytes' NF4 path
(`fitune_qlora_bnb`: main's code since the lean NF4 op, measured in the same calls within noise of it, was removed)
against Unsloth's fastest QLoRA setup of UNSLOTH_CALL (and, in call 2, its plain loop with its checkpointing)."""


def qlora_machine_row(root: str) -> Row:
    """The QLoRA row of LEAN_NF4_CALLS: each call's fitune figure against the fastest Unsloth setup of that call."""
    mine, theirs, firsts = [], [], []
    for folder in LEAN_NF4_CALLS:
        fitune = _lines(root, folder, "rank_check.jsonl")
        (rec,) = [r for r in fitune if r["case"].split("-r")[0] == "fitune_qlora_bnb"]
        peer = _strongest([r for r in _lines(root, folder, "peers.jsonl") if r.get("fits")])
        mine.append(rec["tokens_per_s_median"])
        theirs.append(peer)
        firsts.append(rec)
    setup = firsts[0]["setup"]
    plan = f"plan 1: micro-batch {setup['batch_size']} x {setup['grad_accum']}, checkpointing {setup['grad_checkpointing']}"
    calls = "; ".join(f"**{_n(x)}** (call {i + 1})" for i, x in enumerate(mine))
    peers = "; ".join(f"{_n(p['tokens_per_s'])} (call {i + 1}: {_unsloth_words(p)})" for i, p in enumerate(theirs))
    ratios = "; ".join(f"{_vs(x, p['tokens_per_s'])} (call {i + 1})" for i, (x, p) in enumerate(zip(mine, theirs)))
    return Row(f"{QLORA} ({_call_label('issue 32', firsts[0])}, another machine, two calls)",
               f"{calls} ({plan}; {mfu_words(statistics.median(mine), firsts[0])})",
               f"Unsloth {peers}: the fastest setup that ran in each call",
               ratios, ", ".join(_link(f) for f in LEAN_NF4_CALLS))


def hf_liger_by_call(root: str) -> list[float]:
    """The strongest HF + Liger figure of each of the five calls of the seeds' workload, in call order."""
    files = (("peers.jsonl",), ("run2", "peers.jsonl"), ("run3", "call_a", "peers.jsonl"), ("run3", "peers.jsonl"),
             ("run4", "peers.jsonl"))
    return [_strongest([r for r in _lines(root, PEERS, *f) if "liger" in r["stack"]])["tokens_per_s"] for f in files]


REAL_LENGTH_SEARCH = os.path.join("bench", "results", "issue32", "real")
"""The real-length call with every stack's setups searched (issue 32, 14 steps): fitune as planned, TRL's packed
`SFTTrainer` and Unsloth's, each with and without checkpointing."""
REAL_LENGTH_CALL = os.path.join("bench", "results", "issue32", "window", "real")
"""The real-length call over 80 steps: fitune twice and the strongest peer setup of REAL_LENGTH_SEARCH."""
REAL_AGAIN_CALL = os.path.join("bench", "results", "issue32", "real_again")
"""The real-length workload once more (commit 6b44142, 50 steps): fitune, TRL's strongest setup, fitune again."""


def _setup_words(rec: dict) -> str:
    """A peer's searched setup in words: checkpointing, Liger, micro-batch x accumulation."""
    gc = {"on": "checkpointing", "off": "no checkpointing", "unsloth": "Unsloth's checkpointing"}[rec["grad_checkpointing"]]
    liger = ", Liger" if rec.get("liger") else ""
    return f"{gc}{liger}, micro-batch {rec['micro_batch_size']} x {rec['grad_accum']}"


def real_length_rows(root: str) -> list[Row]:
    """Real-length data (issue 32's calls, the newest first): in each, fitune's median over its runs against the
    strongest peer setup of the search, run in the same call; the cell names each peer stack's best."""
    return [_real_length_row(root, call) for call in (REAL_AGAIN_CALL, REAL_LENGTH_CALL)]


def _real_length_row(root: str, call: str) -> Row:
    recs = _lines(root, call, "real_length.jsonl")
    mine = [r["trained_tokens_per_s"] for r in recs if r["stack"] == "fitune" and r["fits"]]
    fitune = statistics.median(mine)
    (best,) = [r for r in recs if r["stack"] != "fitune"]
    searched = [r for r in _lines(root, REAL_LENGTH_SEARCH, "real_length.jsonl") if r["stack"] != "fitune"]
    top = _strongest(searched, "trained_tokens_per_s")
    assert (top["stack"], _setup_words(top)) == (best["stack"], _setup_words(best)), "not the searched strongest"
    others = []
    for stack in sorted({r["stack"] for r in searched} - {top["stack"]}):
        other = _strongest([r for r in searched if r["stack"] == stack], "trained_tokens_per_s")
        others.append(f"{STACK_NAMES[stack]} at best {_n(other['trained_tokens_per_s'])}")
    label = _call_label("issue 32", recs[0])
    real = (f"real-length data ({_n(recs[0]['data']['examples'])} examples), LoRA r8 q,v, 24 GB cap: trained "
            f"tokens/s, median of steps 3-{recs[0]['steps']}")
    runs = ", ".join(_n(x) for x in mine)
    gpu = recs[0]["provenance"]["gpu"]["name"]
    positions = statistics.median(r["nonpad_tokens_per_s"] for r in recs if r["stack"] == "fitune" and r["fits"])
    peer = (f"{STACK_NAMES[best['stack']]} ({_setup_words(best)}) {_n(best['trained_tokens_per_s'])} "
            f"({linear_mfu_words(best['nonpad_tokens_per_s'], 'llama-3.1-8b', gpu)}): the fastest of "
            f"{len(searched)} peer setups searched in {_link(REAL_LENGTH_SEARCH)} ({searched[0]['steps']} steps), "
            f"{sum(1 for r in searched if r['fits'])} of which fit; " + "; ".join(others) + " there")
    return Row(f"{real} ({label})", f"**{_n(fitune)}** (median of {len(mine)} runs: {runs}; "
               f"{linear_mfu_words(positions, 'llama-3.1-8b', gpu)})", peer,
               _vs(fitune, best["trained_tokens_per_s"]), _link(call))


CONTEXT_CALLS = (("issue 33", os.path.join("bench", "results", "issue33", "noretry", "lanes")),
                 ("issue 34", os.path.join("bench", "results", "issue34", "gb48")),
                 ("issue 33", os.path.join("bench", "results", "issue33", "retries", "lanes")),
                 ("issue 33", os.path.join("bench", "results", "issue33", "context_pool")),
                 ("call 2", os.path.join(PEERS, "context_per_card", "call2")),
                 ("call 1", os.path.join(PEERS, "context_per_card", "call1")),
                 ("issue 14's 48 GB call 3, H200", os.path.join(PEERS, "context_48gb", "call3", "unsloth")),
                 ("issue 14's 48 GB call 2, H200", os.path.join(PEERS, "context_48gb", "call2")))
"""The context records, newest first: the calls on today's code (issue 34's 48 GB probe; fitune and Unsloth side by
side, issue 33), then the two calls of issue 14 and its 48 GB calls (Unsloth's probes; one stack a call there: at
these lengths each keeps 48-60 GiB of checkpoints in pinned host memory)."""


def _probes(root: str) -> list[dict]:
    out = []
    for call, folder in CONTEXT_CALLS:
        out += [dict(r, call=call, folder=folder, label=_call_label(call, r))
                for r in _lines(root, folder, "max_context.jsonl") if not r.get("summary") and r.get("cap")]
    return out


def _call_label(call: str, rec: dict) -> str:
    """How a row names its call: the commit and GPU where the record carries them (issue 34's provenance)."""
    prov = rec.get("provenance") or {}
    gpu = (prov.get("gpu") or {}).get("name", "")
    short = next((w for w in ("H200", "H100", "A100") if w in gpu), gpu)
    return f"{call}, commit {prov['commit'][:7]}, {short}" if prov.get("commit") else call


def _newest_call(probes: list[dict], stack: str) -> list[dict]:
    """The probes of `stack` from the newest call (folder) that has any."""
    for _, folder in CONTEXT_CALLS:
        mine = [r for r in probes if r["stack"] == stack and r["folder"] == folder]
        if mine:
            return mine
    return []


def _newest_shared_call(at_cap: list[dict]) -> list[dict]:
    """The probes at one cap of the newest call where fitune fit and Unsloth ran too (same call); else those of
    fitune's newest call."""
    for _, folder in CONTEXT_CALLS:
        here = [r for r in at_cap if r["folder"] == folder]
        if any(r["stack"] == "fitune" and r.get("fits") is True for r in here) and any(
                r["stack"] == "unsloth" for r in here):
            return here
    return at_cap


def context_rows(root: str) -> list[Row]:
    """Context per card: fitune's longest probe that fit against Unsloth's shortest out-of-memory length (its
    longest lies between the two numbers, so the ratio is the least fitune's lead can be), each from the newest call
    that ran it; where the two stacks' newest calls differ, the row says so."""
    rows, probes = [], _probes(root)
    for card, cap in CARDS:
        at_cap = _newest_shared_call([r for r in probes if r["cap"] == cap])
        mine = [r for r in _newest_call([r for r in at_cap if r.get("fits") is True], "fitune")]
        best = max(mine, key=lambda r: r["seq_len_tokens"])
        same = [r for r in at_cap if r["stack"] == "unsloth" and r["folder"] == best["folder"]]
        alone = not same
        host = (f"; host RAM peak {best['host_peak_rss_bytes'] / 2**30:.1f} GiB" if best.get("host_peak_rss_bytes")
                else "")
        if best.get("plan_host_ram"):  # the host RAM `fitune plan --host-ram` held the plan to
            host += f" of the {best['plan_host_ram'].replace('GiB', ' GiB')} planned for"
        note = f" ({best['label']}{host}, fitune alone)" if alone else f" ({best['label']}{host})"
        fit, oom = _unsloth_bounds(same or [r for r in at_cap if r["stack"] == "unsloth"])
        parts = ([f"fits {_n(fit['seq_len_tokens'])}" + (f" ({fit['label']})" if alone else "")] if fit else []) + \
            [f"out of memory at {_n(oom['seq_len_tokens'])}" + (f" ({oom['label']})" if alone else "")]
        if alone and fit and fit["folder"] == oom["folder"]:  # one call: named once
            parts = [f"({oom['label']}) fits {_n(fit['seq_len_tokens'])}", f"out of memory at {_n(oom['seq_len_tokens'])}"]
        if fit and fit["seq_len_tokens"] >= best["seq_len_tokens"]:  # Unsloth trained as long: no lead measured
            ratio = f"no lead measured (both train {_n(fit['seq_len_tokens'])})"
        else:
            ratio = f"at least {best['seq_len_tokens'] / oom['seq_len_tokens']:.2f}x"
        folders = sorted({best["folder"], oom["folder"]} | ({fit["folder"]} if fit else set()), reverse=True)
        rows.append(Row(f"{CONTEXT}, {card} card ({cap.removesuffix('GiB')} GiB)",
                        f"**{_n(best['seq_len_tokens'])}**{note}", "Unsloth " + ", ".join(parts), ratio,
                        ", ".join(_link(f) for f in folders)))
    return rows


def _unsloth_bounds(probes: list[dict]) -> tuple[dict | None, dict]:
    """Unsloth's longest probe that fit and its shortest that ran out of memory, each from the newest call (in
    CONTEXT_CALLS' order) that measured one; its longest lies between the two."""
    def newest(ok: bool) -> list[dict]:
        for _, folder in CONTEXT_CALLS:
            here = [r for r in probes if r["folder"] == folder and r.get("fits") is ok]
            if here:
                return here
        return []

    fits, ooms = newest(True), newest(False)
    return (max(fits, key=lambda r: r["seq_len_tokens"]) if fits else None,
            min(ooms, key=lambda r: r["seq_len_tokens"]))


def render_results(root: str) -> str:
    rows = seeds_rows(root) + unsloth_rows(root) + [qlora_machine_row(root)] + real_length_rows(root) + context_rows(root) + [
        no_retry_row(root)]
    lines = ["| measured on one GPU, H200 unless the row names another (allocator capped at the card's budget) | fitune | strongest peer, same call "
             "| fitune against it | records |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.what} | {r.fitune} | {r.peer} | {r.ratio} | {r.records} |" for r in rows]
    liger = hf_liger_by_call(root)
    fitune5 = _lines(root, PEERS, "run4", "rank_check.jsonl")[0]["tokens_per_s_median"]
    lines += ["", f"HF + Liger's strongest figure in each of the five calls of the seeds' workload: "
              f"{', '.join(_n(x) for x in liger)} tokens/s (median {_n(statistics.median(liger))}); fitune's call-5 "
              f"figure is {fitune5 / statistics.median(liger):.2f}x that median. Calls 2 to 4 measured fitune with a "
              "bug and are withdrawn for fitune ([docs/history.md](docs/history.md)).", "",
              real_length_latest_note(root), "", host_ram_note(root)]
    return "\n".join(lines)


TRAINED_ROWS_CALL = os.path.join("bench", "results", "issue32", "trained_rows")
"""The newest real-length call (commit 8039b9b, 50 steps): its record files did not come back from the GPU machine,
so its printed `RESULT` lines (call_output.txt) are the record."""


def result_lines(path: str) -> dict[str, dict]:
    """`[name] rc=0 Ns RESULT {...}` lines of a call's printed output, by run name."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("[") and " RESULT " in line:
                out[line[1:line.index("]")]] = json.loads(line.split(" RESULT ", 1)[1])
    return out


def real_length_latest_note(root: str) -> str:
    """The real-length call the table leaves out (commit 8039b9b: its records did not come back, its printed result
    lines are the record), and fitune against TRL's strongest setup across the three calls."""
    runs = result_lines(os.path.join(root, TRAINED_ROWS_CALL, "call_output.txt"))
    mine = [runs[k]["tokens_per_s"] for k in ("fitune", "fitune_again")]
    trl = runs["trl_nogc_liger_m1a2"]["tokens_per_s"]
    again = _lines(root, REAL_AGAIN_CALL, "real_length.jsonl")
    mine2 = [r["trained_tokens_per_s"] for r in again if r["stack"] == "fitune"]
    (trl2,) = [r["trained_tokens_per_s"] for r in again if r["stack"] == "trl_packing"]
    (commit2,) = {r["provenance"]["commit"][:7] for r in again}
    table = {r["stack"]: r["trained_tokens_per_s"] for r in _lines(root, "bench", "results", "issue32", "window",
                                                                     "real", "real_length.jsonl")}
    trls = [table["trl_packing"], trl, trl2]
    first = [r["trained_tokens_per_s"] for r in _lines(root, "bench", "results", "issue32", "window", "real",
                                                       "real_length.jsonl") if r["stack"] == "fitune"]
    ours = [statistics.median(first), statistics.median(mine), statistics.median(mine2)]
    ratios = [ours[0] / trls[0], statistics.median(mine) / trl, statistics.median(mine2) / trl2]
    return (f"Real-length data in a third call (commit 8039b9b, H100, 50 steps; its printed result lines are the record, "
            f"{_link(TRAINED_ROWS_CALL)}): fitune {_n(statistics.median(mine))} trained tokens/s (median of "
            f"{', '.join(_n(x) for x in mine)}), TRL's strongest setup {_n(trl)}: {ratios[1]:.2f}x. Across the three "
            f"calls (commit {commit2}'s, this one, and the 80-step call's) fitune is {min(ratios):.2f}x to "
            f"{max(ratios):.2f}x TRL: issue 32's goal, 1.5x in one call, is met in the newest call only; TRL's figure "
            f"moved {(max(trls) - min(trls)) / max(trls):.0%} between the calls, fitune's median "
            f"{(max(ours) - min(ours)) / max(ours):.0%}.")


def _mem_total_gib(env_txt: str) -> int:
    """`free -g`'s total from a call's env.txt (the GPU machine's host RAM, GiB)."""
    for line in env_txt.splitlines():
        if line.startswith("Mem:"):
            return int(line.split()[1])
    raise ValueError("no `Mem:` line in env.txt")


def host_ram_note(root: str) -> str:
    """What host RAM the long-context rows assume (issue 33): the GPU machine's, and the host peaks measured for
    fitune's offloaded checkpoints (bench/results/issue5/call4: the process's peak RSS) against the estimate then
    (its pinned bytes) plus the process baseline fitune/memory/phases.py assumes."""
    from fitune.memory.phases import HOST_RUNTIME_BASELINE_BYTES

    gib = 2 ** 30
    env = open(os.path.join(root, PEERS, "context_per_card", "call2", "env.txt"), encoding="utf-8").read()
    runs = {(r["method"], r["seq_len_tokens"]): r
            for r in _lines(root, "bench", "results", "issue5", "call4", "fitune_max_context.jsonl")}
    first, second = runs[("qlora", 131072)], runs[("qlora", 143360)]

    def est(r: dict) -> str:
        return f"{(r['est_host_bytes'] + HOST_RUNTIME_BASELINE_BYTES) / gib:.1f} GiB"

    layers = 32  # llama-3.1-8b (fitune/specs catalog): one pinned block per decoder layer
    block = second["est_host_bytes"] / layers
    rounded = 2 ** math.ceil(math.log2(block))  # PyTorch < 2.13's pinned allocator: a power of two per block
    torch_version = next(w for line in env.splitlines() if line.startswith("torch ") for w in line.split()[1:2])
    torch_minor = ".".join(torch_version.split(".")[:2])
    return (f"Host RAM: the context rows ran on a machine with {_mem_total_gib(env)} GiB (PyTorch {torch_minor}). "
            "Offloaded "
            f"checkpoints keep each layer's input in pinned host memory: a {_n(first['seq_len_tokens'])}-token QLoRA "
            f"run held {first['host_rss_peak_bytes'] / gib:.1f} GiB at its peak (estimated {est(first)}); a "
            f"{_n(second['seq_len_tokens'])}-token run measured next in the same process peaked at "
            f"{second['host_rss_peak_bytes'] / gib:.1f} GiB: PyTorch {torch_minor} rounds each layer's {block / gib:.2f} GiB "
            f"block up to {rounded / gib:.0f} GiB ({layers} x {rounded / gib:.0f} GiB), and the first run's blocks "
            f"stayed cached. {today_context_note(root)} `fitune plan` holds plans to the host RAM (this machine's, else "
            f"64 GiB assumed): [docs/phases.md](docs/phases.md). Records: {_link('bench/results/issue5/call4')}, "
            f"{_link('bench/results/issue33/context')}, {_link('bench/results/issue33/context_pool')}, "
            f"{_link('bench/results/issue33/rows')}, {_link('bench/results/issue33/retries')}.")


def today_context_note(root: str) -> str:
    """The plan's longest QLoRA context for 64 GiB of host RAM, run by `fitune train` in a fresh process: before
    (bench/results/issue33/context, PyTorch's rounded pinned blocks) and after (issue33/context_pool, fitune's
    exact-size page-locked buffers) the change of issue 33; GPU and host peaks against the estimate."""
    gib = 2 ** 30

    def probe(folder: str) -> dict:
        (r,) = [x for x in _lines(root, "bench", "results", "issue33", folder, "max_context.jsonl")
                if x.get("probe") and x["stack"] == "fitune" and x["cap"] == "23.4GiB"]
        assert r["fits"] and r["oom_guard_replans"] == 0, r
        return r

    before, r = probe("context"), probe("context_pool")
    return (f"On commit {r['provenance']['commit'][:7]} ({_call_label('', r).split(', ')[-1]}), `fitune plan "
            f"--host-ram 64GiB`'s longest, {_n(r['seq_len_tokens'])} tokens, trained in a fresh process within the card "
            f"({r['peak_allocated_bytes'] / gib:.2f} GiB allocated, estimated {r['est_peak_allocated_bytes'] / gib:.2f}) "
            f"and peaked at {r['host_peak_rss_bytes'] / gib:.1f} GiB of host RAM (estimated "
            f"{r['est_host_peak_bytes'] / gib:.1f}; {r['host_registered_bytes'] / gib:.1f} GiB of it the checkpoints' "
            f"exact-size buffers, page-locked by fitune). Before that change (commit "
            f"{before['provenance']['commit'][:7]}), the same run peaked at {before['host_peak_rss_bytes'] / gib:.1f} "
            f"GiB: PyTorch {torch_minor_of(root)}'s pinned blocks, rounded up to powers of two. {host_32_note(root)}")


def host_32_note(root: str) -> str:
    """The 32 GiB host rows (bench/results/issue33/rows): what ran, its host peak, the allocator retries, and the
    plan's longest since its host check counts saving (bench/results/issue33/context/plan_longest.jsonl)."""
    gib = 2 ** 30
    rows = {r["method"]: r for r in _lines(root, "bench", "results", "issue33", "rows", "max_context.jsonl")
            if r.get("probe")}
    q, lo = rows["qlora"], rows["lora"]
    longest = {(r["method"], r["host_ram"]): r["plan_longest_tokens"]
               for r in _lines(root, "bench", "results", "issue33", "context", "plan_longest.jsonl")}
    retries = sorted({n for r in rows.values() for n in r["alloc_retries_per_step"]})
    later = [r for r in _lines(root, "bench", "results", "issue33", "retries", "lanes", "max_context.jsonl")
             if r.get("probe") and r["stack"] == "fitune"]
    (q32,) = [r for r in later if r.get("plan_host_ram") == "32GiB"]
    assert q32["seq_len_tokens"] == longest[("qlora", "32GiB")] and q32["fits"], q32
    later_retries = sorted(n for r in later for n in r["alloc_retries_per_step"])
    return (f"With 32 GiB of host RAM (commit {q['provenance']['commit'][:7]}): QLoRA {_n(q['seq_len_tokens'])} tokens "
            f"trained within the card and peaked at {q['host_peak_rss_bytes'] / gib:.1f} GiB of host RAM while "
            f"saving, over the 32 GiB its plan was held to by the training step alone; `fitune plan` now counts the "
            f"save too, and its longest, {_n(q32['seq_len_tokens'])}, trained within the card and peaked at "
            f"{q32['host_peak_rss_bytes'] / gib:.1f} GiB (estimated {q32['est_host_peak_bytes'] / gib:.1f}; commit "
            f"{q32['provenance']['commit'][:7]}). bf16 LoRA: {_n(lo['seq_len_tokens'])} tokens, host peak "
            f"{lo['host_peak_rss_bytes'] / gib:.1f} GiB. Both runs of commit {q['provenance']['commit'][:7]} needed "
            f"{retries[0]} to {retries[-1]} allocator retries in every step, and the {len(later)} offloaded runs of "
            f"commit {q32['provenance']['commit'][:7]} {later_retries[0]} to {later_retries[-1]} a step, which their "
            f"plans did not expect (issue 33's open goal). {retry_cause_note(root)}")


def retry_cause_note(root: str) -> str:
    """Where those retries come from: reserved at the estimate under the memory fraction
    (bench/results/issue33/noretry), the same plan under the card-like cap (bench/results/issue33/ballast), and
    131,072 tokens under it with the memory outside the allocator recorded (bench/results/issue33/ballast_131k)."""
    from fitune.specs.gpu import CONSUMER_CONTEXT_BYTES, KERNEL_IMAGES_BYTES, resolve_gpu
    from fitune.units import parse_memory_bytes

    rtx = resolve_gpu("rtx4090")
    gib = 2 ** 30
    (b,) = [x for x in _lines(root, "bench", "results", "issue33", "ballast", "lanes", "max_context.jsonl")
            if x.get("probe") and x["stack"] == "fitune"]
    budget = parse_memory_bytes(b["cap"])  # the card's budget the run was capped to
    (r,) = [x for x in _lines(root, "bench", "results", "issue33", "noretry", "lanes", "max_context.jsonl")
            if x.get("probe") and x["stack"] == "fitune" and x.get("plan_host_ram") == "32GiB"]
    (c,) = [x for x in _lines(root, "bench", "results", "issue33", "ballast_131k", "lanes", "max_context.jsonl")
            if x.get("probe") and x["stack"] == "fitune"]
    return (f"On commit {r['provenance']['commit'][:7]} the {_n(r['seq_len_tokens'])}-token run still retried "
            f"{r['alloc_retries_per_step'][-1]} times in its second step with {r['peak_reserved_bytes'] / gib:.2f} GiB "
            f"reserved (estimated {r['est_peak_reserved_bytes'] / gib:.2f}) under the {r['cap']} cap of PyTorch's "
            "memory fraction. Under a cap that behaves as the card (the memory beyond the budget taken outside "
            f"PyTorch, commit {b['provenance']['commit'][:7]}), the 64 GiB plan's {_n(b['seq_len_tokens'])} tokens "
            f"retried {b['alloc_retries_per_step'][0]} and {b['alloc_retries_per_step'][1]} times with "
            f"{b['peak_reserved_bytes'] / gib:.2f} GiB reserved, {(budget - b['peak_reserved_bytes']) / gib:.2f} "
            "GiB under the budget: a card would retry too. At 131,072 tokens, 1.50x Unsloth's out-of-memory length "
            f"(commit {c['provenance']['commit'][:7]}), it retried {c['alloc_retries_per_step'][0]} and "
            f"{c['alloc_retries_per_step'][1]} times, the process holding "
            f"{c['outside_allocator_bytes_per_step'][-1] / 2**20:,.0f} MiB outside PyTorch's allocator after each step "
            f"where the budget leaves {CONSUMER_CONTEXT_BYTES / 2**20:,.0f} MiB ([docs/phases.md](docs/phases.md)). "
            f"A card's plans now leave room for the {KERNEL_IMAGES_BYTES / 2**20:,.0f} MiB of kernel images a run loads "
            f"after cuBLAS is up (`--gpu rtx4090`: {rtx.training_budget_bytes / gib:.2f} GiB for the step of the "
            f"allocator's {rtx.allocator_budget_bytes / gib:.2f}; `--gpu 23.4GiB` stays the allocator's). "
            f"{card_plan_note(root)}")


def card_plan_note(root: str) -> str:
    """The 131,072-token plan probed with BALLAST_PLAN_GPU=rtx4090 (bench/results/issue33/ballast_4090), which in
    fact planned for the cap: the bench passed plan_gpu on to its probes only from commit 9dd703c."""
    from fitune.units import parse_memory_bytes

    gib = 2 ** 30
    (d,) = [x for x in _lines(root, "bench", "results", "issue33", "ballast_4090", "max_context.jsonl")
            if x.get("probe") and x["stack"] == "fitune"]
    room = parse_memory_bytes(d["cap"]) - d["est_peak_reserved_bytes"]
    return (f"Probed for the card (commit {d['provenance']['commit'][:7]}; the bench planned for `--gpu "
            f"{d['cap']}` there, not for `--gpu rtx4090`: it passed the card's budget on to its probes only from "
            f"commit 9dd703c), the {_n(d['seq_len_tokens'])}-token plan, 8-bit AdamW with the embedding table on the "
            f"GPU, estimated {d['est_peak_reserved_bytes'] / gib:.2f} GiB reserved ({room / 2**20:,.0f} MiB under "
            f"the allocator's room), retried {d['alloc_retries_per_step'][0]} times in its first step with "
            f"{d['peak_reserved_bytes'] / gib:.2f} GiB reserved, the allocator's whole room "
            f"({_link(os.path.join('bench', 'results', 'issue33', 'ballast_4090'))}). {roomier_plan_note(root)}")


def roomier_plan_note(root: str) -> str:
    """AdamW with the embedding table in host memory at 131,072 tokens, three steps under the card-like cap, and
    Unsloth at 87,381 tokens after it in the same call (bench/results/issue33/ballast_4090_adamw; planned for the cap,
    as card_plan_note says); then the plan that met the goal (`no_retry_note`)."""
    gib = 2 ** 30
    rows = _lines(root, "bench", "results", "issue33", "ballast_4090_adamw", "max_context.jsonl")
    (f,) = [x for x in rows if x.get("probe") and x["stack"] == "fitune"]
    (u,) = [x for x in rows if x.get("probe") and x["stack"] == "unsloth"]
    retries = f["alloc_retries_per_step"]
    return (f"AdamW with the embedding table in host memory (commit {f['provenance']['commit'][:7]}, planned the same "
            f"way) trained {len(retries)} steps ({f['peak_allocated_bytes'] / gib:.2f} GiB allocated, estimated "
            f"{f['est_peak_allocated_bytes'] / gib:.2f}) with {', '.join(map(str, retries[:-1]))} and {retries[-1]} "
            "allocator retries, the allocator's whole room reserved again, where Unsloth ran out of memory at "
            f"{_n(u['seq_len_tokens'])} tokens under the same cap in the same call "
            f"({_link(os.path.join('bench', 'results', 'issue33', 'ballast_4090_adamw'))}; restoring the offloaded "
            "inputs into two fixed buffers did not change that: "
            f"{_link(os.path.join('bench', 'results', 'issue33', 'ballast_staging'))}). {no_retry_note(root)}")


NO_RETRY_CALL = os.path.join("bench", "results", "issue33", "ballast_plan1")
"""Issue 33's no-retries goal: `fitune plan --gpu rtx4090 --host-ram 64GiB`'s plan 1 at 131,072 tokens, three steps
under the card-like cap, Unsloth at 87,381 tokens after it in the same call."""


def no_retry_note(root: str) -> str:
    """The plan that trains 131,072 tokens without allocator retries (NO_RETRY_CALL), and what its reserved estimate
    missed (bench/results/issue33/ballast_8bit: the allocator's history of the same plan)."""
    gib = 2 ** 30
    rows = _lines(root, NO_RETRY_CALL, "max_context.jsonl")
    (f,) = [x for x in rows if x.get("probe") and x["stack"] == "fitune"]
    (m,) = [x for x in _lines(root, "bench", "results", "issue33", "ballast_8bit", "history", "alloc_history_output.txt")
            if x.get("model_replay")]
    over = f["peak_reserved_bytes"] / f["est_peak_reserved_bytes"] - 1
    return (f"Since a tight AdamW plan is also offered with 8-bit AdamW where that buys room (commit "
            f"{f['provenance']['commit'][:7]}), plan 1 for `--gpu rtx4090` at {_n(f['seq_len_tokens'])} tokens is "
            f"8-bit AdamW with the table in host memory: it trained {len(f['alloc_retries_per_step'])} steps with "
            f"{', '.join(map(str, f['alloc_retries_per_step']))} allocator retries "
            f"({', '.join(f'{x:.1f}' for x in f['step_seconds'])} s; "
            f"{f['peak_allocated_bytes'] / gib:.2f} GiB allocated, estimated {f['est_peak_allocated_bytes'] / gib:.2f}; "
            f"host peak {f['host_peak_rss_bytes'] / gib:.1f} GiB, estimated {f['est_host_peak_bytes'] / gib:.1f}), "
            "the table's last row. It reserved "
            f"{f['peak_reserved_bytes'] / gib:.2f} GiB, {over * 100:.1f} % over its estimate: the run's own requests "
            "replayed through the estimator's allocator model map "
            f"{m['model_peak_reserved_bytes'] / gib:.2f} GiB where the run mapped {m['measured_peak_mapped_bytes'] / gib:.2f} "
            f"({_link(os.path.join('bench', 'results', 'issue33', 'ballast_8bit'))}): the model of expandable "
            "segments is not yet the allocator's ([docs/phases.md](docs/phases.md)).")


def no_retry_row(root: str) -> Row:
    """Issue 33's goal as a row: fitune's plan 1 at 1.5x Unsloth's out-of-memory length, retries per step, and
    Unsloth in the same call under the same cap."""
    rows = _lines(root, NO_RETRY_CALL, "max_context.jsonl")
    (f,) = [x for x in rows if x.get("probe") and x["stack"] == "fitune"]
    (u,) = [x for x in rows if x.get("probe") and x["stack"] == "unsloth"]
    label = _call_label("issue 33", f)
    retries = f["alloc_retries_per_step"]
    return Row(f"QLoRA r32 all-linear, `fitune plan --gpu rtx4090 --host-ram 64GiB`'s plan 1, 24 GB card "
               f"({f['cap'].removesuffix('GiB')} GiB, the card-like cap): {len(retries)} steps, allocator retries "
               "in each",
               f"**{_n(f['seq_len_tokens'])}**, retries {', '.join(map(str, retries))} ({label}; host RAM peak "
               f"{f['host_peak_rss_bytes'] / 2**30:.1f} GiB of the {f['plan_host_ram'].replace('GiB', ' GiB')} "
               "planned for)",
               f"Unsloth out of memory at {_n(u['seq_len_tokens'])}" + (" (in its step 2)" if len(u["step_seconds"]) == 1
                                                                         else ""),
               f"at least {f['seq_len_tokens'] / u['seq_len_tokens']:.2f}x, no retries", _link(NO_RETRY_CALL))


def torch_minor_of(root: str) -> str:
    """The GPU machine's PyTorch (major.minor), from the context call's env.txt."""
    env = open(os.path.join(root, "bench", "results", "issue33", "context_pool", "env.txt"), encoding="utf-8").read()
    version = next(w for line in env.splitlines() if line.startswith("torch ") for w in line.split()[1:2])
    return ".".join(version.split(".")[:2])


def render_accuracy(root: str) -> str:
    """The estimate against measured peaks: the HF recipe's runs, and the runs measured after the estimator's last
    change (out of sample) against the goal of 2 % allocated, 5 % reserved."""
    from fitune.profile.accuracy import compare, measured_rows, summary

    recipe = compare(os.path.join(root, "bench", "results", "hf_recipe", "hf_recipe.jsonl"))
    s, archs = summary(recipe), len({r.label.split()[0] for r in recipe})
    out = [r for r in measured_rows(root) if r.sample == "out"]
    alloc_ok = sum(abs(r.allocated_error_pct) <= 2.0 for r in out)
    resv_ok = sum(abs(r.reserved_error_pct) <= 5.0 for r in out)
    worst_a = max(abs(r.allocated_error_pct) for r in out)
    worst_r = max(abs(r.reserved_error_pct) for r in out)
    return "\n".join([
        "| `fitune estimate` against measured peaks | runs | peak allocated | peak reserved | records |",
        "| --- | --- | --- | --- | --- |",
        f"| HF recipe, {archs} architectures (median / max error) | {s['cases']} | {s['allocated_median_pct']:.2f} % / "
        f"{s['allocated_max_pct']:.2f} % | {s['reserved_median_pct']:.2f} % / {s['reserved_max_pct']:.2f} % | "
        f"{_link('bench/results/hf_recipe')} |",
        f"| fitune's runner, measured after the estimator's last change (within 2 % / 5 %; max error) | {len(out)} | "
        f"{alloc_ok} of {len(out)}; {worst_a:.2f} % | {resv_ok} of {len(out)}; {worst_r:.2f} % | "
        f"{_link('bench/results/speed')}, {_link('bench/results/rank_check')} |",
    ])


def render(root: str = ROOT) -> str:
    """The whole generated block's content (without the marker lines)."""
    return render_results(root) + "\n\n" + render_accuracy(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.readme_numbers", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.root) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
