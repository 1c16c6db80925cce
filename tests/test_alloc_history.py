"""bench/alloc_history.py's `gaps` on a trace written by hand: the room before each give-back, its free gaps and
the blocks on either side, and the request that needed the room (issue 33's retries)."""

from __future__ import annotations

import json
import pickle

from bench.alloc_history import border_counts, frame_label, main, retries


def _frames(name: str, line: int) -> list[dict]:
    return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": f"/repo/fitune/runtime/techniques/{name}.py", "line": line, "name": name}]


TRACE = [
    {"action": "segment_map", "addr": 0, "size": 64},
    {"action": "segment_map", "addr": 64, "size": 36},  # adjacent: one range [0, 100)
    {"action": "alloc", "addr": 0, "size": 30, "frames": _frames("offload", 160)},
    {"action": "alloc", "addr": 30, "size": 40, "frames": _frames("tiled_mlp", 80)},
    {"action": "alloc", "addr": 70, "size": 20, "frames": _frames("lean_norm", 50)},
    {"action": "free_requested", "addr": 30, "size": 40},
    {"action": "free_completed", "addr": 30, "size": 40},
    {"action": "segment_unmap", "addr": 30, "size": 40},  # a retry gives back the gap and the free tail
    {"action": "segment_unmap", "addr": 90, "size": 10},
    {"action": "alloc", "addr": 90, "size": 50, "frames": _frames("offload", 170)},
]


def test_each_give_back_reports_the_room_its_gaps_and_the_request():
    (r,) = retries(TRACE, top=8)
    assert (r["event"], r["mapped_bytes"], r["allocated_bytes"], r["free_bytes"]) == (7, 100, 50, 50)
    assert r["gaps"] == 2 and r["given_back_bytes"] == 50 and r["request_bytes"] == 50 and not r["oom"]
    big, tail = r["largest_gaps"]
    assert big == {"bytes": 40, "address": 30, "below": "fitune/runtime/techniques/offload.py:160 offload",
                   "above": "fitune/runtime/techniques/lean_norm.py:50 lean_norm"}
    assert tail == {"bytes": 10, "address": 90, "below": "fitune/runtime/techniques/lean_norm.py:50 lean_norm",
                    "above": None}
    assert r["request"] == "fitune/runtime/techniques/offload.py:170 offload"
    assert border_counts([r])[0] == ("fitune/runtime/techniques/lean_norm.py:50 lean_norm", 2)


def test_frame_label_without_fitune_frames_and_without_frames():
    assert frame_label([]) == "?"
    assert frame_label([{"filename": "/x/torch/a.py", "line": 3, "name": "f"}]) == "/x/torch/a.py:3 f"


def test_the_gaps_command_prints_a_line_per_give_back_and_a_summary(tmp_path, capsys):
    path = tmp_path / "h.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [TRACE]}))
    assert main(["gaps", str(path), "--top", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["largest_gaps"]) == 1 and lines[0]["largest_gaps"][0]["bytes"] == 40
    assert lines[1]["summary"] and lines[1]["give_backs"] == 1
