"""Using a trained model: `fitune chat`, `generate`, `merge`, `eval` (fitune/infer/) on the real SmolLM2-135M.

One real LoRA run (r8 on q_proj,v_proj, fp32, 4 steps at lr 1e-2, seq_len 48) is trained once for the module; the
tests load it, generate from it, merge it and evaluate it, each against plain transformers / PEFT.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from fitune.cli.main import main  # noqa: E402

TRAIN = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a + b}. Banana!"}]}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]
]
EVAL = [  # completion records: the labels are easy to build by hand (the completion and the eos)
    {"prompt": "The capital of France is", "completion": " Paris."},
    {"prompt": "Two plus two equals", "completion": " four, as everyone knows."},
    {"prompt": "Q: What colour is the sky on a clear day?\nA:", "completion": " Blue."},
]
PROMPTS = ["Hi", "What is 3 plus 4?",
           [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Please tell me, in a few words, what 5 plus 6 makes."}]]
MAX_NEW = 12
MERGE_TOLERANCE = 2e-4
"""Max |logit difference| between the merged model and base + adapter, fp32: measured 7.2e-5 on 3 prompts (logits
of magnitude ~20; W + BA rounded once to fp32 instead of W x + B(A x)); the adapter itself moves them by ~10."""


def _write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def _fake_run(root, method: str, base: str, outputs=("adapter",)) -> str:
    """A run folder as `fitune train` lays it out (run.json, the output folders), without weights: enough for the
    checks that run before anything is loaded."""
    os.makedirs(root)
    with open(os.path.join(root, "run.json"), "w") as f:
        json.dump({"run_id": "test", "config": {"model": base, "method": method, "dtype": "fp32", "seq_len": 48}}, f)
    for name in outputs:
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "adapter_config.json"), "w") as f:
            json.dump({"base_model_name_or_path": base, "peft_type": "LORA"}, f)
    return str(root)


@pytest.fixture(scope="module")
def run_dir(real_model_dir, tmp_path_factory) -> str:
    """A finished `fitune train` run on the real model: run.json, adapter/, checkpoints/step-000004."""
    work = tmp_path_factory.mktemp("infer")
    data = _write_jsonl(work / "train.jsonl", TRAIN)
    config = work / "run.yaml"
    config.write_text(f"model: {real_model_dir}\ndata: {data}\nmethod: lora\n"
                      "lora: {rank: 8, alpha: 16, targets: [q_proj, v_proj]}\ndtype: fp32\nseq_len: 48\n"
                      f"batch_size: 2\nmax_steps: 4\nlr: 0.01\noutput_dir: {work / 'run'}\n")
    assert main(["train", str(config), "--no-progress"]) == 0
    return str(work / "run")


@pytest.fixture(scope="module")
def loaded(run_dir):
    """(model, tokenizer, info) of the run, loaded once: base + PEFT adapter, eval mode, fp32 on the CPU."""
    from fitune.infer.load import load_run

    return load_run(run_dir)


def _logits(model, tokenizer, texts):
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            out.append(model(input_ids=ids).logits[0])
    return out


# ---- loading ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_folder_loads_as_base_plus_adapter(run_dir, loaded, real_model_dir):
    from peft import PeftModel

    model, tokenizer, info = loaded
    assert isinstance(model, PeftModel) and not model.training
    assert (info.kind, info.weights, info.method, info.dtype, info.seq_len_tokens) == ("run", "adapter", "lora",
                                                                                       "fp32", 48)
    assert info.weights_dir == os.path.join(run_dir, "adapter")
    assert info.base_model == real_model_dir
    assert info.describe() == f"{run_dir}/adapter (lora adapter) over {real_model_dir}, fp32"
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    # the adapter does something: the trained model's logits are not the base model's
    with model.disable_adapter():
        base = _logits(model, tokenizer, ["What is 1 plus 2?"])[0]
    tuned = _logits(model, tokenizer, ["What is 1 plus 2?"])[0]
    assert (tuned - base).abs().max().item() > 0.1


def test_errors_say_what_the_folder_holds(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("x")
    assert main(["generate", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fitune generate: error: {folder} is not a fitune run folder, a model folder or a PEFT "
                          "adapter folder: it holds todo.txt (no run.json")
    assert main(["chat", str(tmp_path / "nowhere")]) == 2
    assert "does not exist; give the output_dir of a `fitune train` run" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_without_adapter_names_its_newest_checkpoint(run_dir, loaded, tmp_path, capsys):
    from fitune.infer.load import RunLoadError, describe_folder, load_run

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(os.path.join(run_dir, "run.json"), unfinished / "run.json")
    shutil.copytree(os.path.join(run_dir, "checkpoints"), unfinished / "checkpoints")
    newest = str(unfinished / "checkpoints" / "step-000004")
    with pytest.raises(RunLoadError, match=(
            rf"^run {unfinished} has no adapter/ yet \(adapter/ is written at the end of a run\): the run was "
            rf"interrupted or has not finished, its newest complete checkpoint is {newest}: load it with "
            rf"`--checkpoint {newest}`, or finish the run with `fitune train CONFIG --resume`$")):
        describe_folder(str(unfinished))
    data = _write_jsonl(tmp_path / "x.jsonl", [{"text": "a line to score"}])  # data first: it is checked first
    assert main(["eval", str(unfinished), "--data", data]) == 2
    assert f"--checkpoint {newest}" in capsys.readouterr().err
    with pytest.raises(RunLoadError, match="--merged: run .* has no merged/ .*fitune merge"):
        describe_folder(run_dir, merged=True)
    # the last checkpoint holds what adapter/ holds: loading it gives the same model
    model, tokenizer, info = load_run(str(unfinished), checkpoint="step-000004")
    assert (info.weights, info.weights_dir) == ("checkpoint", newest)
    a = _logits(model, tokenizer, ["What is 1 plus 2?"])[0]
    b = _logits(loaded[0], loaded[1], ["What is 1 plus 2?"])[0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_missing_base_model_is_named(tmp_path):
    from fitune.infer.load import RunLoadError, describe_folder

    gone = str(tmp_path / "gone" / "model")
    adapter = _fake_run(tmp_path / "run", "lora", gone)
    with pytest.raises(RunLoadError, match=rf"^the base model {gone} named by {adapter}/run.json \(model:\) is not "
                                           r"there \(moved or deleted\?\); the adapter holds only"):
        describe_folder(adapter)
    with pytest.raises(RunLoadError, match=rf"^the base model {gone} named by {adapter}/run.json \(model:\) is not "
                                           r"there"):
        describe_folder(os.path.join(adapter, "adapter"))  # a run's adapter/ given directly: the run's model
    plain = tmp_path / "plain-adapter"
    shutil.copytree(os.path.join(adapter, "adapter"), plain)  # outside a run: adapter_config.json names the base
    with pytest.raises(RunLoadError, match=rf"^the base model {gone} named by {plain}/adapter_config.json is not "
                                           r"there"):
        describe_folder(str(plain))


# ---- generate -------------------------------------------------------------------------------------------


def _alone(model, tokenizer, prompt):
    """Plain transformers: one prompt, no padding, greedy; the new tokens up to the first stop token."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                             do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    stops = {model.generation_config.eos_token_id, tokenizer.eos_token_id}
    end = next((i for i, t in enumerate(new) if t in stops), len(new))
    return tokenizer.decode(new[:end], skip_special_tokens=True), min(end + 1, len(new))


