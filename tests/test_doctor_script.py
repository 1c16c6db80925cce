"""`fitune doctor SCRIPT`: every rule against fixtures that plant it (and ones that must stay silent), JSON keys,
output order, exit codes, bad input."""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from fitune.cli.main import main
from fitune.doctor import check_source
from fitune.doctor.findings import JSON_KEYS
from fitune.doctor.rules import ALL_RULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "doctor", "scripts")
CLEAN = ["clean_trainer.py", "clean_loop.py"]
MARKER = re.compile(r"# expect: (.*)$")


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def expected_findings(path: str) -> set[tuple[str, int, str | None]]:
    """The `# expect: rule[:severity], ...` markers of a fixture, as (rule, line, severity)."""
    out = set()
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            m = MARKER.search(line)
            if m:
                for item in m.group(1).split(","):
                    rule, _, severity = item.strip().partition(":")
                    out.add((rule, line_no, severity or None))
    return out


def check(path: str):
    with open(path, encoding="utf-8") as f:
        return check_source(f.read(), path)


ALL_FIXTURES = sorted(f for f in os.listdir(FIXTURES) if f.endswith(".py"))


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixture_findings_are_exactly_its_markers(name):
    path = fixture(name)
    expected = expected_findings(path)
    findings = check(path)
    assert {(f.rule, f.line) for f in findings} == {(r, line) for r, line, _ in expected}
    for rule, line, severity in expected:
        if severity:
            assert [f.severity for f in findings if f.rule == rule and f.line == line] == [severity]


@pytest.mark.parametrize("rule", [r.id for r in ALL_RULES])
def test_every_rule_has_a_positive_and_a_negative_fixture(rule):
    positive, negative = fixture(f"{rule}.py"), fixture(f"{rule}_ok.py")
    assert os.path.exists(positive) and os.path.exists(negative)
    assert any(r == rule for r, _, _ in expected_findings(positive))
    assert expected_findings(negative) == set()


@pytest.mark.parametrize("name", CLEAN)
def test_clean_scripts_have_no_finding(name):
    assert check(fixture(name)) == []


def test_every_finding_carries_evidence_and_a_fix():
    for name in ALL_FIXTURES:
        for f in check(fixture(name)):
            assert f.severity in ("error", "warning", "info")
            assert f.message and f.fix and f.evidence
            # evidence is a measurement with its file, fitune's estimate, a source reference, or marked reasoned
            assert re.search(r"measured|fitune estimate|source:|reasoned \(not measured\)|computed from", f.evidence)


def test_measured_evidence_cites_the_measured_cases_through_the_docs():
    f = next(f for f in check(fixture("lora-all-linear.py")))
    assert "the HF recipe's measured runs (docs/accuracy.md), llama-3.1-8b:bf16 case 1 and 9" in f.evidence
    assert "bench/results" not in f.evidence
    assert "fitune estimate (its error against measured runs: docs/accuracy.md)" in f.evidence


def test_estimates_are_quoted_for_the_scripts_own_model():
    f = check(fixture("lora-bias.py"))[0]
    assert "qwen2.5-7b has 129,024 bias parameters" in f.evidence  # 28 layers x (3584 + 512 + 512) q/k/v biases


def test_full_finetune_of_an_unknown_model_is_only_info():
    src = ("import torch\nfrom transformers import AutoModelForCausalLM\n"
           "model = AutoModelForCausalLM.from_pretrained('./my-model', dtype=torch.bfloat16)\n"
           "opt = torch.optim.AdamW(model.parameters())\nmodel.train()\n"
           "for b in loader:\n    model(**b).loss.backward()\n")
    findings = [f for f in check_source(src) if f.rule == "full-finetune-adamw"]
    assert [(f.line, f.severity) for f in findings] == [(4, "info")]


def test_constants_and_argparse_defaults_are_resolved():
    src = ("import argparse\nfrom transformers import AutoTokenizer\np = argparse.ArgumentParser()\n"
           "p.add_argument('--max-len', type=int, default=64)\nargs = p.parse_args()\n"
           "tokenizer = AutoTokenizer.from_pretrained('x')\n"
           "ids = tokenizer('t', padding='max_length', truncation=True, max_length=args.max_len)\n")
    assert check_source(src) == []  # 64 tokens of padding is left alone
    assert [f.rule for f in check_source(src.replace("default=64", "default=4096"))] == ["pad-to-max-length"]


