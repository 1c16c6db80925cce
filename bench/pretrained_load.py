"""A user's pretrained folder on the GPU: an 8B-shaped Llama (the catalog's llama-3.1-8b config, random weights) saved
as a Hub download is, then trained along the user's path, bf16 LoRA and QLoRA, each in a fresh process, under a
24 GB card's allocator cap. Run on the GPU machine.

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/pretrained_load.py --out $OUT --cases lora,qlora --steps 4
    python3 bench/pretrained_load.py --out /tmp/smoke --smoke        # the whole flow on the CPU, in seconds

1. The folder (once per call, reused by every case): config.json, generation_config.json,
   model-0000K-of-0000N.safetensors with model.safetensors.index.json (`save_pretrained(max_shard_size="5GB")`, as
   Meta's upload: 4 shards for 8B), and a word-level tokenizer (fitune/train/synthetic.py; its few thousand words
   fit the model's 128,256 embedding rows, which stay as they are). Weights drawn on the GPU (`--device`).
2. Per case, the user's commands: `fitune plan FOLDER --gpu CAP --method M --data train.jsonl --write plan.yaml`,
   the run's own keys set in that file (init: pretrained, model: the folder, cap, max_steps, output_dir), then
   `fitune estimate --config plan.yaml --gpu CAP --json` and `fitune train plan.yaml` in a fresh process
   (`--child`): `fitune.cli.main.main` run in-process, with `fitune.runtime.model.build_model_for_setup` wrapped
   (the loop imports it from that module when it runs, so the wrapper is the one called) to measure the load:
   - GPU: peak allocated / reserved while loading (and quantising), what stays allocated after it;
   - host: the process's peak RSS during the load (VmHWM, reset just before through /proc/self/clear_refs), and the
     peaks of its anonymous and file-backed parts sampled every 10 ms (RssAnon / RssFile: the shards' pages mapped
     by safetensors count as file-backed RSS, page cache that the kernel can drop; anonymous memory is the host
     copy a load makes). `load_path` says which the code did: "host_first" when the anonymous peak grew by half the
     bf16 weights or more (the model whole in host RAM before the GPU), else "direct_to_gpu"; `hf_device_map`
     whether transformers placed it with a device_map;
   - how long the load took (wall seconds, from the shards just written: in the page cache, a warm load).
   The first steps' peaks come from the run's metrics.jsonl (the loop resets the peaks at each step).
3. One JSON line per case in --out/pretrained_load.jsonl, compared with `fitune estimate` of the same config: the
   step peak (allocated, reserved) and, for the load, the weights' bytes (`breakdown.weights`) against what the
   load left allocated. Each line carries the commit (`git rev-parse HEAD`), the sha256 of `git diff HEAD` (""
   when clean; without a git checkout, as on the GPU machine, FITUNE_COMMIT / FITUNE_DIFF_SHA256 from the
   command: `python3 bench/pretrained_load.py --print-provenance` here prints them), the sha256 of
   fitune/runtime/model.py (the loading code that ran), package versions, the GPU and the commands.

QLoRA needs CUDA (bitsandbytes): --smoke runs bf16 LoRA only, on a tiny Llama (2 layers, 64 wide) on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import yaml  # noqa: E402

from bench.common import code_version, grad_norm_probe, proc_status, training_facts, write_record  # noqa: E402

from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data  # noqa: E402

MODEL = "llama-3.1-8b"
SMOKE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 512, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
"""--smoke's model: a tiny Llama whose 512 rows hold the smoke tokenizer's words."""

SHARD_SIZE = "5GB"
"""`save_pretrained(max_shard_size=...)` of the 8B folder: Meta's Llama-3.1-8B upload has 4 shards of at most 5 GB."""

SMOKE_SHARDS = 4
"""--smoke's shard count (max_shard_size = the weights' bytes / this, so the index.json path is taken too)."""

WORDS = 4000
"""The tokenizer's words (plus 7 specials): well under the 8B model's 128,256 embedding rows."""

HOST_FIRST_FRACTION = 0.5
"""`load_path` is "host_first" when the anonymous host memory grew during the load by this share of the bf16
weights' bytes or more (a whole copy on the host), else "direct_to_gpu" (a layer or a shard at a time)."""

SAMPLE_S = 0.01
"""How often the load's host memory (RssAnon, RssFile) is sampled."""

STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")

PHASE_KEYS = ("gpu_allocated_bytes", "gpu_reserved_bytes", "host_bytes")
"""What `fitune estimate --json`'s `run_phases` gives per phase, and what each measured phase records."""

