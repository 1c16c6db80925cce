"""Two rules of PyTorch's allocator with expandable segments that fitune's model leaves out, tried on the CPU.

CUDACachingAllocator.cpp (PyTorch 2.x) with `expandable_segments:True`:
- `should_split` splits off any remainder from 512 bytes (kMinBlockSize) in both pools; fitune/memory/allocator.py
  keeps the default allocator's rule (large pool: more than 1 MiB) for expandable segments too;
- `get_free_block` counts a free block followed by unmapped space (the free tail of the segment) as large as what
  it could grow to (`expandable_size`), so any other free block that fits is taken first.

This replays (1) a measured run's own requests (bench/_with_memory_history.py `--trace`) through the model as it is
and with these rules (`PyTorchRulesModel`), beside what the run mapped, and (2) the estimator's reserved peaks of
every measured run with expandable segments (fitune/profile/accuracy.py `measured_rows`) both ways. One JSON object:

    python -m bench.expandable_rules bench/results/issue33/ballast_8bit/history/fitune_23.4GiB_131072.trace.json.xz

Result, bench/results/issue33/ballast_8bit/rules_trial.json: the rules bring the replay of the run's requests close
to what the run mapped, and move the estimator's tapes away from the measured peaks (lower, on average): they wait
for the tapes' own gap, and are not in the model yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

import fitune.memory.allocator as allocator
from bench.alloc_history import model_replay, open_trace
from fitune.memory.allocator import MIN_BLOCK, ExpandableAllocatorModel
from fitune.profile.accuracy import measured_rows


class PyTorchRulesModel(ExpandableAllocatorModel):
    """ExpandableAllocatorModel with `should_split`'s and `get_free_block`'s rules for expandable segments."""

    def _splits(self, remaining: int, small: bool) -> bool:
        return remaining >= MIN_BLOCK

    def _best_fit(self, pool: list[tuple[int, int]], i: int, small: bool) -> int:
        tail = self._tail[small]
        if i + 1 < len(pool) and tail is not None and tail.free and tail.next is None and pool[i][1] == tail.offset:
            return i + 1
        return i


@contextlib.contextmanager
def pytorch_rules():
    """fitune's estimator with PyTorchRulesModel in place of its model of expandable segments."""
    saved = allocator.ExpandableAllocatorModel
    allocator.ExpandableAllocatorModel = PyTorchRulesModel
    try:
        yield
    finally:
        allocator.ExpandableAllocatorModel = saved


def accuracy(root: str) -> dict:
    """The reserved error (estimate against measured, %) of the measured runs with expandable segments."""
    rows = [r for r in measured_rows(root) if r.setup.expandable_segments]
    errors = [r.reserved_error_pct for r in rows]
    out_of_sample = [r.reserved_error_pct for r in rows if r.sample == "out"]
    return {"runs": len(rows), "median_abs_pct": round(statistics.median(abs(e) for e in errors), 2),
            "mean_pct": round(statistics.mean(errors), 2), "max_abs_pct": round(max(abs(e) for e in errors), 2),
            "out_of_sample": len(out_of_sample), "out_of_sample_within_5_pct": sum(abs(e) <= 5 for e in out_of_sample)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.expandable_rules", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a run's allocator history (bench/_with_memory_history.py --trace; .json.gz or .xz)")
    p.add_argument("--root", default=".", help="the checkout whose measured runs to estimate")
    args = p.parse_args(argv)
    events = open_trace(args.trace)["events"]
    out = {"trace": args.trace, "model_now": model_replay(events), "estimates_now": accuracy(args.root)}
    with pytorch_rules():
        out["model_pytorch_rules"] = model_replay(events, PyTorchRulesModel)
        out["estimates_pytorch_rules"] = accuracy(args.root)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
