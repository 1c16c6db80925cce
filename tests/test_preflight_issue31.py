"""Issue 31: `fitune train` gives no traceback and no slow error. Every check that needs no model runs before
anything loads (fitune.train.preflight.preflight_problems, TrainConfig.validate): LoRA targets against the model's
config.json, CUDA-only options, missing packages (all in one message), data formats, paths (and what they are
relative to). Plus the smaller items: --attn flash, compile on the CPU, seq_len beyond the model's positions,
--tokenizer /nope, the quickstart without torch, DeepSpeed's accelerator notice.

"Before loading" is checked by order of events, never by time: `fitune.train.loop.train` (where the tokenizer, the
data and the model load) is replaced by a function that fails the test if it is reached.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from fitune.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _chat_file(path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(20):
            f.write(json.dumps(CHAT) + "\n")
    return str(path)


def _config(path, model: str, data: str, **more) -> str:
    lines = [f"model: {model}", "init: pretrained", f"data: {{path: {data}}}", "max_steps: 1",
             f"output_dir: {os.path.join(os.path.dirname(str(path)), 'out')}"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in more.items()]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def run_yaml(tmp_path, real_model_dir):
    """The issue's reproduction: the real SmolLM2 folder, 20 chat rows, max_steps 1."""
    return _config(tmp_path / "r.yaml", real_model_dir, _chat_file(tmp_path / "chat.jsonl"))


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if `fitune train` gets as far as the loop (tokenizer, data, model)."""
    import fitune.train.loop as loop

    def reached(*args, **kwargs):
        raise AssertionError("fitune train reached the training loop (the tokenizer and the data would load)")

    monkeypatch.setattr(loop, "train", reached)


@pytest.fixture
def cpu_machine(monkeypatch):
    """A machine without CUDA (whatever this one has)."""
    monkeypatch.setattr("fitune.runtime.needs.cuda_available", lambda: False)


def _train(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


# ---- LoRA targets the model lacks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["query,value", "embed_tokens", "*", "Q_PROJ"])
def test_lora_targets_the_model_lacks_get_estimates_message_before_loading(run_yaml, real_model_dir, targets, capsys,
                                                                         nothing_loads):
    assert main(["estimate", real_model_dir, "--lora-targets", targets]) == 2
    estimate_error = capsys.readouterr().err.split("fitune estimate: error: ", 1)[1]
    code, err = _train(capsys, run_yaml, "--no-progress", "--lora-targets", targets)
    assert code == 2
    assert err == f"fitune train: error: {estimate_error}"
    assert err.count("error:") == 1
    assert (f"--lora-targets {targets}: not a Linear of this model; it has q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj (or use all-linear)") in err


def test_lora_targets_in_the_yaml_are_named_by_their_key(tmp_path, real_model_dir, capsys, nothing_loads):
    cfg = _config(tmp_path / "r.yaml", real_model_dir, _chat_file(tmp_path / "chat.jsonl"),
                  lora={"targets": ["query", "value"]})
    code, err = _train(capsys, cfg, "--no-progress")
    assert code == 2
    assert "error: lora.targets: query,value: not a Linear of this model; it has q_proj," in err


def test_peft_matching_no_module_becomes_the_same_message():
    """An architecture outside the catalog is checked when PEFT wraps it: PEFT's NoMatchingPeftModuleError becomes
    the ConfigError estimate's check gives, with the Linear names the model has."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fitune.errors import ConfigError
    from fitune.runtime.model import layer_linear_names, wrap_lora

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    assert layer_linear_names(model) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    expected = (r"^lora.targets: query,value: not a Linear of this model; it has q_proj, k_proj, v_proj, o_proj, "
                r"gate_proj, up_proj, down_proj \(or use all-linear\)$")
    with pytest.raises(ConfigError, match=expected):
        wrap_lora(model, 4, ["query", "value"])


# ---- CUDA-only options and missing packages --------------------------------------------------------------------------


