"""bench/alloc_history.py on an allocator history written by hand in bench/_with_memory_history.py's `--trace`
format: the room before each give-back, its free gaps and the blocks on either side, the phase, and the request
that needed the room (issue 33's retries)."""

from __future__ import annotations

import gzip
import json
import os

from bench._with_memory_history import write_trace
from bench.alloc_history import border_counts, give_backs, main, model_replay, open_trace, peak_room, size_label

MIB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# [action, addr, size, stream, time_us], as write_trace keeps them
EVENTS = [
    ["segment_map", 0, 64 * MIB, 0, 10],
    ["segment_map", 64 * MIB, 36 * MIB, 0, 11],  # adjacent: one range of 100 MiB
    ["alloc", 0, 30 * MIB, 0, 20],
    ["alloc", 30 * MIB, 40 * MIB, 0, 21],
    ["alloc", 70 * MIB, 20 * MIB, 0, 22],
    ["free_requested", 30 * MIB, 40 * MIB, 0, 30],
    ["free_completed", 30 * MIB, 40 * MIB, 0, 31],
    ["segment_unmap", 30 * MIB, 40 * MIB, 0, 40],  # a retry gives back the gap and the free tail
    ["segment_unmap", 90 * MIB, 10 * MIB, 0, 41],
    ["alloc", 90 * MIB, 50 * MIB, 0, 42],
]
MARKS = [[0, "load"], [35, "step 2"]]


def test_each_give_back_reports_the_room_its_gaps_the_phase_and_the_request():
    (r,) = give_backs(EVENTS, MARKS, top=8)
    assert (r["event"], r["phase"], r["mapped_bytes"], r["allocated_bytes"]) == (7, "step 2", 100 * MIB, 50 * MIB)
    assert r["free_bytes"] == 50 * MIB and r["gaps"] == 2 and r["given_back_bytes"] == 50 * MIB
    assert r["request_bytes"] == 50 * MIB and not r["oom"]
    big, tail = r["largest_gaps"]
    assert big == {"bytes": 40 * MIB, "address": 30 * MIB, "below": "30.00 MiB", "above": "20.00 MiB"}
    assert tail == {"bytes": 10 * MIB, "address": 90 * MIB, "below": "20.00 MiB", "above": None}
    assert border_counts([r])[0] == ("20.00 MiB", 2) and size_label(1536 * MIB) == "1,536.00 MiB"