@pytest.mark.slow
def test_batched_greedy_generation_equals_one_prompt_at_a_time(loaded, run_dir, tmp_path, capsys):
    from fitune.infer.generate import GenerationSettings, generate_batch

    model, tokenizer, _ = loaded
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"])
               for p in PROMPTS]
    assert len(set(lengths)) == 3  # the batch is padded on the left
    batched = generate_batch(model, tokenizer, PROMPTS, GenerationSettings(max_new_tokens=MAX_NEW), batch_size=3)
    expected = [_alone(model, tokenizer, p) for p in PROMPTS]
    assert [(g.response, g.new_tokens) for g in batched] == expected
    assert all(g.response for g in batched)
    # the command: JSONL out, one line per prompt in order, the prompt's own key
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]},
                                                        {"messages": PROMPTS[2]}])
    out = tmp_path / "answers.jsonl"
    assert main(["generate", run_dir, "--prompts", prompts, "--out", str(out), "--max-new-tokens", str(MAX_NEW),
                 "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [{"prompt": PROMPTS[0], "response": expected[0][0], "new_tokens": expected[0][1],
                      "finished": expected[0][1] < MAX_NEW},
                     {"prompt": PROMPTS[1], "response": expected[1][0], "new_tokens": expected[1][1],
                      "finished": expected[1][1] < MAX_NEW},
                     {"messages": PROMPTS[2], "response": expected[2][0], "new_tokens": expected[2][1],
                      "finished": expected[2][1] < MAX_NEW}]


