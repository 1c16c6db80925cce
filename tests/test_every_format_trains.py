"""Issue 31: every data format `fitune train` reads trains the CPU quick-start model.

The quick start's tiny Llama (`python -m fitune.train.quickstart FOLDER`) learns its colour task ("what color is the
red cat" -> "the answer is red red red") in a few dozen LoRA steps. Here the same chats are written in each format
and file type of docs/data.md, and `fitune train FOLDER/run.yaml --set data.path=FILE` runs 40 steps on each. Each
run must name the format it detected, train the same number of records, and its loss must fall by the same margin
the quick-start test asks for.
"""

from __future__ import annotations

import csv
import json
import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from fitune.train.quickstart import COLOURS, THINGS  # noqa: E402

RECORDS = 128
STEPS = 40


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c, thing = rng.choice(COLOURS), rng.choice(THINGS)
        out.append((f"what color is the {c} {thing}", f"the answer is {c} {c} {c}"))
    return out


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _table(path, rows, delimiter) -> str:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def _write(kind: str, folder) -> str:
    """The colour chats as `kind`: (file, format name train reports)."""
    pairs = _pairs(RECORDS)
    if kind == "chat":
        return _jsonl(folder / "chat.jsonl", [{"messages": [{"role": "user", "content": q},
                                                           {"role": "assistant", "content": a}]} for q, a in pairs])
    if kind == "sharegpt":
        return _jsonl(folder / "sharegpt.jsonl", [{"system": "answer", "conversations": [
            {"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs])
    if kind == "alpaca":
        return _jsonl(folder / "alpaca.jsonl", [{"instruction": q, "input": "", "output": a} for q, a in pairs])
    if kind == "completion":
        return _jsonl(folder / "completion.jsonl", [{"prompt": q, "completion": " " + a} for q, a in pairs])
    if kind == "conversational_completion":
        return _jsonl(folder / "conv.jsonl", [{"prompt": [{"role": "user", "content": q}],
                                               "completion": [{"role": "assistant", "content": a}]} for q, a in pairs])
    if kind == "text":
        return _jsonl(folder / "text.jsonl", [{"text": f"{q} {a}"} for q, a in pairs])
    if kind == "csv":
        return _table(folder / "alpaca.csv", [{"instruction": q, "input": "", "output": a} for q, a in pairs], ",")
    if kind == "tsv":
        return _table(folder / "completion.tsv", [{"prompt": q, "completion": " " + a} for q, a in pairs], "\t")
    if kind == "txt":
        path = folder / "lines.txt"
        path.write_text("".join(f"{q} {a}\n" for q, a in pairs), encoding="utf-8")
        return str(path)
    raise AssertionError(kind)


CASES = [("chat", "chat"), ("sharegpt", "sharegpt"), ("alpaca", "alpaca"), ("completion", "completion"),
         ("conversational_completion", "conversational_completion"), ("text", "text"), ("csv", "alpaca"),
         ("tsv", "completion"), ("txt", "text")]


@pytest.fixture(scope="module")
def quickstart_folder(tmp_path_factory):
    from fitune.train.quickstart import main as quickstart

    folder = tmp_path_factory.mktemp("qs") / "demo"
    assert quickstart([str(folder)]) == 0
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("kind,detected", CASES, ids=[c[0] for c in CASES])
def test_every_format_trains_the_quickstart_model(kind, detected, quickstart_folder, tmp_path, capfd, caplog):
    from fitune.cli.main import main

    data = _write(kind, tmp_path)
    out_dir = tmp_path / "run"
    code = main(["train", str(quickstart_folder / "run.yaml"), "--no-progress", "--max-steps", str(STEPS),
                 "--set", f"data.path={data}", "--set", "data.eval_path=null", "--set", f"output_dir={out_dir}"])
    err = capfd.readouterr().err + caplog.text  # train's log line goes to stderr, or to caplog under pytest
    assert code == 0, err
    assert f"data: format {detected}; {RECORDS} examples" in err  # named in the output, every record kept
    lines = [json.loads(x) for x in open(out_dir / "metrics.jsonl")]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == STEPS
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < first - 0.5, (kind, first, last)  # it learnt: the quick-start test's margin