@pytest.mark.parametrize("flags, option, package", [
    (["--optimizer", "adamw8bit"], "optimizer: adamw8bit", "bitsandbytes"),
    (["--kernels", "liger"], "kernels: liger", "liger-kernel"),
    (["--method", "qlora"], "method: qlora", "bitsandbytes"),
])
def test_cuda_only_options_are_refused_before_loading(run_yaml, flags, option, package, capsys, cpu_machine,
                                                      nothing_loads, monkeypatch):
    monkeypatch.setattr("fitune.runtime.needs.has_module", lambda m: m not in ("bitsandbytes", "liger_kernel"))
    code, err = _train(capsys, run_yaml, "--no-progress", *flags)
    assert code == 2
    assert f"{option} needs a CUDA GPU" in err and "this machine has none" in err
    assert f"pip install {package}\n" in err


def test_every_missing_package_is_named_in_one_message_with_one_pip_line(run_yaml, capsys, cpu_machine,
                                                                         nothing_loads, monkeypatch):
    monkeypatch.setattr("fitune.runtime.needs.has_module", lambda m: m not in ("bitsandbytes", "liger_kernel"))
    flags = ["--method", "qlora", "--optimizer", "adamw8bit", "--kernels", "liger"]
    code, err = _train(capsys, run_yaml, "--no-progress", *flags)
    assert code == 2
    assert err.startswith("fitune train: error: 4 problems in the training setup:\n")
    assert ("  - these packages are not installed: bitsandbytes (for method: qlora, optimizer: adamw8bit), "
            "liger-kernel (for kernels: liger); install them with: pip install bitsandbytes liger-kernel\n") in err
    assert err.count("pip install") == 1
    for option in ("method: qlora", "optimizer: adamw8bit", "kernels: liger"):
        assert f"  - {option} needs a CUDA GPU" in err
    # on a GPU machine the packages are all that is missing: one problem
    monkeypatch.setattr("fitune.runtime.needs.cuda_available", lambda: True)
    code, err = _train(capsys, run_yaml, "--no-progress", *flags)
    assert code == 2
    assert err == ("fitune train: error: these packages are not installed: bitsandbytes (for method: qlora, optimizer: "
                   "adamw8bit), liger-kernel (for kernels: liger); install them with: pip install bitsandbytes "
                   "liger-kernel\n")


def test_missing_torch_stack_is_one_extra_in_the_pip_line():
    from fitune.runtime.needs import machine_problems, needs_of
    from fitune.setup import TrainSetup

    needs = needs_of(TrainSetup(stack="fitune", optimizer="adamw8bit"), ("wandb",))
    missing = {"torch", "peft", "bitsandbytes", "wandb"}
    (problem,) = machine_problems(needs, on_cuda=True, has=lambda m: m not in missing)
    assert problem == ("these packages are not installed: torch (for fitune train), peft (for fitune train), "
                       "bitsandbytes (for optimizer: adamw8bit), wandb (for report_to: wandb); install them with: "
                       "pip install 'fitune[torch]' bitsandbytes wandb")


@pytest.mark.parametrize("hidden", [("tensorboard",), ("wandb",), ("tensorboard", "wandb")])
def test_a_missing_logger_package_is_refused_before_loading(run_yaml, hidden, capsys, nothing_loads, monkeypatch):
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # import tensorboard -> ImportError
    code, err = _train(capsys, run_yaml, "--no-progress", "--report-to", ",".join(hidden))
    assert code == 2
    assert f"install {'it' if len(hidden) == 1 else 'them'} with: pip install {' '.join(hidden)}\n" in err
    for module in hidden:
        assert f"{module} (for report_to: {module})" in err


def test_the_runtime_raises_the_same_package_message(tmp_path, monkeypatch):
    from fitune.errors import FituneError
    from fitune.train.loggers import make_loggers

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    expected = r"^this package is not installed: tensorboard \(for report_to: tensorboard\); install it with: pip " \
               r"install tensorboard"
    with pytest.raises(FituneError, match=expected):
        make_loggers(("tensorboard",), str(tmp_path), "r", {})


