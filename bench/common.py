"""What the GPU benchmark scripts share: capping the allocator, timing training steps (the runtime's) under it, and
writing records that say what produced them (`write_record`: commit, diff hash, versions, GPU; for training runs
the first step's trainable-gradient norm and the loss trajectory)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import subprocess
import sys
import time


def cap_allocator(cap: str | None, device: str) -> None:
    """Limit PyTorch's allocator to a GPU's budget (`rtx4090`, `23.4GiB`), as a smaller card would."""
    if device != "cuda" or not cap:
        return
    from fitune.runtime.device import limit_allocator
    from fitune.specs.gpu import resolve_gpu

    limit_allocator(resolve_gpu(cap).allocator_budget_bytes)


def timed_steps(run_step, steps: int, tokens_per_step: int, device: str) -> dict:
    """Run `run_step(check_gradients=...)` `steps` times; fits / tokens_per_s (mean of the steps after the first) /
    CUDA peaks, and the training facts of `write_record` (first_step_grad_norm: the first step checks its gradients
    and `grad_norm_probe` reads their norm; loss_trajectory: what `run_step` returned; take them with
    `pop_training`).

    An out-of-memory error is a result (fits: False), any other error propagates.
    """
    import torch

    from fitune.runtime.oom import is_oom

    cuda = device == "cuda"
    rec: dict = {}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times, losses = [], []
    probe = grad_norm_probe()
    seen = probe.__enter__()
    try:
        for i in range(steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(run_step(check_gradients=i == 0))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rec["fits"] = True
        rec["tokens_per_s"] = tokens_per_step / (sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0])
    except Exception as exc:  # noqa: BLE001 - an OOM is a result here
        if not is_oom(exc):
            raise
        rec["fits"] = False
        rec["error"] = str(exc).splitlines()[0][:200]
    finally:
        probe.__exit__(None, None, None)
    rec.update(training_facts(losses, seen, why_none=f"out of memory before the first backward: {rec.get('error')}"))
    if cuda:
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        rec["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def training_step(model, opt, ids, chunked_loss: bool, micro_batch_size: int | None = None,
                  check_gradients: bool = False) -> float:
    """One optimizer step on `ids` (labels = inputs) through fitune's runtime step (`fitune train`'s):
    transformers' loss or fitune's chunked loss; with `micro_batch_size` below the batch, gradients accumulate
    over micro-batches of that many rows (each micro-batch's mean loss / their number). `check_gradients`: the
    runtime's check that some trainable gradient is non-zero (where `grad_norm_probe` reads their norm)."""
    from fitune.runtime.step import train_step

    micro = ids.split(micro_batch_size or ids.shape[0])
    return train_step(model, opt, micro, loss="chunked" if chunked_loss else "hf",
                      check_gradients=check_gradients).loss


def pop_training(rec: dict) -> dict:
    """Take the training facts (`TRAINING_KEYS` and the reason a norm is None) out of `rec`, for `write_record`'s
    `training=`."""
    return {k: rec.pop(k) for k in (*TRAINING_KEYS, "first_step_grad_norm_why_none") if k in rec}


# ---- provenance: what produced a record ---------------------------------------------------------------------------

PROVENANCE_KEYS = ("commit", "diff_sha256", "provenance_from", "versions", "gpu")
"""The keys of a record's `provenance` (tests/test_records_provenance.py refuses a record without them)."""
TRAINING_KEYS = ("first_step_grad_norm", "loss_trajectory")
"""What a training record carries besides: the trainable parameters' gradient norm after the first backward (before
clipping; None only with `first_step_grad_norm_why_none`, e.g. a probe out of memory before its first backward) and
the loss of every step, in order."""
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "liger_kernel", "trl", "unsloth")
"""The packages whose versions a record names (None where not installed)."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordError(ValueError):
    """A record a bench script was about to write lacks what says how it was produced."""


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def code_version() -> dict:
    """The code that ran: git's commit and the sha256 of `git diff HEAD` ("" when the tree is clean); where the copy
    has no .git (the GPU machine), FITUNE_COMMIT / FITUNE_DIFF_SHA256 as exported by the command that ran it (print
    them here with `python -m bench.common`)."""
    if os.environ.get("FITUNE_COMMIT"):
        return {"commit": os.environ["FITUNE_COMMIT"], "diff_sha256": os.environ.get("FITUNE_DIFF_SHA256", ""),
                "provenance_from": "env"}
    try:
        commit = _git("rev-parse", "HEAD").decode().strip()
        diff = _git("diff", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "diff_sha256": None, "provenance_from": "none (no git checkout, no FITUNE_COMMIT)"}
    return {"commit": commit, "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else "",
            "provenance_from": "git"}


def package_versions() -> dict:
    """Python's version and each of PACKAGES' (None where it is not installed), read without importing them."""
    import importlib.metadata
    import platform

    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_facts() -> dict | None:
    """The GPU of this machine: from torch.cuda where this process imported torch, else from `nvidia-smi` (a parent
    whose children measure; importing torch only to name the card costs seconds). None without a GPU."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"name": props.name, "total_memory_bytes": int(props.total_memory), "count": torch.cuda.device_count(),
                "source": "torch.cuda"}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, mib = (x.strip() for x in out[0].rsplit(",", 1))
    return {"name": name, "total_memory_bytes": int(mib) * 2**20, "count": len(out), "source": "nvidia-smi"}


