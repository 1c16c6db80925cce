"""Issue 18: no input gets a traceback.

A corpus of bad inputs, run through `fitune.cli.main.main` in-process, across every command (estimate, plan, train,
profile --device cpu, doctor, report). Each one must get one message that says what to do, naming the key, flag or
file it is about, and exit status 2 (or the documented code), never a traceback and never a hang. Then property-based
fuzzing (hypothesis) of train config YAML documents and of model config.json values, and a few subprocess runs
with a timeout as hang guards.

Most cases are generated: every model size key of a config.json x every kind of wrong JSON value, every key of the
`fitune train` YAML x the wrong values its schema rules out, every flag x text / negative / infinite values. Each
is one distinct bad input. The files a case needs are written by the case itself into its tmp_path.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from fitune.cli.main import main
from fitune.config import ALL_KEYS
from fitune.errors import ConfigError
from fitune.setup import SETUP_KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A tiny Llama as config.json: 2 layers, hidden 64, 4 heads (2 key/value heads).
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}

#: A training script `fitune doctor` reads (never runs): it loads a model whose config --model stands in for.
SCRIPT = """\
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
model = AutoModelForCausalLM.from_pretrained("my-org/private-model")
args = TrainingArguments(output_dir="out", per_device_train_batch_size=1)
Trainer(model=model, args=args).train()
"""

CHAT = json.dumps({"messages": [{"role": "user", "content": "what color is the sky"},
                                {"role": "assistant", "content": "blue"}]}) + "\n"


# ---- the harness ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One bad input: the command line, the files it needs, the exit status and the names its message must hold."""

    id: str
    argv: list
    files: dict = field(default_factory=dict)
    code: int = 2
    names: tuple = ()
    needs: tuple = ()
    """Fixtures beyond tmp_path: "model" (@MODEL@: a model folder with config.json and a tokenizer), "ro" (@RO@: a
    read-only folder; skipped where the tests run as root and permissions stop nothing)."""


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`fitune ARGV` in-process: (exit status, stdout, stderr). argparse's SystemExit is an exit status too."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_failure(code: int, out: str, err: str, expected_code: int = 2, names=()) -> None:
    text = out + err
    assert "Traceback" not in text, text
    assert code == expected_code, f"exit {code}, expected {expected_code}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    if expected_code == 2:
        assert "error" in err, f"no error message on stderr: {err!r} (stdout {out[-500:]!r})"
    for name in names:
        assert name in text, f"the message does not name {name!r}:\n{text[-3000:]}"


def _fill(value, subs: dict[str, str]):
    if isinstance(value, str):
        for k, v in subs.items():
            value = value.replace(k, v)
        return value
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    if isinstance(value, dict):
        return {_fill(k, subs): _fill(v, subs) for k, v in value.items()}
    return value


def write_files(files: dict, subs: dict[str, str]) -> None:
    import yaml

    for rel, content in files.items():
        path = _fill(rel, subs)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if content is DIR:
            os.makedirs(path, exist_ok=True)
            continue
        if isinstance(content, bytes):
            data = content
        elif isinstance(content, str):
            data = _fill(content, subs).encode("utf-8")
        elif path.endswith((".yaml", ".yml")):
            data = yaml.safe_dump(_fill(content, subs), sort_keys=False).encode("utf-8")
        else:
            data = json.dumps(_fill(content, subs)).encode("utf-8")
        with open(path, "wb") as f:
            f.write(data)


DIR = object()
"""A file entry that is a folder."""


# ---- shared fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """A model folder with config.json and a word-level tokenizer (no weights: every case fails before loading)."""
    from tests.tiny import make_tokenizer
    from fitune.train.synthetic import SPECIALS
    from tests.tiny import WORDS

    folder = str(tmp_path_factory.mktemp("tiny-model"))
    make_tokenizer(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY, "vocab_size": len(SPECIALS) + len(WORDS)}, f)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:  # never read: the cases fail before loading
        f.write(b"not weights")
    return folder


@pytest.fixture(scope="module")
def read_only_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("read-only")
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with open(folder / "probe", "w"):
            pass
    except OSError:
        yield str(folder)
    else:
        os.remove(folder / "probe")
        folder.chmod(stat.S_IRWXU)
        pytest.skip("running as root (or with CAP_DAC_OVERRIDE): a read-only folder does not stop writes here")
    folder.chmod(stat.S_IRWXU)


@pytest.fixture
def subs_for(tmp_path, request):
    def make(case: Case) -> dict[str, str]:
        subs = {"@D@": str(tmp_path), "@DATA@": str(tmp_path / "data.jsonl"), "@CFG@": str(tmp_path / "tiny.json"),
                "@SCRIPT@": str(tmp_path / "train.py")}
        if "model" in case.needs:
            subs["@MODEL@"] = request.getfixturevalue("model_folder")
        else:
            subs["@MODEL@"] = str(tmp_path / "tiny-model")
        if "ro" in case.needs:
            subs["@RO@"] = request.getfixturevalue("read_only_dir")
        base = {"@D@/data.jsonl": CHAT * 4, "@D@/tiny.json": TINY, "@D@/train.py": SCRIPT,
                "@D@/tiny-model/config.json": TINY, "@D@/tiny-model/model.safetensors": b"not weights",
                "@D@/m/model.safetensors": b"not weights"}
        write_files({k: v for k, v in base.items() if k not in case.files}, subs)
        write_files(case.files, subs)
        return subs

    return make


# ---- model config.json values ----------------------------------------------------------------------------------

SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size")
#: (id, the value as JSON text): every kind of JSON value that is not a size, and sizes no model has.
BAD_SIZES = (("nan", "NaN"), ("inf", "Infinity"), ("neg-inf", "-Infinity"), ("null", "null"), ("list", "[64]"),
             ("text", '"sixty-four"'), ("numeric-text", '"64"'), ("object", '{"value": 64}'), ("true", "true"),
             ("zero", "0"), ("negative", "-1"), ("fraction", "1.5"), ("1e12", "1e12"),
             ("huge-int", "1000000000000"), ("5000-digits", "9" * 5000))
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim")  # null means "the default" there: a valid value


def config_text(key: str, raw: str, base: dict | None = None) -> str:
    doc = dict(base or TINY)
    doc[key] = "@@V@@"
    return json.dumps(doc).replace('"@@V@@"', raw)


