"""What the peer scripts share: the command line, the shared data, step timing, the JSON record.

Imports nothing heavy at import (unsloth_run.py must import unsloth before transformers, peft and trl): torch,
transformers and the rest are imported inside the functions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

DATA_FILE = "data.pt"
PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "unsloth", "unsloth_zoo",
            "liger_kernel", "bitsandbytes", "triton", "cut_cross_entropy")


def parser(description: str, ckpt_choices: tuple[str, ...] = ("none", "full")) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="folder written by bench/peers/make_model.py")
    p.add_argument("--out", required=True, help="JSON lines file; one line per run is appended")
    p.add_argument("--grad-checkpointing", default=ckpt_choices[0], choices=ckpt_choices)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (tokens/s: median of steps 3 and later)")
    p.add_argument("--cap", default="rtx4090", help="allocator budget of this card (cuda only); '' for none")
    p.add_argument("--device", default="cuda")
    return p


def base_record(stack: str, args, **extra) -> dict:
    meta = {}
    meta_path = os.path.join(args.model_dir, "peers_meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    seq = meta.get("seq_len", 2048)
    return {"stack": stack, "model": meta.get("model"), "layers": meta.get("layers"),
            "cap": args.cap if args.device == "cuda" else None, "device": args.device,
            "grad_checkpointing": args.grad_checkpointing, "micro_batch_size": args.micro_batch,
            "grad_accum": args.grad_accum, "seq_len_tokens": seq,
            "tokens_per_step": args.micro_batch * args.grad_accum * seq, "steps": args.steps,
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]},
            "optim": "adamw_torch", **extra}


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    out["python"] = sys.version.split()[0]
    return out


def load_rows(model_dir: str):
    """The shared token ids: a LongTensor (rows, seq_len), the same for every stack."""
    import torch

    return torch.load(os.path.join(model_dir, DATA_FILE))


def hf_args(description: str, liger_help: str):
    """The HF stacks' command line (the common one plus --liger), parsed, with the allocator capped."""
    p = parser(description)
    p.add_argument("--liger", action="store_true", help=liger_help)
    args = p.parse_args()
    start_cuda(args)
    return args


def start_cuda(args) -> None:
    """Cap the allocator (before any CUDA allocation) and zero the counters."""
    if args.device != "cuda":
        return
    from bench.common import cap_allocator

    cap_allocator(args.cap, "cuda")


