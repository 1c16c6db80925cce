"""The HTML reports in a real browser (headless Chromium driven by Playwright): no console errors, every number
shown equal to the JSON it came from, clicking a plan changes the view, hovering shows what a bar is, and nothing
is wider than a 1280 px window.

Skipped, with the reason, when Chromium or the playwright package is missing (`make test` installs both).
"""

import json
import os
import shutil

import pytest

from fitune.report import read_run, write_html

from test_report import (PROFILE_GPU, PROFILE_OOM, check_marks, doctor_doc, estimate_doc, plan_doc,
                         profile_timeline_doc, write_run)

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    for path in (os.environ.get("FITUNE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if path and os.path.exists(path):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium found (/usr/bin/chromium; `apt-get install chromium`, or set FITUNE_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing "
                                   "(pip install playwright; its browser download is not needed)")
    with sync_api.sync_playwright() as pw:
        # Playwright adds --headless and a fresh temporary --user-data-dir itself
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def open_page(browser, tmp_path):
    """open_page(kind, doc, **options) -> (page, errors): the report loaded from a file at 1280 x 900."""
    pages = []

    def _open(kind, doc, **options):
        path = tmp_path / f"{kind}.html"
        write_html(kind, doc, str(path), **options)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: errors.append(f"fetched {r.url}") if not r.url.startswith("file:") else None)
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        pages.append(page)
        return page, errors

    yield _open
    for p in pages:
        p.close()


def _marks(page) -> list[dict]:
    return page.eval_on_selector_all("[data-key]", """els => els.map(e => ({
        key: e.getAttribute('data-key'), bytes: e.getAttribute('data-bytes'), value: e.getAttribute('data-value'),
        doc: e.getAttribute('data-doc'),
        text: (e.tagName === 'SPAN' || e.tagName === 'text') ? e.textContent : ''}))""")


def _fits_1280(page) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 1280, f"the page is {width} px wide: it scrolls sideways in a 1280 px window"


def test_estimate_in_the_browser(open_page):
    doc = estimate_doc()
    page, errors = open_page("estimate", doc)
    assert check_marks(_marks(page), {"main": doc}) > 20
    assert errors == []
    _fits_1280(page)
    # hovering a bar segment shows its bytes and what the term is
    seg = page.locator('rect[data-category="saved_activations"]').first
    seg.hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    text = tip.text_content()
    assert "saved activations" in text and "21.03 GiB" in text and "forward keeps for the backward" in text


def test_estimate_with_measurement_in_the_browser(open_page):
    doc = estimate_doc("--grad-checkpointing", "full")
    with open(PROFILE_GPU) as f:
        measured = json.load(f)
    page, errors = open_page("estimate", doc, measured=measured)
    marks = _marks(page)
    assert check_marks(marks, {"main": doc, "measured": measured}) > 20
    assert any(m["doc"] == "measured" for m in marks)
    assert errors == []


def test_clicking_a_plan_shows_its_breakdown(open_page):
    doc = plan_doc()
    page, errors = open_page("plan", doc)
    assert check_marks(_marks(page), {"main": doc}) > 20
    assert errors == []
    _fits_1280(page)
    detail = page.locator(".plan-detail")
    assert detail.nth(0).is_visible() and not detail.nth(1).is_visible()
    page.locator('.plan-row[data-plan="1"] button').click()
    assert detail.nth(1).is_visible() and not detail.nth(0).is_visible()
    assert page.get_attribute('.plan-row[data-plan="1"]', "aria-selected") == "true"
    assert page.get_attribute('.plan-row[data-plan="0"]', "aria-selected") == "false"
    # the breakdown shown is plan 2's
    shown = page.locator('.plan-detail[data-plan="1"] [data-key="plans.1.breakdown.weights"]').get_attribute("data-bytes")
    assert int(shown) == doc["plans"][1]["breakdown"]["weights"]
    # clicking a plan's bar selects it too
    page.locator('g.bar[data-row="plan-2"] rect').first.click()
    assert detail.nth(2).is_visible() and not detail.nth(1).is_visible()


def test_profile_in_the_browser(open_page):
    for path in (PROFILE_GPU, PROFILE_OOM):
        with open(path) as f:
            doc = json.load(f)
        page, errors = open_page("profile", doc)
        assert check_marks(_marks(page), {"main": doc}) > 10
        assert errors == []
        _fits_1280(page)


def test_profile_timeline_in_the_browser(open_page):
    doc = profile_timeline_doc()
    page, errors = open_page("profile", doc)
    marks = _marks(page)
    assert check_marks(marks, {"main": doc}) > 1000  # up to 400 points of each of the three lines
    assert errors == []
    _fits_1280(page)
    chart = page.locator('figure.chart[data-chart="memory over time"]')
    assert chart.locator("g.series").count() == 3 and chart.locator("rect[data-band]").count() == 9


def test_profile_timeline_by_category_with_the_tape_in_the_browser(open_page, tmp_path):
    """A real CPU profile (`fitune profile --json`): the live bytes stacked by category, the estimate's replayed
    tape over the last step, every point's number the JSON's."""
    pytest.importorskip("torch")
    import contextlib
    import io

    from fitune.cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 1000, "max_position_embeddings": 512}))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["profile", str(cfg), "--device", "cpu", "--seq-len", "64", "--steps", "2", "--json"]) == 0
    for doc in (json.loads(buf.getvalue()), profile_timeline_doc(split=True)):
        page, errors = open_page("profile", doc)
        marks = _marks(page)
        assert check_marks(marks, {"main": doc}) > 300
        assert errors == []
        _fits_1280(page)
        chart = page.locator('figure.chart[data-chart="memory over time"]')
        assert chart.locator("g.area").count() >= 3
        tape = chart.locator('g.series[data-series="estimate (replayed tape)"] circle')
        assert tape.count() >= 100
        assert any(m["key"].startswith("estimate.timeline.") for m in marks)
        # hovering a point of the tape names it
        tape.last.hover()  # (points lie close together: the last one has none drawn over it)
        assert "estimate (replayed tape) at seconds" in page.locator("#tip").text_content()


def test_train_in_the_browser(open_page, tmp_path):
    doc = read_run(write_run(tmp_path / "run", steps=50))
    page, errors = open_page("train", doc, refresh_s=60)
    assert check_marks(_marks(page), {"main": doc}) >= 50 * 5
    assert errors == []
    _fits_1280(page)
    assert page.locator("figure.chart svg").count() == 4


def test_doctor_in_the_browser(open_page):
    doc = doctor_doc()
    page, errors = open_page("doctor", doc)
    assert check_marks(_marks(page), {"main": doc}) == len(doc["findings"])
    assert errors == []
    _fits_1280(page)
    for i, f in enumerate(doc["findings"]):  # each finding sits right under its line
        line_box = page.locator(f'#L{f["line"]}').bounding_box()
        box = page.locator(f'[data-finding="{i}"]').bounding_box()
        assert 0 <= box["y"] - (line_box["y"] + line_box["height"]) < 400