def _model_value_cases() -> list[tuple[str, str, str]]:
    """(id, config.json text, the name the message must hold)."""
    out = []
    for key in SIZE_KEYS:
        for vid, raw in BAD_SIZES:
            if vid == "null" and key in OPTIONAL_SIZE_KEYS:
                continue
            out.append((f"{key}={vid}", config_text(key, raw), "config.json" if vid == "5000-digits" else key))
    base = dict(TINY)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        doc = {k: v for k, v in base.items() if k != key}
        out.append((f"missing-{key}", json.dumps(doc), key))
    out += [
        ("missing-model_type", json.dumps({k: v for k, v in base.items() if k != "model_type"}), "model_type"),
        ("model_type=number", config_text("model_type", "5"), "model_type"),
        ("model_type=list", config_text("model_type", '["llama"]'), "model_type"),
        ("model_type=unknown", config_text("model_type", '"gpt-9000"'), "gpt-9000"),
        ("kv-heads-not-dividing", config_text("num_key_value_heads", "3"), "num_key_value_heads"),
        ("hidden-not-divisible-by-heads", config_text("hidden_size", "66"), "head_dim"),
        ("top-level-list", "[1, 2]", "JSON object"),
        ("top-level-text", '"llama"', "JSON object"),
        ("top-level-number", "5", "JSON object"),
        ("top-level-null", "null", "JSON object"),
        ("top-level-nan", "NaN", "JSON object"),
        ("empty-file", "", "config.json"),
        ("whitespace", "  \n\t ", "config.json"),
        ("truncated", '{"model_type": "llama", "hidden_size": 6', "config.json"),
        ("trailing-comma", '{"model_type": "llama",}', "config.json"),
        ("nested-lists-100k", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("nested-objects-50k", '{"a":' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
        ("text_config=list", json.dumps({"model_type": "gemma3", "text_config": [1]}), "text_config"),
        ("text_config=text", json.dumps({"model_type": "gemma3", "text_config": "x"}), "text_config"),
        ("gemma3-window-pattern-0", json.dumps({**base, "model_type": "gemma3_text", "sliding_window": 512,
                                                "sliding_window_pattern": 0}), "sliding_window_pattern"),
        ("qwen2-max-window-layers-text", json.dumps({**base, "model_type": "qwen2", "sliding_window": 512,
                                                     "use_sliding_window": True, "max_window_layers": "x"}),
         "max_window_layers"),
        ("mistral-sliding-window-text", json.dumps({**base, "model_type": "mistral", "sliding_window": "4k"}),
         "sliding_window"),
        ("mixtral-experts-negative", json.dumps({**base, "model_type": "mixtral", "num_local_experts": -1,
                                                 "num_experts_per_tok": 2}), "num_local_experts"),
        ("mixtral-experts-per-token-above", json.dumps({**base, "model_type": "mixtral", "num_local_experts": 8,
                                                        "num_experts_per_tok": 9}), "num_experts_per_tok"),
        ("qwen2_moe-mlp-only-layers-number", json.dumps({**base, "model_type": "qwen2_moe", "num_experts": 4,
                                                         "num_experts_per_tok": 2, "mlp_only_layers": 5}),
         "mlp_only_layers"),
        ("qwen2_moe-mlp-only-layers-text", json.dumps({**base, "model_type": "qwen2_moe", "num_experts": 4,
                                                       "num_experts_per_tok": 2, "mlp_only_layers": ["a"]}),
         "mlp_only_layers"),
        ("gemma2-softcapping-text", json.dumps({**base, "model_type": "gemma2", "attn_logit_softcapping": "x"}),
         "attn_logit_softcapping"),
        ("layer_types-number", json.dumps({**base, "layer_types": 5}), "layer_types"),
    ]
    return out


MODEL_VALUE_CASES = _model_value_cases()
#: The ones the issue names, also run through doctor --model and profile --device cpu.
ISSUE_MODEL_CASES = ("hidden_size=nan", "hidden_size=inf", "vocab_size=null", "num_hidden_layers=list",
                     "intermediate_size=text", "num_attention_heads=zero", "num_hidden_layers=1e12",
                     "vocab_size=negative", "missing-vocab_size", "hidden-not-divisible-by-heads",
                     "nested-lists-100k", "top-level-list")


def _model_cases() -> list[Case]:
    out = []
    for vid, text, name in MODEL_VALUE_CASES:
        files = {"@D@/m/config.json": text.encode("utf-8")}
        out.append(Case(f"estimate-config-{vid}", ["estimate", "@D@/m/config.json"], files, names=(name,)))
        out.append(Case(f"plan-config-{vid}", ["plan", "@D@/m", "--gpu", "24GiB"], files, names=(name,)))
        out.append(Case(f"train-config-{vid}", ["train", "@D@/run.yaml"],
                        {**files, "@D@/run.yaml": {"model": "@D@/m", "data": "@DATA@", "max_steps": 1,
                                                   "output_dir": "@D@/out"}}, names=(name,)))
        if vid in ISSUE_MODEL_CASES:
            out.append(Case(f"doctor-model-{vid}", ["doctor", "@SCRIPT@", "--model", "@D@/m/config.json"], files,
                            names=(name,)))
            out.append(Case(f"profile-cpu-{vid}", ["profile", "@D@/m/config.json", "--device", "cpu", "--steps", "1"],
                            files, names=(name,)))
    binary = {"@D@/m/config.json": bytes(range(256)) * 4}
    latin1 = {"@D@/m/config.json": '{"model_type": "llama", "name": "café"}'.encode("latin-1")}
    utf16 = {"@D@/m/config.json": json.dumps(TINY).encode("utf-16")}
    for cmd, argv in (("estimate", ["estimate", "@D@/m"]), ("plan", ["plan", "@D@/m", "--gpu", "rtx4090"]),
                      ("profile", ["profile", "@D@/m", "--device", "cpu"]),
                      ("doctor", ["doctor", "@SCRIPT@", "--model", "@D@/m"])):
        out += [
            Case(f"{cmd}-config-binary", argv, binary, names=("UTF-8",)),
            Case(f"{cmd}-config-latin1", argv, latin1, names=("UTF-8",)),
            Case(f"{cmd}-config-utf16", argv, utf16, names=("UTF-8",)),
            Case(f"{cmd}-folder-without-config", argv, {"@D@/m/weights.bin": b"x"}, names=("config.json",)),
            Case(f"{cmd}-config-json-is-a-folder", argv, {"@D@/m/config.json": DIR}, names=("config.json",)),
        ]
    for cmd, extra in (("estimate", []), ("plan", ["--gpu", "rtx4090"]), ("profile", ["--device", "cpu"])):
        out += [
            Case(f"{cmd}-unknown-model", [cmd, "llama-9000b", *extra], names=("llama-9000b", "--list-models")),
            Case(f"{cmd}-empty-model", [cmd, "", *extra], names=("MODEL",)),
            Case(f"{cmd}-missing-config-path", [cmd, "@D@/nope/config.json", *extra], names=("nope",)),
            Case(f"{cmd}-model-nul-byte", [cmd, "llama\x00-3.1-8b", *extra], names=("llama",)),
            Case(f"{cmd}-model-newline", [cmd, "llama-3.1-8b\nrm -rf /", *extra], names=("llama",)),
        ]
    out.append(Case("estimate-config-17MiB", ["estimate", "@D@/m/config.json"],
                    {"@D@/m/config.json": b'{"pad": "' + b"x" * (17 << 20) + b'"}'}, names=("too large",)))
    return out


# ---- train config YAML: files ------------------------------------------------------------------------------------

GOOD_TRAIN = {"model": "@MODEL@", "data": {"path": "@DATA@"}, "max_steps": 1, "output_dir": "@D@/out", "seq_len": 32,
              "batch_size": 1}


def _yaml_file_cases() -> list[Case]:
    """Whole-file problems, for every command that reads a config (train CONFIG, estimate/profile --config)."""
    good = "model: @MODEL@\ndata: @DATA@\nmax_steps: 1\noutput_dir: @D@/out\n"
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    files = {
        "binary": (bytes(range(256)) * 8, "binary"),
        "latin1": ("model: café\nlr: 1.0e-4\n".encode("latin-1"), "UTF-8"),
        "utf16-le": (good.encode("utf-16-le").join([b"\xff\xfe", b""]), "UTF-16"),
        "utf16-be": (b"\xfe\xff" + good.encode("utf-16-be"), "UTF-16"),
        "utf16-no-bom": (good.encode("utf-16-le"), "binary"),
        "empty": (b"", "empty"),
        "only-comments": (b"# nothing here\n", "empty"),
        "top-level-list": (b"- model: x\n- lr: 1\n", "mapping"),
        "top-level-text": (b"just some text\n", "mapping"),
        "top-level-number": (b"42\n", "mapping"),
        "tab-indented": (b"lora:\n\trank: 8\n", "YAML"),
        "unclosed-quote": (b'model: "abc\n', "YAML"),
        "duplicate-key": (good + "max_steps: 2\n", "twice"),
        "complex-key": (b"? [a, b]\n: 1\n", "plain name"),
        "python-tag": (b"model: !!python/object/apply:os.system ['echo hi']\n", "YAML"),
        "nested-9-levels": (b"a: {b: {c: {d: {e: {f: {g: {h: {i: {j: 1}}}}}}}}}\n", "nested"),
        "nested-flow-3k": (b"a: " + b"[" * 3_000 + b"]" * 3_000 + b"\n", "nested"),
        "billion-laughs": (laughs.encode(), "@D@"),
        "2MiB": (b"# " + b"x" * (2 << 20) + b"\n", "too large"),
        "nul-in-text": (b"model: a\x00b\n", "binary"),
    }
    out = []
    for fid, (content, name) in files.items():
        f = {"@D@/run.yaml": content}
        out.append(Case(f"train-yaml-{fid}", ["train", "@D@/run.yaml"], f, names=(name,)))
        out.append(Case(f"estimate-yaml-{fid}", ["estimate", "--config", "@D@/run.yaml"], f, names=(name,)))
        out.append(Case(f"profile-yaml-{fid}", ["profile", "--config", "@D@/run.yaml", "--device", "cpu"], f,
                        names=(name,)))
    for cmd in (["train", "@D@/cfgdir"], ["estimate", "--config", "@D@/cfgdir"]):
        out.append(Case(f"{cmd[0]}-config-is-a-folder", cmd, {"@D@/cfgdir": DIR}, names=("folder",)))
    for cmd in (["train", "@D@/missing.yaml"], ["estimate", "--config", "@D@/missing.yaml"],
                ["profile", "--config", "@D@/missing.yaml", "--device", "cpu"]):
        out.append(Case(f"{cmd[0]}-config-missing", cmd, names=("missing.yaml",)))
    out.append(Case("train-config-empty-path", ["train", ""], names=("empty",)))
    return out


# ---- train config YAML: one bad value per key ----------------------------------------------------------------------


def _set_dotted(doc: dict, dotted: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *outer, last = dotted.split(".")
    node = doc
    for part in outer:
        node = node.setdefault(part, {})
    node[last] = value
    return doc


def bad_values(k) -> list[tuple[str, object]]:
    """Values of a schema key that its kind, bounds and choices rule out."""
    out: list[tuple[str, object]] = []
    if k.kind in ("int", "float"):
        out += [("text", "abc"), ("bool", True), ("list", [1]), ("mapping", {"a": 1}), ("inf", math.inf),
                ("nan", math.nan)]
        if k.kind == "int":
            out.append(("fraction", 1.5))
        if k.minimum is not None:
            below = k.minimum if (k.exclusive_minimum and k.kind == "float") else k.minimum - 1
            out.append(("below-minimum", below))
        if k.maximum is not None:
            out.append(("above-maximum", int(k.maximum) * 10 + 1 if k.kind == "int" else k.maximum * 10))
    elif k.kind == "bool":
        out += [("quoted-true", "true"), ("number", 1), ("list", [True])]
    elif k.kind == "choice":
        out += [("unknown", "bogus-value"), ("number", 5), ("list", ["a"])]
    elif k.kind == "checkpointing":
        out += [("unknown", "bogus"), ("selective-text", "selective:abc"), ("number", 5), ("list", [1])]
    elif k.kind == "targets":
        out += [("number", 5), ("mapping", {"a": 1}), ("list-of-numbers", [1, 2])]
    elif k.kind == "names":
        out += [("unknown", "bogus"), ("number", 5), ("list-of-numbers", [1])]
    else:  # str
        out += [("number", 5), ("list", ["a"]), ("mapping", {"a": 1}), ("empty", ""), ("newline", "a\nb"),
                ("bool", True)]
    if not k.optional and k.kind != "bool":
        out.append(("null", None))
    return out


def _train_key_cases() -> list[Case]:
    out = []
    for k in ALL_KEYS:
        for vid, value in bad_values(k):
            doc = _set_dotted(GOOD_TRAIN, k.yaml, value)
            out.append(Case(f"train-key-{k.yaml}={vid}", ["train", "@D@/run.yaml"], {"@D@/run.yaml": doc},
                            names=(k.yaml,)))
    # The setup keys also through estimate --config and profile --config (one wrong type each).
    for k in SETUP_KEYS:
        vid, value = bad_values(k)[0]
        doc = _set_dotted({"model": "@CFG@"}, k.yaml, value)
        out.append(Case(f"estimate-config-key-{k.yaml}={vid}", ["estimate", "--config", "@D@/run.yaml"],
                        {"@D@/run.yaml": doc}, names=(k.yaml,)))
        out.append(Case(f"profile-config-key-{k.yaml}={vid}", ["profile", "--config", "@D@/run.yaml", "--device", "cpu"],
                        {"@D@/run.yaml": doc}, names=(k.yaml,)))
    return out


def _train_issue_cases() -> list[Case]:
    """The values issue 18 names, each with the name its message must hold."""
    named = [
        ("seed-text", {"seed": "abc"}, "seed"),
        ("weight_decay-text", {"weight_decay": "0.1x"}, "weight_decay"),
        ("max_grad_norm-text", {"max_grad_norm": "one"}, "max_grad_norm"),
        ("epochs-inf", {"epochs": math.inf, "max_steps": None}, "epochs"),
        ("lr-1e300", {"lr": 1e300}, "lr"),
        ("lr-inf", {"lr": math.inf}, "lr"),
        ("lr-nan", {"lr": math.nan}, "lr"),
        ("model-list", {"model": ["a", "b"]}, "model"),
        ("lora-rank-1e9", {"lora": {"rank": 10**9}}, "lora.rank"),
        ("lora-rank-above-hidden", {"lora": {"rank": 4096}}, "lora.rank"),
        ("max_steps-true", {"max_steps": True}, "max_steps"),
        ("max_grad_norm-negative", {"max_grad_norm": -1.0}, "max_grad_norm"),
        ("selective-99-on-2-layers", {"grad_checkpointing": "selective:99"}, "grad_checkpointing"),
        ("freeze-layers-above-model", {"method": "freeze", "freeze_trainable_layers": 5}, "freeze_trainable_layers"),
        ("model-without-weights", {"model": "@D@/noweights"}, "holds no weights"),
        ("model-folder-without-config", {"model": "@D@/datadir"}, "without a config.json"),
        ("output_dir-number", {"output_dir": 5}, "output_dir"),
        ("output_dir-null", {"output_dir": None}, "output_dir"),
        ("output_dir-list", {"output_dir": ["a"]}, "output_dir"),
        ("output_dir-empty", {"output_dir": ""}, "output_dir"),
        ("output_dir-a-file", {"output_dir": "@D@/data.jsonl"}, "output_dir"),
        ("output_dir-under-a-file", {"output_dir": "@D@/data.jsonl/run"}, "output_dir"),
        ("no-steps-no-epochs", {"max_steps": None}, "max_steps"),
        ("steps-and-epochs", {"epochs": 1}, "epochs"),
        ("model-missing-folder", {"model": "@D@/nope"}, "model"),
        ("model-catalog-name-pretrained", {"model": "llama-3.1-8b"}, "model"),
        ("init-random-no-tokenizer", {"model": "llama-3.1-8b", "init": "random"}, "tokenizer"),
        ("data-missing", {"data": {"path": "@D@/nope.jsonl"}}, "nope.jsonl"),
        ("eval-data-missing", {"data": {"path": "@DATA@", "eval_path": "@D@/nope.jsonl"}}, "data.eval_path"),
        ("data-unknown-suffix", {"data": "@D@/train.xlsx"}, "train.xlsx"),
        ("data-empty-file", {"data": "@D@/empty.jsonl"}, "empty.jsonl"),
        ("data-folder-not-dataset", {"data": "@D@/datadir"}, "datadir"),
        ("cap-bogus", {"cap": "rtx9999"}, "cap"),
        ("cap-negative", {"cap": "-5GiB"}, "cap"),
        ("cap-zero", {"cap": "0GiB"}, "cap"),
        ("cap-decimal-units", {"cap": "7GB"}, "cap"),  # no card is sold with 7 GB (24GB is a card)
        ("foreign-key", {"learning_rate": 1e-4}, "learning_rate"),
        ("unknown-nested-key", {"lora": {"rnk": 8}}, "lora.rnk"),
        ("lora-section-text", {"lora": "big"}, "lora"),
        ("qlora-fp32", {"method": "qlora", "dtype": "fp32"}, "dtype"),
        ("chunked-loss-hf-stack", {"loss": "chunked", "stack": "hf"}, "stack"),
        ("report_to-unknown", {"report_to": ["mlflow"]}, "report_to"),
        ("trust_remote_code-text", {"trust_remote_code": "yes please"}, "trust_remote_code"),
    ]
    out = []
    extra = {"@D@/train.xlsx": "a,b\n", "@D@/empty.jsonl": "", "@D@/datadir/x.txt": "x", "@D@/noweights/config.json": TINY}
    for cid, over, name in named:
        doc = copy.deepcopy(GOOD_TRAIN)
        for key, value in over.items():
            if value is None and key in ("max_steps",):
                doc.pop(key, None)
            else:
                doc[key] = value
        out.append(Case(f"train-{cid}", ["train", "@D@/run.yaml"], {"@D@/run.yaml": doc, **extra}, names=(name,),
                        needs=("model",)))
    out.append(Case("train-output_dir-read-only", ["train", "@D@/run.yaml"],
                    {"@D@/run.yaml": {**GOOD_TRAIN, "output_dir": "@RO@/run"}}, names=("output_dir",),
                    needs=("model", "ro")))
    # --set and flags on top of a good file
    good = {"@D@/run.yaml": GOOD_TRAIN}
    for cid, args, name in (
        ("set-without-equals", ["--set", "lora.rank"], "--set"),
        ("set-empty-key", ["--set", "=5"], "not a fitune key"),
        ("set-unknown", ["--set", "lora.rnk=8"], "lora.rnk"),
        ("set-under-text", ["--set", "model.x=1"], "model"),
        ("set-bad-yaml", ["--set", "lr=[1,"], "--set"),
        ("set-rank-text", ["--set", "lora.rank=big"], "lora.rank"),
        ("set-nested-deep", ["--set", "a.b.c.d=1"], "a"),
        ("flag-lr-text", ["--lr", "fast"], "--lr"),
        ("flag-lr-inf", ["--lr", "inf"], "--lr"),
        ("flag-max-steps-zero", ["--max-steps", "0"], "--max-steps"),
        ("flag-max-steps-huge", ["--max-steps", "1e30"], "--max-steps"),
        ("flag-epochs-negative", ["--epochs", "-1"], "--epochs"),
        ("flag-seed-negative", ["--seed", "-1"], "--seed"),
        ("flag-lora-rank-1e9", ["--lora-rank", "1000000000"], "--lora-rank"),
        ("flag-seq-len-zero", ["--seq-len", "0"], "--seq-len"),
        ("flag-grad-checkpointing-selective-99", ["--grad-checkpointing", "selective:99"], "--grad-checkpointing"),
        ("flag-output-dir-empty", ["--output-dir", ""], "--output-dir"),
        ("flag-cap-bogus", ["--cap", "rtx9999"], "--cap"),
        ("resume-and-overwrite", ["--resume", "--overwrite"], "--resume"),
        ("resume-nothing", ["--resume"], "--resume"),
        ("unknown-flag", ["--learning-rate", "1e-4"], "--learning-rate"),
    ):
        out.append(Case(f"train-{cid}", ["train", "@D@/run.yaml", *args], good, names=(name,), needs=("model",)))
    return out


def _train_data_cases() -> list[Case]:
    """Data files `fitune train` cannot use: they fail when read, after the tokenizer and before the model loads."""
    files = {
        "binary": ("@D@/d.jsonl", bytes(range(256)) * 16, "d.jsonl"),
        "latin1": ("@D@/d.jsonl", '{"text": "café"}\n'.encode("latin-1"), "UTF-8"),
        "not-json-lines": ("@D@/d.jsonl", b"hello world\nsecond line\n", "not valid JSON"),
        "list-lines": ("@D@/d.jsonl", b"[1, 2]\n[3]\n", "not an object"),
        "huge-single-line": ("@D@/d.jsonl", b'{"text": "' + b"a " * (4 << 20), "d.jsonl"),
        "nested-line": ("@D@/d.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", "d.jsonl"),
        "json-object": ("@D@/d.json", b'{"text": "one record"}', "d.json"),
        "json-number": ("@D@/d.json", b"5", "d.json"),
        "blank-lines": ("@D@/d.jsonl", b"\n\n  \n", "no records"),
        "no-fields": ("@D@/d.jsonl", b'{"foo": 1}\n{"bar": 2}\n', "d.jsonl"),
    }
    out = []
    for fid, (path, content, name) in files.items():
        doc = {**GOOD_TRAIN, "data": path}
        out.append(Case(f"train-data-{fid}", ["train", "@D@/run.yaml"], {"@D@/run.yaml": doc, path: content},
                        names=(name,), needs=("model",)))
    return out


# ---- flags of estimate / plan / profile / doctor -------------------------------------------------------------------


def _flag_cases() -> list[Case]:
    out = []
    for k in SETUP_KEYS:
        if k.kind == "bool":
            continue
        if k.kind in ("int", "float"):
            values = [("text", "abc"), ("empty", ""), ("inf", "1e999"), ("nan", "nan")]
            if k.minimum is not None:
                values.append(("below-minimum", str(int(k.minimum) - 1)))
            if k.maximum is not None:
                values.append(("above-maximum", str(int(k.maximum) * 10 + 1)))
        elif k.kind in ("choice", "checkpointing"):
            values = [("unknown", "bogus"), ("empty", "")]
        else:  # targets: an empty list, and names no Linear of the model has
            values = [("empty", ","), ("unknown-module", "attn.c_proj")]
        for vid, value in values:
            out.append(Case(f"estimate-flag-{k.flag}={vid}", ["estimate", "@CFG@", f"{k.flag}={value}"],
                            names=(k.flag,)))
    for vid, value, name in (("text", "abc", "--seq-len"), ("zero", "0", "--seq-len"), ("negative", "-8", "--seq-len"),
                             ("lora-rank-text", "x", "--lora-rank")):
        flag = name
        out.append(Case(f"plan-flag-{flag}={vid}", ["plan", "@CFG@", "--gpu", "24GiB", f"{flag}={value}"],
                        names=(flag,)))
        out.append(Case(f"profile-flag-{flag}={vid}", ["profile", "@CFG@", "--device", "cpu", f"{flag}={value}"],
                        names=(flag,)))
    gpus = (("unknown", "rtx9999", "rtx9999"), ("empty", "", "--gpu"), ("zero", "0GiB", "positive"),
            ("negative", "-5GiB", "-5GiB"), ("decimal-units", "7GB", "GiB"), ("words", "a big one", "a big one"),
            ("nan", "nanGiB", "nanGiB"), ("huge-exponent", "1e999GiB", "1e999GiB"))
    for vid, value, name in gpus:
        out.append(Case(f"estimate-gpu-{vid}", ["estimate", "@CFG@", f"--gpu={value}"], names=(name,)))
        out.append(Case(f"plan-gpu-{vid}", ["plan", "@CFG@", f"--gpu={value}"], names=(name,)))
        out.append(Case(f"doctor-gpu-{vid}", ["doctor", "@SCRIPT@", f"--gpu={value}"], names=(name,)))
        out.append(Case(f"profile-cap-{vid}", ["profile", "@CFG@", "--device", "cpu", f"--cap={value}"],
                        names=(name.replace("--gpu", "--cap"),)))
    out.append(Case("profile-gpu-unknown-with-cap", ["profile", "@CFG@", "--device", "cpu", "--gpu", "rtx9999"],
                    names=("--gpu 'rtx9999'",)))
    return out


def _plan_cases() -> list[Case]:
    p = ["plan", "@CFG@", "--gpu", "24GiB"]
    cases = [
        ("batch-zero", ["--batch-size", "0"], "--batch-size"),
        ("batch-negative", ["--batch-size", "-2"], "--batch-size"),
        ("batch-text", ["--batch-size", "two"], "--batch-size"),
        ("tokens-per-step-zero", ["--tokens-per-step", "0"], "--tokens-per-step"),
        ("tokens-per-step-negative", ["--tokens-per-step", "-5"], "--tokens-per-step"),
        ("batch-and-tokens", ["--batch-size", "2", "--tokens-per-step", "4096"], "--tokens-per-step"),
        ("gpus-zero", ["--gpus", "0"], "--gpus"),
        ("gpus-negative", ["--gpus", "-1"], "--gpus"),
        ("gpus-not-dividing", ["--gpus", "3", "--batch-size", "2"], "--gpus"),
        ("top-zero", ["--top", "0"], "--top"),
        ("top-negative", ["--top", "-3"], "--top"),
        ("method-empty", ["--method", ""], "--method"),
        ("method-commas", ["--method", ",,,"], "--method"),
        ("method-unknown", ["--method", "lora,dpo"], "dpo"),
        ("method-only-qlora-no-quantize", ["--method", "qlora", "--no-quantize"], "--method"),
        ("host-ram-text", ["--host-ram", "lots"], "--host-ram"),
        ("host-ram-negative", ["--host-ram", "-5GiB"], "--host-ram"),
        ("host-ram-decimal", ["--host-ram", "64GB"], "--host-ram"),
        ("emit-unknown", ["--emit", "axolotl"], "--emit"),
        ("data-missing", ["--data", "@D@/nope.jsonl", "--tokenizer", "@D@"], "nope.jsonl"),
        ("data-without-tokenizer", ["--data", "@DATA@"], "--tokenizer"),
        ("lora-rank-above-hidden", ["--lora-rank", "4096"], "--lora-rank"),
        ("lora-targets-unknown", ["--lora-targets", "c_attn"], "--lora-targets"),
        ("write-to-existing-folder", ["--write", "@D@"], "--write"),
        ("write-missing-parent", ["--write", "@D@/no/such/dir/plan.yaml"], "--write"),
        ("write-under-a-file", ["--write", "@DATA@/plan.yaml"], "--write"),
        ("write-empty", ["--write", ""], "--write"),
        ("html-to-folder", ["--html", "@D@"], "--html"),
        ("html-under-a-file", ["--html", "@DATA@/x.html"], "--html"),
    ]
    out = [Case(f"plan-{cid}", p + args, names=(name,)) for cid, args, name in cases]
    out.append(Case("plan-write-read-only", p + ["--write", "@RO@/plan.yaml"], names=("--write",), needs=("ro",)))
    return out


def _estimate_cases() -> list[Case]:
    e = ["estimate", "@CFG@"]
    cases = [
        ("no-model", ["estimate"], "MODEL"),
        ("engine-unknown", e + ["--engine", "magic"], "--engine"),
        ("unknown-flag", e + ["--learning-rate", "1"], "--learning-rate"),
        ("freeze-more-layers-than-model", e + ["--method", "freeze", "--freeze-trainable-layers", "5"],
         "--freeze-trainable-layers"),
        ("selective-99", e + ["--grad-checkpointing", "selective:99"], "--grad-checkpointing"),
        ("qlora-fp32", e + ["--method", "qlora", "--dtype", "fp32"], "--dtype"),
        ("liger-on-hf", e + ["--kernels", "liger"], "--kernels"),
        ("html-to-folder", e + ["--html", "@D@"], "--html"),
        ("html-under-a-file", e + ["--html", "@DATA@/x.html"], "--html"),
        ("html-empty", e + ["--html", ""], "--html"),
        ("config-and-model-missing", ["estimate", "--config", "@D@/run.yaml"], "MODEL"),
    ]
    out = [Case(f"estimate-{cid}", argv, {"@D@/run.yaml": {"seq_len": 64}}, names=(name,)) for cid, argv, name in cases]
    for vid, key, raw in (("layers-1e6", "num_hidden_layers", "1000000"), ("hidden-nan", "hidden_size", "NaN"),
                          ("vocab-list", "vocab_size", "[1]"), ("heads-zero", "num_attention_heads", "0")):
        out.append(Case(f"estimate-trace-{vid}", ["estimate", "@D@/m/config.json", "--engine", "trace"],
                        {"@D@/m/config.json": config_text(key, raw).encode()}, names=(key,)))
    out.append(Case("estimate-html-read-only", e + ["--html", "@RO@/x.html"], names=("--html",), needs=("ro",)))
    return out


def _profile_cases() -> list[Case]:
    p = ["profile", "@CFG@", "--device", "cpu"]
    cases = [
        ("70b-on-cpu", ["profile", "llama-3.1-70b", "--device", "cpu"], "--device cpu"),
        ("8b-on-cpu", ["profile", "llama-3.1-8b", "--device", "cpu", "--method", "full"], "--device cpu"),
        ("steps-zero", p + ["--steps", "0"], "--steps"),
        ("steps-negative", p + ["--steps", "-1"], "--steps"),
        ("steps-text", p + ["--steps", "many"], "--steps"),
        ("device-unknown", ["profile", "@CFG@", "--device", "tpu"], "--device"),
        ("gpu-unknown", p + ["--gpu", "rtx9999"], "rtx9999"),
        ("no-model", ["profile", "--device", "cpu"], "MODEL"),
        ("plot-to-folder", p + ["--plot", "@D@"], "--plot"),
        ("plot-under-a-file", p + ["--plot", "@DATA@/x.png"], "--plot"),
        ("plot-empty", p + ["--plot", ""], "--plot"),
        ("html-to-folder", p + ["--html", "@D@"], "--html"),
        ("seq-len-huge", p + ["--seq-len", "16777216", "--batch-size", "65536"], "--device cpu"),
    ]
    out = [Case(f"profile-{cid}", argv, names=(name,)) for cid, argv, name in cases]
    out.append(Case("profile-plot-read-only", p + ["--plot", "@RO@/m.png"], names=("--plot",), needs=("ro",)))
    return out


def _doctor_cases() -> list[Case]:
    deep_expr = "x = " + "-" * 100_000 + "1\n"
    deep_sum = "x = " + " + ".join(["a"] * 30_000) + "\n"
    deep_call = "x = " + "f(" * 5_000 + ")" * 5_000 + "\n"
    deep_ifs = "".join(" " * i + "if a:\n" for i in range(120)) + " " * 120 + "pass\n"
    scripts = {
        "missing": (None, "nope.py"),
        "folder": (DIR, "folder"),
        "binary": (bytes(range(256)) * 4, "UTF-8"),
        "latin1": ("x = 'café'\n".encode("latin-1"), "UTF-8"),
        "utf16": ("x = 1\n".encode("utf-16"), "UTF-8"),
        "syntax-error": (b"def f(:\n", "not a Python script"),
        "deep-unary": (deep_expr.encode(), "s.py"),
        "deep-sum": (deep_sum.encode(), "s.py"),
        "deep-calls": (deep_call.encode(), "s.py"),
        "deep-ifs": (deep_ifs.encode(), "s.py"),
        "deep-lists": (("x = " + "[" * 250 + "]" * 250 + "\n").encode(), "s.py"),
        "nul-byte": (b"x = 1\x00\n", "s.py"),
    }
    out = []
    for sid, (content, name) in scripts.items():
        files = {} if content is None else {"@D@/s.py": content}
        out.append(Case(f"doctor-script-{sid}", ["doctor", "@D@/nope.py" if content is None else "@D@/s.py"], files,
                        names=(name,)))
    s = ["doctor", "@SCRIPT@"]
    cases = [
        ("nothing", ["doctor"], "nothing to check"),
        ("script-and-data", s + ["--data", "@DATA@"], "--data"),
        ("tokenizer-with-script", s + ["--tokenizer", "@D@"], "--tokenizer"),
        ("seq-len-zero", s + ["--seq-len", "0"], "--seq-len"),
        ("seq-len-text", s + ["--seq-len", "abc"], "--seq-len"),
        ("batch-size-negative", s + ["--batch-size", "-1"], "--batch-size"),
        ("model-unknown", s + ["--model", "llama-9000b"], "llama-9000b"),
        ("lora-rank-text", s + ["--lora-rank", "big"], "--lora-rank"),
        ("dtype-unknown", s + ["--dtype", "fp8"], "--dtype"),
        ("data-without-tokenizer", ["doctor", "--data", "@DATA@"], "--tokenizer"),
        ("data-missing", ["doctor", "--data", "@D@/nope.jsonl", "--tokenizer", "@D@"], "nope.jsonl"),
        ("tokenizer-missing", ["doctor", "--data", "@DATA@", "--tokenizer", "@D@/nope"], "nope"),
        ("html-to-folder", s + ["--html", "@D@"], "--html"),
    ]
    out += [Case(f"doctor-{cid}", argv, names=(name,)) for cid, argv, name in cases]
    return out


def _report_cases() -> list[Case]:
    inputs = {
        "missing": (None, "nope.json"),
        "folder": (DIR, "in.json"),
        "empty": (b"", "in.json"),
        "binary": (bytes(range(256)), "in.json"),
        "not-json": (b"hello", "in.json"),
        "json-list": (b"[1, 2]", "in.json"),
        "json-number": (b"5", "in.json"),
        "json-nan": (b"NaN", "in.json"),
        "nested": (b"[" * 100_000 + b"]" * 100_000, "in.json"),
        "other-kind": (json.dumps({"script": "x.py", "findings": []}).encode(), "in.json"),
        "empty-object": (b"{}", "in.json"),
    }
    out = []
    for kind in ("estimate", "plan", "profile", "doctor"):
        for iid, (content, name) in inputs.items():
            if kind == "doctor" and iid == "other-kind":
                continue
            files = {} if content is None else {"@D@/in.json": content}
            src = "@D@/nope.json" if content is None else "@D@/in.json"
            out.append(Case(f"report-{kind}-{iid}", ["report", kind, src, "-o", "@D@/out.html"], files, names=(name,)))
    est = {"@D@/est.json": b"{}"}
    cases = [
        ("unknown-kind", ["report", "bogus", "@D@/est.json"], "bogus"),
        ("train-missing-run", ["report", "train", "@D@/nope"], "nope"),
        ("train-run-is-a-file", ["report", "train", "@D@/est.json"], "est.json"),
        ("train-empty-folder", ["report", "train", "@D@/empty"], "empty"),
        ("refresh-zero", ["report", "estimate", "@D@/est.json", "--refresh", "0"], "--refresh"),
        ("watch-zero", ["report", "train", "@D@/empty", "--watch", "0"], "--watch"),
        ("watch-not-train", ["report", "estimate", "@D@/est.json", "--watch", "5"], "--watch"),
        ("measured-not-estimate", ["report", "plan", "@D@/est.json", "--measured", "@D@/est.json"], "--measured"),
        ("script-not-doctor", ["report", "plan", "@D@/est.json", "--script", "@SCRIPT@"], "--script"),
    ]
    out += [Case(f"report-{cid}", argv, {**est, "@D@/empty": DIR}, names=(name,)) for cid, argv, name in cases]
    return out


CASES: list[Case] = (_model_cases() + _yaml_file_cases() + _train_key_cases() + _train_issue_cases()
                     + _train_data_cases() + _flag_cases() + _plan_cases() + _estimate_cases() + _profile_cases()
                     + _doctor_cases() + _report_cases())


def test_the_corpus_is_large_and_every_case_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(CASES) >= 350
    commands = {c.argv[0] for c in CASES}
    assert commands >= {"estimate", "plan", "train", "profile", "doctor", "report"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_a_message_and_exit_2(case: Case, subs_for, capsys):
    subs = subs_for(case)
    argv = [_fill(a, subs) for a in case.argv]
    code, out, err = run_cli(argv, capsys)
    names = tuple(_fill(n, subs) for n in case.names)
    assert_clean_failure(code, out, err, case.code, names)


# ---- hangs: a huge batch, pipes, deep nesting -- in a subprocess with a timeout ------------------------------------


def test_plan_answers_a_billion_sequence_batch_in_seconds(capsys):
    """The micro-batch search is bounded by constants (plan/search.py: micro_batch_candidates), not by --batch-size:
    before, `--batch-size 1000000000` tried every number up to a billion (139 s). A hang guard, not a speed claim."""
    for flags in (["--batch-size", "1000000000"], ["--batch-size", "720720"], ["--tokens-per-step", str(10**15)],
                  ["--batch-size", str(10**30)]):
        t0 = time.perf_counter()
        code, out, err = run_cli(["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--json", *flags], capsys)
        assert time.perf_counter() - t0 < 10, flags
        assert code in (0, 2) and "Traceback" not in out + err, (flags, err)


def _fitune(args: list[str], timeout_s: float = 60, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "fitune", *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=cwd or ROOT, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_no_command_waits_on_a_pipe_or_hangs_on_deep_input(tmp_path):
    """Each would wait forever (a pipe nobody writes to) or run for minutes (aliases expanding a YAML document a
    billion times) without its check; run as a real process so that a hang fails the test instead of the suite."""
    fifo = str(tmp_path / "pipe.jsonl")
    os.mkfifo(fifo)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    data = tmp_path / "data.jsonl"
    data.write_text(CHAT)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    (tmp_path / "laughs.yaml").write_text(laughs)
    (tmp_path / "run.yaml").write_text(f"model: {tmp_path}\ndata: {fifo}\nmax_steps: 1\noutput_dir: {tmp_path}/o\n")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "deep.py").write_text("x = " + " + ".join(["a"] * 30_000) + "\n")
    runs = [
        (["train", fifo], fifo),
        (["train", str(tmp_path / "run.yaml")], "pipe.jsonl"),
        (["estimate", "--config", str(tmp_path / "laughs.yaml")], "laughs.yaml"),
        (["doctor", fifo], fifo),
        (["doctor", str(tmp_path / "deep.py")], "deep.py"),
        (["report", "estimate", fifo, "-o", str(tmp_path / "r.html")], fifo),
        (["plan", str(cfg), "--gpu", "24GiB", "--batch-size", "1000000000"], None),
    ]
    for args, name in runs:
        p = _fitune(args)
        assert "Traceback" not in p.stderr + p.stdout, p.stderr
        if name is not None:
            assert p.returncode == 2 and name in p.stderr, (args, p.returncode, p.stderr[-2000:])


# ---- what the written files say: no code or key injected through a path --------------------------------------------

EVIL = 'evil"\nimport os; os.system("echo pwned")  # \'\\ : #'


def _normalised(code: str) -> str:
    """The module's syntax tree with every string constant blanked: what the code does, not what it quotes."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def test_emitted_code_quotes_any_model_path(tmp_path, capsys):
    codes = {}
    for label in ("plain", EVIL):
        folder = tmp_path / label
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(TINY))
        code, out, err = run_cli(["plan", str(folder), "--gpu", "24GiB", "--emit", "hf"], capsys)
        assert code == 0, err
        codes[label] = out
        calls = [n for n in ast.walk(ast.parse(out)) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", "") == "from_pretrained"]
        assert [c.args[0].value for c in calls] == [str(folder)] * 2  # the model and its tokenizer, exactly
    assert _normalised(codes[EVIL]) == _normalised(codes["plain"])  # the same statements, only the strings differ
    assert "pwned" not in "".join(line for line in codes[EVIL].splitlines() if not line.lstrip().startswith("#")
                                  and "from_pretrained" not in line and str(tmp_path) not in line)


def test_emitted_code_quotes_any_data_path(tmp_path, capsys, model_folder):
    """--data's path goes into a comment of the emitted code: one line, whatever it holds."""
    codes = {}
    for label in ("plain.jsonl", 'd"\nos.system("echo pwned")\n#.jsonl'):
        path = tmp_path / label
        path.write_text(CHAT * 8)
        code, out, err = run_cli(["plan", model_folder, "--gpu", "24GiB", "--data", str(path), "--emit", "hf"], capsys)
        assert code == 0, err
        codes[label] = out
    plain, evil = codes.values()
    assert _normalised(evil) == _normalised(plain)
    assert len(evil.splitlines()) == len(plain.splitlines())


def test_written_plan_yaml_reads_back_whatever_the_paths_hold(tmp_path, capsys):
    import yaml

    from fitune.config import config_from_dict

    docs = {}
    for label in ("plain", EVIL, "emoji 😀 café\u2028x"):
        folder = tmp_path / label
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(TINY))
        (folder / "model.safetensors").write_bytes(b"x")
        out = tmp_path / f"plan-{len(docs)}.yaml"
        code, _, err = run_cli(["plan", str(folder), "--gpu", "24GiB", "--write", str(out)], capsys)
        assert code == 0, err
        doc = yaml.safe_load(out.read_text(encoding="utf-8"))
        assert doc["model"] == str(folder)
        docs[label] = doc
        data = tmp_path / "train.jsonl"
        data.write_text(CHAT)
        if "\n" in label:  # fitune train takes no model path with a line break in it, and says so
            with pytest.raises(ConfigError, match="model: must be one line"):
                config_from_dict({**doc, "data": {"path": str(data)}, "output_dir": str(tmp_path / "o")}, str(out))
            continue
        cfg = config_from_dict({**doc, "data": {"path": str(data)}, "output_dir": str(tmp_path / "o")}, str(out))
        assert cfg.model == str(folder)
    assert len({tuple(d) for d in docs.values()}) == 1  # the same keys: nothing a path held became a key


# ---- optional packages missing ---------------------------------------------------------------------------------------


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, out, err = run_cli(["profile", str(cfg), "--device", "cpu", "--steps", "1", "--seq-len", "8",
                              "--plot", str(tmp_path / "m.png")], capsys)
    assert_clean_failure(code, out, err, 2, ("--plot", "pip install matplotlib"))
    assert not (tmp_path / "m.png").exists()


def test_html_needs_no_matplotlib(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (["estimate", str(cfg), "--gpu", "24GiB", "--html", str(tmp_path / "e.html")],
                 ["plan", str(cfg), "--gpu", "24GiB", "--html", str(tmp_path / "new" / "p.html")]):
        code, out, err = run_cli(argv, capsys)
        assert code == 0 and "Traceback" not in err, err
    assert (tmp_path / "e.html").stat().st_size > 0 and (tmp_path / "new" / "p.html").stat().st_size > 0


# ---- property-based fuzzing (hypothesis) ---------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fitune.errors import FituneError  # noqa: E402
from fitune.schema import FOREIGN_KEYS  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
#: Values near what each kind of key takes: the right type at the edges, and the near misses.
NEAR_VALUES = st.one_of(st.integers(-3, 70_000), st.sampled_from([0.0, 1e-300, 1e300, 2e-4, 0.5, 1.0, 65536, 2**32]),
                        st.sampled_from(["lora", "qlora", "full", "freeze", "bf16", "fp32", "selective:1", "selective:",
                                         "selective:-1", "all-linear", "q_proj,v_proj", "none", "offload", "true",
                                         "rtx4090", "0GiB", "24GiB", "", " ", "\t", "null", "~", "runs/x"]),
                        st.lists(st.sampled_from(["q_proj", "v_proj", "", "all-linear", "tensorboard"]), max_size=3))
CONFIG_PATHS = [k.yaml for k in ALL_KEYS] + sorted(FOREIGN_KEYS)[:20] + ["lora", "data", "lora.r", "data.format.x"]


@st.composite
def train_documents(draw):
    """A `fitune train` YAML mapping: known, foreign and made-up keys with values of every type and near misses."""
    doc: dict = {}
    for dotted in draw(st.lists(st.sampled_from(CONFIG_PATHS), max_size=8, unique=True)):
        value = draw(st.one_of(JSON_VALUES, NEAR_VALUES))
        try:
            doc = _set_dotted(doc, dotted, value)
        except (AttributeError, TypeError):  # a section given a scalar by an earlier key: keep the scalar
            pass
    if draw(st.booleans()):
        doc[draw(st.text(min_size=1, max_size=12))] = draw(JSON_SCALARS)
    return doc


@FUZZ
@given(doc=train_documents(), with_model=st.booleans())
def test_fuzzed_train_configs_are_read_or_refused_by_name(doc, with_model, tmp_path_factory, capsys):
    """Any YAML document: `fitune train`'s reader returns a config or raises ConfigError (never anything else), and
    `fitune estimate --config` answers or exits 2 with a message."""
    import yaml

    from fitune.config import config_from_dict
    from fitune.schema import load_config_file

    folder = tmp_path_factory.mktemp("fuzz-yaml")
    (folder / "config.json").write_text(json.dumps(TINY))
    if with_model:
        doc = {**doc, "model": str(folder / "config.json")}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    try:
        config_from_dict(load_config_file(str(path)), str(path))
    except ConfigError as exc:
        assert str(exc)
    code, out, err = run_cli(["estimate", "--config", str(path)], capsys)
    assert code in (0, 2) and "Traceback" not in out + err, err
    if code == 2:
        assert "error:" in err


SIZE_OR_JUNK = st.one_of(st.integers(-5, 3 * 2**20), st.integers(-(2**80), 2**80),
                         st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(), st.text(max_size=6),
                         st.lists(st.integers(0, 8), max_size=3), st.just({}))
MODEL_KEYS = [*SIZE_KEYS, "model_type", "sliding_window", "sliding_window_pattern", "max_window_layers",
              "use_sliding_window", "layer_types", "num_local_experts", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
              "tie_word_embeddings", "attention_bias", "text_config", "attn_logit_softcapping"]


@st.composite
def model_configs(draw):
    """A config.json: a supported model type, then any of its keys replaced by a size, a near miss or junk."""
    cfg = {**TINY, "model_type": draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                                                         "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]))}
    if cfg["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe"):
        cfg.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    for k in draw(st.lists(st.sampled_from(MODEL_KEYS), max_size=5, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            cfg.pop(k, None)
        else:
            cfg[k] = draw(SIZE_OR_JUNK)
    return cfg


@FUZZ
@given(cfg=model_configs())
def test_fuzzed_model_configs_are_sized_or_refused_by_name(cfg, tmp_path_factory, capsys):
    """Any config.json values: the spec is built or a FituneError says which key; `fitune estimate` answers (in
    well under a second: no loop runs over a size the config gives beyond the documented limits) or exits 2."""
    from fitune.specs.model import model_spec_from_hf_config

    try:
        model_spec_from_hf_config(cfg, source="config.json")
    except FituneError as exc:
        assert "config.json" in str(exc)
    folder = tmp_path_factory.mktemp("fuzz-model")
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    code, out, err = run_cli(["estimate", str(path), "--seq-len", "16", "--batch-size", "1", "--gpu", "24GiB"], capsys)
    assert code in (0, 2) and "Traceback" not in out + err, err
    assert time.perf_counter() - t0 < 10


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=model_configs(), batch=st.integers(1, 10**12))
def test_fuzzed_model_configs_are_planned_or_refused(cfg, batch, tmp_path_factory, capsys):
    folder = tmp_path_factory.mktemp("fuzz-plan")
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    code, out, err = run_cli(["plan", str(path), "--gpu", "24GiB", "--seq-len", "64", "--batch-size", str(batch),
                              "--json"], capsys)
    assert code in (0, 2) and "Traceback" not in out + err, err
    assert time.perf_counter() - t0 < 10