# ---- data formats ----------------------------------------------------------------------------------------------------


def test_a_wrong_data_format_is_refused_before_the_tokenizer_loads(run_yaml, capsys, nothing_loads):
    code, err = _train(capsys, run_yaml, "--no-progress", "--data-format", "alpaca")
    assert code == 2
    assert "chat.jsonl: 20 bad records; fix or delete them:\n  line 1: missing field 'instruction' (keys found: " \
           "['messages'])" in err
    assert ("(these records look like format chat, not alpaca: set data.format (--data-format) to chat, or leave it "
            "out to detect the format from the records)") in err


def test_the_format_peek_reads_only_the_first_records(tmp_path):
    from fitune.data.encode import PEEK_RECORDS, check_first_records
    from fitune.errors import DataError

    path = tmp_path / "d.jsonl"
    rows = [json.dumps(CHAT)] * (PEEK_RECORDS + 50) + ["not json at all"]
    path.write_text("\n".join(rows) + "\n")
    assert check_first_records(str(path), None) == "chat"  # the bad line is past the peek: training reports it
    rows[2] = json.dumps({"text": "no messages"})
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"(?s)line 3: missing field 'messages'.*checked the first 100 records before "
                                        r"loading the model"):
        check_first_records(str(path), "chat")


def test_an_unreadable_line_in_the_peek_lists_every_bad_line(tmp_path):
    from fitune.data.encode import check_first_records
    from fitune.errors import DataError

    path = tmp_path / "d.jsonl"
    path.write_text("{bad\n" + json.dumps(CHAT) + "\n" * 300 + "{worse\n")
    with pytest.raises(DataError, match=r"(?s)2 bad records.*line 1:.*line 302:"):
        check_first_records(str(path), None)


# ---- paths and what they are relative to -----------------------------------------------------------------------------