def simulate_card_view(cap: str | None) -> dict | None:
    """Make the memory queries a library sizes itself from answer as the capped card would.

    The allocator cap (set_per_process_memory_fraction) limits allocations, but `torch.cuda.mem_get_info` and
    `get_device_properties().total_memory` still report the H200's 140 GiB. Unsloth picks some paths from them
    (fused-loss chunk size and double-buffered activation offload from free memory; its "small card" route below
    24.5 GiB of total_memory): here free memory is the allocator budget less what this process reserved, and
    `get_device_properties().total_memory` the card's. `mem_get_info`'s total stays the H200's, since Unsloth caps
    free memory with `total * get_per_process_memory_fraction()`. Call after `cap_allocator` (which reads the real
    total). Returns what the record notes, None when nothing was patched.
    """
    if not cap:
        return None
    import torch

    from fitune.specs.gpu import resolve_gpu

    card = resolve_gpu(cap)
    total, budget = int(card.total_bytes), int(card.allocator_budget_bytes)
    real_mem_get_info = torch.cuda.mem_get_info
    real_props = torch.cuda.get_device_properties

    def mem_get_info(device=None):
        free, real_total = real_mem_get_info(device)
        return min(free, max(0, budget - torch.cuda.memory_reserved(device))), real_total

    class _Props:
        def __init__(self, props):
            object.__setattr__(self, "_props", props)

        total_memory = total

        def __getattr__(self, name):
            return getattr(self._props, name)

        def __repr__(self):
            return repr(self._props).replace(str(self._props.total_memory // 2**20), str(total // 2**20))

    def get_device_properties(device=None):
        return _Props(real_props(device))

    torch.cuda.mem_get_info = mem_get_info
    torch.cuda.memory.mem_get_info = mem_get_info
    torch.cuda.get_device_properties = get_device_properties
    return {"card": card.name, "total_memory": total, "budget": budget}


def plain_loop(model, opt, rows, args, clock) -> None:
    """The training loop people write around a model (bench/peers/hf_loop.py's on transformers + PEFT,
    bench/peers/unsloth_run.py's on Unsloth's model): per optimizer step `args.grad_accum` micro-batches of
    `args.micro_batch` rows, each `model(input_ids, labels=input_ids).loss / grad_accum` backward and `.item()`ed
    (the step's loss is their sum), then `opt.step()`. One clock tick per optimizer step, the batch moved to the
    device before it (as the Trainer's dataloader does); the first step's trainable-gradient norm read before its
    optimizer step."""
    from bench.common import first_step_grad_norm

    per_step = args.micro_batch * args.grad_accum
    clock.losses = []
    for step in range(args.steps):
        start = (step * per_step) % (rows.shape[0] - per_step + 1)
        batch = rows[start:start + per_step].to(args.device)  # outside the timed step, as the Trainer's
        clock.begin()
        total = 0.0
        for mb in batch.split(args.micro_batch):
            loss = model(input_ids=mb, labels=mb).loss / args.grad_accum
            loss.backward()
            total += loss.item()
        if step == 0:  # the record's first-step trainable-gradient norm (step 1 is outside tokens/s)
            clock.first_grad_norm = first_step_grad_norm(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.end()
        clock.losses.append(total)


def reset_peaks(device: str) -> int:
    if device != "cuda":
        return 0
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def cuda_stats(device: str, retries0: int) -> dict:
    if device != "cuda":
        return {}
    import torch

    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0,
            "gpu": torch.cuda.get_device_name(0),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}


class StepClock:
    """Seconds of each optimizer step (synchronized on CUDA) and the wall time between step ends."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.seconds: list[float] = []
        self.ends: list[float] = []
        self._t0 = None

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def begin(self):
        self._sync()
        self._t0 = time.perf_counter()

    def end(self):
        self._sync()
        t = time.perf_counter()
        self.seconds.append(t - self._t0)
        self.ends.append(t)

    def summary(self, tokens_per_step: int) -> dict:
        """tokens/s: median over steps 3 and later of tokens per step / step seconds (all steps when fewer)."""
        s = self.seconds
        steady = s[2:] if len(s) > 2 else s
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:])][1:]  # end(k) - end(k-1), k >= 3
        return {"steps_done": len(s),
                "tokens_per_s": statistics.median(tokens_per_step / x for x in steady) if steady else None,
                "tokens_per_s_wall": statistics.median(tokens_per_step / x for x in gaps) if gaps else None,
                "step_seconds": [round(x, 4) for x in s[:64]]}


def trainer_callback(clock: StepClock):
    """A transformers TrainerCallback that feeds `clock` (on_step_begin / on_step_end: one optimizer step)."""
    from transformers import TrainerCallback

    class _Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                clock.losses = getattr(clock, "losses", []) + [logs["loss"]]
            if logs and logs.get("grad_norm") is not None and not hasattr(clock, "first_grad_norm"):
                # logging_steps=1: the first step's; the Trainer's clip_grad_norm_ total, before clipping
                clock.first_grad_norm = float(logs["grad_norm"])

    return _Timer()


def is_oom(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            import torch

            if isinstance(exc, torch.OutOfMemoryError):
                return True
        except ImportError:
            pass
        if "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def outcome(exc: BaseException | None) -> dict:
    """fits True (no error) / False (out of memory) / None (another error, with its type, message, traceback)."""
    if exc is None:
        return {"fits": True}
    if is_oom(exc):
        return {"fits": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                if str(exc).strip() else type(exc).__name__}
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip().splitlines()
    return {"fits": None, "error": f"{type(exc).__name__}: {str(exc)[:600]}", "traceback": tb[-15:]}


def write(out: str, rec: dict, training: bool = True) -> None:
    """Append `rec` through bench.common.write_record; a probe's or a run's record is a training record (its loss
    trajectory: `losses`; its first step's trainable-gradient norm: `first_step_grad_norm`), a search's summary is
    not (`training=False`)."""
    from bench.common import training_facts, write_record

    facts = None
    if training:
        facts = training_facts(rec.get("losses") or [], {"first_step_grad_norm": rec.pop("first_step_grad_norm", None)},
                               why_none=rec.get("error") or "this stack's first-step gradient norm was not read")
    write_record(out, rec, training=facts)
    short = {k: rec.get(k) for k in ("stack", "grad_checkpointing", "micro_batch_size", "grad_accum", "fits",
                                     "tokens_per_s", "peak_allocated_bytes", "peak_reserved_bytes",
                                     "num_alloc_retries")}
    if rec.get("error"):
        short["error"] = rec["error"][:200]
    print("RESULT " + json.dumps(short), flush=True)


def record_whatever_happens(rec: dict, args, run, summarize, progress, in_process: bool = True) -> dict:
    """Run `run()` and write `rec` once, whatever happens: an exception becomes the record's outcome, then
    `summarize(rec)` adds the measurements and, `in_process`, this process's CUDA peaks. SIGTERM (`timeout`) writes
    the record at once, saying how far it got (`progress()`), and exits 124: libraries may swallow an exception
    raised from a signal handler, so the handler does not rely on one."""
    import signal

    t_start = time.perf_counter()
    written = []

    def finish(exc: BaseException | None) -> dict:
        if written:
            return rec
        written.append(True)
        rec.update(outcome(exc))
        summarize(rec)
        if in_process:
            try:
                rec.update(cuda_stats(args.device, rec.pop("_retries0", 0)))
            except Exception as e:  # noqa: BLE001 - a broken CUDA context after a failure
                rec["cuda_stats_error"] = repr(e)[:200]
        rec["elapsed_s"] = round(time.perf_counter() - t_start, 2)
        write(args.out, rec)
        return rec

    def _term(signum, frame):  # `timeout` sends SIGTERM: record the case as not finished instead of vanishing
        finish(TimeoutError(f"stopped by signal {signum} (the case's time limit) after {progress()}"))
        os._exit(124)

    signal.signal(signal.SIGTERM, _term)
    exc = None
    try:
        rec["versions"] = versions()
        run()
    except BaseException as e:  # noqa: BLE001 - every failure is a result here (KeyboardInterrupt included)
        exc = e
    return finish(exc)


def run_case(stack: str, args, body, **extra) -> dict:
    """Run `body(rec, clock)` (which builds and trains) and write one record, whatever happens
    (`record_whatever_happens`). `body` fills `rec` (load seconds, `_retries0` from `reset_peaks`...) and drives
    `clock`."""
    rec = base_record(stack, args, **extra)
    clock = StepClock(args.device)

    def summarize(rec: dict) -> None:
        if rec["fits"] and len(clock.seconds) < args.steps:
            rec.update({"fits": None, "error": f"only {len(clock.seconds)} of {args.steps} steps were timed"})
        rec.update(clock.summary(rec["tokens_per_step"]))
        if getattr(clock, "losses", None):
            rec["losses"] = [round(x, 4) for x in clock.losses[:64]]
        rec["first_step_grad_norm"] = getattr(clock, "first_grad_norm", None)
        if not rec["fits"]:
            rec["tokens_per_s"] = rec["tokens_per_s_wall"] = None

    return record_whatever_happens(rec, args, lambda: body(rec, clock), summarize,
                                   lambda: f"{len(clock.seconds)} timed steps")


# ---- issue 14, "real-length data" and "context per card size" (bench/peers/real_length.py, unsloth_max_context.py)

#: The instruction-like length distribution every stack of real_length.py trains on: an example's words (= tokens of
#: the peers' word-level tokenizer, before each stack's eos) are lognormal with median 300 and sigma 0.9, rounded and
#: clipped to [32, 2048]. Percentiles of the distribution: p10 95, p25 163, p50 300, p75 550, p90 951, p95 1318,
#: p99 2048 (1.6 % of the examples sit at the 2048 clip; mean about 435).
LENGTH_MEDIAN = 300
LENGTH_SIGMA = 0.9
LENGTH_MIN, LENGTH_MAX = 32, 2048
LENGTH_PERCENTILES = {"p10": 95, "p25": 163, "p50": 300, "p75": 550, "p90": 951, "p95": 1318, "p99": 2048}


def instruction_lengths(n: int, seed: int = 0) -> list[int]:
    """`n` example lengths (words) from the distribution above; the same list for the same seed on any machine
    (Python's own `random`, no numpy)."""
    import math
    import random

    rng = random.Random(seed)
    mu = math.log(LENGTH_MEDIAN)
    return [min(LENGTH_MAX, max(LENGTH_MIN, round(rng.lognormvariate(mu, LENGTH_SIGMA)))) for _ in range(n)]


def length_percentiles(lengths) -> dict:
    """Nearest-rank percentiles (p10 ... p99), max, mean, and the share at the 2048 clip, of a list of lengths."""
    xs = sorted(lengths)
    if not xs:
        return {}
    pick = lambda q: xs[min(len(xs) - 1, max(0, -(-q * len(xs) // 100) - 1))]  # noqa: E731 - ceil(q n / 100)
    out = {f"p{q}": pick(q) for q in (10, 25, 50, 75, 90, 95, 99)}
    out.update(max=xs[-1], mean=round(sum(xs) / len(xs), 1), at_max_share=round(xs.count(LENGTH_MAX) / len(xs), 4))
    return out


def write_length_data(path: str, n: int = 2000, seed: int = 0, words: int = 4000) -> dict:
    """Write `n` prompt/completion records (JSON lines) with `instruction_lengths(n, seed)` words each, of the
    words w0 ... w{words-1} that bench/peers/make_model.py's tokenizer knows; the prompt takes a uniform 10-50 % of
    an example (at least 4 words, the completion at least 1), and the completion starts with a space so that
    prompt + completion (TRL's concatenation) keeps the word boundary. Returns the distribution's description,
    which every record of real_length.py carries."""
    import random

    lengths = instruction_lengths(n, seed)
    rng = random.Random(seed + 1)
    vocab = [f"w{i}" for i in range(words)]
    prompt_words = 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for length in lengths:
            p = min(length - 1, max(4, round(length * rng.uniform(0.1, 0.5))))
            text = [rng.choice(vocab) for _ in range(length)]
            prompt_words += p
            f.write(json.dumps({"prompt": " ".join(text[:p]), "completion": " " + " ".join(text[p:])}) + "\n")
    return {"distribution": f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}) words, clipped to "
                            f"[{LENGTH_MIN}, {LENGTH_MAX}]; prompt 10-50 % (uniform), the rest completion",
            "documented_percentiles": LENGTH_PERCENTILES, "examples": n, "seed": seed,
            "sample_percentiles": length_percentiles(lengths), "words": sum(lengths),
            "prompt_share": round(prompt_words / max(1, sum(lengths)), 3)}


def parse_result(text: str) -> dict | None:
    """The last `RESULT {...}` line a case printed (a progress bar's carriage return may precede it), or None."""
    import re

    found = re.findall(r"RESULT (\{.*\})", text or "")
    for line in reversed(found):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
