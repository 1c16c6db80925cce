"""The README is an entry point whose every number comes from a record or a command (issue 34).

- the results block is `bench/readme_numbers.py`'s output, regenerated from bench/results/ and compared exactly;
- each command example's output is what the command prints now (on the CPU, catalog models: pure Python);
- every other number in the prose is recomputed here from a record or the catalog, or is a setup figure named in
  ALLOWED with why;
- the README stays an entry point: at most 250 lines, its links resolve, `make test` is its test command.
Nothing here asserts a sentence.
"""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from bench.readme_numbers import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_PATH = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- generated: bench/readme_numbers.py -->", "<!-- end generated -->"
MAX_LINES = 250

ALLOWED = {
    "4090": "the RTX 4090, the 24 GB card of the forum case (a card's name, not a measurement)",
}
"""Numbers the prose may hold without a record: setup figures, each with why."""

# a number standing alone: not inside a name (Llama-3.1-8B, rtx4090, fp32, q8_0, run4); "1.79x" and "128k" count
NUMBER = re.compile(r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)(?:x|k)?(?![\w])")


def _readme() -> str:
    with open(README_PATH, encoding="utf-8") as f:
        return f.read()


def _generated(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The README less its generated block and its fenced code blocks."""
    text = text[:text.index(BEGIN)] + text[text.index(END) + len(END):]
    return re.sub(r"^```[a-z]*\n.*?^```$", "", text, flags=re.S | re.M)


def _recomputed() -> dict[str, str]:
    """Each number the prose quotes, recomputed from its record (value -> where from)."""
    from fitune.specs import load_model_spec

    with open(os.path.join(ROOT, "bench", "results", "quickstart", "results.jsonl"), encoding="utf-8") as f:
        quickstart = [json.loads(x) for x in f if x.strip()][-1]  # the README quotes the last line
    out = {
        str(quickstart["cpu_cores"]): "quickstart: CPU cores",
        str(quickstart["train_steps"]): "quickstart: LoRA steps",
        str(quickstart["held_out_right"]): "quickstart: held-out answers in the persona",
        str(quickstart["held_out_prompts"]): "quickstart: held-out prompts",
        f"{quickstart['total_s']:.0f}": "quickstart: seconds to the chat answer",
        str(load_model_spec("llama-3.1-8b").vocab_size // 1000): "Llama-3.1's vocabulary, in thousands (128k)",
    }
    assert quickstart["held_out_right"] == quickstart["held_out_prompts"]  # the README says it answers all of them
    return out


def test_the_readme_is_an_entry_point_of_at_most_250_lines():
    assert len(_readme().splitlines()) <= MAX_LINES


def test_the_results_block_is_regenerated_from_the_records(capsys):
    """`python -m bench.readme_numbers` prints exactly what the README holds between the markers."""
    assert main([]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    assert _generated(_readme()) == printed, "run `python -m bench.readme_numbers` and paste its output"


def test_every_results_row_links_to_its_records_and_names_a_peer_of_its_call():
    rows = [line for line in _generated(_readme()).splitlines()
            if line.startswith("| ") and not line.startswith("| ---") and "measured on" not in line
            and "against measured peaks" not in line]
    assert rows
    for row in rows:
        links = re.findall(r"\]\((bench/results/[^)]*)\)", row)
        assert links, row
        assert all(os.path.exists(os.path.join(ROOT, link)) for link in links), row


def test_where_fitune_is_behind_the_table_says_so():
    """Issue 32: a row whose fitune figure is below its peer's says "behind"; none claims a lead it lacks."""
    for line in _generated(_readme()).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and re.match(r"\**[\d,]+", cells[1]) and cells[2][:1].isalpha() and "fits" not in cells[2] \
                and "out of memory" not in cells[2]:
            fitune = float(re.match(r"\**([\d,]+)", cells[1]).group(1).replace(",", ""))
            peer = float(re.findall(r"([\d,]{3,})", cells[2])[-1].replace(",", ""))
            assert ("behind" in cells[3]) == (fitune < peer), line


def _examples() -> list[tuple[str, list[str]]]:
    """The README's command examples: a fenced block whose first line is `$ fitune ...`, then its output."""
    out = []
    for block in _code_blocks(_readme()):
        lines = block.rstrip("\n").split("\n")
        if lines[0].startswith("$ fitune "):
            out.append((lines[0][2:], lines[1:]))
    return out


def test_every_pure_python_command_has_an_example():
    commands = {cmd.split()[1] for cmd, _ in _examples()}
    assert {"estimate", "plan", "doctor", "train", "profile"} <= commands


def _demo_folder(tmp_path, monkeypatch) -> str:
    """The train and profile examples' set-up, as the README says: `python -m fitune.train.quickstart demo` (a tiny random
    Llama and its data), run from tmp_path; returns the prefix its absolute paths print with."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from fitune.train.quickstart import main as quickstart

    monkeypatch.chdir(tmp_path)
    assert quickstart(["demo"]) == 0
    return f"{tmp_path}/"


@pytest.mark.parametrize("command,shown", _examples(), ids=[c.split()[1] for c, _ in _examples()])
def test_each_example_output_is_what_the_command_prints(command, shown, capsys, monkeypatch, tmp_path):
    """Every shown line is a line of the real output, in order; `...` stands for lines left out, and a block
    without `...` is the whole output."""
    from fitune.cli.main import main

    monkeypatch.chdir(ROOT)  # the doctor example names a file under tests/
    prefix = _demo_folder(tmp_path, monkeypatch) if command.split()[1] in ("train", "profile") else None
    capsys.readouterr()
    code = main(shlex.split(command)[1:])
    assert code == 0, command
    out = capsys.readouterr().out.rstrip("\n")
    printed = [line.rstrip() for line in (out.replace(prefix, "") if prefix else out).split("\n")]
    wanted = [line.rstrip() for line in shown]
    if not any(line.strip() == "..." for line in wanted):
        assert printed == wanted, f"{command}: run it and paste its output into the README"
        return
    position = 0
    for line in (w for w in wanted if w.strip() != "..."):
        assert line in printed[position:], f"{command}: now prints no line {line!r} here; paste its output"
        position = printed.index(line, position) + 1


def test_every_number_in_the_prose_is_recomputed_or_allowed():
    recomputed = _recomputed()
    found = [m.group(1) for m in NUMBER.finditer(_prose(_readme()))]
    assert found  # the prose does quote numbers; each is accounted for
    unaccounted = sorted({n for n in found if n not in recomputed and n not in ALLOWED})
    assert not unaccounted, f"numbers in the README's prose with no record: {unaccounted}"


PENDING_PAGES = {"docs/phases.md": "being written beside this change (every phase's memory and host RAM)"}
"""Pages the README links to before they land; once a page exists it is checked like any other link."""


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _readme()):
        assert os.path.exists(os.path.join(ROOT, target)) or target in PENDING_PAGES, target


def test_make_test_is_the_test_command():
    """CI (.ci/run) runs `make test`; the README names the same command."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "make test" in f.read()
    assert "make test" in _prose(_readme())
