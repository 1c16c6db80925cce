"""Issue 14, "context per card size": the longest sequence whose training steps complete under a card's budget.

Workload (Unsloth's published long-context test): Llama-3.1-8B-shaped (random weights), QLoRA (4-bit NF4 base)
r32 on all linear layers (q,k,v,o,gate,up,down), batch 1, AdamW (torch), PyTorch's allocator capped to --cap
(7.4GiB, 11.4GiB, 15.4GiB, 23.4GiB, 47.4GiB: what 8, 12, 16, 24 and 48 GB cards leave to PyTorch). A length N
fits when --steps optimizer steps (forward, backward, optimizer step) at N all complete under the cap; the default
2 steps make the second run with the optimizer's states already allocated, as every step of a real run does.

Stacks (one fresh process per probe: an out-of-memory error, Unsloth's global patches and a half-freed CUDA
context stay in it):
  unsloth  Unsloth 2026.10.9's documented path: `FastLanguageModel.from_pretrained(MODEL_DIR, max_seq_length=N,
           dtype=bf16, load_in_4bit=True)` (the bf16 folder of make_model.py, quantised to NF4 while it loads: Unsloth
           passes a BitsAndBytesConfig(nf4, double quant) to transformers), `get_peft_model(r=32, all 7 projections,
           use_gradient_checkpointing="unsloth")`, TRL's SFTTrainer (AdamW torch, bf16) on N-token rows. The card
           view is patched as in unsloth_run.py (`torch.cuda.mem_get_info` and the device's total memory answer as
           the capped card: Unsloth sizes its loss chunks, offloading and embedding placement from them).
  fitune   the user's path: `fitune plan llama-3.1-8b --gpu CAP --method qlora --lora-rank 32 --lora-targets
           all-linear --seq-len N --batch-size 1 --json --top 10`, the first plan whose optimizer is AdamW
           (--fitune-optimizer any: plan 1 whatever its optimizer) written with `--write plan.yaml --pick K`, then
           `fitune train plan.yaml` with init: random, `cap: CAP`, max_steps, and text records longer than N
           (truncated to N). The plan saying nothing fits is a no (no GPU work); exit code 0 with every step logged
           is a yes.

Search (the parent; each probe is `python3 unsloth_max_context.py --probe N ...` under a time limit, its RESULT
line parsed): with a prior P (--prior auto: Unsloth's published figure for the card the cap stands for; for
fitune, the longest length `fitune plan` accepts, found on the CPU first) it probes P, then gallops away from it in
steps of --resolution (doubling) and bisects - bench/max_context.py's `search` on the offsets; with --prior none
it doubles from --start and bisects (that `search` as it is). A probe that times out counts as a no; any other
error (not out of memory) stops the search while no length has fitted yet (a set-up error) and counts as a no,
listed in `error_probes`, after one has. No probe starts when less than --min-probe-s of --budget-s is left.
One JSON line per probe (appended by the probe) and a final summary line {stack, cap, longest_tokens (the longest
length that was probed and fitted), upper_bound_tokens, complete, probes: [[N, fits, seconds], ...]} in --out.

    export PYTHONPATH=.:$PWD/.peers_site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
    python3 bench/peers/unsloth_max_context.py --model-dir /tmp/fitune_peers/llama8b --cap 23.4GiB --out F.jsonl
    python3 bench/peers/unsloth_max_context.py --stack fitune --model-dir DIR --cap 23.4GiB --out F.jsonl
    python3 bench/peers/unsloth_max_context.py --model-dir DIR --cap 23.4GiB --out F --fake-threshold 70000  # test
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from bench.common import PROBE_ENV, probed_fitune_cmd, training_facts  # noqa: E402

HISTORY_ENV = "FITUNE_MEMORY_HISTORY_DIR"
"""Set to a folder: each fitune probe trains under bench/_with_memory_history.py, which writes its summary and its
allocator history (`--trace`) there, named after the probe's run folder."""
from bench.peers.peerlib import (outcome, parse_result, reset_peaks, run_case, simulate_card_view,  # noqa: E402
                                 start_cuda, trainer_callback, versions, write)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Unsloth's published longest context for Llama 3.1 (8B), QLoRA r32 on all linear layers, batch 1, per card size in