LOOP_PHASES = {"eval_step": "_evaluate", "save": "_save", "write_outputs": "_write_outputs"}
"""The phases measured inside `fitune train` by wrapping fitune/train/loop.py's functions (called by module-level
name, so the wrapper in the module is the one called): the eval pass, a checkpoint's save, the adapter written at
the end."""

EST_PHASE = {"write_outputs": "save"}
"""A measured phase compared with another phase of the estimate: its `save` models both a checkpoint's save and the
adapter written at the end (the larger of the two)."""


# ---- provenance --------------------------------------------------------------------------------------------


def provenance() -> dict:
    """The code that ran (bench.common.code_version: FITUNE_COMMIT / FITUNE_DIFF_SHA256 when set, a copy without
    .git, else git's answer), and the sha256 of fitune/runtime/model.py."""
    prov = code_version()
    with open(os.path.join(ROOT, "fitune", "runtime", "model.py"), "rb") as f:
        prov["runtime_model_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return prov


def versions() -> dict:
    """Package versions and the GPU (in the process that trains)."""
    import importlib.metadata

    import torch

    v = {}
    for name in ("torch", "transformers", "peft", "accelerate", "safetensors", "bitsandbytes", "liger-kernel",
                 "triton"):
        try:
            v[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            v[name] = None
    v["torch"] = torch.__version__
    cuda = torch.cuda.is_available()
    v["gpu"] = torch.cuda.get_device_name() if cuda else "cpu"
    v["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory if cuda else None
    return v


# ---- host memory -------------------------------------------------------------------------------------------


def host_status() -> dict:
    """This process's memory from /proc/self/status, in bytes (VmHWM: peak RSS since start or the last reset)."""
    return proc_status(STATUS_KEYS)


def reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


WEIGHT_FILES = (".safetensors", ".gguf", ".bin")
"""Files whose mapped pages are the model's weights read in place (page cache, which the kernel drops under
pressure): what `fitune/memory/phases.py` leaves out of its host figures."""

SMAPS_EVERY = 5
"""/proc/self/smaps (every mapping: slower to read) is sampled once in this many samples."""


def weight_files_mapped_bytes() -> int | None:
    """Resident file-backed bytes of this process's mappings of weight files (`WEIGHT_FILES`), from
    /proc/self/smaps: each mapping's Rss less its Anonymous pages (a page written through a private mapping, as a
    merge writes the merged weights in place, is copied: anonymous memory, which counts)."""
    total, counting = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header: address range ... [path]
                    counting = line.rstrip().endswith(WEIGHT_FILES)
                elif counting and first == "Rss:":
                    total += int(line.split()[1]) * 1024
                elif counting and first == "Anonymous:":
                    total -= int(line.split()[1]) * 1024
    except OSError:
        return None
    return total


class HostSampler(threading.Thread):
    """The largest RssAnon, RssFile and VmRSS seen while it runs (sampled: a short spike can be missed), and the
    largest resident memory outside the mapped weight files (`no_weight_files`: VmRSS less their pages, sampled
    every `SMAPS_EVERY` samples), the figure the estimate's host memory models."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks = {k: 0 for k in ("RssAnon", "RssFile", "VmRSS", "no_weight_files")}
        self._stop_event = threading.Event()
        self._n = 0

    def run(self):
        while not self._stop_event.is_set():
            self._sample()
            self._stop_event.wait(SAMPLE_S)

    def _sample(self):
        st = host_status()
        for k in ("RssAnon", "RssFile", "VmRSS"):
            self.peaks[k] = max(self.peaks[k], st.get(k, 0))
        if self._n % SMAPS_EVERY == 0:
            mapped = weight_files_mapped_bytes()
            if mapped is not None:
                self.peaks["no_weight_files"] = max(self.peaks["no_weight_files"], host_status().get("VmRSS", 0) - mapped)
        self._n += 1

    def stop(self) -> dict:
        self._stop_event.set()
        self.join()
        self._sample()
        return self.peaks


# ---- the folder --------------------------------------------------------------------------------------------


def model_config(smoke: bool) -> dict:
    if smoke:
        return dict(SMOKE_CONFIG)
    from fitune.specs.model import load_model_spec

    return dict(load_model_spec(MODEL).hf_config)


def write_model_folder(folder: str, hf_config: dict, device: str, smoke: bool, words: list[str]) -> dict:
    """A Hub-like model folder: sharded safetensors + index, config.json, generation_config.json, a tokenizer.
    Reused when `folder` holds a complete one of the same config (its `.complete` marker is written last)."""
    marker = os.path.join(folder, ".complete")
    digest = hashlib.sha256(json.dumps([hf_config, smoke, len(words)], sort_keys=True).encode()).hexdigest()
    if os.path.exists(marker) and open(marker).read() == digest:
        return {**folder_facts(folder), "write_s": None, "reused": True}
    import torch

    from fitune.runtime.model import build_model

    t0 = time.perf_counter()
    model = build_model(hf_config, dtype_name="bf16", device=device, init="random")  # drawn where it lives
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = -(-total // SMOKE_SHARDS) if smoke else SHARD_SIZE
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, max_shard_size=shard)
    if not os.path.exists(os.path.join(folder, "generation_config.json")):
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    make_word_tokenizer(folder, words)
    with open(marker, "w") as f:
        f.write(digest)
    return {**folder_facts(folder), "write_s": time.perf_counter() - t0, "reused": False}


def folder_facts(folder: str) -> dict:
    """The folder's files and the weights' bytes as stored (bf16: what a whole host copy of them takes)."""
    files = sorted(f for f in os.listdir(folder) if not f.startswith("."))
    shards = [f for f in files if f.endswith(".safetensors")]
    return {"folder_files": files, "shards": len(shards),
            "shard_bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in shards)}


# ---- one case, in the driver -------------------------------------------------------------------------------


def fitune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fitune", *args]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def write_case_config(work: str, folder: str, data: str, case: str, args) -> tuple[list[str], str, dict]:
    """`fitune plan FOLDER --write` (the user's command), then the run's keys set in the file; (plan command,
    path, config)."""
    import contextlib
    import io

    from fitune.cli.main import main as fitune_main

    path = os.path.join(work, f"{case}.yaml")
    plan_args = ["plan", folder, "--gpu", args.cap, "--method", case, "--data", data, "--seq-len", str(args.seq_len),
                 "--batch-size", str(args.batch_size), "--write", path]
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):  # in this process: no second start-up
        try:
            code = fitune_main(plan_args)
        except Exception as exc:  # noqa: BLE001 - the case is recorded as failed, the next one runs
            code = f"{type(exc).__name__}: {exc}"
    print(said.getvalue()[-1500:], end="", flush=True)
    if code != 0:
        raise RuntimeError(f"fitune plan exited {code}: {said.getvalue()[-1500:]}")
    plan = fitune_cmd(*plan_args)
    cfg = yaml.safe_load(open(path))
    cfg.pop("epochs", None)
    cfg.update({"model": folder, "init": "pretrained", "max_steps": args.steps, "cap": args.cap,
                "output_dir": os.path.join(work, f"run_{case}")})
    if args.eval_data:  # the eval step's phase: evaluated once, at the end (with the last checkpoint's save)
        cfg["data"] = {**cfg.get("data", {}), "eval_path": args.eval_data}
        cfg["eval_every"] = args.steps
    cfg.pop("tokenizer", None)  # the folder's own
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return plan, path, cfg


def estimate_case(path: str, cap: str) -> tuple[list[str], dict]:
    """`fitune estimate --config PATH --gpu CAP --json`: the step's peaks and the weights' bytes on the GPU."""
    cmd = fitune_cmd("estimate", "--config", path, "--gpu", cap, "--json")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env())
    if proc.returncode not in (0, 2) or not proc.stdout.strip():  # 2: does not fit (still a full answer)
        return cmd, {"est_error": (proc.stdout + proc.stderr)[-800:]}
    est = json.loads(proc.stdout)
    return cmd, {"est_peak_allocated_bytes": est["peak_allocated_bytes"],
                 "est_peak_reserved_bytes": est["peak_reserved_bytes"], "est_peak_phase": est.get("peak_phase"),
                 "est_weights_bytes": est["breakdown"]["weights"], "est_fits": est.get("fits"),
                 "est_host_bytes": est.get("host_bytes"), "est_notes": est.get("notes"),
                 "est_run_phases": {ph["name"]: {k: ph.get(k) for k in PHASE_KEYS} for ph in est.get("run_phases") or []},
                 "est_host_peak_bytes": est.get("host_peak_bytes"), "est_host_peak_phase": est.get("host_peak_phase"),
                 "est_worst_phase": est.get("worst_phase"), "est_run_fits": est.get("run_fits")}


def run_child(case_dir: str, config: str, log_path: str, timeout_s: float) -> tuple[list[str], object, str]:
    """`fitune train CONFIG` in a fresh process (this script's --child), its output echoed and logged; (command,
    exit code or "timeout", the log's tail)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case_dir, "--config", config]
    tail = ""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=_env())
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail = (tail + line)[-3000:]
        code = proc.wait()
        timed_out = not timer.is_alive()
        timer.cancel()
    return cmd, ("timeout" if timed_out else code), tail


def run_case(case: str, args, folder: str, facts: dict, data: str, prov: dict) -> dict:
    work = os.path.join(args.work, "cases")
    case_dir = os.path.join(work, case)
    os.makedirs(case_dir, exist_ok=True)
    for stale in ("load.json", "record.json"):
        if os.path.exists(os.path.join(case_dir, stale)):
            os.remove(os.path.join(case_dir, stale))
    rec = {"case": case, "method": case, "model": "smoke-llama" if args.smoke else MODEL, "smoke": args.smoke,
           "cap": args.cap, "steps_asked": args.steps, **prov, "command": shlex.join([sys.executable, *sys.argv]),
           "folder": {k: facts[k] for k in ("folder_files", "shards", "shard_bytes", "write_s", "reused")}}
    t0 = time.perf_counter()
    try:
        plan_cmd, path, cfg = write_case_config(work, folder, data, case, args)
    except RuntimeError as exc:
        return {**rec, "exit": "plan failed", "error": str(exc)}
    rec["plan_command"] = shlex.join(plan_cmd)
    rec["train_config"] = cfg
    shutil.rmtree(cfg["output_dir"], ignore_errors=True)  # an earlier call's run there: `fitune train` would refuse it
    shutil.copy(path, os.path.join(args.out, f"{case}_config.yaml"))
    est_cmd, est = estimate_case(path, args.cap)
    rec["estimate_command"] = shlex.join(est_cmd)
    rec.update(est)
    cmd, code, tail = run_child(case_dir, path, os.path.join(args.out, f"{case}.log"), args.timeout)
    rec["train_command"] = shlex.join(fitune_cmd("train", path, "--no-progress")) + "  (in-process: " + \
        shlex.join(cmd) + ")"
    rec["exit"] = code
    rec["wall_s"] = time.perf_counter() - t0
    done = os.path.join(case_dir, "record.json")
    load = os.path.join(case_dir, "load.json")
    if os.path.exists(done):
        rec.update(json.load(open(done)))
    else:  # killed or crashed: what the load recorded, and the steps written so far
        if os.path.exists(load):
            rec.update(json.load(open(load)))
        rec.update(step_peaks(cfg["output_dir"]))
    if code != 0:
        rec["log_tail"] = tail
    elif args.merge:
        rec["merge"] = run_merge_child(case_dir, cfg["output_dir"], args)
    return with_comparisons(rec)


def run_merge_child(case_dir: str, run_dir: str, args) -> dict:
    """`fitune merge RUN --out DIR` in a fresh process (this script's --merge-child), under the same allocator cap as
    training: its GPU peaks and the process's peak RSS (VmHWM: the whole process, start-up included, as the
    estimate's merge phase counts it). The merged folder (16 GB for 8B) is deleted after."""
    merged = os.path.join(args.work, "merged")
    shutil.rmtree(merged, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--merge-child", case_dir, "--run", run_dir, "--merged", merged,
           "--cap", args.cap]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=args.timeout)
        code, tail = proc.returncode, (proc.stdout[-800:] + proc.stderr[-1500:])
    except subprocess.TimeoutExpired:
        code, tail = "timeout", ""
    path = os.path.join(case_dir, "merge.json")
    out = json.load(open(path)) if os.path.exists(path) else {}
    out.update({"exit": code, "wall_s": time.perf_counter() - t0,
                "command": shlex.join(fitune_cmd("merge", run_dir, "--out", merged)) + "  (in-process: " +
                shlex.join(cmd) + ")"})
    if code != 0:
        out["log_tail"] = tail[-2000:]
    print("### merge:", json.dumps({k: out.get(k) for k in ("exit", "wall_s", "gpu_peak_allocated_bytes",
                                                            "host_rss_peak_bytes")}), flush=True)
    shutil.rmtree(merged, ignore_errors=True)
    return out


MERGE_STAGES = (("fitune.runtime.model", "build_model", "base built"),
                ("fitune.infer.merge", "dequantize_nf4", "NF4 dequantized"),
                ("peft", "PeftModel.from_pretrained", "adapter loaded"),
                ("peft.tuners.tuners_utils", "BaseTuner.merge_and_unload", "merged"),
                ("fitune.infer.merge", "_write", "written"))
"""The steps of `fitune merge` whose GPU memory is recorded (module, attribute, stage): what stays allocated after
each, and the peak since the one before (functions looked up by name when called, so the wrappers run)."""


def staged_merge(stages: list, cuda: bool):
    """Wrap `MERGE_STAGES`; each appends {stage, seconds, gpu_allocated_after_bytes, gpu_peak_since_last_bytes}
    (the largest of these peaks is kept in `stages`' last entry, "overall", by the returned function, which puts
    the originals back)."""
    import importlib

    import torch

    undo = []
    overall = [0, 0]  # allocated, reserved
    for module_name, attr, stage in MERGE_STAGES:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__[name]
        func = original.__func__ if isinstance(original, classmethod) else original

        def wrapper(*a, _func=func, _stage=stage, **kw):
            t0 = time.perf_counter()
            out = _func(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            stages.append({"stage": _stage, "seconds": time.perf_counter() - t0,
                           "gpu_allocated_after_bytes": torch.cuda.memory_allocated() if cuda else None,
                           "gpu_peak_since_last_bytes": torch.cuda.max_memory_allocated() if cuda else None})
            if cuda:
                overall[:] = [max(overall[0], torch.cuda.max_memory_allocated()),
                              max(overall[1], torch.cuda.max_memory_reserved())]
                torch.cuda.reset_peak_memory_stats()
            return out

        setattr(owner, name, classmethod(wrapper) if isinstance(original, classmethod) else wrapper)
        undo.append((owner, name, original))

    def restore():
        for owner, name, original in undo:
            setattr(owner, name, original)
        if cuda:
            overall[:] = [max(overall[0], torch.cuda.max_memory_allocated()),
                          max(overall[1], torch.cuda.max_memory_reserved())]
        stages.append({"stage": "overall", "gpu_peak_allocated_bytes": overall[0] if cuda else None,
                       "gpu_peak_reserved_bytes": overall[1] if cuda else None})
    return restore


def merge_child_main(case_dir: str, run_dir: str, merged: str, cap: str) -> int:
    """The merge child: the allocator capped as `cap: CAP` caps training, then `fitune merge` in this process."""
    import torch

    from bench.common import cap_allocator
    from fitune.cli.main import main as fitune_main

    cuda = torch.cuda.is_available()
    if cuda:
        cap_allocator(cap, "cuda")
        torch.cuda.reset_peak_memory_stats()
    sampler = HostSampler()
    sampler.start()
    t0 = time.perf_counter()
    stages: list = []
    undo = staged_merge(stages, cuda)
    try:
        code = fitune_main(["merge", run_dir, "--out", merged])
        error = None
    except BaseException as exc:  # noqa: BLE001 - an OOM under the cap is a finding: recorded
        code, error = 1, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        undo()
    sampled = sampler.stop()
    rec = {"merge_s": time.perf_counter() - t0, "child_exit": code, **({"error": error} if error else {}),
           "gpu_peak_allocated_bytes": stages[-1]["gpu_peak_allocated_bytes"],
           "gpu_peak_reserved_bytes": stages[-1]["gpu_peak_reserved_bytes"],
           "host_rss_peak_bytes": host_status().get("VmHWM"), "host_anon_peak_bytes": sampled["RssAnon"],
           "host_file_peak_bytes": sampled["RssFile"], "host_no_weight_files_peak_bytes": sampled["no_weight_files"],
           "stages": stages,
           "merged_bytes": sum(os.path.getsize(os.path.join(merged, f)) for f in os.listdir(merged)
                               if f.endswith(".safetensors")) if os.path.isdir(merged) else None}
    with open(os.path.join(case_dir, "merge.json"), "w") as f:
        json.dump(rec, f)
    return 0 if code == 0 else 1


def with_comparisons(rec: dict) -> dict:
    """Measured / estimated ratios, and the host peaks against the bf16 weights as stored."""
    def ratio(a, b):
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    rec["step_allocated_over_est"] = ratio(rec.get("peak_allocated_bytes"), rec.get("est_peak_allocated_bytes"))
    rec["step_reserved_over_est"] = ratio(rec.get("peak_reserved_bytes"), rec.get("est_peak_reserved_bytes"))
    est = rec.get("est_run_phases") or {}
    measured = {name: {**m, "host_rss_bytes": m.get("host_bytes"),
                       "host_bytes": m.get("host_no_weight_files_bytes") or m.get("host_bytes")}
                for name, m in (rec.get("phases") or {}).items()}
    if rec.get("load") and "load_error" not in rec["load"]:
        measured["load"] = {"gpu_allocated_bytes": rec["load"].get("gpu_peak_allocated_bytes"),
                            "gpu_reserved_bytes": rec["load"].get("gpu_peak_reserved_bytes"),
                            "host_rss_bytes": rec["load"].get("host_rss_peak_bytes"),
                            "host_bytes": rec["load"].get("host_no_weight_files_peak_bytes"),
                            "host_anon_bytes": rec["load"].get("host_anon_peak_bytes")}
    if rec.get("peak_allocated_bytes") is not None:
        measured["train_step"] = {"gpu_allocated_bytes": rec["peak_allocated_bytes"],
                                  "gpu_reserved_bytes": rec.get("peak_reserved_bytes")}
    merge = rec.get("merge")
    if merge and merge.get("child_exit") == 0:
        measured["merge"] = {"gpu_allocated_bytes": merge.get("gpu_peak_allocated_bytes"),
                             "gpu_reserved_bytes": merge.get("gpu_peak_reserved_bytes"),
                             "host_rss_bytes": merge.get("host_rss_peak_bytes"),
                             "host_bytes": merge.get("host_no_weight_files_peak_bytes"),
                             "host_anon_bytes": merge.get("host_anon_peak_bytes")}
    rec["phase_comparison"] = {
        name: {"est_phase": EST_PHASE.get(name, name),
               **{f"measured_{k}": m.get(k) for k in (*PHASE_KEYS, "host_rss_bytes", "host_anon_bytes")},
               **{f"est_{k}": est.get(EST_PHASE.get(name, name), {}).get(k) for k in PHASE_KEYS},
               **{f"{k}_over_est": ratio(m.get(k), est.get(EST_PHASE.get(name, name), {}).get(k))
                  for k in PHASE_KEYS}}
        for name, m in measured.items()}
    load = rec.get("load")
    if load and "load_error" not in load:
        bf16 = rec["folder"]["shard_bytes"]
        load["gpu_after_over_est_weights"] = ratio(load.get("gpu_allocated_after_bytes"), rec.get("est_weights_bytes"))
        load["gpu_peak_over_est_weights"] = ratio(load.get("gpu_peak_allocated_bytes"), rec.get("est_weights_bytes"))
        load["host_rss_peak_over_bf16_weights"] = load["host_rss_peak_bytes"] > bf16
        load["host_anon_peak_over_bf16_weights"] = load["host_anon_peak_bytes"] > bf16
        load["load_path"] = ("host_first" if load["host_anon_growth_bytes"] >= HOST_FIRST_FRACTION * bf16
                             else "direct_to_gpu")
    return rec


def step_peaks(output_dir: str) -> dict:
    """The run's steps from its metrics.jsonl: each step's peaks (reset by the loop at each step), and the max."""
    path = os.path.join(output_dir, "metrics.jsonl")
    lines = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    steps = [x for x in lines if "tokens_per_s" in x]
    out = {"steps_done": len(steps),
           "steps": [{k: s.get(k) for k in ("step", "loss", "peak_allocated_bytes", "peak_reserved_bytes",
                                            "step_time_s", "micro_batch_size", "grad_checkpointing")} for s in steps]}
    alloc = [s["peak_allocated_bytes"] for s in steps if s.get("peak_allocated_bytes") is not None]
    reserved = [s["peak_reserved_bytes"] for s in steps if s.get("peak_reserved_bytes") is not None]
    out["peak_allocated_bytes"] = max(alloc) if alloc else None
    out["peak_reserved_bytes"] = max(reserved) if reserved else None
    return out


# ---- the child: fitune train, its load measured ------------------------------------------------------------


def measured_phase(name: str, fn, phases: dict):
    """`fn` wrapped: the GPU's peaks while it runs (allocated, reserved: absolute, the weights and optimizer states
    included, as the estimate's phases are) and the process's peak RSS (VmHWM reset at its start, so the peak of
    this call; pinned buffers are resident and count) with its anonymous part sampled; the largest over calls in
    `phases[name]`."""
    def wrapper(*a, **kw):
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        reset_ok = reset_host_peak()
        sampler = HostSampler()
        sampler.start()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if cuda:
                torch.cuda.synchronize()
            sampled = sampler.stop()
            now = {"seconds": time.perf_counter() - t0,
                   "gpu_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                   "gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
                   "host_bytes": host_status().get("VmHWM") if reset_ok else sampled["VmRSS"],
                   "host_exact": reset_ok, "host_anon_bytes": sampled["RssAnon"], "host_file_bytes": sampled["RssFile"],
                   "host_no_weight_files_bytes": sampled["no_weight_files"]}
            old = phases.get(name)
            phases[name] = now if old is None else {
                k: (max(v, old.get(k) or 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                for k, v in now.items()}
            phases[name]["calls"] = (old or {}).get("calls", 0) + 1
            print(f"### phase {name}:", json.dumps(phases[name]), flush=True)
    return wrapper



def child_main(case_dir: str, config: str) -> int:
    """`fitune train CONFIG --no-progress` in this process, `build_model_for_setup` wrapped to measure the load;
    writes CASE_DIR/load.json as soon as the model is built and CASE_DIR/record.json at the end."""
    import fitune.runtime.model as runtime_model
    from fitune.cli.main import main as fitune_main

    build = runtime_model.build_model_for_setup
    load: dict = {}

    def build_and_measure(*a, **kw):
        import torch

        device = a[2] if len(a) > 2 else kw.get("device")
        cuda = str(device).startswith("cuda")
        before = host_status()
        reset_ok = reset_host_peak()
        if cuda:  # CUDA is up: the loop capped the allocator before building the model
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated() if cuda else None
        sampler = HostSampler()
        sampler.start()
        t0 = time.perf_counter()
        try:
            model = build(*a, **kw)
        except BaseException as exc:  # an OOM under the cap while loading is a finding: its peaks are kept
            sampled = sampler.stop()
            load.update({"load_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                         "load_s": time.perf_counter() - t0, "device": device,
                         "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                         "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
                         "host_anon_peak_bytes": sampled["RssAnon"], "host_file_peak_bytes": sampled["RssFile"]})
            with open(os.path.join(case_dir, "load.json"), "w") as f:
                json.dump({"load": load}, f)
            raise
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        sampled = sampler.stop()
        after = host_status()
        placement = {}
        for p in model.parameters():
            placement[str(p.device)] = placement.get(str(p.device), 0) + 1
        device_map = getattr(model, "hf_device_map", None)
        load.update({
            "load_s": seconds, "device": device,
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "gpu_allocated_before_bytes": allocated_before,
            "gpu_allocated_after_bytes": torch.cuda.memory_allocated() if cuda else None,
            "gpu_reserved_after_bytes": torch.cuda.memory_reserved() if cuda else None,
            "host_rss_before_bytes": before.get("VmRSS"), "host_rss_after_bytes": after.get("VmRSS"),
            "host_rss_peak_bytes": after.get("VmHWM") if reset_ok else max(after.get("VmHWM", 0), sampled["VmRSS"]),
            "host_rss_peak_exact": reset_ok,  # False: VmHWM could not be reset (the process's whole-life peak)
            "host_rss_growth_bytes": (after.get("VmHWM", 0) if reset_ok else sampled["VmRSS"]) - before.get("VmRSS", 0),
            "host_anon_before_bytes": before.get("RssAnon"), "host_anon_peak_bytes": sampled["RssAnon"],
            "host_anon_growth_bytes": sampled["RssAnon"] - before.get("RssAnon", 0),
            "host_file_peak_bytes": sampled["RssFile"],
            "host_no_weight_files_peak_bytes": sampled["no_weight_files"],
            "hf_device_map": None if device_map is None else {str(k): str(v) for k, v in device_map.items()},
            "parameters_on": placement,
            "linear4bit_modules": sum(type(m).__name__ == "Linear4bit" for m in model.modules()),
        })
        with open(os.path.join(case_dir, "load.json"), "w") as f:
            json.dump({"load": load, "versions": versions()}, f)
        print("### load:", json.dumps(load), flush=True)
        return model

    runtime_model.build_model_for_setup = build_and_measure  # train/loop.py imports it from the module at call time
    import fitune.train.loop as loop

    phases: dict = {}
    originals = {name: getattr(loop, fn) for name, fn in LOOP_PHASES.items()}
    for name, fn in LOOP_PHASES.items():
        setattr(loop, fn, measured_phase(name, originals[name], phases))
    error = None
    seen: dict = {}
    try:
        with grad_norm_probe() as seen:  # the first step's trainable-gradient norm
            code = fitune_main(["train", config, "--no-progress"])
    except Exception as exc:  # noqa: BLE001 - recorded (an OOM outside the guard, a loading error)
        import traceback

        traceback.print_exc()
        code, error = 1, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        runtime_model.build_model_for_setup = build
        for name, fn in LOOP_PHASES.items():
            setattr(loop, fn, originals[name])
    cfg = yaml.safe_load(open(config))
    if not load and error is None and code == 0:
        error = ("fitune train never called fitune.runtime.model.build_model_for_setup: wrap what train/loop.py calls "
                 "now to build the model")
    rec = {"load": load or None, "phases": phases, "child_exit": code, **({"error": error} if error else {}),
           **step_peaks(cfg["output_dir"])}
    rec["versions"] = versions()
    rec["training"] = training_facts([s["loss"] for s in rec["steps"] if s.get("loss") is not None], seen,
                                     why_none=error or f"fitune train exited {code} before it")
    with open(os.path.join(case_dir, "record.json"), "w") as f:
        json.dump(rec, f)
    return code


# ---- main --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where pretrained_load.jsonl, each case's log and train config go")
    p.add_argument("--work", default=None, help="the model folder and the runs (default: /tmp/fitune_pretrained_load,"
                   " or OUT/work with --smoke); 16 GB of shards: keep it out of $OUT")
    p.add_argument("--cases", default="lora,qlora", help="methods, comma-separated (lora: bf16 LoRA; qlora: NF4 "
                   "quantised on load by BitsAndBytesConfig)")
    p.add_argument("--steps", type=int, default=4, help="training steps per case (their peaks are recorded)")
    p.add_argument("--cap", default="rtx4090", help="the card whose allocator budget caps the run (cap: in the config)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--device", default="cuda", help="where the folder's random weights are drawn")
    p.add_argument("--timeout", type=float, default=240, help="seconds per case's training process")
    p.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, bf16 LoRA only, 2 steps of 64 tokens")
    p.add_argument("--print-provenance", action="store_true",
                   help="print FITUNE_COMMIT=... FITUNE_DIFF_SHA256=... of this checkout (for a command run elsewhere)")
    p.add_argument("--no-eval", dest="eval", action="store_false",
                   help="no eval data (the eval step's phase is then not measured)")
    p.add_argument("--no-merge", dest="merge", action="store_false",
                   help="no `fitune merge` of each case's run (its phase is then not measured)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--merge-child", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--merged", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child, args.config)
    if args.merge_child:
        return merge_child_main(args.merge_child, args.run, args.merged, args.cap)
    if args.print_provenance:
        prov = provenance()
        print(f"FITUNE_COMMIT={prov['commit']} FITUNE_DIFF_SHA256={prov['diff_sha256']}")
        return 0
    if not args.out:
        p.error("--out is required")
    cases = [c for c in args.cases.split(",") if c]
    if args.smoke:
        args.device, args.seq_len, args.steps = "cpu", 64, min(args.steps, 2)
        if "qlora" in cases:
            print("--smoke: qlora skipped (bitsandbytes NF4 needs CUDA)", flush=True)
            cases = [c for c in cases if c != "qlora"]
    os.makedirs(args.out, exist_ok=True)
    args.work = args.work or (os.path.join(args.out, "work") if args.smoke else "/tmp/fitune_pretrained_load")
    os.makedirs(args.work, exist_ok=True)
    prov = provenance()
    print("### provenance:", json.dumps(prov), flush=True)

    words = synthetic_words(400 if args.smoke else WORDS)
    folder = os.path.join(args.work, "model")
    facts = write_model_folder(folder, model_config(args.smoke), args.device, args.smoke, words)
    print("### folder:", json.dumps(facts), flush=True)
    data = write_chat_data(os.path.join(args.work, "train.jsonl"), 64, words, answer_words=args.seq_len + 50)
    args.eval_data = write_chat_data(os.path.join(args.work, "eval.jsonl"), 2 * args.batch_size, words,
                                     answer_words=args.seq_len + 50, seed=1) if args.eval else None

    for case in cases:
        rec = run_case(case, args, folder, facts, data, prov)
        training = rec.pop("training", None) or training_facts(  # killed before record.json: its steps so far
            [s["loss"] for s in rec.get("steps", []) if s.get("loss") is not None], None,
            why_none=f"the training process ended ({rec.get('exit')}) without saying")
        write_record(os.path.join(args.out, "pretrained_load.jsonl"), rec, training=training)
        brief = {k: rec.get(k) for k in ("case", "exit", "peak_allocated_bytes", "est_peak_allocated_bytes",
                                         "step_allocated_over_est", "peak_reserved_bytes", "est_peak_reserved_bytes")}
        if rec.get("load"):
            brief.update({k: rec["load"].get(k) for k in ("load_path", "load_s", "gpu_peak_allocated_bytes",
                                                          "host_rss_peak_bytes", "host_anon_peak_bytes")})
        print("### case:", json.dumps(brief), flush=True)
        for name, c in (rec.get("phase_comparison") or {}).items():
            print(f"### {rec['case']} {name}:", json.dumps({k: v for k, v in c.items() if k.endswith("_over_est")}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
