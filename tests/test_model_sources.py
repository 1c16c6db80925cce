"""Model sources beyond a folder and the catalog: a Hugging Face Hub id (through the Hub cache) and a .gguf file,
for estimate, plan, train and the tokenizer loaders, on the real SmolLM2-135M-Instruct (tests/real_model.py).

No test touches the network: HF_HUB_OFFLINE=1 and HF_HUB_CACHE point at a cache each test fabricates
(models--ORG--NAME/refs/main + snapshots/<revision>/ linking the real model's files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from fitune.cli.main import main
from fitune.errors import ConfigError, DataError, UnknownModelError
from fitune.specs.model import catalog_key_for_hub_id, describe_source, load_model_spec, resolve_model_source
from fitune.specs import sources

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "0123456789abcdef0123456789abcdef01234567"
Q4_NOTE = "weights dequantized from Q4_1 to {dtype} on load: the GGUF's 4-bit precision is not what trains"


def fake_hub_cache(root: str, repo_id: str, files_from: str | None) -> str:
    """A Hub cache holding `repo_id` at REVISION, its files symlinked from `files_from`; the snapshot folder."""
    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(snapshot)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    for name in sorted(os.listdir(files_from)) if files_from else ():
        if name != "done":
            os.symlink(os.path.join(files_from, name), os.path.join(snapshot, name))
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache for this test, offline."""
    cache = str(tmp_path / "hub")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def cached_smollm(hub_cache, real_model_dir):
    """HUB_ID in the test's Hub cache: the snapshot folder."""
    return fake_hub_cache(hub_cache, HUB_ID, real_model_dir)


def _same_shape(a, b) -> None:
    """Two ModelSpecs equal in every compared field but where they came from."""
    assert dataclasses.replace(a, name="m", source="s") == dataclasses.replace(b, name="m", source="s")


# ---- GGUF metadata ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_header_reads_what_the_gguf_package_reads(real_gguf):
    from gguf import GGUFReader

    fields, tensors = sources.read_gguf_header(real_gguf)
    reader = GGUFReader(real_gguf)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        mine = fields[key]
        if isinstance(mine, sources._Length):  # long arrays (the vocabulary, merges) are kept as their length
            assert mine.n == len(field.data), key
        else:
            assert mine == field.contents(), key
    assert [(t[0], t[1], t[2]) for t in tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors]


def test_gguf_spec_equals_the_folders(real_gguf, real_model_dir):
    g = sources.read_gguf(real_gguf)
    assert g.weights_type == "Q4_1" and g.weights_bits == 4  # 210 of the 211 2-D tensors; token_embd is Q8_0
    assert {k: g.hf_config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")} == {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    from_gguf = load_model_spec(real_gguf)
    from_folder = load_model_spec(real_model_dir)
    _same_shape(from_gguf, from_folder)
    assert from_gguf.name == "SmolLM2-135M-Instruct.Q4_1" and from_gguf.source == real_gguf
    assert from_gguf.gguf_weights_type == "Q4_1" and from_folder.gguf_weights_type == ""
    assert describe_source(from_folder, "bf16") is None
    assert describe_source(from_gguf, "fp32") == (f"architecture from the GGUF metadata of {real_gguf}; "
                                                  + Q4_NOTE.format(dtype="fp32"))
    assert describe_source(from_gguf, "bf16", "qlora").endswith(
        "to bf16, then NF4 for QLoRA on load: the GGUF's 4-bit precision is not what trains")


@pytest.mark.parametrize("name, bits", [("Q4_K", 4), ("Q8_0", 8), ("IQ3_S", 3), ("F16", 16), ("BF16", 16),
                                        ("F32", 32), ("type 99", None)])
def test_weights_bits_from_the_type_name(name, bits):
    assert sources.weights_bits(name) == bits


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UnknownModelError, match=r"model\.gguf is not a GGUF file \(it does not start with 'GGUF'\)"):
        load_model_spec(str(bad))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01\x00")
    with pytest.raises(UnknownModelError, match="the GGUF header is cut short or damaged"):
        load_model_spec(str(cut))