#: GB (unsloth.ai/blog/llama3-3; the README quotes the 24 GB figure). Used only as the search's first probe.
UNSLOTH_PUBLISHED = {8: 2972, 12: 21848, 16: 40724, 24: 78475, 40: 153977, 48: 191728, 80: 342733}
#: The card each cap stands for (what a card of that size leaves to PyTorch's allocator).
CAP_CARD_GB = {"7.4gib": 8, "11.4gib": 12, "15.4gib": 16, "23.4gib": 24, "rtx4090": 24, "rtx3090": 24,
               "47.4gib": 48}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("unsloth", "fitune"), default="unsloth")
    p.add_argument("--model-dir", required=True,
                   help="make_model.py's folder (unsloth: the model; fitune: its tokenizer, the model is --model)")
    p.add_argument("--out", required=True, help="JSON lines: one per probe, then the summary")
    p.add_argument("--cap", required=True, help="allocator budget: 7.4GiB ... 47.4GiB, or a catalog GPU")
    p.add_argument("--model", default="llama-3.1-8b", help="fitune: the catalog model planned and trained")
    p.add_argument("--method", choices=("qlora", "lora"), default="qlora")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per probe (2: the second with Adam states)")
    p.add_argument("--optim", default="adamw_torch", help="unsloth: SFTConfig(optim=...)")
    p.add_argument("--fitune-optimizer", default="adamw",
                   help="fitune: the first plan whose optimizer is one of these (comma-separated; adamw: torch's, as "
                        "--optim adamw_torch; with --optim adamw_8bit give adamw,adamw8bit); 'any': plan 1")
    p.add_argument("--fitune-retries", action="store_true",
                   help="fitune: accept a plan whose reserved peak is over the budget (it says to expect allocator "
                        "retries); by default only plans without them count as fitting")
    p.add_argument("--fitune-set", action="append", default=[], metavar="KEY=VALUE",
                   help="fitune: a setup key set in the written plan before training (YAML value, e.g. "
                        "offload_embeddings=true); the run's own estimate is then recorded from that config")
    p.add_argument("--fitune-host-ram", metavar="NGiB",
                   help="fitune: `fitune plan --host-ram` (the host RAM its plans must fit; default: the plan's own "
                        "default, this machine's RAM when its GPU is here)")
    p.add_argument("--fitune-plan-gpu", metavar="GPU",
                   help="fitune: plan for this budget (`fitune plan --gpu`) while the run is capped at --cap: room "
                        "left under the cap for the memory outside PyTorch's allocator (issue 33)")
    p.add_argument("--fitune-plan-optimizer", metavar="NAME[,NAME]",
                   help="fitune: `fitune plan --optimizer` (the optimizers its plans may use; default: any)")
    p.add_argument("--fitune-plan-at", type=int, metavar="N",
                   help="fitune: plan at N tokens and train that plan at the probe's length (with --fitune-set: a "
                        "technique the planner does not propose yet, on the plan it makes where it still fits)")
    p.add_argument("--start", type=int, default=8192, help="first length of the doubling search (--prior none)")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--limit", type=int, default=262144)
    p.add_argument("--prior", default="auto", help="auto | none | a length to probe first and gallop from")
    p.add_argument("--lengths", help="instead of a search, probe these lengths in order (comma-separated; 'plan': "
                                     "fitune plan's longest), skipping any a probe already decides (a shorter one "
                                     "failed or a longer one fitted): brackets the longest for a few probes")
    p.add_argument("--probe-timeout", type=float, default=420, help="seconds one probe may take")
    p.add_argument("--budget-s", type=float, default=0, help="seconds for the whole search (0: no limit)")
    p.add_argument("--min-probe-s", type=float, default=60, help="start no probe with less than this left")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "peers_max_context"))
    p.add_argument("--log-dir", help="append each probe's output here ({stack}_{cap}.log)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-card-view", action="store_true", help="unsloth: keep the H200's memory answers")
    p.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # child mode: one probe at this length
    p.add_argument("--fake-threshold", type=int, help="test hook: a probe fits iff N <= this (no GPU, no model)")
    p.add_argument("--fake-seconds", type=float, default=0, help="test hook: each fake probe takes this long")
    return p.parse_args(argv)


