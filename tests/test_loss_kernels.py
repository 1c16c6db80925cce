"""bench/loss_kernels.py (issue 14: is a fused loss kernel faster than the chunked loss?) on the CPU with tiny
shapes: it writes one line per implementation and token count, and its exactness columns hold fitune's chunked
loss against transformers' plain path."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_loss_kernels_bench_lines_and_exactness(tmp_path):
    from bench.loss_kernels import main

    out = tmp_path / "lk.jsonl"
    assert main(["--out", str(out), "--device", "cpu", "--tokens", "64,100", "--hidden", "32", "--vocab", "500",
                 "--iters", "2", "--warmup", "1"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    impls = ["chunked", "hf", "chunked_compiled"]
    assert [(r["impl"], r["tokens"]) for r in rows] == [(i, n) for n in (64, 100) for i in impls]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["tokens_per_s"] > 0
    for r in (r for r in rows if r["impl"] != "chunked"):  # against the chunked reference: the same loss and gradient
        assert r["loss_rel_diff"] < 1e-5 and r["grad_rel_norm_diff"] < 1e-5
