"""This CPU's matmul rate per dtype, as `fitune train` measures it when it trains without a GPU
(fitune/runtime/device.py `matmul_gflops`, `cpu_training_notice`): one JSON line per dtype.

    python3 bench/cpu_matmul.py --out bench/results/cpu/matmul.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import provenance, write_record  # noqa: E402
from fitune.runtime.device import matmul_gflops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="seconds of products per dtype")
    args = p.parse_args(argv)
    prov = provenance(gpu=False)
    for dtype in ("fp32", "bf16", "fp16"):
        rate = matmul_gflops(dtype, seconds=args.seconds)
        print(dtype, f"{rate:.2f} GFLOP/s")
        write_record(args.out, {"dtype": dtype, "size": 256, "gflops": rate, "cpu": os.cpu_count()}, prov=prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
