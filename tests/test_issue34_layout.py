"""Issue 34 (layout) and issue 35's doctor leftovers: the spine's data vocabulary below it, the preflight above it,
each doctor constant defined once, fix text without "line None", and one renderer for the doctor's HTML page
(`fitune doctor --html` and `fitune report doctor` draw the same sections)."""

import ast
import json
import os
import re
from collections import defaultdict

from fitune.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCTOR = os.path.join(ROOT, "fitune", "doctor")

NO_LOAD_SCRIPT = """\
from transformers import TrainingArguments
args = TrainingArguments(output_dir="o", per_device_train_batch_size=8, bf16=True)
"""
QLORA_SCRIPT = """\
import torch
from transformers import AutoModelForCausalLM, TrainingArguments
model = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', torch_dtype=torch.bfloat16)
args = TrainingArguments(output_dir='o', learning_rate="2e-4", per_device_train_batch_size=8)
"""


def _rank_script(r: int) -> str:
    return ("from peft import LoraConfig, get_peft_model\n"
            f"model = get_peft_model(model, LoraConfig(r={r}, lora_alpha={2 * r}, target_modules=['q_proj']))\n")


# ---- the spine's vocabulary, the preflight ---------------------------------------------------------------------
def test_the_data_vocabulary_is_defined_once_below_the_spine():
    from fitune import config, datasource
    from fitune.data import encode, formats, hub, read

    assert formats.FORMATS is datasource.FORMATS and formats.FORMAT_ALIASES is datasource.FORMAT_ALIASES
    assert read.SUFFIXES is datasource.SUFFIXES and read.data_path_problem is datasource.data_path_problem
    assert hub.is_hub_id is datasource.is_hub_id and hub.HUB_ID is datasource.HUB_ID
    assert encode.tokenizer_source_problem is datasource.tokenizer_source_problem
    assert config.DATA_FORMATS is datasource.FORMATS


def test_the_preflight_lives_above_the_spine_and_config_still_answers(tmp_path):
    from fitune import config
    from fitune.train import preflight

    data = tmp_path / "d.jsonl"
    data.write_text('{"nope": 1}\n')
    model = tmp_path / "m"
    model.mkdir()  # a model folder without config.json: the spine's own check
    cfg = config.TrainConfig(model=str(model), data=config.DataConfig(path=str(data), format="chat"), max_steps=1)
    problems = preflight.preflight_problems(cfg)
    assert any("without a config.json" in p for p in problems)  # fitune.config.source_problems
    assert any(str(data) in p for p in problems)  # the data peek (fitune.data), above the spine
    assert not hasattr(config, "preflight_problems")  # one place: the spine keeps no forwarder to it


# ---- the doctor's constants --------------------------------------------------------------------------------------
def _module_constants(folder: str) -> dict[str, list[str]]:
    """UPPER_CASE names assigned at module level -> the modules (relative paths) that assign them."""
    out: dict[str, list[str]] = defaultdict(list)
    for dirpath, _, files in os.walk(folder):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name) and t.id.isupper() and os.path.relpath(path, ROOT) not in out[t.id]:
                        out[t.id].append(os.path.relpath(path, ROOT))
    return out


def test_each_doctor_constant_is_defined_in_one_module():
    twice = {name: paths for name, paths in _module_constants(DOCTOR).items() if len(paths) > 1 and name != "RULES"}
    assert twice == {}, f"defined in several modules of fitune/doctor (define once, import elsewhere): {twice}"


def test_large_rank_is_one_threshold_for_the_rule_and_the_fixes():
    from fitune.doctor import check_source, evidence, fixes
    from fitune.doctor.rules import adapters

    assert fixes.LARGE_RANK is adapters.LARGE_RANK is evidence.LARGE_RANK == 64
    rules = lambda r: {f.rule for f in check_source(_rank_script(r), model="llama-3.1-8b")}  # noqa: E731
    assert "lora-rank-large" not in rules(64)
    assert "lora-rank-large" in rules(96)


# ---- fix text without "line None" ------------------------------------------------------------------------------
def test_fixes_name_no_missing_line(tmp_path, capsys):
    script = tmp_path / "noload.py"
    script.write_text(NO_LOAD_SCRIPT)
    assert main(["doctor", str(script), "--model", "llama-3.1-8b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    edits = [e for f in doc["fixes"] for e in f["edits"]]
    assert any("quantization_config=" in e for e in edits)  # the QLoRA fix, whose line is the (absent) model load
    assert not [e for e in edits if "line None" in e or "line ?" in e], edits
    assert main(["doctor", str(script), "--model", "llama-3.1-8b"]) == 0
    assert "line None" not in capsys.readouterr().out


# ---- one renderer ------------------------------------------------------------------------------------------------
def test_the_doctor_html_module_writes_no_markup_of_its_own():
    text = open(os.path.join(DOCTOR, "html.py"), encoding="utf-8").read()
    assert not re.search(r"<(h\d|div|table|tr|p|section|ol|li)\b", text)


def _sections(page: str) -> list[str]:
    return re.findall(r'<h2 id="([a-z]+)"', page)


def test_report_doctor_draws_what_doctor_html_draws(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text(QLORA_SCRIPT)
    live = tmp_path / "live.html"
    assert main(["doctor", str(script), "--html", str(live), "--json"]) == 1
    doc_path = tmp_path / "doc.json"
    doc_path.write_text(capsys.readouterr().out)
    reported = tmp_path / "rep.html"
    assert main(["report", "doctor", str(doc_path), "--script", str(script), "-o", str(reported)]) == 0
    live_page, report_page = live.read_text(), reported.read_text()
    assert _sections(live_page) == _sections(report_page) == ["setup", "estimate", "fixes", "plan", "findings"]
    for page in (live_page, report_page):
        assert re.search(r'data-verdict="(yes|no)"', page)
        assert 'data-key="fixes.0.peak_reserved_bytes"' in page
        assert 'data-rule="string-hyperparameter"' in page and 'id="L4"' in page
        assert re.search(r'<tr data-field="dtype" data-assumed="false">.*?<b>bf16</b>.*?line 3', page)
    # the live doctor adds why each stated field has its value (not in --json)
    assert "torch_dtype=torch.bfloat16" in re.search(r'<tr data-field="dtype".*?</tr>', live_page).group(0)


def test_report_doctor_of_a_findings_list_still_shows_only_the_findings():
    from fitune.report import render_html

    findings = [{"rule": "r", "line": 1, "severity": "warning", "message": "m", "fix": "f", "evidence": "e",
                 "claims": []}, {"rule": "q", "line": None, "severity": "info", "message": "m", "fix": "f",
                                 "evidence": "e", "claims": []}]
    page = render_html("doctor", {"script": "x.py", "source": "a = 1\n", "findings": findings})
    assert _sections(page) == [] and "The script, with the findings on their lines" in page
    assert page.index('id="L1"') < page.index('data-finding="0"')
    assert "Findings not on a line of the script" in page and "(the run)" in page


def test_report_doctor_of_an_edited_answer_names_what_is_wrong(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text(QLORA_SCRIPT)
    assert main(["doctor", str(script), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    doc["estimate"]["peak_reserved_bytes"] = "lots"
    doc["fixes"] = "none"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["report", "doctor", str(bad), "-o", str(tmp_path / "bad.html")]) == 2
    err = capsys.readouterr().err
    assert "not the unedited JSON of `fitune doctor SCRIPT --json`: fixes is str, not list" in err
