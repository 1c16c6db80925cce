"""Issue 33, the export phase: `fitune export`'s host memory, measured in a fresh process against `fitune estimate`'s
`export` phase (fitune/memory/phases.py `export_phase`: the process's CPU baseline plus the largest tensor's working
set). Runs on the CPU (export never uses a GPU).

    python bench/export_host.py --out bench/results/issue33/export/export_host.jsonl

The model: Llama-3.1-8B's config (the catalog's) with `--layers` decoder layers (default 2), random bf16 weights
saved as safetensors shards (`save_pretrained`, 5 GB shards). Its largest tensors, the 128,256 x 4,096 embedding and
lm_head, are 8B's own, and each layer's are 8B's, so the export's peak (the largest tensor's working set) is the
8B export's; only the file is smaller. The tokenizer is the real SmolLM2's (tests/real_model.py: a byte-level BPE
GGUF export supports; its ids are within the vocabulary).

Per `--qtypes` entry, `fitune export FOLDER --gguf Q --out FILE` runs in a fresh process (this script's `--child`:
`fitune.cli.main.main` in-process, with bench/pretrained_load.py's `HostSampler` every 10 ms): the peak resident
memory (VmHWM), and the peak without the weight files' mapped pages (page cache: what the estimate models), beside
the estimate of the same folder. One JSON line per case through bench.common.write_record (commit, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import write_record  # noqa: E402
from bench.pretrained_load import HostSampler, host_status, reset_host_peak  # noqa: E402

MODEL = "llama-3.1-8b"
SHARD_SIZE = "5GB"


def write_folder(folder: str, layers: int) -> dict:
    """The model folder (reused when complete for the same layer count): config, safetensors shards, tokenizer."""
    marker = os.path.join(folder, ".complete")
    if os.path.exists(marker) and open(marker).read() == str(layers):
        return {"reused": True}
    import torch

    from fitune.runtime.model import build_model
    from fitune.specs.model import load_model_spec
    from tests.real_model import model_folder

    t0 = time.perf_counter()
    config = {**load_model_spec(MODEL).hf_config, "num_hidden_layers": layers}
    torch.manual_seed(0)
    model = build_model(config, dtype_name="bf16", device="cpu", init="random")
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    del model
    real = model_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(real, name)):
            shutil.copy(os.path.join(real, name), folder)
    with open(marker, "w") as f:
        f.write(str(layers))
    return {"reused": False, "write_s": round(time.perf_counter() - t0, 1)}


def estimate_export(folder: str, qtype: str) -> dict:
    """`export_phase` of the folder's model (its config.json read as `fitune estimate FOLDER` reads it)."""
    from fitune.memory.phases import HOST_CPU_BASELINE_BYTES, export_phase, largest_tensor_numel
    from fitune.setup import TrainSetup
    from fitune.specs.model import load_model_spec

    spec = load_model_spec(folder)
    phase = export_phase(spec, TrainSetup(), qtype)
    return {"est_host_bytes": phase.host_bytes, "est_baseline_bytes": HOST_CPU_BASELINE_BYTES,
            "largest_tensor_numel": largest_tensor_numel(spec), "est_note": phase.note}


def child_main(folder: str, qtype: str, out_file: str, result: str) -> int:
    """`fitune export` in this process, its host memory sampled; the figures to `result` (JSON)."""
    from fitune.cli.main import main as fitune_main

    before = host_status()
    reset_host_peak()
    sampler = HostSampler()
    sampler.start()
    t0 = time.perf_counter()
    try:
        code = fitune_main(["export", folder, "--gguf", qtype, "--out", out_file, "--force"])
    finally:
        sampler.stop()
    after = host_status()
    with open(result, "w") as f:
        json.dump({"exit": code, "wall_s": round(time.perf_counter() - t0, 1), "before_rss_bytes": before.get("VmRSS"),
                   "host_peak_rss_bytes": after.get("VmHWM"), "sampled_peaks": sampler.peaks,
                   "gguf_bytes": os.path.getsize(out_file) if os.path.exists(out_file) else None}, f)
    return 0


def run_case(folder: str, qtype: str, work: str) -> dict:
    result = os.path.join(work, f"export_{qtype}.json")
    out_file = os.path.join(work, f"model.{qtype}.gguf")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", folder, "--qtype", qtype, "--gguf-out", out_file,
           "--result", result]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0 or not os.path.exists(result):
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    with open(result) as f:
        measured = json.load(f)
    if os.path.exists(out_file):
        os.remove(out_file)
    return measured


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON lines, one per case")
    p.add_argument("--work", default="/tmp/fitune_export_host")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--qtypes", default="f16,q8_0")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--qtype", help=argparse.SUPPRESS)
    p.add_argument("--gguf-out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child, args.qtype, args.gguf_out, args.result)
    if not args.out:
        p.error("--out is required")
    folder = os.path.join(args.work, f"llama8b_{args.layers}layers")
    os.makedirs(args.work, exist_ok=True)
    made = write_folder(folder, args.layers)
    for qtype in args.qtypes.split(","):
        measured = run_case(folder, qtype, args.work)
        est = estimate_export(folder, qtype)
        rec = {"bench": "export_host", "model": MODEL, "layers": args.layers, "qtype": qtype, "folder": made,
               "command": f"fitune export {folder} --gguf {qtype} --out model.{qtype}.gguf", **measured, **est}
        peak = (measured.get("sampled_peaks") or {}).get("no_weight_files")
        if peak:
            rec["host_no_weight_files_peak_bytes"] = peak
            rec["host_over_est"] = round(peak / est["est_host_bytes"], 4)
        line = write_record(args.out, rec, gpu=False)
        print(json.dumps({k: line[k] for k in ("qtype", "host_peak_rss_bytes", "host_no_weight_files_peak_bytes",
                                               "est_host_bytes", "host_over_est") if k in line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