def test_a_relative_path_says_it_is_read_from_the_current_directory(tmp_path, real_model_dir, capsys, monkeypatch,
                                                                    nothing_loads):
    folder = tmp_path / "configs"
    folder.mkdir()
    _chat_file(folder / "chat.jsonl")
    cfg = _config(folder / "r.yaml", real_model_dir, "chat.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = _train(capsys, cfg, "--no-progress")
    assert code == 2
    assert err == (f"fitune train: error: data.path: chat.jsonl does not exist (relative to the current directory "
                   f"({elsewhere}), not the config's folder ({folder}); {folder / 'chat.jsonl'} exists: write that "
                   f"path in the config, or run fitune from {folder})\n")
    os.remove(folder / "chat.jsonl")  # nothing beside the config either: where it was looked for, no suggestion
    code, err = _train(capsys, cfg, "--no-progress")
    assert code == 2
    assert err == (f"fitune train: error: data.path: chat.jsonl does not exist (relative to the current directory "
                   f"({elsewhere}), not the config's folder ({folder}))\n")
    code, err = _train(capsys, cfg, "--no-progress", "--data", "chat.jsonl")  # a flag's path: the current directory
    assert code == 2
    assert err == "fitune train: error: --data chat.jsonl does not exist (a Hub data set id is written ORG/NAME)\n"


def test_a_relative_model_that_reads_as_a_hub_id_but_sits_beside_the_config(tmp_path, real_model_dir, capsys,
                                                                           monkeypatch, nothing_loads):
    folder = tmp_path / "configs"
    (folder / "models").mkdir(parents=True)
    os.symlink(real_model_dir, folder / "models" / "smol")
    cfg = _config(folder / "r.yaml", "models/smol", _chat_file(tmp_path / "chat.jsonl"))
    monkeypatch.chdir(tmp_path)
    code, err = _train(capsys, cfg, "--no-progress")
    assert code == 2
    assert err == (f"fitune train: error: model: models/smol does not exist (relative to the current directory "
                   f"({tmp_path}), not the config's folder ({folder}); {folder / 'models/smol'} exists: write that "
                   f"path in the config, or run fitune from {folder})\n")


def test_a_missing_tokenizer_folder(run_yaml, capsys, nothing_loads):
    code, err = _train(capsys, run_yaml, "--no-progress", "--tokenizer", "/nope")
    assert code == 2
    assert err == ("fitune train: error: --tokenizer /nope: no such folder; pass a folder with tokenizer.json / "
                   "tokenizer_config.json (a downloaded model folder works), a .gguf file or a Hub id (org/name) in "
                   "the Hub cache\n")


def test_an_uncached_tokenizer_hub_id_offline_is_refused_before_loading(run_yaml, capsys, nothing_loads, monkeypatch,
                                                                        tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, err = _train(capsys, run_yaml, "--no-progress", "--tokenizer", "some-org/some-tokenizer")
    assert code == 2
    assert err.startswith("fitune train: error: tokenizer: some-org/some-tokenizer is not in the Hub cache (")
    assert "HF_HUB_OFFLINE is set" in err


# ---- --attn flash, compile on the CPU --------------------------------------------------------------------------------


def test_attn_flash_is_flash_attention_2_or_refused(run_yaml, capsys, cpu_machine, nothing_loads, monkeypatch):
    from fitune.errors import ConfigError
    from fitune.runtime.model import hf_attn_implementation

    monkeypatch.setattr("fitune.runtime.needs.has_module", lambda m: m != "flash_attn")
    code, err = _train(capsys, run_yaml, "--no-progress", "--attn", "flash")
    assert code == 2
    assert "  - attn: flash needs a CUDA GPU (flash-attention 2 is a CUDA kernel) and this machine has none" in err
    assert "install it with: pip install flash-attn\n" in err
    with pytest.raises(ConfigError, match=r"^this package is not installed: flash-attn \(for attn: flash\); install "
                                          r"it with: pip install flash-attn$"):
        hf_attn_implementation("flash", "cuda")
    monkeypatch.setattr("fitune.runtime.needs.has_module", lambda m: True)
    assert hf_attn_implementation("flash", "cuda") == "flash_attention_2"  # what the estimator and plan mean
    assert hf_attn_implementation("sdpa", "cpu") == "sdpa"
    assert hf_attn_implementation("flash", "cpu") == "sdpa"  # a CPU model built outside train: said in a warning
    with pytest.raises(ConfigError, match="bf16 or fp16 only"):
        hf_attn_implementation("flash", "cuda", "fp32")
    monkeypatch.setattr("fitune.runtime.needs.cuda_available", lambda: True)
    code, err = _train(capsys, run_yaml, "--no-progress", "--attn", "flash", "--dtype", "fp32")
    assert code == 2
    assert err == ("fitune train: error: attn: flash runs flash-attention 2, which computes in bf16 or fp16 only; "
                   "with dtype: fp32 use attn: sdpa (or dtype: bf16)\n")


def test_packed_rows_with_flash_attention_need_one_row_per_micro_batch(run_yaml, capsys, nothing_loads):
    """transformers' flash_attention_2 separates packed examples by their position ids only in a batch of one row;
    with more they would attend to each other."""
    code, err = _train(capsys, run_yaml, "--no-progress", "--packing", "--attn", "flash", "--grad-accum", "3")
    assert code == 2
    assert err == ("fitune train: error: packing with attn flash and batch_size 2: flash-attention 2 keeps packed "
                   "examples apart only with one row per micro-batch; use batch_size 1 (with grad_accum 6: the same "
                   "step), or attn sdpa, with which fitune attends each packed example on its own\n")


def test_compiled_layers_on_the_cpu_are_refused_before_loading(run_yaml, capsys, cpu_machine, nothing_loads):
    code, err = _train(capsys, run_yaml, "--no-progress", "--compile", "layers", "--lean-lora")
    assert code == 2
    assert err == ("fitune train: error: compile: layers needs a CUDA GPU (Inductor's Triton kernels; on the CPU, "
                   "compiling takes minutes and gives no speed-up) and this machine has none; run it on a machine "
                   "with an NVIDIA GPU, or use compile: none\n")


def test_a_cpu_rehearsal_of_several_ranks_counts_as_no_cuda(monkeypatch):
    from fitune.train.preflight import runs_on_cuda as _runs_on_cuda
    from fitune.parallel import CPU_RANKS_ENV
    from fitune.setup import TrainSetup

    monkeypatch.setattr("fitune.runtime.needs.cuda_available", lambda: True)
    monkeypatch.setenv(CPU_RANKS_ENV, "1")
    assert _runs_on_cuda(TrainSetup(num_gpus=2)) is False
    assert _runs_on_cuda(TrainSetup(num_gpus=1)) is True


# ---- seq_len beyond the model's positions ----------------------------------------------------------------------------


def test_seq_len_beyond_the_models_positions_is_warned_before_training(run_yaml, capsys, caplog, monkeypatch):
    pytest.importorskip("torch")
    import fitune.runtime.model as model_mod
    from fitune.errors import ConfigError

    warning = ("fitune train: warning: seq_len 100000 tokens is beyond the 8192 positions {} was trained on "
               "(max_position_embeddings in its config.json, no rope_scaling that reaches further): rows longer than "
               "8192 tokens use positions the model was not trained on")
    warned_before_tokenizer = []

    def stop(*args, **kwargs):  # the tokenizer is the first thing the run loads: was the warning said by then?
        warned_before_tokenizer.append([r.getMessage() for r in caplog.records if "warning: seq_len" in r.getMessage()])
        raise ConfigError("stopped at the tokenizer")

    monkeypatch.setattr(model_mod, "load_tokenizer", stop)
    caplog.set_level(logging.WARNING, logger="fitune")
    code, err = _train(capsys, run_yaml, "--no-progress", "--seq-len", "100000")
    assert code == 2 and err == "fitune train: error: stopped at the tokenizer\n"
    (said,) = warned_before_tokenizer[0]
    model = open(run_yaml).readline().split(": ", 1)[1].strip()
    assert said.startswith(warning.format(model))
    caplog.clear()
    code, err = _train(capsys, run_yaml, "--no-progress", "--seq-len", "8192")
    assert code == 2 and warned_before_tokenizer[1] == []


def test_rope_scaling_that_reaches_the_sequence_is_no_warning():
    from fitune.config import trained_positions

    assert trained_positions({"max_position_embeddings": 8192}) == 8192
    llama31 = {"max_position_embeddings": 131072,
               "rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    assert trained_positions(llama31) == 131072  # llama-3.1-8b's 143k-token plans are still warned about
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 32768}}
    assert trained_positions(yarn) == 131072
    assert trained_positions({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2}}) == 8192
    assert trained_positions({}) is None


