"""`fitune profile`: measure a real run's memory and speed, attribute the peak, explain an OOM."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import ConfigError
from ..files import atomic_writer
from ..memory import estimate
from ..perf.flops import hardware_flops_per_token
from ..report import add_html_argument, maybe_write_html
from ..specs.gpu import resolve_gpu
from ..specs.model import load_model_spec
from ..units import gib, human_bytes
from .common import check_output_file
from .estimate import LABELS, add_setup_arguments, setup_from_args

DESCRIPTION = """\
Run real training steps and measure them (--stack hf: the HF recipe, transformers + PEFT as users write it;
--stack fitune: fitune's runner with its chunked loss, tiled MLP, offloaded or selective checkpointing): peak allocated
and reserved memory per phase, the peak split into the estimator's categories next to `fitune estimate`'s figure
for each, tokens/s and MFU, allocator retries and fragmentation. An out-of-memory error becomes a post-mortem
(what filled the card, by category and source line, and the changes that would fit) and exit status 1.

A catalog model or config.json gets random weights (memory does not depend on their values); a model folder
with weights loads them. `--cap rtx4090` limits PyTorch's allocator to that card's budget on a bigger GPU.

examples:
  fitune profile llama-3.1-8b --seq-len 2048 --batch-size 2 --grad-checkpointing full --cap rtx4090
  fitune profile ./tiny/config.json --device cpu --seq-len 128 --steps 2 --json
  fitune profile --config train.yaml --plot memory.png
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure a real training run's memory and speed",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--steps", type=int, default=3, help="training steps to measure (default 3)")
    p.add_argument("--cap", metavar="NGiB|GPU", help="limit PyTorch's allocator to this budget (e.g. rtx4090, 23.4GiB)")
    p.add_argument("--gpu", metavar="NAME", help="the GPU MFU is computed against (default: --cap, else h200)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (tiny models; tensor-level accounting instead of CUDA counters)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys in docs/reference.md)")
    p.add_argument("--plot", metavar="FILE.png", help="write memory over time, phases shaded, the peak marked")
    add_html_argument(p)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    setup = setup_from_args(args)  # --config's keys, then the flags given on top
    model_name = args.model
    if not model_name:
        raise ConfigError("MODEL is missing: name a catalog model, a config.json or a model folder (or --config)")
    if args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer, got {args.steps}")
    spec = load_model_spec(model_name)
    setup.validate(num_layers=spec.num_layers, hidden_size=spec.hidden_size, linear_names=spec.linear_names())
    cap = resolve_gpu(args.cap, "--cap") if args.cap is not None else None
    gpu = resolve_gpu(args.gpu) if args.gpu is not None else (cap if cap and cap.peak_bf16_tflops else
                                                  (resolve_gpu("h200") if args.device == "cuda" else None))
    if args.device == "cpu":
        check_cpu_can_run(spec, setup, model_name)
    check_output_paths(args)
    try:
        # torch, matplotlib: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError("fitune profile needs torch, transformers and peft (pip install 'fitune[torch]')") from exc
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..profile.run import profile

    def progress(i, n):
        if not args.json:
            print(f"\r  step {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    result = profile(spec, setup, source=model_name, steps=args.steps, device=args.device, cap=cap, gpu=gpu,
                     progress=progress)
    if args.plot and result.timeline:
        _write_plot(result, args.plot)
    maybe_write_html(args, "profile", result.to_json())
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(format_result(result))
    return 1 if result.oom else 0


def _write_plot(result, path: str) -> None:
    """--plot through a temporary file no planted link can redirect, renamed over `path` once complete; matplotlib
    gets the open file, so the format comes from the name's extension here (png when it has none)."""
    import matplotlib

    from ..profile.plot import plot_timeline

    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    with atomic_writer(path, what="--plot") as f, matplotlib.rc_context({"savefig.format": fmt}):
        plot_timeline(result, f)


#: The largest training step `--device cpu` runs, in FLOPs (forward + backward, `fitune.perf.flops`): about
#: three minutes at the ~100 GFLOP/s of a laptop CPU. CPU profiling is for tiny models (tests, smoke runs).
CPU_MAX_STEP_FLOPS = 2e13


def available_host_bytes() -> int | None:
    """Host memory available to a new process (Linux's MemAvailable), bytes; None when it cannot be told."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_cpu_can_run(spec, setup, model_name: str) -> None:
    """Refuse, before any tensor exists, a `--device cpu` run that cannot fit this machine's memory or would take
    hours: the step's estimated bytes against the available host memory, its FLOPs against CPU_MAX_STEP_FLOPS."""
    problems = []
    est = estimate(spec, setup, None, device="cpu")
    need = est.peak_allocated_bytes + est.host_bytes
    available = available_host_bytes()
    if available is not None and need > available:
        problems.append(f"--device cpu: a training step of {model_name} needs about {gib(need)} (fitune estimate), "
                        f"and this machine has {gib(available)} of memory available")
    flops = hardware_flops_per_token(spec, setup) * setup.batch_size * setup.seq_len_tokens
    if flops > CPU_MAX_STEP_FLOPS:
        problems.append(f"--device cpu: one step of {model_name} at {setup.batch_size} x {setup.seq_len_tokens} "
                        f"tokens is about {flops / 1e12:,.0f} TFLOP; CPU profiling is for tiny models (at most "
                        f"{CPU_MAX_STEP_FLOPS / 1e12:.0f} TFLOP a step, minutes on a CPU)")
    if problems:
        raise ConfigError("; ".join(problems) + ". Profile it on a GPU (--device cuda), estimate it without running "
                          f"it (fitune estimate {model_name} ...), or profile a smaller config.json on the CPU (fewer "
                          "layers, a shorter --seq-len)")


def check_output_paths(args) -> None:
    """--plot: matplotlib is there and the file can be written, checked before the run rather than after it."""
    if args.plot is not None:
        check_output_file(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ConfigError("--plot needs matplotlib: pip install matplotlib (or pip install 'fitune[plot]'); "
                              "--html draws its charts without it") from exc
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if ext and ext not in kinds:
            raise ConfigError(f"--plot {args.plot}: matplotlib cannot write .{ext} files; name a .png (or one of: "
                              f"{', '.join(sorted(kinds))})")
    if getattr(args, "html", None) is not None:
        check_output_file(args.html, "--html", make_parents=True)


def format_result(r) -> str:
    from ..runtime.oom import OomReport, format_report

    scale = max(r.peak_allocated_bytes, r.estimate_peak_allocated_bytes)

    def gib(n):
        return human_bytes(n, scale)

    s = r.setup
    lines = [f"{r.model}: {s.method} r{s.lora_rank}, {s.batch_size} x {s.seq_len_tokens} tokens, checkpointing "
             f"{s.grad_checkpointing}, attention {s.attn}, {r.steps} step(s) on {r.device}"
             + (f", allocator capped at {gib(r.cap_bytes)}" if r.cap_bytes else "")]
    if r.oom:
        o = r.oom
        rep = OomReport(message=o["message"], requested_bytes=o["requested_bytes"], live_bytes=o["live_bytes"],
                        live_by_category=o["live_by_category"],
                        top_sources=[(x["source"], x["bytes"]) for x in o["top_sources"]],
                        reserved_bytes=o["reserved_bytes"], budget_bytes=o["budget_bytes"], phase=o["phase"],
                        estimate_peak_allocated_bytes=o["estimate_peak_allocated_bytes"],
                        estimate_peak_reserved_bytes=o["estimate_peak_reserved_bytes"],
                        estimate_breakdown=o["estimate_breakdown"],
                        suggestions=[(x["change"], x["peak_reserved_bytes"]) for x in o["suggestions"]])
        lines.append(format_report(rep))
        return "\n".join(lines)
    lines.append("")
    lines.append(f"  {'at the measured peak (' + r.peak_phase + ')':34s} {'measured':>11s} {'estimated':>11s} {'difference':>11s}")
    for key, label in LABELS.items():
        if key == "allocator_overhead":
            continue
        m, e = r.breakdown.get(key, 0), r.estimate_breakdown.get(key, 0)
        if key in ("gathered_weights", "comm_buffers") and not (m or e):
            continue  # several-GPU terms: nothing to show for one process
        lines.append(f"    {label:32s} {gib(m):>11s} {gib(e):>11s} {gib(m - e):>11s}")
    lines.append(f"    {'peak allocated':32s} {gib(r.peak_allocated_bytes):>11s} {gib(r.estimate_peak_allocated_bytes):>11s} "
                 f"{gib(r.peak_allocated_bytes - r.estimate_peak_allocated_bytes):>11s}")
    if r.peak_reserved_bytes is not None:
        lines.append(f"    {'peak reserved':32s} {gib(r.peak_reserved_bytes):>11s} {gib(r.estimate_peak_reserved_bytes):>11s} "
                     f"{gib(r.peak_reserved_bytes - r.estimate_peak_reserved_bytes):>11s}")
    lines.append("")
    lines.append("  phase peaks (allocated): " + ", ".join(f"{p} {gib(m.peak_allocated_bytes)}" for p, m in r.phases.items()))
    speed = f"  {r.tokens_per_s:,.0f} tokens/s ({r.step_time_s:.3f} s per step of {r.tokens_per_step} tokens)"
    if r.mfu is not None:
        speed += f", MFU {100 * r.mfu:.1f} %"
    lines.append(speed)
    if r.num_alloc_retries is not None:
        lines.append(f"  allocator: {r.num_alloc_retries} retries, fragmentation at the peak {gib(r.fragmentation_bytes or 0)}")
    if r.outside_allocator_bytes is not None:
        lines.append(f"  outside the allocator: {gib(r.outside_allocator_bytes)} (CUDA context, kernels loaded, libraries; "
                     f"the estimate's budget leaves {gib(r.estimate_context_bytes or 0)} for it on this GPU)")
    return "\n".join(lines)
