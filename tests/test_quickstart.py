"""The CPU quick-start (docs/quickstart.md): `python -m fitune.train.quickstart FOLDER`, then
`fitune train FOLDER/run.yaml`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.mark.slow
def test_quickstart_writes_a_config_that_trains_on_the_cpu(tmp_path, monkeypatch, capfd):
    from fitune.cli.main import main
    from fitune.train.quickstart import main as quickstart

    folder = tmp_path / "demo"
    assert quickstart([str(folder)]) == 0
    assert quickstart([str(folder)]) == 2  # never writes over a folder that holds something
    monkeypatch.chdir(tmp_path)  # paths in run.yaml are absolute: it runs from anywhere
    html = tmp_path / "run.html"
    assert main(["train", str(folder / "run.yaml"), "--max-steps", "30", "--no-progress",
                 "--report-to", "tensorboard", "--html", str(html)]) == 0
    assert "Loading weights" not in capfd.readouterr().err  # --no-progress: transformers' bar is off too
    assert html.exists() and "<svg" in html.read_text()
    assert list((folder / "run" / "tensorboard").iterdir())  # the same scalars in TensorBoard's event files
    lines = [json.loads(x) for x in open(folder / "run" / "metrics.jsonl")]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5
    assert (folder / "run" / "adapter" / "adapter_config.json").exists()