def test_the_command_reads_write_traces_file_and_prints_a_line_per_give_back(tmp_path, capsys):
    path = tmp_path / "run.trace.json.gz"
    trace = [{"action": a, "addr": addr, "size": size, "stream": st, "time_us": t} for a, addr, size, st, t in EVENTS]
    write_trace(str(path), trace, [], [tuple(m) for m in MARKS])
    with gzip.open(path, "rt") as f:
        assert json.load(f)["events"] == EVENTS
    assert main([str(path), "--top", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and [g["bytes"] for g in lines[0]["largest_gaps"]] == [40 * MIB]
    assert lines[1]["peak_reserved"] and lines[1]["mapped_bytes"] == 100 * MIB
    assert lines[2] == {"summary": True, "give_backs": 1, "borders": [["30.00 MiB", 1], ["20.00 MiB", 1]]}


def test_the_room_at_the_peak_reserved_shows_where_the_free_bytes_sit():
    """Mapped bytes peak at 100 MiB after the second map; the room is taken once the request that needed it is
    served: 80 MiB live (30 + 40 + 10), a 20 MiB gap between the 40 and 10 MiB blocks after the 20 MiB one is freed."""
    events = [
        ["segment_map", 0, 80 * MIB, 0, 10],
        ["alloc", 0, 30 * MIB, 0, 20],
        ["alloc", 30 * MIB, 40 * MIB, 0, 21],
        ["alloc", 70 * MIB, 10 * MIB, 0, 22],
        ["free_completed", 30 * MIB, 40 * MIB, 0, 23],
        ["alloc", 30 * MIB, 20 * MIB, 0, 24],
        ["segment_map", 80 * MIB, 20 * MIB, 0, 30],
        ["alloc", 80 * MIB, 20 * MIB, 0, 31],  # the request that needed the new pages
        ["free_completed", 0, 30 * MIB, 0, 40],
    ]
    r = peak_room(events, [[0, "load"], [25, "step 1"]], top=4)
    assert (r["event"], r["phase"], r["mapped_bytes"], r["allocated_bytes"]) == (7, "step 1", 100 * MIB, 80 * MIB)
    assert r["request_bytes"] == 20 * MIB and r["free_bytes"] == 20 * MIB and r["gaps"] == 1
    assert r["largest_gaps"] == [{"bytes": 20 * MIB, "address": 50 * MIB, "below": "20.00 MiB", "above": "10.00 MiB"}]
    assert r["free_in_gaps_over_20mib_bytes"] == 0
    assert [x["size"] for x in r["live_by_size"]] == ["20.00 MiB", "30.00 MiB", "10.00 MiB"]  # largest total first
    assert r["live_by_size"][0] == {"size": "20.00 MiB", "count": 2, "bytes": 40 * MIB}
    assert peak_room([["alloc", 0, 1, 0, 1]]) is None


def test_model_replay_puts_the_runs_own_requests_through_the_estimators_allocator(tmp_path):
    """The model maps 20 MiB pages at the end of its range: 40 for the 30 MiB request (10 left free at the end), 40
    more for the 40 MiB one and 20 for the 20 MiB one (100 MiB, as the run). The 50 MiB request after the 40 MiB
    block's free fits neither that block nor the 10 MiB tail: the model maps 40 MiB more (140), where the run gave
    the gap and the tail back and mapped only what it needed (100: the model has no cap)."""
    r = model_replay(EVENTS)
    assert r["model_replay"] and r["model_peak_allocated_bytes"] == 100 * MIB  # 30 + 20 + 50
    assert (r["model_peak_reserved_bytes"], r["measured_peak_mapped_bytes"]) == (140 * MIB, 100 * MIB)
    assert r["model_over_measured"] == 1.4
    import lzma

    path = tmp_path / "t.json.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump({"events": EVENTS, "marks": MARKS}, f)
    assert open_trace(str(path))["events"] == EVENTS


def test_pytorch_rules_split_from_512_bytes_and_take_the_free_tail_last():
    """bench/expandable_rules.py's model against the estimator's: a 0.75 MiB rest is split off (the model as it is
    keeps it inside the block); an 8 MiB request takes a 10 MiB block freed below, not the 9 MiB free tail, which
    could grow (the model as it is takes the tail)."""
    from bench.expandable_rules import PyTorchRulesModel
    from fitune.memory.allocator import ExpandableAllocatorModel

    for cls, kept_inside in ((ExpandableAllocatorModel, True), (PyTorchRulesModel, False)):
        m = cls()
        m.malloc(1, 19 * MIB + MIB // 4)  # 20 MiB page: a 0.75 MiB rest
        assert (m._live[1].size == 20 * MIB) is kept_inside
    for cls, takes_hole in ((ExpandableAllocatorModel, False), (PyTorchRulesModel, True)):
        m = cls()
        m.malloc(1, 10 * MIB)
        m.malloc(2, 11 * MIB)  # the tail grows by a 20 MiB page: 19 MiB left
        m.malloc(3, 10 * MIB)  # 9 MiB left in the tail
        hole = m._live[1].offset
        m.release(1)  # a 10 MiB hole at the start
        m.malloc(4, 8 * MIB)  # the tail (9 MiB) is the smaller fit; the rules take the hole
        assert (m._live[4].offset == hole) is takes_hole
        assert m.reserved == 40 * MIB


def test_the_rules_trial_record_replays_from_the_committed_trace():
    """bench/results/issue33/ballast_8bit/rules_trial.json's replays, recomputed from the committed trace."""
    from bench.expandable_rules import PyTorchRulesModel

    folder = os.path.join(ROOT, "bench", "results", "issue33", "ballast_8bit")
    with open(os.path.join(folder, "rules_trial.json"), encoding="utf-8") as f:
        trial = json.load(f)
    events = open_trace(os.path.join(folder, "history", "fitune_23.4GiB_131072.trace.json.xz"))["events"]
    assert model_replay(events) == trial["model_now"]
    assert model_replay(events, PyTorchRulesModel) == trial["model_pytorch_rules"]
    assert trial["model_now"]["measured_peak_mapped_bytes"] == 24767365120