def test_reentrant_checkpoint_with_frozen_inputs_gives_no_gradient():
    """The fact rule checkpoint-reentrant rests on, checked on the CPU: reentrant checkpointing of a block whose
    input does not require grad computes no gradient for the trainable weights inside it."""
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    frozen, adapter = torch.nn.Linear(8, 8).requires_grad_(False), torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)  # a frozen embedding's output: requires_grad=False

    def block(h):
        return frozen(h) + adapter(h)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = checkpoint(block, x, use_reentrant=True)
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert adapter.weight.grad is not None


# ---- the command line ------------------------------------------------------------------------------------------
def test_json_keys_are_stable(capsys):
    from fitune.cli.doctor import SCRIPT_JSON_KEYS

    assert main(["doctor", fixture("fp16-instead-of-bf16.py"), "--json"]) == 0  # warnings only
    top = json.loads(capsys.readouterr().out)
    assert tuple(top) == SCRIPT_JSON_KEYS == ("script", "gpu", "setup", "estimate", "tokens_per_s", "fixes", "plan",
                                             "findings")
    doc = top["findings"]
    assert isinstance(doc, list) and len(doc) == 8
    assert all(tuple(d) == JSON_KEYS for d in doc)
    assert JSON_KEYS == ("rule", "line", "severity", "message", "fix", "evidence", "claims")
    assert {d["rule"] for d in doc} == {"fp16-instead-of-bf16"} and doc[0]["claims"] == ["C19"]
    assert [d["line"] for d in doc] == sorted(d["line"] for d in doc)


def test_error_findings_exit_1_and_print_blocks_sorted_by_line(capsys):
    assert main(["doctor", fixture("checkpoint-reentrant.py")]) == 1
    out = capsys.readouterr().out
    assert f"\n{fixture('checkpoint-reentrant.py')}: 3 findings (2 errors, 1 warning)\n" in out
    heads = re.findall(r"^\S+:(\d+): (error|warning|info) \[([a-z0-9-]+)\]", out, re.M)
    assert [(int(n), s, r) for n, s, r in heads] == [(10, "warning", "checkpoint-reentrant"),
                                                     (17, "error", "checkpoint-reentrant"),
                                                     (18, "error", "checkpoint-reentrant")]
    assert "  fix: use_reentrant=False" in out and "  evidence: source: torch/utils/checkpoint.py" in out


def test_clean_script_exits_0(capsys):
    assert main(["doctor", fixture("clean_trainer.py")]) == 0
    assert f"no findings ({len(ALL_RULES)} rules checked)" in capsys.readouterr().out
    assert main(["doctor", fixture("clean_trainer.py"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_list_rules(capsys):
    assert main(["doctor", "--list-rules"]) == 0
    out = capsys.readouterr().out
    assert all(r.id in out for r in ALL_RULES)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"def f(:\n    pass\n", "is not a Python script: invalid syntax at line 1"),
    (b"x = 1\ny = '\xff\xfe'\n", "is not UTF-8 text (line 2, byte offset 11)"),
])
def test_bad_script_exits_2_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "train.py"
    if content is not None:
        path.write_bytes(content)
    assert main(["doctor", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_folder_and_missing_argument_exit_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["doctor"]) == 2
    assert "nothing to check" in capsys.readouterr().err


def test_script_check_imports_no_torch():
    code = ("import sys, io, contextlib\nfrom fitune.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['doctor', {fixture('lora-all-linear.py')!r}])\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


@pytest.mark.slow
def test_trainer_without_labels_fails_as_the_rule_says_and_its_fix_trains(tmp_path):
    """What `trainer-without-labels` claims, run with transformers on the CPU (tiny Llama): the Trainer on tokenized
    text with a padding collator raises "no loss" at the first step (with its default collator it fails even
    earlier, stacking examples of different lengths); with the rule's fix (DataCollatorForLanguageModeling) the same
    step trains."""
    pytest.importorskip("torch")
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,
                              DataCollatorWithPadding, Trainer, TrainingArguments)

    from tests.tiny import make_model_folder

    folder = make_model_folder(str(tmp_path / "m"))
    tok = AutoTokenizer.from_pretrained(folder)
    ds = [dict(tok(text, truncation=True, max_length=32)) for text in ["the cat sat on the mat", "what is the sky"] * 4]

    def trainer(**kw):
        args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, save_strategy="no")
        return Trainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args, train_dataset=ds, **kw)

    with pytest.raises(ValueError, match="did not return a loss from the inputs"):
        trainer(data_collator=DataCollatorWithPadding(tok)).train()
    with pytest.raises(ValueError):  # the default collator cannot even stack examples of different lengths
        trainer().train()
    out = trainer(data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
    assert out.global_step == 1 and out.training_loss > 0
