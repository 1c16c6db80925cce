"""`fitune train` with PyTorch's allocator history recorded in the process that trains (rank 0), summarised at its end.

    python3 bench/_with_memory_history.py --summary OUT/run.memory.json -- train run.yaml --no-progress

What is live on the GPU at the peak of a whole run, construction included (the ZeRO-3 question: does the model pass
through the GPU whole before DeepSpeed partitions it?), without touching fitune: this wrapper runs
`fitune.cli.main.main` itself and wraps a few of fitune's functions, which fitune looks up at call time:

- `fitune.parallel.launch.command`: a run that fitune starts as torchrun ranks (--gpus N, any ZeRO strategy, even on
  one GPU) runs this wrapper in each rank instead of `python -m fitune`;
- `fitune.runtime.device.configure_allocator`: the history starts right after it (PYTORCH_CUDA_ALLOC_CONF is set
  before CUDA allocates anything), on rank 0 only;
- `fitune.train.loop.train`: the snapshot is taken and summarised when it returns or raises (an OOM is worth it too);
- the phases (building the model, preparing it, deepspeed.initialize, each step, writing the outputs) are marked with
  wall-clock times, and the peak is attributed to the phase it fell in.

No stacks are recorded (`context=None`): recording Python stacks makes DeepSpeed ZeRO-3's autograd Function fail
(bench/results/zero/COMMAND.md), so blocks are told apart by size. The summary is a small JSON file (`summarize`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench.common import PROBE_ENV, run_fitune_probed  # noqa: E402

DEFAULT_MAX_ENTRIES = 5_000_000
"""Trace events kept (a ring buffer: beyond it the oldest go, and with them the construction). No stacks: each entry
is a few hundred bytes in PyTorch; the snapshot turns each into a Python dict."""

TOP_SIZES = 40
"""Sizes listed in the summary's blocks at the peak (largest total first)."""


def _phase_of(times_us: list[float], labels: list[str], t_us: float | None) -> str | None:
    """The label of the last mark at or before `t_us` ("before the first mark" when none)."""
    if t_us is None or not labels:
        return None
    i = bisect.bisect_right(times_us, t_us)
    return labels[i - 1] if i else "before the first mark"


