"""Issue 31, the doctor's blind spots: notebooks, files that are not Python, numbers written as strings, a GradScaler
left unused, a bf16 model trained in fp16, Unsloth's loaders, and `--html` carrying the whole answer."""

import html as htmllib
import json
import re

import pytest

from fitune.cli.main import main
from fitune.doctor import check_source
from fitune.doctor.findings import JSON_KEYS
from fitune.doctor.notebook import read_notebook

ISSUE_SCRIPT = """\
import torch
from transformers import AutoModelForCausalLM, TrainingArguments
from unsloth import FastLanguageModel
model, tok = FastLanguageModel.from_pretrained('unsloth/llama-3-8b', max_seq_length=2048, load_in_4bit=True)
m2 = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', torch_dtype=torch.bfloat16)
args = TrainingArguments(output_dir='o', learning_rate="2e-4", fp16=True)
scaler = torch.cuda.amp.GradScaler()
for batch in loader:
    with torch.autocast('cuda', dtype=torch.float16):
        loss = m2(**batch).loss
    loss.backward()
    opt.step()
"""
ISSUE_CELL = ["from transformers import TrainingArguments\n",
              "args = TrainingArguments(output_dir='o', learning_rate='2e-4', fp16=True)"]


def notebook(cells: list[tuple[str, list[str] | str]]) -> str:
    return json.dumps({"cells": [{"cell_type": t, "metadata": {}, "source": src, **(
        {"outputs": [], "execution_count": None} if t == "code" else {})} for t, src in cells],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


ISSUE_NOTEBOOK = notebook([("markdown", ["# Fine-tune\n", "Install first."]),
                           ("code", ["!pip install -q transformers\n", "%matplotlib inline"]),
                           ("code", ISSUE_CELL)])


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["doctor", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def findings_of(source: str) -> set[tuple[str, int]]:
    return {(f.rule, f.line) for f in check_source(source)}


# ---- notebooks --------------------------------------------------------------------------------------------------
def test_issue_notebook_is_read_and_findings_are_located_by_cell_and_line(tmp_path, capsys):
    path = tmp_path / "train.ipynb"
    path.write_text(ISSUE_NOTEBOOK)
    code, out, err = run(capsys, path)
    assert code == 1 and "no findings" not in out and "Traceback" not in err
    assert f"{path}: cell 3, line 2: error [string-hyperparameter]" in out
    assert f"{path}: cell 3, line 2: warning [fp16-instead-of-bf16]" in out
    code, out, _ = run(capsys, path, "--json")
    doc = json.loads(out)
    got = {(f["rule"], f["cell"], f["line"], f["severity"]) for f in doc["findings"]}
    assert got == {("string-hyperparameter", 3, 2, "error"), ("fp16-instead-of-bf16", 3, 2, "warning")}
    assert all(tuple(f)[:len(JSON_KEYS)] == JSON_KEYS for f in doc["findings"])  # the stable keys, then `cell`


def test_notebook_magics_are_blanked_and_lines_keep_their_place():
    text = notebook([("code", "%%bash\npip install x\nls"),
                     ("code", "import torch\nif True:\n    !nvidia-smi\n%load_ext autoreload\nx = 1"),
                     ("raw", "not code"), ("code", ["y = 2"])])
    nb = read_notebook("n.ipynb", text)
    assert nb.source == "\n\n\nimport torch\nif True:\n    pass\n\nx = 1\ny = 2\n"
    assert [nb.where(n) for n in (1, 4, 8, 9)] == ["cell 1, line 1", "cell 2, line 1", "cell 2, line 5",
                                                   "cell 4, line 1"]
    assert nb.relabel("kept (line 8) until backward (lines 4, 5 and 9)") == (
        "kept (cell 2, line 5) until backward (cell 2, lines 1, 2 and cell 4, line 1)")


@pytest.mark.parametrize("content, message", [
    ('{"cells": [', r"train.ipynb is not a readable notebook: not JSON \(Expecting value at line 1, column 12\)"),
    ("[1, 2]", r"train.ipynb is JSON but not a Jupyter notebook"),
    ('{"worksheets": [], "nbformat": 3}', r"nbformat 3 notebook; fitune reads nbformat 4"),
    ('{"cells": [{"cell_type": "code", "source": 7}]}', r"cell 1's \"source\" is int, not text"),
    (notebook([("markdown", "# only prose")]), r"train.ipynb has no code cell: nothing to check"),
    (notebook([("markdown", "x"), ("code", "a = 1\ndef f(:\n")]),
     r"train.ipynb is not a notebook of Python code: invalid syntax at cell 2, line 2"),
])
def test_a_broken_notebook_exits_2_with_one_message(tmp_path, capsys, content, message):
    path = tmp_path / "train.ipynb"
    path.write_text(content)
    code, out, err = run(capsys, path)
    assert code == 2 and re.search(message, err) and "Traceback" not in err
    assert err.count("\n") == 1  # one message


def test_notebook_setup_fixes_and_json_name_cells(tmp_path, capsys):
    lines = ISSUE_SCRIPT.splitlines(keepends=True)
    path = tmp_path / "train.ipynb"
    path.write_text(notebook([("code", lines[:3]), ("markdown", "## load"), ("code", lines[3:6]),
                              ("code", lines[6:])]))
    code, out, _ = run(capsys, path)
    assert "as written (unsloth notebook):" in out
    assert re.search(r"^  seq len \(tokens\)\s+2048\s+cell 3, line 1\s+max_seq_length=2048", out, re.M)
    assert f"{path}: cell 4, line 1: error [grad-scaler-unused]" in out
    assert "(cell 4, line 3)" in out  # the autocast the scaler message points to, located in its cell
    code, out, _ = run(capsys, path, "--json")
    doc = json.loads(out)
    assert doc["setup"]["lines"]["seq_len_tokens"] == [1] and doc["setup"]["cells"]["seq_len_tokens"] == [3]
    for fix in doc["fixes"]:
        assert len(fix["cells"]) == len(fix["lines"]) and not re.search(r"\bline \d+:", " ".join(
            e for e in fix["edits"] if "cell" not in e))


# ---- what is not Python -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, message", [
    ("data.jsonl", '{"text":"hi"}\n',
     "data.jsonl is data, not a Python script: `fitune doctor --data {p} --tokenizer DIR` checks data"),
    ("data.json", '[{"text": "hi"}]', "data.json is data, not a Python script: `fitune doctor --data {p}"),
    ("data.csv", "text\nhi\n", "data.csv is data, not a Python script: `fitune doctor --data {p}"),
    ("data.parquet", "PAR1", "data.parquet is data, not a Python script: `fitune doctor --data {p}"),
    ("notes.txt", "hello world\n", "notes.txt is text (or plain-text data), not a Python script: "
                                   "`fitune doctor --data {p} --tokenizer DIR` checks a data file; `fitune doctor "
                                   "SCRIPT` reads a training script (.py) or a notebook (.ipynb)"),
    ("notes.txt", "hello\n", "notes.txt is text (or plain-text data), not a Python script"),  # "hello" parses
    ("README.md", "# Train\n", "README.md is Markdown, not a Python script: `fitune doctor SCRIPT` reads a "
                               "training script (.py) or a notebook (.ipynb)"),
    ("config.yaml", "model: llama-3.1-8b\n", "config.yaml is a YAML config, not a Python script: `fitune estimate "
                                             "--config {p}` estimates the setup it describes and `fitune train {p}` "
                                             "runs it"),
])
def test_a_file_that_is_not_python_exits_2_with_one_message(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    code, out, err = run(capsys, path)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"fitune doctor: error: {tmp_path}/{message.format(p=path)}")
    assert err.count("\n") == 1


def test_a_script_that_does_not_parse_names_both_commands(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text("def f(:\n")
    code, _, err = run(capsys, path)
    assert code == 2 and (f"{path} is not a Python script: invalid syntax at line 1; `fitune doctor SCRIPT` reads a "
                          "training script (.py) or a notebook (.ipynb); `fitune doctor --data FILE --tokenizer DIR` "
                          "checks data") in err


# ---- the issue's script -----------------------------------------------------------------------------------------
def test_issue_script_findings(tmp_path, capsys):
    path = tmp_path / "s.py"
    path.write_text(ISSUE_SCRIPT)
    code, out, err = run(capsys, path, "--json")
    assert code == 1 and "Traceback" not in err
    doc = json.loads(out)
    got = {(f["rule"], f["line"], f["severity"]) for f in doc["findings"]}
    assert got == {("string-hyperparameter", 6, "error"), ("fp16-instead-of-bf16", 6, "warning"),
                   ("fp16-on-bf16-model", 6, "warning"), ("grad-scaler-unused", 7, "error"),
                   ("fp16-instead-of-bf16", 9, "warning"), ("fp16-on-bf16-model", 9, "warning")}
    assert all(tuple(f) == JSON_KEYS for f in doc["findings"])  # a script's findings: no `cell` key
    by_rule = {f["rule"]: f for f in doc["findings"]}
    s = by_rule["string-hyperparameter"]
    assert s["message"].startswith("`learning_rate='2e-4'` in `TrainingArguments(...)` is a string where "
                                   "TrainingArguments expects a number")
    assert "AdamW raises TypeError: '<=' not supported between instances of 'float' and 'str'" in s["message"]
    assert s["fix"].startswith("write the number without quotes: learning_rate=2e-4")
    g = by_rule["grad-scaler-unused"]
    assert "never used" in g["message"] and "(line 9)" in g["message"] and "loss falls slowly" in g["message"]
    assert "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()" in g["fix"]
    assert "bf16" in g["fix"]
    b = [f for f in doc["findings"] if f["rule"] == "fp16-on-bf16-model" and f["line"] == 6][0]
    assert "line 5" in b["message"] and "Nothing raises" in b["message"] and "65504" in b["message"]
    assert doc["setup"]["method"] == "qlora" and doc["setup"]["lines"]["method"] == [4]


def test_unsloth_loaders_pick_their_dtype_and_read_as_lora():
    src = ("from unsloth import FastLanguageModel, FastModel\n"
           "model, tok = FastLanguageModel.from_pretrained('unsloth/llama-3-8b', max_seq_length=2048, "
           "load_in_4bit=True)\n"
           "model = FastLanguageModel.get_peft_model(model, r=32, target_modules=['q_proj', 'k_proj'])\n"
           "vlm, proc = FastModel.from_pretrained('unsloth/gemma-3-4b-it')\n"
           "trainer = SFTTrainer(model=model, train_dataset=ds)\n")
    assert "load-without-dtype" not in {r for r, _ in findings_of(src)}
    from fitune.doctor.script import index_source

    ss = index_source(src).script_setup
    assert (ss.setup.method, ss.setup.lora_rank, tuple(ss.setup.lora_targets)) == ("qlora", 32, ("q_proj", "k_proj"))
    assert ss.fields["lora_rank"].lines == (3,) and ss.fields["method"].lines == (2, 3)
    assert ss.fields["dtype"].why.startswith("Unsloth's dtype=None: bf16")
    fast_model = src.replace("FastLanguageModel.get_peft_model", "FastModel.get_peft_model").replace(
        "FastLanguageModel.from_pretrained", "FastModel.from_pretrained")
    assert index_source(fast_model).script_setup.setup.lora_rank == 32
    plain = "from transformers import AutoModelForCausalLM\nm = AutoModelForCausalLM.from_pretrained('x')\n"
    assert findings_of(plain) == {("load-without-dtype", 2)}  # transformers' loaders still warn


def test_a_4bit_load_without_adapter_is_estimated_as_qlora():
    src = ("from unsloth import FastLanguageModel\n"
           "model, tok = FastLanguageModel.from_pretrained('unsloth/llama-3-8b', load_in_4bit=True)\n"
           "model(**batch).loss.backward()\n")
    from fitune.doctor.script import index_source

    ss = index_source(src).script_setup
    assert ss.setup.method == "qlora"
    assert any("4-bit weights cannot train themselves" in n for n in ss.notes)


# ---- string hyper-parameters --------------------------------------------------------------------------------------
def test_string_hyperparameters_are_found_wherever_a_number_is_expected():
    src = ("import os, torch\nfrom peft import LoraConfig\nfrom transformers import TrainingArguments\n"
           "from trl import SFTConfig\nLR = '1e-4'\n"
           "a = TrainingArguments(output_dir='o', weight_decay='0.01', warmup_ratio='0.1')\n"
           "b = SFTConfig(output_dir='o', learning_rate=LR, max_length='2048')\n"
           "c = LoraConfig(lora_dropout='0.05')\n"
           "opt = torch.optim.AdamW(params, lr=os.environ['LR'], eps='1e-8')\n")
    findings = [f for f in check_source(src) if f.rule == "string-hyperparameter"]
    named = {f.line: re.findall(r"`(\w+=[^`]+)`", f.message.split(" in `")[0]) for f in findings}
    assert named == {6: ["weight_decay='0.01'", "warmup_ratio='0.1'"],  # one finding per line, both named
                     7: ["learning_rate=LR (= '1e-4')", "max_length='2048'"], 8: ["lora_dropout='0.05'"],
                     9: ["lr=os.environ['LR']", "eps='1e-8'"]}
    fixes = {f.line: f.fix for f in findings}
    assert fixes[7].startswith("write the number without quotes where LR is set: LR = 1e-4 (from a YAML file")
    assert fixes[7].endswith("; write the number without quotes: max_length=2048")
    assert fixes[9].startswith("convert it: lr=float(os.environ.get(...))")
    assert "yaml.safe_load reads 1e-8 as a string; write 1.0e-8 there" in fixes[9]
    assert "weight_decay: the first optimizer step raises TypeError" in findings[0].message
    assert all(f.severity == "error" for f in findings)


def test_strings_that_are_converted_or_belong_are_left_alone():
    src = ("import argparse\nfrom transformers import TrainingArguments\np = argparse.ArgumentParser()\n"
           "p.add_argument('--lr', type=float, default='2e-4')\nargs = p.parse_args()\n"
           "t = TrainingArguments(output_dir='o', learning_rate=args.lr, lr_scheduler_type='cosine', optim='adamw_torch',"
           " num_train_epochs=float('3'))\n")
    assert "string-hyperparameter" not in {r for r, _ in findings_of(src)}


def test_what_the_rule_says_a_string_learning_rate_and_rank_do(tmp_path):
    """The rule's evidence, re-run: transformers keeps learning_rate='2e-4' as a str and AdamW raises when the
    Trainer builds it; PEFT raises on r='16' when the adapters are made."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from fitune.doctor.rules.arguments import ADAM_CHECK, LORA_NUMBERS

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate="2e-4", use_cpu=True,
                                          report_to=[])
    assert args.learning_rate == "2e-4"  # nothing converts it
    trainer = transformers.Trainer(model=model, args=args)
    with pytest.raises(TypeError, match=re.escape(ADAM_CHECK.split("TypeError: ")[1])):
        trainer.create_optimizer()
    with pytest.raises(TypeError, match=re.escape(LORA_NUMBERS["r"].split("TypeError: ")[1].split(" (")[0])):
        peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r="16", target_modules=["q_proj"]))


# ---- GradScaler and fp16 on a bf16 model ----------------------------------------------------------------------------
LOOP = ("import torch\nmodel = build().cuda()\nopt = torch.optim.AdamW(model.parameters())\n{scaler}\n"
        "for batch in loader:\n    with torch.autocast('cuda', dtype={dtype}):\n        loss = model(**batch).loss\n"
        "    {backward}\n    opt.step()\n")


@pytest.mark.parametrize("scaler, dtype, backward, fires", [
    ("scaler = torch.cuda.amp.GradScaler()", "torch.float16", "loss.backward()", True),
    ("scaler = torch.amp.GradScaler('cuda')", "torch.float16", "scaler.scale(loss).backward()", True),  # no step
    ("scaler = torch.amp.GradScaler('cuda')", "torch.float16",
     "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()", False),
    ("scaler = torch.amp.GradScaler('cuda', enabled=False)", "torch.float16", "loss.backward()", False),
    ("scaler = torch.amp.GradScaler('cuda'); helper(scaler)", "torch.float16", "loss.backward()", False),
    ("scaler = torch.amp.GradScaler('cuda')", "torch.bfloat16", "loss.backward()", False),  # bf16 needs none
])
def test_grad_scaler_unused(scaler, dtype, backward, fires):
    findings = [f for f in check_source(LOOP.format(scaler=scaler, dtype=dtype, backward=backward))
                if f.rule == "grad-scaler-unused"]
    assert [f.line for f in findings] == ([4] if fires else [])


def test_what_the_rule_says_unscaled_fp16_gradients_underflow():
    """CPU check behind grad-scaler-unused: a float16 activation gradient of 1e-8 flushes to zero unless the fp32
    loss is multiplied by the scaler's initial scale (65536) first."""
    torch = pytest.importorskip("torch")
    import inspect

    init_scale = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
    assert init_scale == 2.0 ** 16
    w = torch.tensor(1e-4, dtype=torch.float16)
    grads = []
    for scale in (1.0, init_scale):
        x = torch.ones(1, dtype=torch.float16, requires_grad=True)
        loss = (x * w).sum().float() * 1e-4  # the loss is fp32, the activations fp16 (as under autocast)
        (loss * scale).backward()
        grads.append(x.grad.item())
    assert grads[0] == 0.0 and grads[1] == pytest.approx(6.55e-4, rel=1e-2)


def test_what_the_rule_says_fp16_amp_does_with_bf16_weights(tmp_path):
    """Source check behind fp16-on-bf16-model: TrainingArguments(fp16=True) asks accelerate for fp16 mixed
    precision, and the GradScaler unscales bf16 gradients without complaint (it refuses only float16 ones)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to=[])
    assert args.mixed_precision == "fp16"
    for dtype, raises in ((torch.bfloat16, False), (torch.float16, True)):
        p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale((p.float() * 2).sum()).backward()
        if raises:
            with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
                scaler.unscale_(opt)
        else:
            scaler.unscale_(opt)
            assert p.grad.dtype == torch.bfloat16 and p.grad.float().tolist() == [2.0] * 4


def test_fp16_on_bf16_model_needs_a_bf16_model():
    base = ("import torch\nfrom transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
            "m = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', dtype={dtype})\n"
            "args = TrainingArguments(output_dir='o', {flag}=True)\nTrainer(model=m, args=args).train()\n")
    rules = lambda dtype, flag: {r for r, _ in findings_of(base.format(dtype=dtype, flag=flag))}  # noqa: E731
    assert "fp16-on-bf16-model" in rules("torch.bfloat16", "fp16")
    assert "fp16-on-bf16-model" not in rules("torch.bfloat16", "bf16")
    assert "fp16-on-bf16-model" not in rules("torch.float32", "fp16")


# ---- --html ---------------------------------------------------------------------------------------------------------
def _numbers(page: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r'data-key="([^"]+)" data-bytes="(\d+)"', page)}


def test_html_carries_setup_estimate_verdict_and_ranked_fixes(tmp_path, capsys):
    path = tmp_path / "s.py"
    path.write_text(ISSUE_SCRIPT)
    out_html = tmp_path / "out.html"
    code, out, err = run(capsys, path, "--html", out_html, "--json")
    assert code == 1 and f"wrote {out_html}" in err
    doc = json.loads(out)
    page = out_html.read_text()
    est = doc["estimate"]
    assert est["fits"] is False and doc["fixes"]
    numbers = _numbers(page)
    for term, n_bytes in est["breakdown"].items():
        assert numbers[f"breakdown.{term}"] == n_bytes
    assert numbers["peak_reserved_bytes"] == est["peak_reserved_bytes"]
    assert 'data-verdict="no">DOES NOT FIT, headroom' in page
    first = doc["fixes"][0]
    assert htmllib.escape(first["change"], quote=True) in page
    assert numbers["fixes.0.peak_reserved_bytes"] == first["peak_reserved_bytes"]
    assert page.index('id="setup"') < page.index('id="estimate"') < page.index('id="fixes"') < page.index(
        'id="findings"')
    assert re.search(r'<tr data-field="method" data-assumed="false">.*?<b>qlora</b>.*?line 4', page)
    assert re.search(r'<tr data-field="seq_len_tokens" data-assumed="false">.*?<b>2048</b>', page)
    assert 'data-rule="string-hyperparameter"' in page and 'id="L6"' in page


def test_html_of_a_notebook_shows_its_cells(tmp_path, capsys):
    path = tmp_path / "train.ipynb"
    path.write_text(ISSUE_NOTEBOOK)
    out_html = tmp_path / "nb.html"
    assert run(capsys, path, "--html", out_html)[0] == 1
    page = out_html.read_text()
    assert 'id="cell2"' in page and 'id="cell3"' in page and 'id="cell1"' not in page  # code cells only
    hit = page.index('id="C3L2"')
    assert page.index('data-rule="string-hyperparameter"') > hit
    assert "No model load found, so no estimate" in page