def _lora(args) -> dict:
    return {"r": args.lora_rank, "alpha": 16, "dropout": 0.0, "targets": TARGETS if args.stack == "unsloth"
            else ["all-linear"]}


def _probe_record(args, n: int) -> dict:
    return {"stack": args.stack, "probe": True, "cap": args.cap, "seq_len_tokens": n, "tokens_per_step": n,
            "micro_batch_size": 1, "grad_accum": 1, "steps": args.steps, "method": args.method,
            "lora": _lora(args), "optim": args.optim if args.stack == "unsloth" else
            f"the plan's, one of: {args.fitune_optimizer}",
            **({"plan_host_ram": args.fitune_host_ram} if args.stack == "fitune" and args.fitune_host_ram else {})}


# ---- child: one probe --------------------------------------------------------------------------------------

def probe_unsloth(args, n: int) -> None:
    start_cuda(args)  # the cap, before any CUDA allocation
    case = argparse.Namespace(model_dir=args.model_dir, out=args.out, cap=args.cap, device=args.device,
                              grad_checkpointing="unsloth", micro_batch=1, grad_accum=1, steps=args.steps)
    extra = _probe_record(args, n)
    extra.pop("stack")

    def body(rec, clock):
        if args.device == "cuda" and not args.no_card_view:
            rec["card_view"] = simulate_card_view(args.cap)
        from unsloth import FastLanguageModel  # first: it patches transformers, peft and trl

        import torch
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        t0 = time.perf_counter()
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=args.model_dir, max_seq_length=n, dtype=torch.bfloat16,
            load_in_4bit=args.method == "qlora", use_gradient_checkpointing="unsloth")
        model = FastLanguageModel.get_peft_model(
            model, r=args.lora_rank, target_modules=list(TARGETS), lora_alpha=16, lora_dropout=0, bias="none",
            use_gradient_checkpointing="unsloth", random_state=0)
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(7, len(tokenizer), (args.steps, n), generator=g)  # past the tokenizer's specials
        config = SFTConfig(
            output_dir=os.path.join(args.work, "unsloth_out"), per_device_train_batch_size=1,
            gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-4, optim=args.optim, bf16=True,
            logging_steps=1, report_to=[], save_strategy="no", max_length=n, packing=False, dataset_num_proc=1,
            seed=0)
        trainer = SFTTrainer(model=model, processing_class=tokenizer, args=config,
                             train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
                             callbacks=[trainer_callback(clock)])
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        try:  # what Unsloth made of the setup (notes only)
            rec["unsloth_setup"] = {
                "model_gradient_checkpointing": repr(getattr(model, "_unsloth_gradient_checkpointing", None)),
                "embedding_device": str(model.get_input_embeddings().weight.device),
                "quantized_linear": type(model.base_model.model.model.layers[0].mlp.down_proj.base_layer).__name__,
                "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
                "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}"}
        except Exception as e:  # noqa: BLE001
            rec["unsloth_setup_error"] = repr(e)[:300]
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    run_case("unsloth", case, body, **extra)


def _fitune_cmd() -> list[str]:
    return [sys.executable, "-m", "fitune"]