_CODE_VERSIONS: dict = {}
"""code_version() once per process (per FITUNE_COMMIT / FITUNE_DIFF_SHA256): the code that runs does not change
while it runs, and a search that writes a record per probe should not run git each time."""


def provenance(gpu: bool = True) -> dict:
    """What produced a record: the code (commit, diff_sha256, provenance_from), package versions and the GPU
    (`gpu=False`: None, for a record that no GPU produced)."""
    key = (os.environ.get("FITUNE_COMMIT"), os.environ.get("FITUNE_DIFF_SHA256"))
    if key not in _CODE_VERSIONS:
        _CODE_VERSIONS[key] = code_version()
    return {**_CODE_VERSIONS[key], "versions": package_versions(), "gpu": gpu_facts() if gpu else None}


def check_training(training: dict) -> None:
    """Raise RecordError unless `training` has a finite first-step gradient norm (or None with a reason) and a
    loss trajectory (a list of numbers)."""
    missing = [k for k in TRAINING_KEYS if k not in training]
    if missing:
        raise RecordError(f"a training record needs {', '.join(missing)} (got keys {sorted(training)}): compute "
                          "the trainable parameters' gradient norm after the first backward and keep every step's "
                          "loss (bench.common.first_step_grad_norm, bench.common.grad_norm_probe)")
    norm, losses = training["first_step_grad_norm"], training["loss_trajectory"]
    if norm is None and not training.get("first_step_grad_norm_why_none"):
        raise RecordError("first_step_grad_norm is None without first_step_grad_norm_why_none: say why the run has "
                          "no first step (e.g. out of memory before the first backward)")
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm)):
        raise RecordError(f"first_step_grad_norm must be a finite number, got {norm!r}")
    if not isinstance(losses, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in losses):
        raise RecordError(f"loss_trajectory must be a list of numbers (one per step), got {losses!r:.200}")


def write_record(path: str, record: dict, *, training: dict | None = None, gpu: bool = True,
                 prov: dict | None = None) -> dict:
    """Append `record` as one JSON line to `path`, with `provenance` (see `provenance`) and, for a training run,
    `training`'s first_step_grad_norm and loss_trajectory (refused without them: RecordError). `prov`: a
    provenance already taken (a script that writes many records asks git once). Returns the line written."""
    if training is not None:
        check_training(training)
    line = {**record, **(training or {}), "provenance": prov if prov is not None else provenance(gpu=gpu)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, default=str) + "\n")
    return line


