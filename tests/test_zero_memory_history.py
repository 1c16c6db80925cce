"""bench/_with_memory_history.py: the allocator-history summary replayed from a synthetic trace, and the wrapper on the
CPU (`fitune train --gpus 2 --strategy zero3` over gloo: the ranks run through the wrapper, rank 0 writes a summary
that says nothing was recorded without CUDA)."""

import json
import os
import subprocess
import sys

import pytest

from bench._with_memory_history import summarize
from bench.trace_peak import live_at_peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trace() -> list[dict]:
    """Reserved 8 KiB, then blocks of 1 and 2 KiB; the live peak (4 KiB: 2048 + 1024 + 1024) is event 6, at t=31 us,
    in step 1; the reserved peak (12 KiB) is event 7."""
    def ev(t, action, addr=0, size=0):
        return {"time_us": t, "action": action, "addr": addr, "size": size}

    return [ev(10, "segment_alloc", 100, 8192),
            ev(11, "alloc", 1, 1024),
            ev(12, "alloc", 2, 2048),
            ev(20, "free_requested", 1, 1024),  # not a free yet: the block is live until free_completed
            ev(21, "free_completed", 1, 1024),
            ev(30, "alloc", 3, 1024),  # back to 3072: equal to the earlier peak, not above it
            ev(31, "alloc", 4, 1024),  # 4096: the peak
            ev(32, "segment_alloc", 200, 4096),
            ev(40, "free_completed", 4, 1024),
            ev(41, "segment_free", 200, 4096),
            ev(42, "free_completed", 99, 512)]  # a block allocated before recording: not in the replay


MARKS = [(5.0, "start"), (25.0, "step 1"), (35.0, "step 2")]


def test_summary_finds_the_peak_its_blocks_and_its_phase():
    trace = _trace()
    s = summarize(trace, MARKS, base_allocated_bytes=100, base_reserved_bytes=1000)
    assert s["peak_live_bytes"] == 100 + 4096 == 100 + live_at_peak(trace)[0]
    assert s["peak"] == {"event_index": 6, "time_us": 31, "seconds_after_start": 0.0, "phase": "step 1"}  # 21 us
    assert s["blocks_at_peak"] == 3
    # grouped by size, largest total first (a tie: the larger blocks first)
    assert s["live_at_peak_by_size"] == [{"size_bytes": 2048, "count": 1, "total_bytes": 2048},
                                         {"size_bytes": 1024, "count": 2, "total_bytes": 2048}]
    assert s["live_at_peak_other_sizes_bytes"] == 0
    assert s["peak_reserved_bytes"] == 1000 + 12288
    assert s["peak_reserved"]["event_index"] == 7 and s["peak_reserved"]["phase"] == "step 1"
    phases = {p["phase"]: p for p in s["phases"]}
    assert list(phases) == ["start", "step 1", "step 2"]
    assert phases["start"]["peak_live_bytes"] == 100 + 3072 and phases["start"]["events"] == 5
    assert phases["step 1"]["peak_live_bytes"] == 100 + 4096
    assert phases["step 2"] == {"phase": "step 2", "events": 3, "peak_live_bytes": 100 + 3072,
                                "peak_reserved_bytes": 1000 + 12288}
    assert s["trace_events"] == 11 and not s["trace_full"]
    assert len(json.dumps(s)) < 1_000_000


def test_summary_agrees_with_trace_peaks_replay_on_random_traces():
    """The same peak and the same blocks at it as `bench.trace_peak.live_at_peak` (which the summary does not call:
    it copies the live set at every new peak)."""
    import random

    rng = random.Random(7)
    for _ in range(20):
        trace, live, addr = [], [], 0
        for t in range(300):
            if live and rng.random() < 0.45:
                trace.append({"time_us": t, "action": "free_completed", "addr": live.pop(rng.randrange(len(live)))})
            else:
                addr += 1
                live.append(addr)
                trace.append({"time_us": t, "action": "alloc", "addr": addr, "size": 512 * rng.randint(1, 8)})
        s = summarize(trace, top=100)
        peak, blocks = live_at_peak(trace)
        assert s["peak_live_bytes"] == peak
        got = sorted(r["size_bytes"] for r in s["live_at_peak_by_size"] for _ in range(r["count"]))
        assert got == sorted(b["size"] for b in blocks)