def _live_after(trace: list[dict], index: int | None) -> dict[int, int]:
    """The blocks (address: size) live right after event `index` (none when `index` is None)."""
    live: dict[int, int] = {}
    for e in trace[:0 if index is None else index + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e["size"]
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    return live


def summarize(trace: list[dict], marks: list[tuple[float, str]] = (), base_allocated_bytes: int = 0,
              base_reserved_bytes: int = 0, max_entries: int | None = None, top: int = TOP_SIZES) -> dict:
    """The allocator history `trace` (one device's `torch.cuda.memory._snapshot()["device_traces"][i]`) replayed.

    Live bytes: `alloc` adds a block, `free_completed` removes it (as `bench.trace_peak.live_at_peak` replays them;
    that function copies the live set at every new peak, quadratic over a run's millions of events, so the blocks at
    the peak come from a second replay up to the peak's event); reserved bytes: `segment_alloc` / `segment_map` add,
    `segment_free` / `segment_unmap` remove. `base_*_bytes`: what was allocated / reserved when recording started
    (not in the trace), added to both peaks.

    Args:
        marks: (wall time in microseconds since the epoch, label) of the run's phases; an event belongs to the last
            mark before its `time_us`. Phases are left out when the trace's clock does not fall within the marks.
        max_entries: the history's ring-buffer size: a trace that long has lost its oldest events.

    Returns: a JSON-able dict: the live peak (bytes, event index, time, phase) with the blocks live then grouped by
    size (size_bytes, count, total_bytes; `top` largest totals), the reserved peak, and each phase's peaks.
    """
    marks = sorted(marks)
    mark_times, mark_labels = [m[0] for m in marks], [m[1] for m in marks]
    times = [e.get("time_us") for e in trace if e.get("time_us") is not None]
    clock_ok = bool(marks and times) and min(times) >= mark_times[0] - 60e6 and max(times) <= mark_times[-1] + 60e6

    live: dict[int, int] = {}
    live_bytes = reserved_bytes = running_peak = peak_reserved_delta = 0
    peak_index = peak_reserved_index = None
    phases: dict[str, dict] = {}
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e["size"]
            live_bytes += e["size"]
            if live_bytes > running_peak:  # the first event at the peak, as live_at_peak keeps it
                running_peak, peak_index = live_bytes, i
        elif action == "free_completed" and e["addr"] in live:
            live_bytes -= live.pop(e["addr"])
        elif action in ("segment_alloc", "segment_map"):
            reserved_bytes += e["size"]
            if reserved_bytes > peak_reserved_delta:
                peak_reserved_delta, peak_reserved_index = reserved_bytes, i
        elif action in ("segment_free", "segment_unmap"):
            reserved_bytes -= e["size"]
        if clock_ok:
            phase = _phase_of(mark_times, mark_labels, e.get("time_us"))
            row = phases.setdefault(phase, {"phase": phase, "events": 0, "peak_live_bytes": 0,
                                            "peak_reserved_bytes": 0})
            row["events"] += 1
            row["peak_live_bytes"] = max(row["peak_live_bytes"], base_allocated_bytes + live_bytes)
            row["peak_reserved_bytes"] = max(row["peak_reserved_bytes"], base_reserved_bytes + reserved_bytes)

    blocks = _live_after(trace, peak_index)
    sizes = Counter(blocks.values())
    by_size = sorted(({"size_bytes": size, "count": n, "total_bytes": size * n} for size, n in sizes.items()),
                     key=lambda r: (-r["total_bytes"], -r["size_bytes"]))

    def when(index: int | None) -> dict:
        t = trace[index].get("time_us") if index is not None else None
        return {"event_index": index, "time_us": t,
                "seconds_after_start": round((t - times[0]) / 1e6, 3) if t is not None and times else None,
                "phase": _phase_of(mark_times, mark_labels, t) if clock_ok else None}

    out = {
        "trace_events": len(trace),
        "trace_full": bool(max_entries and len(trace) >= max_entries),  # the oldest events were overwritten
        "base_allocated_bytes": base_allocated_bytes,
        "base_reserved_bytes": base_reserved_bytes,
        "peak_live_bytes": base_allocated_bytes + running_peak,
        "peak": when(peak_index),
        "blocks_at_peak": len(blocks),
        "live_at_peak_by_size": by_size[:top],
        "live_at_peak_other_sizes_bytes": sum(r["total_bytes"] for r in by_size[top:]),
        "peak_reserved_bytes": base_reserved_bytes + peak_reserved_delta,
        "peak_reserved": when(peak_reserved_index),
        "phases": list(phases.values()),
        "marks": [{"time_us": t, "label": label} for t, label in marks],
    }
    if marks and times and not clock_ok:
        out["phases_note"] = ("the trace's time_us does not fall within the marks' wall-clock times: phases left out "
                              f"(trace {min(times):.0f}..{max(times):.0f} us, marks {mark_times[0]:.0f}.."
                              f"{mark_times[-1]:.0f} us)")
    return out


class _Recorder:
    """The history of this process (rank 0), the marks of its phases, and the summary written at the end."""

    def __init__(self, summary_path: str, max_entries: int, trace_path: str | None = None):
        self.summary_path = summary_path
        self.trace_path = trace_path
        self.max_entries = max_entries
        self.marks: list[tuple[float, str]] = []
        self.recording = False
        self.base_allocated_bytes = self.base_reserved_bytes = 0
        self.started_s = time.time()

    def mark(self, label: str) -> None:
        if self.recording:
            self.marks.append((time.time_ns() / 1000, label))

    def start(self) -> None:
        import torch

        if self.recording or not torch.cuda.is_available():
            return
        self.base_allocated_bytes = torch.cuda.memory_allocated()
        self.base_reserved_bytes = torch.cuda.memory_reserved()
        kwargs = {"enabled": "all", "context": None, "stacks": "python", "max_entries": self.max_entries}
        try:  # free_requested events are not replayed: not recording them leaves room for the rest
            torch.cuda.memory._record_memory_history(**kwargs, skip_actions=["free_requested"])
        except TypeError:  # a PyTorch without skip_actions
            torch.cuda.memory._record_memory_history(**kwargs)
        self.recording = True
        self.mark("start")

    def finish(self, error: BaseException | None) -> None:
        """Snapshot, stop recording, write the summary (also when the run raised: an OOM's peak is the point)."""
        import torch

        summary: dict = {"argv": sys.argv[1:], "rank": int(os.environ.get("RANK", "0")),
                         "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                         "torchrun_rank": "TORCHELASTIC_RUN_ID" in os.environ,
                         "torch": torch.__version__, "max_entries": self.max_entries,
                         "error": None if error is None else f"{type(error).__name__}: {str(error)[:500]}"}
        if not self.recording:
            summary["note"] = ("no CUDA device: nothing recorded" if not torch.cuda.is_available() else
                               "nothing recorded: fitune's configure_allocator was not reached through the wrapper")
        else:
            self.mark("end")
            try:
                torch.cuda.synchronize()
            except RuntimeError:  # a failed run's device may refuse; the history is host-side and still readable
                pass
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
            device = torch.cuda.current_device()
            traces = snapshot.get("device_traces") or []
            trace = traces[device] if device < len(traces) else []
            summary.update(summarize(trace, self.marks, self.base_allocated_bytes, self.base_reserved_bytes,
                                     self.max_entries))
            if self.trace_path:
                write_trace(self.trace_path, trace, snapshot.get("segments") or [], self.marks)
            summary["device"] = device
            summary["end_allocated_bytes"] = torch.cuda.memory_allocated()
            summary["end_reserved_bytes"] = torch.cuda.memory_reserved()
            summary["max_allocated_bytes_since_last_reset"] = torch.cuda.max_memory_allocated()
            summary["max_reserved_bytes_since_last_reset"] = torch.cuda.max_memory_reserved()
            del snapshot, trace, traces
        summary["wall_s"] = round(time.time() - self.started_s, 1)
        os.makedirs(os.path.dirname(os.path.abspath(self.summary_path)), exist_ok=True)
        with open(self.summary_path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        brief = {k: summary.get(k) for k in ("trace_events", "trace_full", "peak_live_bytes", "peak_reserved_bytes")}
        brief["peak_phase"] = (summary.get("peak") or {}).get("phase")
        print(f"memory history: {json.dumps(brief)} -> {self.summary_path}", file=sys.stderr, flush=True)


TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "oom")


def write_trace(path: str, trace: list[dict], segments: list[dict], marks: list[tuple[float, str]]) -> None:
    """The allocator's history as compact JSON (gzip): `events` [action, addr, size, stream, time_us] in order (what
    fitune/memory/allocator.py's models replay: allocs and completed frees; the segment maps and unmaps of expandable
    segments; an `oom`), `segments` as the snapshot lists them at the end [address, total_size, allocated_size,
    stream, segment_type], and the phase marks."""
    import gzip

    events = [[e["action"], e.get("addr"), e.get("size"), e.get("stream"), e.get("time_us")]
              for e in trace if e.get("action") in TRACE_ACTIONS]
    segs = [[g.get("address"), g.get("total_size"), g.get("allocated_size"), g.get("stream"), g.get("segment_type")]
            for g in segments]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"events": events, "segments": segs, "marks": marks}, f)