def first_step_grad_norm(model) -> float | None:
    """The L2 norm over every trainable parameter's gradient (requires_grad), as after the first backward and
    before clipping; None when no trainable parameter holds a `.grad` (DeepSpeed's ZeRO keeps them in its buffers)."""
    import torch

    grads = [p.grad.detach() for p in model.parameters() if p.requires_grad and p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2's DTensor: this rank's shard
    # in fp32, 16 Mi elements at a time: an fp32 copy of a whole gradient (a full fine-tune's embedding: GBs) would
    # raise the peak the benchmark measures
    squares = [torch.linalg.vector_norm(chunk, dtype=torch.float32) ** 2
               for g in grads if g.numel() for chunk in g.reshape(-1).split(1 << 24)]
    return float(torch.stack(squares).sum().sqrt()) if squares else None


@contextlib.contextmanager
def grad_norm_probe():
    """Inside: fitune's runner (`fitune.runtime.step`) records the first step's trainable-gradient norm in the
    yielded dict (`first_step_grad_norm`), read where the runner checks the first step's gradients (before
    clipping and the optimizer step)."""
    from unittest import mock

    from fitune.runtime import step as step_mod

    seen: dict = {}
    real = step_mod.require_gradients

    def require_gradients(model):
        if "first_step_grad_norm" not in seen:
            seen["first_step_grad_norm"] = first_step_grad_norm(model)
            # fp16: train_step checks before `scaler.unscale_`, so its gradients are times the loss scale
            scaler = sys._getframe(1).f_locals.get("scaler")
            if scaler is not None and seen["first_step_grad_norm"] is not None:
                seen["first_step_grad_norm"] /= float(scaler.get_scale())
            if seen["first_step_grad_norm"] is None:
                seen["first_step_grad_norm_why_none"] = "no trainable parameter holds a .grad (an engine such as " \
                                                        "DeepSpeed's ZeRO keeps the gradients in its own buffers)"
        return real(model)

    with mock.patch.object(step_mod, "require_gradients", require_gradients):
        yield seen


PROBE_ENV = "FITUNE_BENCH_GRAD_NORM_OUT"


def probed_fitune_cmd(probe_path: str) -> tuple[list[str], dict]:
    """`(argv prefix, env)` that run `fitune ...` in a child process under `grad_norm_probe`, which writes the
    first step's trainable-gradient norm as JSON to `probe_path` (read it back with `training_facts`)."""
    return [sys.executable, os.path.join(ROOT, "bench", "common.py"), "--fitune"], \
        {**os.environ, PROBE_ENV: probe_path, "PYTHONPATH": os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def proc_status(keys: tuple[str, ...]) -> dict:
    """This process's memory figures `keys` (VmHWM, VmRSS, RssAnon, ...) from /proc/self/status, in bytes; {} where
    there is no /proc."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out


def host_peaks() -> dict:
    """This process's host memory as it ends: `host_peak_rss_bytes` (VmHWM of /proc/self/status: the peak resident
    set of the whole process, pinned host buffers included, since they are resident) and, where PyTorch reports them,
    the peak bytes of its pinned (page-locked) host allocator (`torch.cuda.host_memory_stats`, PyTorch >= 2.5) and the
    bytes fitune's offloaded checkpoints page-locked themselves (`host_registered_bytes`)."""
    out: dict = {}
    peak = proc_status(("VmHWM",)).get("VmHWM")
    if peak is not None:
        out["host_peak_rss_bytes"] = peak
    torch = sys.modules.get("torch")  # only if the run imported it
    if torch is not None and torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        try:
            stats = torch.cuda.host_memory_stats()
        except RuntimeError:
            stats = {}
        peak = stats.get("allocated_bytes.peak")  # pinned blocks owned by the allocator (active + cached)
        if peak is not None:
            out["host_pinned_peak_bytes"] = int(peak)
    offload = sys.modules.get("fitune.runtime.techniques.offload")
    if offload is not None:  # offloaded checkpoints' exact-size buffers, page-locked outside PyTorch's allocator
        out["host_registered_bytes"] = offload.registered_bytes()
    return out


def run_fitune_probed(argv: list[str]) -> int:
    from fitune.cli.main import main as fitune_main

    with grad_norm_probe() as seen:
        try:
            return fitune_main(argv)
        finally:
            seen.update(host_peaks())
            if os.environ.get(PROBE_ENV):
                with open(os.environ[PROBE_ENV], "w", encoding="utf-8") as f:
                    json.dump(seen, f)


def training_facts(losses: list, probe: dict | str | None, why_none: str | None = None) -> dict:
    """The `training=` of `write_record`: `losses` (one per step, in order) and the first step's gradient norm from
    `probe` (`grad_norm_probe`'s dict, or the path `probed_fitune_cmd` wrote; absent: None, because `why_none`)."""
    if isinstance(probe, str):
        try:
            with open(probe, encoding="utf-8") as f:
                probe = json.load(f)
        except (OSError, ValueError):
            probe = None
    probe = probe or {}
    out = {"first_step_grad_norm": probe.get("first_step_grad_norm"), "loss_trajectory": [float(x) for x in losses]}
    if out["first_step_grad_norm"] is None:
        out["first_step_grad_norm_why_none"] = probe.get("first_step_grad_norm_why_none") or why_none or \
            "the run ended before its first backward (no first step: out of memory or an error before it)"
    return out


if __name__ == "__main__":  # provenance for a command run where .git is absent; or `--fitune ARGS` probed
    if sys.argv[1:2] == ["--fitune"]:
        sys.path.insert(0, ROOT)
        sys.exit(run_fitune_probed(sys.argv[2:]))
    v = code_version()
    print(f"FITUNE_COMMIT={v['commit']} FITUNE_DIFF_SHA256={v['diff_sha256']}")