def test_summary_keeps_the_largest_sizes_and_says_when_the_buffer_was_full():
    trace = [{"time_us": i, "action": "alloc", "addr": i, "size": 512 * (i + 1)} for i in range(50)]
    s = summarize(trace, max_entries=50, top=3)
    assert s["trace_full"]
    assert [r["size_bytes"] for r in s["live_at_peak_by_size"]] == [512 * 50, 512 * 49, 512 * 48]
    assert s["live_at_peak_other_sizes_bytes"] == sum(512 * (i + 1) for i in range(47))
    assert s["peak"]["phase"] is None and s["phases"] == []  # no marks: no phases


def test_summary_leaves_phases_out_when_the_clocks_disagree():
    """The trace's time_us is the allocator's clock converted to wall time; marks far from it are not trusted."""
    far = [(t + 1e12, label) for t, label in MARKS]
    s = summarize(_trace(), far)
    assert s["phases"] == [] and s["peak"]["phase"] is None and "phases left out" in s["phases_note"]
    assert s["peak_live_bytes"] == 4096  # the replay itself does not need the clock


def test_empty_trace():
    s = summarize([], MARKS)
    assert s["peak_live_bytes"] == 0 and s["peak"]["event_index"] is None and s["live_at_peak_by_size"] == []


def test_ranks_launched_by_fitune_run_through_the_wrapper(monkeypatch, tmp_path):
    """`fitune.parallel.launch.command` is rewritten so each rank runs the wrapper with the same summary path."""
    import fitune.parallel.deepspeed_engine as ds_mod
    import fitune.parallel.launch as launch_mod
    import fitune.runtime.device as device_mod
    import fitune.runtime.model as model_mod
    import fitune.train.loop as loop_mod
    from bench import _with_memory_history as wrapper

    for module, name in [(launch_mod, "command"), (device_mod, "configure_allocator"), (loop_mod, "train"),
                         (loop_mod, "configure_allocator"),
                         (model_mod, "build_model_for_setup"), (model_mod, "prepare_model"),
                         (loop_mod, "_optimizer_step"), (loop_mod, "_write_outputs"), (ds_mod, "initialize")]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setenv("RANK", "0")
    summary = str(tmp_path / "run.memory.json")
    wrapper.install(summary, 1000)
    cmd = launch_mod.command("/tmp/c.yaml", 2, resume=False, overwrite=False, progress=False)
    assert cmd[5:] == [os.path.abspath(wrapper.__file__), "--summary", summary, "--max-entries", "1000", "--",
                       "train", "/tmp/c.yaml", "--no-progress"]
    assert wrapper._step_label(*range(7), 4, None) == "step 5"


def test_recording_starts_where_the_training_loop_configures_the_allocator(monkeypatch, tmp_path):
    """fitune/train/loop.py calls its own binding of configure_allocator: the wrapper must start recording there
    (wrapping only fitune.runtime.device's recorded nothing on the GPU, 2026-12-07)."""
    import fitune.parallel.deepspeed_engine as ds_mod
    import fitune.parallel.launch as launch_mod
    import fitune.runtime.device as device_mod
    import fitune.runtime.model as model_mod
    import fitune.train.loop as loop_mod
    from bench import _with_memory_history as wrapper

    for module, name in [(launch_mod, "command"), (device_mod, "configure_allocator"), (loop_mod, "train"),
                         (loop_mod, "configure_allocator"),
                         (model_mod, "build_model_for_setup"), (model_mod, "prepare_model"),
                         (loop_mod, "_optimizer_step"), (loop_mod, "_write_outputs"), (ds_mod, "initialize")]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    started = []
    monkeypatch.setattr(wrapper._Recorder, "start", lambda self: started.append(self))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    wrapper.install(str(tmp_path / "run.memory.json"), 1000)
    setup = type("Setup", (), {"expandable_segments": False})()
    for module in (loop_mod, device_mod):
        module.configure_allocator(setup)
    assert len(started) == 2