def _fitune_env() -> dict:
    """This checkout first on the path of the `python -m fitune` subprocesses, whatever their working folder."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.path.abspath(ROOT) + (os.pathsep + path if path else ""))


def _plan_args(args, n: int) -> list[str]:
    return ["plan", args.model, "--gpu", getattr(args, "fitune_plan_gpu", None) or args.cap, "--method", args.method, "--lora-rank", str(args.lora_rank),
            "--lora-targets", "all-linear", "--seq-len", str(n), "--batch-size", "1"] + (
        ["--host-ram", args.fitune_host_ram] if args.fitune_host_ram else []) + (
        ["--optimizer", args.fitune_plan_optimizer] if getattr(args, "fitune_plan_optimizer", None) else [])


def plan_choice(args, n: int) -> tuple[int | None, dict]:
    """`fitune plan --json --top 10` at length n: the plan number to train (None: no plan) and what the plan said."""
    proc = subprocess.run(_fitune_cmd() + _plan_args(args, n) + ["--json", "--top", "10"], capture_output=True,
                          text=True, timeout=300, env=_fitune_env())
    try:
        answer = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        answer = {}
    plans = answer.get("plans") or []
    info: dict = {"plan_exit": proc.returncode, "plans": len(plans)}
    if plans:
        s = plans[0]["setup"]
        info["plan1"] = {k: s.get(k) for k in ("optimizer", "grad_checkpointing", "loss", "tiled_mlp", "kernels")}
    elif answer.get("minimum"):
        info["plan_minimum"] = {k: answer["minimum"].get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes")
                                if isinstance(answer["minimum"], dict)}
    if proc.returncode not in (0, 2) or (not plans and not answer):
        raise RuntimeError(f"fitune plan exit {proc.returncode}: {(proc.stdout[-500:] + proc.stderr[-1500:]).strip()}")
    for plan in plans:
        if plan.get("retries_expected") and not args.fitune_retries:
            continue  # the plan itself says a fragmented cache can fail it: not what fitune claims fits
        if args.fitune_optimizer == "any" or plan["setup"].get("optimizer") in args.fitune_optimizer.split(","):
            info["picked"] = plan["rank"]
            info["setup"] = plan["setup"]
            info["est_peak_allocated_bytes"] = plan.get("peak_allocated_bytes")
            info["est_peak_reserved_bytes"] = plan.get("peak_reserved_bytes")
            return plan["rank"], info
    info["plan_says"] = (f"no plan with optimizer {args.fitune_optimizer} and without allocator retries" if plans
                         else "nothing fits")
    return None, info


def fitune_changes(args) -> dict:
    """--fitune-set KEY=VALUE ... as a dict of YAML values."""
    import yaml

    out = {}
    for item in args.fitune_set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--fitune-set {item!r}: write KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def host_record(probe: str, plan_path: str) -> dict:
    """The training process's host memory (its peak resident set, pinned buffers included, and the pinned
    allocator's peak: bench.common.host_peaks, written by the probed child) beside `fitune estimate`'s host figures
    of the config it ran (`host_peak_bytes`, `host_peak_phase`, and the training step's `host_bytes`)."""
    try:
        with open(probe, encoding="utf-8") as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    out = {k: seen.get(k) for k in ("host_peak_rss_bytes", "host_pinned_peak_bytes", "host_registered_bytes")}
    est = subprocess.run(_fitune_cmd() + ["estimate", "--config", plan_path, "--json"], capture_output=True, text=True,
                         timeout=300, env=_fitune_env())
    answer = json.loads(est.stdout) if est.returncode in (0, 2) and est.stdout.strip() else {}
    out["est_host_peak_bytes"] = answer.get("host_peak_bytes")
    out["est_host_peak_phase"] = answer.get("host_peak_phase")
    out["est_train_step_host_bytes"] = next((p.get("host_bytes") for p in answer.get("run_phases") or []
                                             if p.get("name") == "train_step"), None)
    if out["host_peak_rss_bytes"] and out["est_host_peak_bytes"]:
        out["host_peak_over_est"] = out["host_peak_rss_bytes"] / out["est_host_peak_bytes"]
    return out


def probe_fitune(args, n: int) -> None:
    import shutil

    import yaml

    t_start = time.perf_counter()
    rec = _probe_record(args, n)
    rec["versions"] = versions()
    written = []

    def finish(exc: BaseException | None = None, **fields) -> None:
        if written:
            return
        written.append(True)
        rec.update(fields)
        if exc is not None:
            rec.update(outcome(exc))
        rec["elapsed_s"] = round(time.perf_counter() - t_start, 2)
        write(args.out, rec)

    def _term(signum, frame):  # the parent's time limit: its process group (fitune train too) gets SIGTERM
        finish(fits=None, error=f"stopped by signal {signum} (the probe's time limit)", timed_out=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, _term)
    try:
        plan_n = args.fitune_plan_at or n
        pick, info = plan_choice(args, plan_n)
        rec.update(info)
        if args.fitune_plan_at:
            rec["planned_at_tokens"] = plan_n
        if getattr(args, "fitune_plan_gpu", None):
            rec["plan_gpu"] = args.fitune_plan_gpu
        if getattr(args, "fitune_plan_optimizer", None):
            rec["plan_optimizer"] = args.fitune_plan_optimizer
        if pick is None:
            return finish(fits=False, plan_fits=False, error=f"fitune plan: {info['plan_says']}")
        run = os.path.join(args.work, f"fitune_{args.cap}_{n}" + "".join(f"_{x}" for x in args.fitune_set))
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(run)
        plan_path = os.path.join(run, "plan.yaml")
        proc = subprocess.run(_fitune_cmd() + _plan_args(args, plan_n) + ["--top", "10", "--write", plan_path,
                                                                     "--pick", str(pick)],
                              capture_output=True, text=True, timeout=300, env=_fitune_env())
        if proc.returncode != 0:
            raise RuntimeError(f"fitune plan --write exit {proc.returncode}: {proc.stderr[-1500:]}")
        data = os.path.join(run, "train.jsonl")
        words = [f"w{i}" for i in range(4000)]  # make_model.py's tokenizer: one token each
        with open(data, "w") as f:
            for r in range(args.steps + 1):
                f.write(json.dumps({"text": " ".join(words[(r * 7 + i) % 4000] for i in range(n + 16))}) + "\n")
        cfg = yaml.safe_load(open(plan_path))
        cfg.pop("epochs", None)
        cfg.update({"model": args.model, "init": "random", "seq_len": n, "tokenizer": args.model_dir,
                    "data": {"path": data, "format": "text"}, "max_steps": args.steps, "cap": args.cap,
                    "output_dir": os.path.join(run, "out")})
        if args.fitune_set:
            changes = fitune_changes(args)
            cfg.update(changes)
            rec["set"] = changes
        with open(plan_path, "w") as f:
            yaml.safe_dump(cfg, f)
        if args.fitune_set or args.fitune_plan_at:  # the plan's estimate was of the plan as written: estimate what runs
            est = subprocess.run(_fitune_cmd() + ["estimate", "--config", plan_path, "--gpu", args.cap, "--json"],
                                 capture_output=True, text=True, timeout=300, env=_fitune_env())
            answer = json.loads(est.stdout) if est.returncode == 0 else {}
            rec["est_peak_allocated_bytes"] = answer.get("peak_allocated_bytes")
            rec["est_peak_reserved_bytes"] = answer.get("peak_reserved_bytes")
        t0 = time.perf_counter()
        probe = os.path.join(run, "grad_norm.json")  # the child's first-step trainable-gradient norm
        probed, _ = probed_fitune_cmd(probe)
        history = os.environ.get(HISTORY_ENV)
        if history:  # the allocator's history of the run (bench/_with_memory_history.py), no gradient-norm probe
            stem = os.path.join(history, os.path.basename(run))
            probed = [sys.executable, os.path.join(ROOT, "bench", "_with_memory_history.py"), "--summary",
                      stem + ".memory.json", "--trace", stem + ".trace.json.gz", "--"]
        try:
            proc = subprocess.run(probed + ["train", plan_path, "--no-progress"], capture_output=True,
                                  text=True, timeout=max(30.0, args.probe_timeout - 30),
                                  env={**_fitune_env(), PROBE_ENV: probe})
            code, tail = proc.returncode, (proc.stdout[-600:] + proc.stderr[-2000:]).strip()
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        rec["train_s"] = round(time.perf_counter() - t0, 2)
        rec["exit"] = code
        metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
        lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        rec["losses"] = [round(x["loss"], 4) for x in lines if "loss" in x][:64]
        rec["first_step_grad_norm"] = training_facts([], probe)["first_step_grad_norm"]
        rec.update(host_record(probe, plan_path))
        lines = [x for x in lines if "step_time_s" in x]
        seconds = [x["step_time_s"] for x in lines]
        rec["steps_done"] = len(lines)
        rec["step_seconds"] = [round(x, 3) for x in seconds]
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            values = [x[key] for x in lines if x.get(key) is not None]
            rec[key] = max(values) if values else None
        rec["alloc_retries_per_step"] = [x.get("alloc_retries") for x in lines]
        rec["outside_allocator_bytes_per_step"] = [x.get("outside_allocator_bytes") for x in lines]
        rec["grad_checkpointing_run"] = sorted({str(x.get("grad_checkpointing")) for x in lines})
        rec["oom_guard_replans"] = tail.count("fitune: out of memory at step")
        shutil.rmtree(os.path.join(run, "out"), ignore_errors=True)  # its checkpoint: about 1 GB per probe
        if code == 0 and len(lines) >= args.steps:
            return finish(fits=True, tokens_per_s=n / statistics.median(seconds[1:] or seconds))
        if code == "timeout":
            return finish(fits=None, timed_out=True, error=f"fitune train: timeout after {rec['train_s']} s")
        if "out of memory" in tail.lower():
            return finish(fits=False, error="fitune train: " + tail.splitlines()[-1][:300] if tail else "oom",
                          log_tail=tail[-1500:])
        return finish(fits=None, error=f"fitune train exit {code} after {len(lines)} steps", log_tail=tail[-2500:])
    except BaseException as e:  # noqa: BLE001 - every failure is a result here
        finish(e)


def probe_fake(args, n: int) -> None:
    time.sleep(args.fake_seconds)
    rec = _probe_record(args, n)
    rec.update(fake=True, fits=n <= args.fake_threshold)
    write(args.out, rec)


# ---- parent: the search ------------------------------------------------------------------------------------

class OutOfBudget(Exception):
    pass


class ProbeError(Exception):
    pass


def gallop(fits, prior: int, resolution: int, limit: int) -> None:
    """Probe `prior`, then walk away from it in steps of resolution x 1, 2, 4 ... and bisect (max_context.search
    on the offsets) until a fitting length and one `resolution` above it that does not fit (or `limit`, or
    nothing down to `resolution`) were probed. `fits` caches: a length is probed once."""
    from bench.max_context import search

    prior = min(limit // resolution * resolution, max(resolution, prior // resolution * resolution))
    if fits(prior):
        base = prior
        while True:  # search's doubling can stop short of its limit: go on from the last fit
            k = search(lambda k: fits(base + k * resolution), 1, 1, (limit - base) // resolution)
            after = base + (k + 1) * resolution
            if after > limit or not fits(after):
                return
            base = after
    top = prior  # does not fit
    while True:
        k = search(lambda k: not fits(top - k * resolution), 1, 1, top // resolution - 1)
        below = top - (k + 1) * resolution
        if below <= 0 or fits(below):
            return
        top = below


def probe_lengths(fits, lengths: list[int], results: dict[int, bool]) -> None:
    """Probe each length in order unless an earlier probe decides it: a shorter length failed (this one would
    too) or a longer one fitted (this one would too)."""
    for n in lengths:
        if any(not ok and m <= n for m, ok in results.items()) or any(ok and m >= n for m, ok in results.items()):
            continue
        fits(n)


def _child_argv(args, n: int) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--probe", str(n), "--stack", args.stack, "--model-dir",
            args.model_dir, "--out", args.out, "--cap", args.cap, "--model", args.model, "--method", args.method,
            "--lora-rank", str(args.lora_rank), "--steps", str(args.steps), "--optim", args.optim,
            "--fitune-optimizer", args.fitune_optimizer] + (["--fitune-retries"] if args.fitune_retries else []) + [
            x for item in args.fitune_set for x in ("--fitune-set", item)] + (
            ["--fitune-plan-at", str(args.fitune_plan_at)] if args.fitune_plan_at else []) + (
            ["--fitune-host-ram", args.fitune_host_ram] if args.fitune_host_ram else []) + (
            # (until 2026-12-07 plan_gpu was not passed on: the probes planned for --cap)
            ["--fitune-plan-gpu", args.fitune_plan_gpu] if getattr(args, "fitune_plan_gpu", None) else []) + (
            ["--fitune-plan-optimizer", args.fitune_plan_optimizer]
            if getattr(args, "fitune_plan_optimizer", None) else []) + [
            "--work", args.work, "--device", args.device,
            "--probe-timeout", str(args.probe_timeout)]
    if args.no_card_view:
        argv.append("--no-card-view")
    if args.fake_threshold is not None:
        argv += ["--fake-threshold", str(args.fake_threshold), "--fake-seconds", str(args.fake_seconds)]
    return argv


class Terminated(Exception):
    pass


def _stop_group(proc, grace_s: float = 10) -> str:
    """SIGTERM to the probe's process group (the probe writes its record; fitune train goes with it), SIGKILL
    after grace_s; what it printed."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        out, _ = proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    return out or ""


def run_probe(args, n: int, limit_s: float) -> tuple[dict, bool]:
    """One probe in its own process group (killed whole on the time limit); its RESULT, and whether it timed out."""
    proc = subprocess.Popen(_child_argv(args, n), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        out = _stop_group(proc, 20)
    except BaseException:  # SIGTERM to this search (Terminated), Ctrl-C: the probe's group must not outlive it
        if parse_result(_stop_group(proc, 8)) is None:
            write(args.out, {**_probe_record(args, n), "fits": None, "timed_out": True,
                             "error": "no record: the search was stopped during this probe"})
        raise
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"{args.stack}_{args.cap}.log"), "a") as f:
            f.write(f"\n==== probe {n} (exit {proc.returncode}, limit {limit_s:.0f} s)\n{out}")
    res = parse_result(out)
    if res is None:  # killed before it wrote its line (SIGKILL, a crash in C): record that
        res = {**_probe_record(args, n), "fits": None, "timed_out": timed_out,
               "error": f"no record: exit code {proc.returncode} (limit {limit_s:.0f} s)",
               "log_tail": (out or "")[-1500:]}
        write(args.out, res)
    return res, timed_out or "stopped by signal" in str(res.get("error", ""))


def plan_longest(args) -> int:
    """The longest length (a multiple of --resolution, at most --limit) `fitune plan` accepts: fitune's prior."""
    from bench.max_context import search

    return search(lambda n: plan_choice(args, n)[0] is not None, args.resolution, args.resolution, args.limit)


def resolve_prior(args) -> tuple[int | None, str]:
    if args.prior == "none":
        return None, "none"
    if args.prior != "auto":
        return int(args.prior), "given"
    if args.stack == "unsloth":
        gb = CAP_CARD_GB.get(args.cap.strip().lower())
        return (UNSLOTH_PUBLISHED[gb], f"Unsloth's published figure for a {gb} GB card") if gb else (None, "none")
    return plan_longest(args), "fitune plan's longest"


def search_main(args) -> int:
    def _term(signum, frame):  # `timeout` around this search: stop the probe, still write the summary
        raise Terminated(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s if args.budget_s else None
    results: dict[int, bool] = {}
    probes: list[list] = []
    timeouts: list[int] = []
    error_probes: list[int] = []

    def fits(n: int) -> bool:
        if n in results:
            return results[n]
        limit_s = args.probe_timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < args.min_probe_s:
                raise OutOfBudget(f"{left:.0f} s left of the {args.budget_s:.0f} s budget")
            limit_s = min(limit_s, left)
        t0 = time.monotonic()
        res, timed_out = run_probe(args, n, limit_s)
        ok = res.get("fits")
        error = str(res.get("error") or "")
        if ok is None and "ALLOC_FAILED" in error:  # cuBLAS / cuDNN could not get workspace memory
            ok = False
        probes.append([n, ok, round(time.monotonic() - t0, 1)])
        print(f"[{args.stack} {args.cap} {n}] fits={ok} {probes[-1][2]} s" + (f" {error[:160]}" if error else ""),
              flush=True)
        if ok is None and not timed_out:
            if not any(results.values()):  # nothing ran yet: a set-up error, which every length would repeat
                raise ProbeError(f"probe {n}: {error[:300]}")
            error_probes.append(n)  # a failure at this length only (a shorter one ran): a no, listed
        if timed_out:
            timeouts.append(n)
        results[n] = bool(ok)
        return results[n]

    summary = {"stack": args.stack, "summary": True, "cap": args.cap, "method": args.method,
               "lora_rank": args.lora_rank, "steps": args.steps, "resolution": args.resolution, "limit": args.limit}
    if args.stack == "fitune" and args.fitune_set:
        summary["set"] = fitune_changes(args)
    if args.stack == "fitune" and args.fitune_plan_at:
        summary["planned_at_tokens"] = args.fitune_plan_at
    stopped = None
    try:
        if args.lengths:
            words = [x.strip() for x in args.lengths.split(",")]
            lengths = [plan_longest(args) if x == "plan" else int(x) for x in words]
            summary.update(mode="lengths", lengths=lengths)
            if "plan" in words:
                summary["plan_longest_tokens"] = lengths[words.index("plan")]
            probe_lengths(fits, lengths, results)
        else:
            prior, source = resolve_prior(args)
            summary.update(prior=prior, prior_source=source)
            if prior:
                summary["first_probe"] = min(args.limit // args.resolution * args.resolution,
                                             max(args.resolution, prior // args.resolution * args.resolution))
                gallop(fits, prior, args.resolution, args.limit)
            else:
                from bench.max_context import search

                search(fits, args.start, args.resolution, args.limit)
    except (OutOfBudget, Terminated) as e:
        stopped = f"out of budget: {e}"
    except ProbeError as e:
        stopped = f"error: {e}"
    except Exception as e:  # noqa: BLE001 - the summary line is written whatever happens
        stopped = f"error: {type(e).__name__}: {str(e)[:300]}"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the summary is written now, whatever comes
    best = max((n for n, ok in results.items() if ok), default=0)
    upper = min((n for n, ok in results.items() if not ok and n > best), default=None)
    summary.update(longest_tokens=best, upper_bound_tokens=upper, complete=stopped is None, stopped=stopped,
                   timed_out_probes=timeouts, error_probes=error_probes,
                   non_monotone=any(not ok and n < best for n, ok in results.items()), probes=probes,
                   elapsed_s=round(time.monotonic() - t_start, 1))
    if args.stack == "fitune" and summary.get("prior_source") == "fitune plan's longest":
        summary["plan_longest_tokens"] = summary["prior"]
    write(args.out, summary, training=False)  # the search's answer: its probes are the training records
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if args.probe is None:
        return search_main(args)
    if args.fake_threshold is not None:
        probe_fake(args, args.probe)
    elif args.stack == "unsloth":
        probe_unsloth(args, args.probe)
    else:
        probe_fitune(args, args.probe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