# ---- the quickstart without torch; DeepSpeed's notice ----------------------------------------------------------------


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_quickstart_without_torch_names_the_install(tmp_path):
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['quickstart', sys.argv[1]]; "
            "runpy.run_module('fitune.train.quickstart', run_name='__main__')")
    done = _python(code, str(tmp_path / "qs"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr == ("python -m fitune.train.quickstart: error: this package is not installed: torch (for the "
                           "quickstart's tiny model, and fitune train); install it with: pip install 'fitune[torch]'\n")
    assert not (tmp_path / "qs").exists()


def test_deepspeeds_accelerator_notice_is_dropped_and_its_other_messages_kept():
    pytest.importorskip("deepspeed")
    code = ("from fitune.cli.main import main; main(['estimate', 'llama-3.1-8b', '--gpu', 'rtx4090']); "
            "import deepspeed; from deepspeed.utils import logger; logger.warning('another deepspeed warning')")
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert "accelerator" not in done.stdout + done.stderr
    assert "another deepspeed warning" in done.stdout


def test_the_notice_filter_drops_that_record_only():
    from fitune.cli.main import _DropAcceleratorNotice

    def record(msg):
        return logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213, msg, None, None)

    drop = _DropAcceleratorNotice()
    assert not drop.filter(record("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
                                  "to detect it."))
    assert drop.filter(record("ZeRO stage 2 optimizer"))