def test_estimate_of_the_gguf_says_the_weights_are_dequantized(real_gguf, real_model_dir, capsys):
    assert main(["estimate", real_gguf, "--seq-len", "64", "--batch-size", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source_note"] == f"architecture from the GGUF metadata of {real_gguf}; " + Q4_NOTE.format(dtype="bf16")
    assert main(["estimate", real_model_dir, "--seq-len", "64", "--batch-size", "1", "--json"]) == 0
    folder_doc = json.loads(capsys.readouterr().out)
    assert folder_doc["source_note"] is None
    assert doc["peak_allocated_bytes"] == folder_doc["peak_allocated_bytes"]  # the same architecture, same bytes
    assert main(["estimate", real_gguf, "--seq-len", "64", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("model source: architecture from the GGUF metadata of "
                                   f"{real_gguf}; " + Q4_NOTE.format(dtype="fp32"))


def test_plan_of_the_gguf_says_the_weights_are_dequantized(real_gguf, tmp_path, capsys):
    assert main(["plan", real_gguf, "--gpu", "rtx4090", "--seq-len", "256", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    note = f"architecture from the GGUF metadata of {real_gguf}; " + Q4_NOTE.format(dtype="bf16")
    assert doc["source_note"] == note
    assert doc["notes"][0] == f"model source: {note}"
    import yaml

    written = str(tmp_path / "run.yaml")
    assert main(["plan", real_gguf, "--gpu", "rtx4090", "--seq-len", "256", "--write", written]) == 0
    out = capsys.readouterr().out
    assert f"model source: {note}" in out and "set `model:`" not in out  # train loads the .gguf file itself
    with open(written) as f:
        assert yaml.safe_load(f)["model"] == real_gguf


# ---- Hub ids ------------------------------------------------------------------------------------------------


def test_hub_id_reads_config_json_from_the_hub_cache(cached_smollm, real_model_dir, capsys):
    spec = load_model_spec(HUB_ID)
    path = os.path.join(cached_smollm, "config.json")
    assert spec.name == HUB_ID and spec.source == path
    assert spec.source_note == f"config.json from the Hub cache at {path}"
    _same_shape(spec, load_model_spec(real_model_dir))
    assert main(["estimate", HUB_ID, "--seq-len", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == HUB_ID and doc["source_note"] == f"config.json from the Hub cache at {path}"


def test_hub_cache_follows_hf_home_set_after_import(tmp_path, monkeypatch, real_model_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sources.hub_cache_dir() == str(tmp_path / "home" / "hub")
    snapshot = fake_hub_cache(str(tmp_path / "home" / "hub"), HUB_ID, real_model_dir)
    assert sources.cached_hub_snapshot(HUB_ID) == snapshot
    assert sources.cached_hub_file(HUB_ID) == os.path.join(snapshot, "config.json")
    assert sources.local_model(HUB_ID) == sources.LocalModel(folder=snapshot, hub_id=HUB_ID)


@pytest.mark.parametrize("hub_id, name", [
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "llama-3.1-8b"),
    ("unsloth/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),  # the catalog's mistral-7b is mistralai/Mistral-7B-v0.3
    ("mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1"),
    ("mistralai/Mistral-7B-Instruct-v0.2", None),  # never silently another version
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
])
def test_hub_id_maps_to_the_catalog_entry_of_its_architecture(hub_id, name):
    assert catalog_key_for_hub_id(hub_id) == name


def test_hub_id_not_cached_uses_the_catalog_and_says_so(hub_cache, capsys):
    src = resolve_model_source("mistralai/Mistral-7B-Instruct-v0.3")
    assert src.name == "mistral-7b"
    assert src.note == (f"mistralai/Mistral-7B-Instruct-v0.3 is not in the Hub cache ({hub_cache}); used the catalog "
                        "entry mistral-7b (mistralai/Mistral-7B-v0.3), which has its architecture")
    assert main(["estimate", "unsloth/Meta-Llama-3.1-8B-Instruct", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "llama-3.1-8b"
    assert doc["source_note"] == (f"unsloth/Meta-Llama-3.1-8B-Instruct is not in the Hub cache ({hub_cache}); used "
                                  "the catalog entry llama-3.1-8b (meta-llama/Llama-3.1-8B), which has its architecture")


def test_unknown_hub_id_not_cached_gives_the_download_command(hub_cache, capsys):
    with pytest.raises(UnknownModelError) as err:
        load_model_spec("mistralai/Mistral-7B-Instruct-v0.2")
    msg = str(err.value)
    assert "neither in the Hub cache" in msg and hub_cache in msg
    assert "download it with `hf download mistralai/Mistral-7B-Instruct-v0.2`" in msg
    assert "closest catalog names: mistral-7b-v0.1, mistral-7b, mixtral-8x7b" in msg
    assert main(["estimate", "someone/no-such-model"]) == 2
    assert "`hf download someone/no-such-model`" in capsys.readouterr().err


def test_the_download_command_is_the_installed_cli():
    hf = os.path.join(os.path.dirname(sys.executable), "hf")
    if not os.path.isfile(hf):
        pytest.skip("huggingface_hub's `hf` command is not installed here")
    out = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and "REPO_ID" in out.stdout
    assert sources.download_command("a/b") == "hf download a/b"


@pytest.mark.parametrize("text, hub", [("meta-llama/Llama-3.1-8B", True), ("./my-model", False),
                                       ("/abs/path", False), ("llama-3.1-8b", False), ("a/b/c", False),
                                       ("org/model.gguf", False), ("org/config.json", False),
                                       ("org--x/y", False)])
def test_what_reads_as_a_hub_id(text, hub):
    assert sources.is_hub_id(text) is hub


# ---- train: config checks, loading -------------------------------------------------------------------------


def _chat_data(path: str) -> str:
    # a system message of its own: SmolLM2's template otherwise adds a default one longer than seq_len 32
    records = [{"messages": [{"role": "system", "content": "Add."},
                             {"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
               for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _config(tmp_path, model: str, out: str = "run") -> dict:
    return {"model": model, "data": {"path": _chat_data(str(tmp_path / "chat.jsonl")), "format": "chat"},
            "method": "lora", "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}, "seq_len": 32,
            "batch_size": 2, "max_steps": 2, "lr": 1e-3, "dtype": "fp32", "output_dir": str(tmp_path / out)}


def test_train_of_a_hub_id_not_cached_offline_is_one_error_with_the_command(tmp_path, hub_cache, capsys):
    from fitune.config import config_from_dict

    with pytest.raises(ConfigError) as err:
        config_from_dict(_config(tmp_path, "someone/not-downloaded"), "test").validate()
    assert err.value.problems == [
        f"model: someone/not-downloaded is not in the Hub cache ({hub_cache}) and HF_HUB_OFFLINE is set, so it "
        "cannot be downloaded; run `hf download someone/not-downloaded` with network access (or unset "
        "HF_HUB_OFFLINE), or point model: at a local folder"]
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, "someone/not-downloaded")))
    assert main(["train", str(path), "--no-progress"]) == 2
    assert "`hf download someone/not-downloaded`" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")  # refused before anything was made or loaded


def test_train_config_accepts_a_gguf_and_a_cached_hub_id(tmp_path, cached_smollm, real_gguf):
    from fitune.config import config_from_dict
    from fitune.train.preflight import preflight_problems

    for model in (real_gguf, HUB_ID):
        cfg = config_from_dict(_config(tmp_path, model), "test").validate()
        assert preflight_problems(cfg) == []
    with pytest.raises(ConfigError, match=r"model: 'nowhere\.bin' is not a folder, a \.gguf file or a Hub id"):
        config_from_dict(_config(tmp_path, "nowhere.bin"), "test").validate()


class _FakeModel:
    """What build_model's pretrained path calls on a model, recorded."""

    def __init__(self):
        self.moved_to = []
        self.hf_quantizer = "gguf"
        self.is_quantized = True
        self.config = type("Config", (), {})()
        self.config.quantization_config = {"quant_method": "gguf"}

    def to(self, device):
        self.moved_to.append(device)
        return self

    def train(self):
        return self


@pytest.fixture
def recorded_from_pretrained(monkeypatch):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    calls = []

    def fake(path, **kwargs):
        calls.append((path, kwargs))
        return _FakeModel()

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    return calls


def test_pretrained_on_cuda_loads_straight_to_the_gpu(recorded_from_pretrained, real_model_dir):
    import torch

    from fitune.runtime.model import build_model

    model = build_model(real_model_dir, dtype_name="bf16", device="cuda", init="pretrained")
    (path, kwargs), = recorded_from_pretrained
    assert path == real_model_dir
    assert kwargs == {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "trust_remote_code": False,
                      "device_map": {"": "cuda"}}
    assert model.moved_to == []  # never whole in host RAM, never moved
    model = build_model(real_model_dir, dtype_name="fp32", device="cpu", init="pretrained")
    assert "device_map" not in recorded_from_pretrained[1][1] and model.moved_to == ["cpu"]  # CPU as before


def test_pretrained_gguf_loads_through_transformers_and_forgets_its_quantizer(recorded_from_pretrained, real_gguf):
    import torch

    from fitune.runtime.model import build_model

    model = build_model(real_gguf, dtype_name="fp32", device="cuda", init="auto")
    (path, kwargs), = recorded_from_pretrained
    assert path == os.path.dirname(real_gguf)
    assert kwargs == {"dtype": torch.float32, "attn_implementation": "sdpa", "trust_remote_code": False,
                      "gguf_file": os.path.basename(real_gguf), "device_map": {"": "cuda"}}
    assert model.hf_quantizer is None and model.is_quantized is False
    assert not hasattr(model.config, "quantization_config")
    assert model.name_or_path == real_gguf  # the adapter's base_model_name_or_path names the file


def test_pretrained_hub_id_loads_the_cached_snapshot(recorded_from_pretrained, cached_smollm):
    from fitune.runtime.model import build_model

    model = build_model(HUB_ID, dtype_name="fp32", device="cpu", init="auto")
    assert recorded_from_pretrained[0][0] == cached_smollm and model.name_or_path == HUB_ID


# ---- the tokenizer loaders ----------------------------------------------------------------------------------


CHAT = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]


def _rendered(tokenizer) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def test_one_tokenizer_loader_for_folders_and_hub_ids(real_model_dir, cached_smollm):
    """(The .gguf file's own tokenizer: test_train_two_steps_from_the_gguf_file, which saves it with the adapter;
    converting it takes 20 s, once is enough.)"""
    pytest.importorskip("transformers")
    from fitune.data.encode import load_tokenizer as data_tokenizer
    from fitune.runtime.model import load_tokenizer as run_tokenizer

    expected = _rendered(data_tokenizer(real_model_dir))
    assert expected[0].startswith("<|im_start|>system\n")  # ChatML, with SmolLM2's default system prompt
    tok = data_tokenizer(HUB_ID)
    assert _rendered(tok) == expected and len(tok) == 49152
    run = run_tokenizer(HUB_ID)
    assert run.pad_token_id == run.eos_token_id == 2  # <|im_end|>, as the GGUF file names them (tests/real_model.py)
    with pytest.raises(DataError, match=r"--tokenizer someone/absent is not in the Hub cache .*HF_HUB_OFFLINE is set"):
        data_tokenizer("someone/absent")
    with pytest.raises(ConfigError, match=r"tokenizer: someone/absent is not in the Hub cache"):
        run_tokenizer("someone/absent")


# ---- train end to end ---------------------------------------------------------------------------------------


def _train_and_reload(tmp_path, model: str, real_model_dir: str):
    """Two LoRA steps of `model`; the adapter reloaded with PEFT on the base build_model makes from `model:`."""
    import torch
    from peft import PeftModel

    from fitune.config import config_from_dict
    from fitune.runtime.model import build_model
    from fitune.train.loop import train

    cfg = config_from_dict(_config(tmp_path, model), "test").validate()
    result = train(cfg, progress=False)
    assert result.steps == 2 and len(result.losses) == 2
    assert os.path.isfile(os.path.join(result.adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(result.adapter_dir, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == model
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(result.adapter_dir)  # the tokenizer the run used, saved beside the adapter
    assert _rendered(saved) == _rendered(AutoTokenizer.from_pretrained(real_model_dir))
    base = build_model(model, dtype_name="fp32", device="cpu", init="pretrained")
    reloaded = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    ids = torch.tensor([[1, 520, 4110, 28, 2]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, result.model.eval()(input_ids=ids).logits)
    return result


@pytest.mark.slow
def test_train_two_steps_from_the_gguf_file(tmp_path, real_gguf, real_model_dir):
    _train_and_reload(tmp_path, real_gguf, real_model_dir)


@pytest.mark.slow
def test_train_two_steps_from_a_cached_hub_id(tmp_path, cached_smollm, real_model_dir):
    _train_and_reload(tmp_path, HUB_ID, real_model_dir)
