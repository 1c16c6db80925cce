"""HTML reports without a browser: units, every kind rendered from real fitune output, every number shown equal
to the JSON it came from, self-containment, the CLI and its errors, the --html helper."""

import argparse
import json
import os
import re
from html import escape
from html.parser import HTMLParser

import pytest

from fitune.cli.main import main
from fitune.errors import FituneError
from fitune.report import KINDS, add_html_argument, load_document, maybe_write_html, read_run, render_html, write_html
from fitune.report.units import byte_unit, format_bytes, format_value, nice_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "fixtures", "doctor", "scripts")
PROFILE_GPU = os.path.join(ROOT, "bench", "results", "profile", "seeds_ckpt_uncapped.json")
PROFILE_OOM = os.path.join(ROOT, "bench", "results", "profile", "seeds_nockpt_capped_rtx4090.json")
GiB, MiB = 1024**3, 1024**2


# ---- shared with test_report_browser.py -------------------------------------------------------------------------


def resolve(docs: dict, key: str, doc: str | None = None):
    """The number a `data-key` names: a dotted path in docs[doc or "main"], or "A - B" of two such paths, each
    optionally prefixed "measured:" (fitune/report/html.py describes the convention)."""
    if " - " in key:
        a, b = key.split(" - ")
        return resolve(docs, a, doc) - resolve(docs, b, doc)
    if ":" in key:
        doc, key = key.split(":", 1)
    node = docs[doc or "main"]
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def check_marks(marks: list[dict], docs: dict) -> int:
    """Each mark {key, bytes, value, doc, text} equals what its key names in the documents; returns how many."""
    for m in marks:
        want = resolve(docs, m["key"], m.get("doc"))
        if m.get("bytes") is not None:
            assert int(m["bytes"]) == want, m
            if m.get("text"):  # the visible text is the same number, rounded to its unit
                t = re.match(r"^(-?[\d,]+(?:\.\d+)?) (B|KiB|MiB|GiB)\b", m["text"].strip())
                if t:
                    size = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB}[t.group(2)]
                    assert abs(float(t.group(1).replace(",", "")) * size - want) <= 0.006 * size, m
        else:
            assert float(m["value"]) == pytest.approx(float(want), rel=1e-12), m
    return len(marks)


def estimate_doc(*flags) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--json", *flags]) == 0
    return json.loads(buf.getvalue())


def plan_doc() -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--json"]) == 0
    return json.loads(buf.getvalue())


def doctor_doc(name: str = "checkpoint-reentrant.py") -> dict:
    from fitune.doctor import check_script

    path = os.path.join(SCRIPTS, name)
    findings = [f.to_dict() for f in check_script(path)]
    with open(path, encoding="utf-8") as f:
        return {"script": path, "source": f.read(), "findings": findings}


