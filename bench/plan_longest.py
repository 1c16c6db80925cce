"""Issue 33: the longest context `fitune plan` accepts on a card, per method and host RAM (on the CPU: the plan is
pure Python). One JSON line per (method, host RAM) through bench.common.write_record, the search being
bench/peers/unsloth_max_context.py `plan_longest` (the prior its GPU probes start from): the longest multiple of
--resolution tokens for which `fitune plan MODEL --gpu CAP --method M --lora-rank R --lora-targets all-linear
--seq-len N --batch-size 1 --host-ram H` has a plan without allocator retries.

    python bench/plan_longest.py --out bench/results/issue33/context/plan_longest.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))

from bench.common import write_record  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--cap", default="rtx4090")
    p.add_argument("--cases", default="qlora:32,lora:32", help="METHOD:RANK, comma-separated")
    p.add_argument("--host-ram", default="32GiB,64GiB", help="comma-separated")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--limit", type=int, default=262144)
    args = p.parse_args(argv)
    import unsloth_max_context as probe  # its plan search, as the GPU probes use it

    for case in args.cases.split(","):
        method, rank = case.split(":")
        for host in args.host_ram.split(","):
            a = SimpleNamespace(model=args.model, cap=args.cap, method=method, lora_rank=int(rank),
                                resolution=args.resolution, limit=args.limit, fitune_host_ram=host,
                                fitune_optimizer="any", fitune_retries=False)
            t0 = time.perf_counter()
            longest = probe.plan_longest(a)
            rec = write_record(args.out, {"model": args.model, "cap": args.cap, "method": method, "lora_rank": int(rank),
                                          "lora_targets": "all-linear", "batch_size": 1, "host_ram": host,
                                          "plan_longest_tokens": longest, "search_s": round(time.perf_counter() - t0, 1),
                                          "command": " ".join([sys.executable, *sys.argv])}, gpu=False)
            print(method, rank, host, rec["plan_longest_tokens"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