def test_bad_prompt_files_are_refused_by_line(tmp_path, capsys):
    from fitune.cli.generate import read_prompts
    from fitune.errors import DataError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n\nnot json\n{"text": "x"}\n')
    with pytest.raises(DataError, match=r"^--prompts .*p.jsonl: line 3: not JSON .*; line 4: expected "
                                        r"\{\"prompt\": \"...\"\}, \{\"messages\""):
        read_prompts(str(path))
    assert read_prompts(_write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}, {"messages": PROMPTS[2]}])) == \
        ["a", PROMPTS[2]]
    path.write_text('{"instruction": "Add 2 and 3.", "input": 5}\n')
    with pytest.raises(DataError, match=r"line 1: an alpaca row whose field 'input' is a number, not a string"):
        read_prompts(str(path))


def test_alpaca_rows_prompt_as_training_renders_them(tmp_path):
    """A held-out alpaca row (its output left out) is a prompt: the system and user messages under a chat template,
    as fitune train's alpaca rows are rendered, else (or with --raw) the Alpaca prompt text."""
    from fitune.cli.generate import read_prompts, resolve_prompts
    from fitune.data.convert import ALPACA_PROMPT

    rows = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
            {"instruction": "Translate.", "input": "chat", "system": "Be brief."}, {"prompt": "hi"}]
    read = read_prompts(_write_jsonl(tmp_path / "a.jsonl", rows))
    chat, plain = type("T", (), {"chat_template": "{{ x }}"})(), type("T", (), {"chat_template": None})()
    assert resolve_prompts(read, chat, raw=False) == [
        [{"role": "user", "content": "Add 2 and 3."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Translate.\n\nchat"}], "hi"]
    no_template = resolve_prompts(read, plain, raw=False)
    assert no_template[0] == ALPACA_PROMPT["prompt_no_input"].format(instruction="Add 2 and 3.")
    assert no_template[1] == "Be brief.\n\n" + ALPACA_PROMPT["prompt_input"].format(instruction="Translate.",
                                                                                  input="chat")
    assert resolve_prompts(read, chat, raw=True) == no_template


# ---- chat -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_streams_keeps_history_and_resets(loaded, run_dir, monkeypatch, capsys):
    from fitune.infer.generate import ChatSession, GenerationSettings

    model, tokenizer, _ = loaded
    session = ChatSession(model, tokenizer, GenerationSettings(max_new_tokens=MAX_NEW), system="Be brief.")
    pieces: list[str] = []
    first = session.send("What is 1 plus 2?", on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == first.response  # streamed, piece by piece
    second = session.send("And 3 plus 4?")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[2]["content"] == first.response  # the second turn was generated after the first
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 1 plus 2?\nAnd 3 plus 4?\n/reset\n\nWhat is 1 plus 2?\n"
                                                 "/exit\nnever read\n"))
    assert main(["chat", run_dir, "--system", "Be brief.", "--max-new-tokens", str(MAX_NEW)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{first.response}\n{second.response}\n{first.response}\n"
    assert "(conversation reset)" in captured.err


def test_chat_ends_cleanly_on_ctrl_c_and_ctrl_d(tmp_path, monkeypatch, capsys):
    from fitune.infer import generate as gen

    class _Interrupting(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr("fitune.cli.generate.load_from_args", lambda args: (None, _FakeTokenizer(), None))
    monkeypatch.setattr(gen.ChatSession, "send", lambda self, text, on_text=None: on_text("ok"))
    monkeypatch.setattr("sys.stdin", _Interrupting())
    assert main(["chat", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))  # Ctrl-D: the input ends without /exit
    assert main(["chat", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "ok\n"


class _FakeTokenizer:
    chat_template = "{{ messages }}"
    name_or_path = "fake"


# ---- merge ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_merge_matches_base_plus_adapter(loaded, run_dir, real_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model, tokenizer, _ = loaded
    out = tmp_path / "merged"
    out.mkdir()  # an empty folder is fine
    assert main(["merge", run_dir, "--out", str(out), "--max-shard-size", "200MB"]) == 0
    # (deepspeed, when installed, prints a line of its own on stdout when transformers imports it)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("merged ")]
    assert said == [f"merged {run_dir}/adapter into {real_model_dir} -> {out} (fp32, 3 safetensors files, 0.50 GiB)"]
    files = sorted(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= set(files)
    assert [f for f in files if f.endswith(".safetensors")] == [f"model-0000{i}-of-00003.safetensors"
                                                                 for i in (1, 2, 3)]
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # no PEFT, no fitune
    assert merged.config.dtype == torch.float32
    texts = ["What is 1 plus 2?", "Hello there, how are you today?", "The capital of France is"]
    diffs = []
    for m, a in zip(_logits(merged, tokenizer, texts), _logits(model, tokenizer, texts)):
        diffs.append((m - a).abs().max().item())
    with model.disable_adapter():
        moved = max((b - a).abs().max().item() for b, a in zip(_logits(model, tokenizer, texts),
                                                                _logits(merged, tokenizer, texts)))
    print(f"merge: max |logit diff| merged vs base + adapter = {max(diffs):.2e}; adapter moved logits by "
          f"{moved:.2f}")
    assert moved > 0.1  # the adapter is not a no-op: the comparison below means something
    assert max(diffs) < MERGE_TOLERANCE


def test_merge_refusals(tmp_path, capsys):
    from fitune.infer.merge import MergeError, merge_run

    base = tmp_path / "base"
    base.mkdir()
    run = _fake_run(tmp_path / "run", "lora", str(base))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["merge", run, "--out", str(busy)]) == 2
    assert capsys.readouterr().err == (f"fitune merge: error: --out {busy} exists and is not empty (keep.txt); merged "
                                       "weights go into a new or empty folder: choose another --out, or remove that "
                                       "folder first\n")
    assert (busy / "keep.txt").read_text() == "mine"
    # QLoRA needs CUDA to dequantize NF4 (these tests run on the CPU)
    qlora = _fake_run(tmp_path / "qlora", "qlora", str(base))
    if not torch.cuda.is_available():
        with pytest.raises(MergeError, match=r"QLoRA run: its adapter was trained against the NF4 \(4-bit\) base, "
                                             r"which must be dequantized before merging, and bitsandbytes "
                                             r"dequantizes on CUDA only"):
            merge_run(qlora, str(tmp_path / "q-out"))
        assert not os.path.exists(tmp_path / "q-out")
    # a full fine-tune has nothing to merge; a run without its adapter yet says so
    full = _fake_run(tmp_path / "full", "full", str(base), outputs=("model",))
    with pytest.raises(MergeError, match=r"holds whole-model weights .*method full\), not a LoRA adapter: there is "
                                         "nothing to merge"):
        merge_run(full, str(tmp_path / "f-out"))
    unfinished = _fake_run(tmp_path / "unfinished", "lora", str(base), outputs=())
    with pytest.raises(MergeError.__mro__[1], match=r"has no adapter/ yet .* no complete checkpoint yet"):
        merge_run(unfinished, str(tmp_path / "u-out"))


# ---- eval -----------------------------------------------------------------------------------------------


def _hand_loss(model, tokenizer, records) -> tuple[float, int]:
    """Completion labels by hand: the completion's tokens and the eos; the prompt scores nothing."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in records:
            prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
            target = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            logits = model(input_ids=torch.tensor([prompt + target])).logits[0].float()
            scored = logits[len(prompt) - 1:-1]  # position t predicts token t + 1
            total += torch.nn.functional.cross_entropy(scored, torch.tensor(target), reduction="sum").item()
            count += len(target)
    return total / count, count


@pytest.mark.slow
def test_eval_loss_equals_a_hand_computation(loaded, run_dir, real_model_dir, tmp_path, capsys):
    import math

    model, tokenizer, _ = loaded
    assert tokenizer("hello world")["input_ids"] == tokenizer("hello world", add_special_tokens=False)["input_ids"]
    data = _write_jsonl(tmp_path / "eval.jsonl", EVAL)
    tuned, count = _hand_loss(model, tokenizer, EVAL)
    with model.disable_adapter():
        base, _ = _hand_loss(model, tokenizer, EVAL)
    assert abs(tuned - base) > 1e-3

    assert main(["eval", run_dir, "--data", data, "--batch-size", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["loss"] == pytest.approx(tuned, rel=1e-5)
    assert doc["perplexity"] == pytest.approx(math.exp(doc["loss"]), rel=1e-12)
    assert {k: doc[k] for k in ("examples", "trained_tokens", "truncated", "dropped", "data_format",
                                "seq_len_tokens", "weights", "dtype")} == \
        {"examples": 3, "trained_tokens": count, "truncated": 0, "dropped": 0, "data_format": "completion",
         "seq_len_tokens": 48, "weights": "adapter", "dtype": "fp32"}
    assert doc["lm_eval"] == (f"lm_eval --model hf --model_args pretrained={real_model_dir},peft={run_dir}/adapter,"
                              "dtype=float32 --tasks hellaswag,arc_easy --device cuda:0 --batch_size auto")

    # the base model itself (before training), a plain model folder
    assert main(["eval", real_model_dir, "--data", data, "--seq-len", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"model: {real_model_dir} (model weights), fp32"
    assert lines[1] == (f"data: {data}: 3 examples (format completion), {doc['tokens']} tokens, {count} scored; 0 cut "
                        "at 64 tokens (--seq-len)")
    assert lines[2] == f"loss {base:.4f} (mean over {count} scored tokens), perplexity {math.exp(base):.3f}"
    assert lines[4] == (f"  lm_eval --model hf --model_args pretrained={real_model_dir},dtype=float32 --tasks "
                        "hellaswag,arc_easy --device cuda:0 --batch_size auto")


def test_lm_eval_command_for_each_kind_of_weights():
    from fitune.infer.evaluate import lm_eval_command
    from fitune.infer.load import RunInfo

    def info(weights, weights_dir, base, method, dtype="bf16"):
        return RunInfo(path="/runs/x", kind="run", weights=weights, weights_dir=weights_dir, base_model=base,
                       tokenizer_dir=weights_dir, method=method, dtype=dtype)

    tail = " --tasks hellaswag,arc_easy --device cuda:0 --batch_size auto"
    assert lm_eval_command(info("adapter", "/runs/x/adapter", "HuggingFaceTB/SmolLM2-135M", "lora")) == (
        "lm_eval --model hf --model_args pretrained=HuggingFaceTB/SmolLM2-135M,peft=/runs/x/adapter,dtype=bfloat16"
        + tail)
    assert lm_eval_command(info("adapter", "/runs/x/adapter", "/m/base.gguf", "qlora")) == (
        "lm_eval --model hf --model_args pretrained=/m,gguf_file=base.gguf,peft=/runs/x/adapter,load_in_4bit=True,"
        "dtype=bfloat16" + tail)
    assert lm_eval_command(info("merged", "/runs/x/merged", None, "lora", "fp16")) == (
        "lm_eval --model hf --model_args pretrained=/runs/x/merged,dtype=float16" + tail)


def test_eval_says_a_missing_data_file_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """`fitune eval RUN --data /nope.jsonl`: the data error comes first, not after the model has loaded."""
    import fitune.cli.generate as generate_cli

    def must_not_load(args):
        raise AssertionError("the model was loaded before the data file was checked")

    monkeypatch.setattr(generate_cli, "load_from_args", must_not_load)
    assert main(["eval", str(tmp_path), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file or folder" in capsys.readouterr().err