def _wrap(module, name: str, around) -> None:
    """Replace `module.name` by `around(original)`."""
    setattr(module, name, around(getattr(module, name)))


def _marked(recorder: _Recorder, label):
    """A wrapper that marks `label` (a string, or a function of the call's arguments) and its end."""
    def around(fn):
        def call(*args, **kwargs):
            text = label(*args, **kwargs) if callable(label) else label
            recorder.mark(text)
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.mark(f"after {text}")
        return call
    return around


def _step_label(*args, **kwargs) -> str:
    """`_optimizer_step(cfg, model, optimizer, scaler, stream, batches, plan, step, fault)`: step is 0-based."""
    step = args[7] if len(args) > 7 else kwargs.get("step")
    return f"step {step + 1}" if isinstance(step, int) else "step"


def install(summary_path: str, max_entries: int, trace_path: str | None = None) -> None:
    """Wrap fitune's functions so the process that trains records (rank 0) and the ranks it launches run this file."""
    import fitune.parallel.launch as launch_mod
    import fitune.runtime.device as device_mod
    import fitune.runtime.model as model_mod
    import fitune.train.loop as loop_mod

    recorder = _Recorder(summary_path, max_entries, trace_path)
    main_rank = os.environ.get("RANK", "0") == "0"

    def ranks_run_this_file(command):
        def call(*args, **kwargs):
            cmd = command(*args, **kwargs)
            if cmd[5:7] != ["-m", "fitune"]:  # launch() runs cmd[5:] with the interpreter
                raise RuntimeError(f"fitune.parallel.launch.command changed shape ({cmd}); update "
                                   "bench/_with_memory_history.py to run its ranks through this file")
            return cmd[:5] + [os.path.abspath(__file__), "--summary", summary_path, "--max-entries",
                              str(max_entries)] + (["--trace", trace_path] if trace_path else []) + ["--"] + cmd[7:]
        return call

    _wrap(launch_mod, "command", ranks_run_this_file)
    if not main_rank:
        return

    def then_record(configure):
        def call(*args, **kwargs):
            added = configure(*args, **kwargs)
            recorder.start()
            return added
        return call

    def then_summarize(train):
        def call(*args, **kwargs):
            error = None
            try:
                return train(*args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                recorder.finish(error)
        return call

    # fitune/train/loop.py bound configure_allocator by name and calls its own binding: wrapping only the defining
    # module's recorded nothing (bench/results/issue33/ballast_8bit/first: "no CUDA device")
    for module in (device_mod, loop_mod):
        _wrap(module, "configure_allocator", then_record)
    _wrap(loop_mod, "train", then_summarize)
    _wrap(model_mod, "build_model_for_setup", _marked(recorder, "build_model"))
    _wrap(model_mod, "prepare_model", _marked(recorder, "prepare_model"))
    _wrap(loop_mod, "_optimizer_step", _marked(recorder, _step_label))
    _wrap(loop_mod, "_write_outputs", _marked(recorder, "write outputs"))
    try:
        import fitune.parallel.deepspeed_engine as ds_mod

        _wrap(ds_mod, "initialize", _marked(recorder, "deepspeed.initialize"))
    except ImportError:  # pragma: no cover - the module imports nothing heavy
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", required=True, help="where rank 0 writes the summary (JSON)")
    p.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES)
    p.add_argument("--trace", help="also write rank 0's allocator history (gzip JSON, `write_trace`) here")
    p.add_argument("fitune_args", nargs=argparse.REMAINDER, help="-- then fitune's arguments: train run.yaml ...")
    args = p.parse_args(argv)
    fitune_args = args.fitune_args[1:] if args.fitune_args[:1] == ["--"] else args.fitune_args
    if not fitune_args:
        p.error("give fitune's arguments after --, e.g. -- train run.yaml --no-progress")
    install(args.summary, args.max_entries, args.trace)
    if os.environ.get(PROBE_ENV):  # a bench probe's child: also its gradient norm and host peaks, as bench/common.py
        return run_fitune_probed(fitune_args)
    from fitune.cli.main import main as fitune_main

    return fitune_main(fitune_args)


if __name__ == "__main__":
    from fitune.parallel.ranks import exit_process

    exit_process(main())  # a rank leaves as fitune/__main__.py leaves one