def test_wrapper_on_cpu_ranks_writes_rank0_summary(tmp_path):
    """The whole path on the CPU: two gloo ranks of ZeRO-3 train through the wrapper; rank 0 writes the summary
    (nothing recorded: no CUDA) and the run's outputs are those of `fitune train`."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny import make_chat_data, make_model_folder, write_config

    model = make_model_folder(str(tmp_path / "model"))
    data = make_chat_data(str(tmp_path / "train.jsonl"), n=16)
    config = write_config(str(tmp_path / "run.yaml"), model=model, data={"path": data, "format": "chat"},
                          method="lora", lora={"rank": 4, "alpha": 8, "targets": ["q_proj"]}, seq_len=32,
                          batch_size=2, max_steps=2, lr=1e-3, dtype="fp32", output_dir=str(tmp_path / "out"))
    summary = str(tmp_path / "run.memory.json")
    env = {**os.environ, "FITUNE_CPU_RANKS": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "_with_memory_history.py"), "--summary", summary,
                          "--", "train", config, "--no-progress", "--gpus", "2", "--strategy", "zero3"],
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 2 steps" in run.stdout
    with open(summary) as f:
        s = json.load(f)
    assert s["rank"] == 0 and s["world_size"] == 2 and s["torchrun_rank"]  # written by rank 0, not the parent
    assert s["error"] is None and s["note"] == "no CUDA device: nothing recorded"
    assert os.path.isfile(tmp_path / "out" / "adapter" / "adapter_model.safetensors")


def test_recorder_glue_with_a_stand_in_for_cuda(monkeypatch, tmp_path):
    """`_Recorder` without a GPU: torch.cuda's calls stood in for. History without stacks (context None), free_requested
    skipped (or not, on a PyTorch without skip_actions), the snapshot of the current device summarised and written."""
    torch = pytest.importorskip("torch")
    from bench._with_memory_history import _Recorder

    calls = []

    def record(enabled="all", context=None, stacks="all", max_entries=0, **kw):
        if "skip_actions" in kw:
            raise TypeError("unexpected keyword argument 'skip_actions'")  # an older PyTorch
        calls.append({"enabled": enabled, "context": context, "max_entries": max_entries})

    trace = _trace()
    for name, value in [("is_available", lambda: True), ("memory_allocated", lambda: 100),
                        ("memory_reserved", lambda: 1000), ("synchronize", lambda: None),
                        ("current_device", lambda: 1), ("max_memory_allocated", lambda: 5),
                        ("max_memory_reserved", lambda: 6)]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [[], trace], "segments": []})
    rec = _Recorder(str(tmp_path / "s.json"), max_entries=11)
    rec.start()
    rec.marks = [(t, label) for t, label in MARKS]  # the stand-in trace's clock
    rec.finish(None)
    assert calls == [{"enabled": "all", "context": None, "max_entries": 11},
                     {"enabled": None, "context": None, "max_entries": 0}]
    with open(tmp_path / "s.json") as f:
        s = json.load(f)
    assert s["device"] == 1 and s["trace_full"] and s["peak_live_bytes"] == 100 + 4096
    assert s["peak"]["phase"] == "step 1" and s["end_allocated_bytes"] == 100


def test_the_trace_file_keeps_the_allocator_events_in_order_and_the_segments(tmp_path):
    """`--trace` (bench/_with_memory_history.py `write_trace`): the events an allocator model replays, in order, with
    their sizes and streams; the snapshot's own entries (`snapshot`) are left out."""
    import gzip

    from bench._with_memory_history import write_trace

    trace = [{"action": "segment_map", "addr": 0, "size": 2 << 20, "stream": 7, "time_us": 1.0},
             {"action": "alloc", "addr": 0, "size": 1024, "stream": 7, "time_us": 2.0},
             {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 3.0},
             {"action": "free_completed", "addr": 0, "size": 1024, "stream": 7, "time_us": 4.0}]
    segments = [{"address": 0, "total_size": 2 << 20, "allocated_size": 0, "stream": 7, "segment_type": "large"}]
    path = tmp_path / "run.trace.json.gz"
    write_trace(str(path), trace, segments, [(0.5, "start")])
    with gzip.open(path, "rt") as f:
        got = json.load(f)
    assert got["events"] == [["segment_map", 0, 2 << 20, 7, 1.0], ["alloc", 0, 1024, 7, 2.0],
                             ["free_completed", 0, 1024, 7, 4.0]]
    assert got["segments"] == [[0, 2 << 20, 0, 7, "large"]] and got["marks"] == [[0.5, "start"]]