def write_run(folder, steps: int = 30, gpu: bool = True, partial_last_line: bool = False) -> str:
    """A run folder as `fitune train` writes it: metrics.jsonl with per-step lines and eval lines."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            line = {"step": s, "loss": 3.5 - 0.05 * s + 0.01 * (s % 3), "lr": 1e-4 * min(1, s / 5),
                    "tokens": 4096, "trained_tokens": 2000, "tokens_per_s": 9000.0 + 13 * s, "step_time_s": 0.45,
                    "micro_batch_size": 2 if s < 12 else 1, "grad_checkpointing": s >= 12,
                    "peak_allocated_bytes": (21 * GiB + s * MiB) if gpu else None,
                    "peak_reserved_bytes": (23 * GiB + s * MiB) if gpu else None}
            f.write(json.dumps(line) + "\n")
            if s % 10 == 0:
                f.write(json.dumps({"step": s, "eval_loss": 3.4 - 0.04 * s}) + "\n")
        if partial_last_line:
            f.write('{"step": 31, "loss": 1.')
    return str(folder)


class _Marks(HTMLParser):
    def __init__(self):
        super().__init__()
        self.marks, self.tags, self._open = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if "data-key" in a:
            self.marks.append({"key": a["data-key"], "bytes": a.get("data-bytes"), "value": a.get("data-value"),
                               "doc": a.get("data-doc"), "text": "", "tag": tag})
            self._open.append((tag, self.marks[-1]))
        else:
            self._open.append((tag, None))

    def handle_endtag(self, tag):
        while self._open:
            t, m = self._open.pop()
            if t == tag:
                break

    def handle_data(self, data):
        for t, m in reversed(self._open):
            if m is not None and t in ("span", "td", "text"):
                m["text"] += data
                break


def marks_of(html: str) -> _Marks:
    p = _Marks()
    p.feed(html)
    return p


# ---- units ------------------------------------------------------------------------------------------------------


def test_units_adapt_to_the_size():
    assert byte_unit(23 * GiB) == ("GiB", GiB)
    assert byte_unit(13 * MiB) == ("MiB", MiB)
    assert byte_unit(96 * 1024) == ("KiB", 1024)
    assert byte_unit(0) == ("B", 1)
    assert format_bytes(23614532096) == "21.99 GiB"
    assert format_bytes(13631488) == "13.00 MiB"
    assert format_bytes(98304) == "96.00 KiB"
    assert format_bytes(4) == "4 B" and format_bytes(0) == "0 B"
    assert format_bytes(-262144000) == "-250.00 MiB"
    assert format_bytes(512 * MiB, scale_bytes=2 * GiB) == "0.50 GiB"  # one unit for an axis
    assert format_bytes(None) == "n/a" and format_bytes(float("nan")) == "n/a"
    assert format_value(2824.9) == "2,825" and format_value(0.000125) == "0.000125" and format_value(None) == "n/a"


def test_ticks_are_round_and_cover_the_maximum():
    assert nice_ticks(43.3) == [0, 10, 20, 30, 40, 50]
    assert nice_ticks(2825) == [0, 1000, 2000, 3000]
    assert nice_ticks(0) == [0.0, 1.0]
    for top in (0.37, 7, 99, 1234.5):
        t = nice_ticks(top)
        assert t[0] == 0 and t[-1] >= top and len(t) <= 8


# ---- every kind, from real output ---------------------------------------------------------------------------------


def _render_and_check(kind, doc, **opts):
    html = render_html(kind, doc, **opts)
    docs = {"main": doc}
    if "measured" in opts:
        docs["measured"] = opts["measured"]
    p = marks_of(html)
    assert check_marks(p.marks, docs) > 0
    # self-contained: nothing to fetch when the page opens
    for tag, a in p.tags:
        assert tag not in ("link", "img", "iframe"), (tag, a)
        assert not (tag == "script" and "src" in a)
        for name in ("src", "href"):
            assert not str(a.get(name, "")).startswith(("http:", "https:", "//")), (tag, a)
    assert not re.search(r"url\((?!#)", html.replace("url(#fitune-hatch)", ""))
    assert "@import" not in html
    return html, p


def test_estimate_page_numbers_are_the_json():
    doc = estimate_doc()
    html, p = _render_and_check("estimate", doc)
    keys = {m["key"] for m in p.marks}
    for cat, v in doc["breakdown"].items():  # every category at the peak, in the bar or the table
        assert f"breakdown.{cat}" in keys or v == 0
    assert "gpu.allocator_budget_bytes" in keys and "peak_reserved_bytes" in keys
    assert {f"phases.{ph}.peak_allocated_bytes" for ph in doc["phases"]} <= keys
    assert {f"suggestions.{i}.peak_reserved_bytes" for i in range(len(doc["suggestions"]))} <= keys
    assert 'data-verdict="no"' in html  # without checkpointing the seeds' case does not fit
    assert "saved activations" in html and "tensors the forward keeps for the backward" in html  # what the term is


def test_estimate_beside_a_measured_profile():
    doc = estimate_doc("--grad-checkpointing", "full")
    with open(PROFILE_GPU) as f:
        measured = json.load(f)
    html, p = _render_and_check("estimate", doc, measured=measured)
    measured_keys = {m["key"] for m in p.marks if m["doc"] == "measured"}
    assert "breakdown.weights" in measured_keys and "peak_reserved_bytes" in measured_keys
    assert "measured (cuda)" in html and 'data-verdict="retries"' in html
    assert any(" - " in m["key"] for m in p.marks)  # the difference column


def test_plan_page_has_every_plan_and_one_detail_open():
    doc = plan_doc()
    html, p = _render_and_check("plan", doc)
    n = len(doc["plans"])
    assert n >= 2
    assert len(re.findall(r'<tr class="plan-row"', html)) == n
    assert len(re.findall(r'<section class="plan-detail', html)) == n
    assert len(re.findall(r'<section class="plan-detail[^>]*hidden', html)) == n - 1
    keys = {m["key"] for m in p.marks}
    for i in range(n):
        assert {f"plans.{i}.trained_tokens_per_s", f"plans.{i}.peak_reserved_bytes", f"plans.{i}.breakdown.weights"} <= keys
    for i, r in enumerate(doc["rejected"]):
        assert f"rejected.{i}.peak_allocated_bytes" in keys
        assert escape(r["message"]) in html
    for t in doc["plans"][0]["turns_on"]:
        assert escape(t) in html


def test_profile_page_measured_against_estimated():
    with open(PROFILE_GPU) as f:
        doc = json.load(f)
    html, p = _render_and_check("profile", doc)
    keys = {m["key"] for m in p.marks}
    assert {"breakdown.weights", "estimate.breakdown.weights", "peak_allocated_bytes", "tokens_per_s", "mfu"} <= keys
    assert "breakdown.saved_activations - estimate.breakdown.saved_activations" in keys


def test_profile_page_explains_an_oom():
    with open(PROFILE_OOM) as f:
        doc = json.load(f)
    html, p = _render_and_check("profile", doc)
    assert 'data-verdict="oom"' in html
    keys = {m["key"] for m in p.marks}
    assert {"oom.requested_bytes", "oom.live_bytes", "oom.live_by_category.weights", "oom.top_sources.0.bytes"} <= keys


def test_profile_page_draws_the_timeline_when_the_document_has_one():
    with open(PROFILE_GPU) as f:
        doc = json.load(f)
    doc["timeline"] = [[0.01 * i, ("forward", "backward", "optimizer")[i // 40 % 3], (15 + (i % 40) / 8) * GiB]
                       for i in range(240)]
    html, p = _render_and_check("profile", doc)
    assert "Memory over time" in html and 'data-band="backward"' in html
    assert sum(1 for m in p.marks if m["key"].startswith("timeline.")) == 240


def profile_timeline_doc(points: int = 2000, split: bool = False) -> dict:
    """The seeds' GPU profile with a timeline as `fitune profile --json` prints it on CUDA (a made-up shape); `split`:
    each sample split by category and the estimate's replayed tape beside it, as fitune writes them now."""
    with open(PROFILE_GPU) as f:
        doc = json.load(f)
    phases = ("forward", "backward", "optimizer")
    doc["timeline"] = []
    for i in range(points):
        live = int((10 + 5 * (i % 400) / 400) * GiB)
        doc["timeline"].append({"t_s": round(0.0005 * i, 6), "phase": phases[i * 9 // points % 3], "live_bytes": live,
                                "allocated_bytes": live + 300 * MiB, "reserved_bytes": 16 * GiB + (i // 400) * 256 * MiB})
        if split:
            acts = (live - 10 * GiB) * 2 // 3
            doc["timeline"][-1]["breakdown"] = {
                "weights": 10 * GiB - 64 * MiB, "adapter_weights": 64 * MiB, "gradients": 0, "optimizer_states": 0,
                "saved_activations": acts, "logits_and_loss": 0, "transients": live - 10 * GiB - acts, "workspaces": 0}
    if split:
        doc["estimate"]["timeline"] = [
            {"event": 10 * j, "phase": phases[j * 3 // 300], "label": f"t{j}", "allocated_bytes": (10 * GiB + j * 10 * MiB),
             "breakdown": {"weights": 10 * GiB, "transients": j * 10 * MiB}} for j in range(300)]
    return doc


def test_profile_page_stacks_the_categories_and_lays_the_tape_over_the_last_step():
    doc = profile_timeline_doc(split=True)
    html, p = _render_and_check("profile", doc)
    for name in ("weights", "adapter weights", "saved activations", "transients"):
        assert f'class="area" data-series="{name}"' in html
    assert 'data-series="gradients"' not in html  # a category that stays empty is not drawn
    assert 'data-series="estimate (replayed tape)"' in html and 'data-series="live tensors"' not in html
    keys = {m["key"] for m in p.marks}
    assert "timeline.0.breakdown.weights" in keys and "estimate.timeline.299.allocated_bytes" in keys


def test_tape_lands_on_the_last_step_phase_by_phase():
    from fitune.report.profile import tape_over_time

    rows = [(0.0, "idle"), (1.0, "forward"), (2.0, "forward"), (3.0, "backward"), (5.0, "backward"),
            (6.0, "optimizer"), (6.5, "idle"), (7.0, "forward"), (8.0, "backward"), (10.0, "optimizer"), (11.0, "idle")]
    tape = [{"event": 0, "phase": "forward"}, {"event": 4, "phase": "forward"}, {"event": 5, "phase": "backward"},
            {"event": 7, "phase": "backward"}, {"event": 9, "phase": "backward"}, {"event": 10, "phase": "optimizer"}]
    assert tape_over_time(rows, tape) == [(7.0, 0), (8.0, 1), (8.0, 2), (9.0, 3), (10.0, 4), (10.0, 5)]
    # SGD: the tape has no optimizer run; the measured optimizer run is left aside
    assert tape_over_time(rows, tape[:5]) == [(7.0, 0), (8.0, 1), (8.0, 2), (9.0, 3), (10.0, 4)]
    # two micro-batches on the tape, one in the measurement: nothing is drawn rather than a wrong overlay
    assert tape_over_time(rows[:6], tape[:2] + tape[2:3] + tape[:2] + tape[2:3]) == []


def test_profile_page_draws_allocated_and_reserved_from_the_json_timeline():
    doc = profile_timeline_doc()
    html, p = _render_and_check("profile", doc)
    assert "Memory over time" in html and "memory over time" in html
    for name in ("live tensors", "allocated", "reserved"):
        assert f'data-series="{name}"' in html
    keys = {m["key"] for m in p.marks}
    assert {"timeline.0.live_bytes", "timeline.0.allocated_bytes", "timeline.1999.reserved_bytes"} <= keys
    assert html.count('data-band="forward"') == 3  # three steps: each phase run is one band


def test_train_page_charts_every_step(tmp_path):
    run = write_run(tmp_path / "run", partial_last_line=True)  # a line being written is skipped
    doc = read_run(run)
    assert len(doc["steps"]) == 30 and len(doc["evals"]) == 3 and doc["finished"] is False
    html, p = _render_and_check("train", doc, refresh_s=30)
    assert '<meta http-equiv="refresh" content="30">' in html
    keys = {m["key"] for m in p.marks}
    assert {f"steps.{i}.loss" for i in range(30)} <= keys
    assert {f"evals.{i}.eval_loss" for i in range(3)} <= keys
    assert {f"steps.{i}.peak_reserved_bytes" for i in range(30)} <= keys
    assert "the OOM guard re-planned" in html
    os.makedirs(tmp_path / "run" / "adapter")
    assert read_run(run)["finished"] is True


def test_train_page_of_a_cpu_run_says_memory_was_not_recorded(tmp_path):
    html, _ = _render_and_check("train", read_run(write_run(tmp_path / "cpu", steps=5, gpu=False)))
    assert "not recorded" in html and "refresh" not in html


def test_doctor_page_puts_findings_on_their_lines():
    doc = doctor_doc()
    html, p = _render_and_check("doctor", doc)
    assert doc["findings"] and any(f["severity"] == "error" for f in doc["findings"])
    for i, f in enumerate(doc["findings"]):
        # the finding follows its line of the script
        at = html.index(f'id="L{f["line"]}"')
        assert html.index(f'data-finding="{i}"') > at
        assert f"findings.{i}.line" in {m["key"] for m in p.marks}
    assert 'class="ln hit error"' in html


def test_doctor_page_escapes_the_script():
    doc = {"script": "x.py", "source": "print('<script>alert(1)</script>')\n", "findings": [
        {"rule": "r", "line": 1, "severity": "warning", "message": "<b>m</b>", "fix": "f", "evidence": "e", "claims": []}]}
    html = render_html("doctor", doc)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html and "<b>m</b>" not in html


def test_doctor_findings_list_alone_renders():
    findings = doctor_doc()["findings"]
    html = render_html("doctor", findings)
    assert html.count('class="finding ') == len(findings)


# ---- input, CLI, errors -----------------------------------------------------------------------------------------


def test_unknown_kind_is_an_error():
    with pytest.raises(FituneError, match="unknown report 'nope'"):
        render_html("nope", {})


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FituneError, match="no such file"):
        load_document("estimate", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("llama-3.1-8b: lora r8 ...")
    with pytest.raises(FituneError, match="is not JSON"):
        load_document("plan", str(bad))
    est = tmp_path / "est.json"
    est.write_text(json.dumps(estimate_doc()))
    with pytest.raises(FituneError, match=r"looks like `fitune estimate --json`: run `fitune report estimate"):
        load_document("plan", str(est))
    with pytest.raises(FituneError, match="no metrics.jsonl"):
        read_run(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\nnot json\n{"step": 2, "loss": 1}\n')
    with pytest.raises(FituneError, match=r"metrics.jsonl:2: not JSON"):
        read_run(str(broken))


def test_cli_writes_each_kind(tmp_path, capsys, monkeypatch):
    est = tmp_path / "est.json"
    est.write_text(json.dumps(estimate_doc()))
    assert main(["report", "estimate", str(est)]) == 0
    assert (tmp_path / "est.html").exists() and "wrote" in capsys.readouterr().out
    assert main(["report", "estimate", str(est), "--measured", PROFILE_GPU, "-o", str(tmp_path / "m.html")]) == 0
    assert 'data-doc="measured"' in (tmp_path / "m.html").read_text()
    findings = tmp_path / "findings.json"
    findings.write_text(json.dumps(doctor_doc()["findings"]))
    script = os.path.join(SCRIPTS, "checkpoint-reentrant.py")
    assert main(["report", "doctor", str(findings), "--script", script, "-o", str(tmp_path / "d.html")]) == 0
    assert 'id="L1"' in (tmp_path / "d.html").read_text()
    run = write_run(tmp_path / "run")
    assert main(["report", "train", run]) == 0
    assert (tmp_path / "run" / "report.html").exists()
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(est.read_text()))
    monkeypatch.chdir(tmp_path)
    assert main(["report", "estimate", "-"]) == 0
    assert (tmp_path / "fitune-estimate.html").exists()


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["report", "estimate", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["report", "train", str(tmp_path / "nothing")]) == 2
    assert main(["report", "plan", PROFILE_GPU]) == 2
    err = capsys.readouterr().err
    assert "looks like `fitune profile --json`" in err
    assert main(["report", "plan", PROFILE_GPU, "--measured", PROFILE_GPU]) == 2
    assert "--measured goes with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "bogus", "x.json"])


def test_watch_stops_when_the_run_is_finished(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=3)
    os.makedirs(tmp_path / "run" / "adapter")
    assert main(["report", "train", run, "--watch", "1"]) == 0
    assert "refresh" not in (tmp_path / "run" / "report.html").read_text()


def test_html_flag_helper_for_other_commands(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("script", nargs="?")
    add_html_argument(parser)
    assert maybe_write_html(parser.parse_args([]), "estimate", {}) is None
    out = tmp_path / "e.html"
    assert maybe_write_html(parser.parse_args(["--html", str(out)]), "estimate", estimate_doc()) == str(out)
    assert out.read_text().startswith("<!DOCTYPE html>") and "wrote" in capsys.readouterr().err
    script = os.path.join(SCRIPTS, "checkpoint-reentrant.py")
    findings = doctor_doc()["findings"]
    maybe_write_html(parser.parse_args([script, "--html", str(tmp_path / "d.html")]), "doctor", findings)
    assert "The script, with the findings on their lines" in (tmp_path / "d.html").read_text()
    run = write_run(tmp_path / "run", steps=2)
    maybe_write_html(parser.parse_args(["--html", str(tmp_path / "t.html")]), "train", run)  # a run folder works too
    assert "steps.1.loss" in (tmp_path / "t.html").read_text()


def test_write_html_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "x.html"
    write_html("doctor", [], str(path))
    assert path.exists() and not [p for p in os.listdir(tmp_path / "sub") if ".tmp" in p]


def test_every_kind_is_a_cli_choice():
    assert KINDS == ("estimate", "plan", "profile", "train", "doctor")


def test_report_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, fitune.report, fitune.cli.report\n"
            "from fitune.report import render_html\n"
            "render_html('doctor', [])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("argv, kind", [
    (["estimate", "llama-3.1-8b", "--gpu", "rtx4090"], "estimate"),
    (["plan", "llama-3.1-8b", "--gpu", "rtx4090"], "plan"),
])
def test_commands_write_their_html_page(tmp_path, capsys, argv, kind):
    from fitune.cli.main import main

    out = tmp_path / f"{kind}.html"
    assert main(argv + ["--html", str(out)]) == 0
    assert "wrote" in capsys.readouterr().err
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") or "<html" in text[:200]
    assert "data-bytes" in text or "data-value" in text
