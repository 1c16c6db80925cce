"""Run training scripts *as written* with random weights, and put their measured peaks beside `fitune doctor`'s
estimate of the same scripts. Run on the GPU machine.

Each script runs in its own subprocess (a crash or an OOM cannot leak into the next), with:
- `from_pretrained` of every causal LM replaced by a random-init model built from fitune's catalog config of the
  model the script names, by fitune's one model builder (`fitune.runtime.model.build_model`:
  `AutoModelForCausalLM.from_config(..., dtype=...)` on the device; `load_in_4bit` / a 4-bit
  `quantization_config`: its decoder quantised to NF4 on the GPU, as `fitune profile` does);
- `AutoTokenizer.from_pretrained` replaced by a word-level tokenizer whose pad token is what the real family's is
  (none for Llama and Mistral), and `datasets.load_dataset` by synthetic rows of exactly the recovered sequence
  length (every batch is the worst case the estimate describes);
- PyTorch's allocator capped with `torch.cuda.set_per_process_memory_fraction(budget / total)` (--cap rtx4090:
  23.40 GiB), saving turned off, and the run stopped after --steps optimizer steps (a global optimizer hook).

One JSON line per script is appended to --out as soon as it ends: peak allocated / reserved bytes, allocator
retries, OOM or the error, the setup fitune recovered from the script and fitune's estimate of it.

    PYTHONUNBUFFERED=1 python3 bench/doctor_scripts.py tests/fixtures/doctor/forum/trainer_llama_seeds.py \\
        tests/fixtures/doctor/forum/loop_llama_seeds.py --out $OUT/doctor_scripts.jsonl --cap rtx4090

`--device cpu --tiny` runs the same machinery on a 2-layer model on the CPU (tests/test_doctor_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import write_record  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1100, "max_position_embeddings": 1 << 16, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": None}
"""--tiny: the catalog config shrunk to a CPU-sized model of the same architecture."""
WORDS = 1000
"""The synthetic tokenizer's vocabulary: w0 ... w999 and four special tokens (ids below every model's vocab)."""
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
PAD_FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3")
"""Model types whose real tokenizers have a pad token; Llama and Mistral tokenizers do not."""


class StepsDone(Exception):
    """Raised by the optimizer hook after the requested number of steps: the run ends there."""


# ---- the parent: one subprocess per script ---------------------------------------------------------------------
def run_all(scripts: list[str], out: str, timeout_s: float, child_args: list[str]) -> list[dict]:
    """Run each script in a subprocess (`--one`), append its JSON line to `out`, return the records."""
    records = []
    for script in scripts:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--one", script, *child_args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            rec = _last_json(proc.stdout)
            if rec is None:
                rec = {"script": script, "status": "crashed", "returncode": proc.returncode,
                       "stderr_tail": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            rec = {"script": script, "status": "timeout", "timeout_s": timeout_s}
        rec["wall_s"] = round(time.time() - t0, 1)
        rec = write_record(out, rec)  # the doctor's findings on a script (its training steps are the script's own)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    return records


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{") and '"script"' in line:
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


# ---- the child: one script --------------------------------------------------------------------------------------
def recovered(script: str, model: str | None, cap: str | None) -> tuple:
    """(ScriptSetup, fitune's estimate of it on the cap's GPU, or rtx4090) - what `fitune doctor` says."""
    from fitune.doctor.script import index_source, read_script
    from fitune.memory import estimate
    from fitune.specs import load_model_spec
    from fitune.specs.gpu import resolve_gpu

    gpu = resolve_gpu(cap or "rtx4090")  # fitune doctor's default card when the run is not capped
    ss = index_source(read_script(script), script, model=model, gpu=gpu.name).script_setup
    return ss, estimate(load_model_spec(ss.model), ss.setup, gpu)


def model_config(name: str, tiny: bool) -> dict:
    """The catalog's config.json of `name` (shrunk with --tiny)."""
    from fitune.specs.model import model_catalog

    cfg = dict(model_catalog()[name]["config"])
    if tiny:
        cfg.update(TINY)
        for k in ("layer_types", "sliding_window_pattern"):
            cfg.pop(k, None)
    return cfg


def synthetic_tokenizer(model_type: str):
    """A word-level tokenizer: "w17" is one token; a pad token only where the real family has one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    kw = {"pad_token": "<pad>"} if model_type in PAD_FAMILIES else {}
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                model_max_length=1 << 20, **kw)
    t.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                       "{% if add_generation_prompt %}w0{% endif %}")
    return t


def synthetic_rows(n: int, seq_len_tokens: int) -> dict[str, list]:
    """`n` rows whose "text" is exactly `seq_len_tokens` tokens of the synthetic tokenizer (and the other columns
    forum scripts read: instruction / input / output, prompt / completion, messages)."""
    words = [f"w{i % WORDS}" for i in range(seq_len_tokens)]
    half = seq_len_tokens // 2
    text = " ".join(words)
    return {"text": [text] * n, "instruction": [" ".join(words[:half])] * n, "input": [""] * n,
            "output": [" ".join(words[half:])] * n, "prompt": [" ".join(words[:half])] * n,
            "completion": [" ".join(words[half:])] * n,
            "messages": [[{"role": "user", "content": " ".join(words[:half])},
                          {"role": "assistant", "content": " ".join(words[half:])}]] * n}


class ShimDataset:
    """What forum scripts use of `datasets.Dataset`, for machines without the `datasets` package."""

    MODEL_COLUMNS = ("input_ids", "attention_mask", "labels")

    def __init__(self, columns: dict[str, list], fmt: str | None = None):
        self.columns = columns
        self.fmt = fmt

    @property
    def format(self) -> dict:  # noqa: A003 - datasets' name
        return {"type": self.fmt, "format_kwargs": {}, "columns": self.column_names, "output_all_columns": False}

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i):
        if isinstance(i, str):
            return self.columns[i]
        row = {k: v[i] for k, v in self.columns.items()}
        if "input_ids" in row:  # Trainer's remove_unused_columns: the model takes only these
            row = {k: v for k, v in row.items() if k in self.MODEL_COLUMNS}
        if self.fmt == "torch":
            import torch

            row = {k: torch.tensor(v) for k, v in row.items()}
        return row

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def map(self, fn, batched: bool = False, remove_columns=None, batch_size: int = 1000, **_):
        drop = set([remove_columns] if isinstance(remove_columns, str) else remove_columns or [])
        n = len(self)
        out: dict[str, list] = {k: list(v) for k, v in self.columns.items() if k not in drop}
        new: dict[str, list] = {}
        if batched:
            for start in range(0, n, batch_size):
                res = fn({k: v[start:start + batch_size] for k, v in self.columns.items()})
                for k, v in dict(res).items():
                    new.setdefault(k, []).extend(list(v))
        else:
            for i in range(n):
                res = fn({k: v[i] for k, v in self.columns.items()})
                for k, v in dict(res).items():
                    new.setdefault(k, []).append(v)
        out.update(new)
        return ShimDataset(out, self.fmt)

    def filter(self, fn, **_):
        keep = [i for i in range(len(self)) if fn({k: v[i] for k, v in self.columns.items()})]
        return self.select(keep)

    def select(self, indices):
        idx = list(indices)
        return ShimDataset({k: [v[i] for i in idx] for k, v in self.columns.items()}, self.fmt)

    def shuffle(self, *_, **__):
        return self

    def set_format(self, type=None, columns=None, **_):  # noqa: A002 - datasets' name
        self.fmt = type
        if columns is not None:
            self.columns = {k: v for k, v in self.columns.items() if k in columns}

    def with_format(self, type=None, *_, **__):  # noqa: A002
        return ShimDataset(self.columns, type)

    def remove_columns(self, names):
        drop = {names} if isinstance(names, str) else set(names)
        return ShimDataset({k: v for k, v in self.columns.items() if k not in drop}, self.fmt)

    def train_test_split(self, *_, **__):
        return {"train": self, "test": self}


def install_patches(*, name: str, dtype_default: str, tiny: bool, device: str, rows: int, seq_len_tokens: int,
                    steps: int) -> dict:
    """Replace model and tokenizer loading, data loading, saving and the step count; returns a counter dict."""
    import types

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = {"steps": 0}
    cfg_dict = model_config(name, tiny)
    model_type = cfg_dict["model_type"]

    def build(*args, **kwargs):
        from fitune.runtime.model import build_model

        cfg = dict(cfg_dict)
        if "use_cache" in kwargs:
            cfg["use_cache"] = kwargs["use_cache"]
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype in (None, "auto"):  # transformers 5: the checkpoint's dtype
            dtype = cfg_dict.get("torch_dtype") or dtype_default
        dtype = str(dtype).replace("torch.", "")
        quant = kwargs.get("quantization_config")
        four_bit = kwargs.get("load_in_4bit") or bool(getattr(quant, "load_in_4bit", False))
        if kwargs.get("load_in_8bit") or getattr(quant, "load_in_8bit", False):
            raise NotImplementedError("8-bit base weights: not run by this bench")
        m = build_model(cfg, dtype_name=DTYPE_NAMES.get(dtype, "bf16") if not four_bit else "bf16",
                        attn=kwargs.get("attn_implementation") or "sdpa", device=device,
                        quantize="nf4" if four_bit else None, init="random")
        m.eval()  # as from_pretrained returns it
        return m

    def model_from_pretrained(cls, *args, **kwargs):
        return build(*args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(model_from_pretrained)
    transformers.PreTrainedModel.from_pretrained = classmethod(model_from_pretrained)
    AutoTokenizer.from_pretrained = classmethod(lambda cls, *a, **k: synthetic_tokenizer(model_type))
    transformers.PreTrainedTokenizerFast.from_pretrained = classmethod(lambda cls, *a, **k:
                                                                       synthetic_tokenizer(model_type))
    data = synthetic_rows(rows, seq_len_tokens)
    try:
        import datasets

        datasets.load_dataset = lambda *a, **k: datasets.Dataset.from_dict(data)
    except ImportError:
        import importlib.machinery

        shim = types.ModuleType("datasets")
        shim.__spec__ = importlib.machinery.ModuleSpec("datasets", None)  # import checks look for a spec
        shim.__version__ = "0.0.0+fitune-shim"
        shim.load_dataset = lambda *a, **k: ShimDataset({k2: list(v) for k2, v in data.items()})
        shim.Dataset = ShimDataset
        sys.modules["datasets"] = shim

    noop = lambda *a, **k: None  # noqa: E731
    transformers.PreTrainedModel.save_pretrained = noop
    transformers.Trainer.save_model = noop
    try:
        import peft

        peft.PeftModel.save_pretrained = noop
    except ImportError:
        pass
    original_post_init = transformers.TrainingArguments.__post_init__

    def post_init(self):
        self.report_to = "none"
        self.save_strategy = "no"
        if device == "cpu":
            self.use_cpu = True
        original_post_init(self)

    transformers.TrainingArguments.__post_init__ = post_init

    def count(optimizer, args, kwargs):
        state["steps"] += 1
        if state["steps"] >= steps:
            raise StepsDone()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(count)
    return state


def run_one(script: str, *, steps: int, cap: str | None, device: str, tiny: bool, model: str | None) -> dict:
    """Run `script` as written under the patches; its measured peaks and fitune's estimate of it."""
    import runpy

    import torch

    from fitune.runtime.oom import is_oom

    ss, est = recovered(script, model, cap)
    s = ss.setup
    rec: dict = {"script": script, "model": ss.model, "device": device, "tiny": tiny, "setup": s.to_dict(),
                 "estimate": {"gpu": est.gpu.name, "peak_allocated_bytes": est.peak_allocated_bytes,
                              "peak_reserved_bytes": est.peak_reserved_bytes, "fits": est.fits,
                              "retries_expected": est.retries_expected}}
    cuda = device == "cuda"
    if cuda and cap:
        from fitune.specs.gpu import resolve_gpu

        budget = resolve_gpu(cap).allocator_budget_bytes
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        rec["cap_bytes"] = budget
    rows = s.batch_size * s.grad_accum * (steps + 1) * 2
    state = install_patches(name=ss.model, dtype_default="bfloat16", tiny=tiny, device=device, rows=rows,
                            seq_len_tokens=s.seq_len_tokens, steps=steps)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    script_path = os.path.abspath(script)
    old_argv, old_cwd = sys.argv, os.getcwd()
    rec.update(status="ok", oom=False, error=None)
    with tempfile.TemporaryDirectory() as work:
        sys.argv = [script_path]
        os.chdir(work)
        try:
            runpy.run_path(script_path, run_name="__main__")
            rec["status"] = "finished"  # the script ended before --steps optimizer steps
        except StepsDone:
            pass
        except BaseException as exc:  # noqa: BLE001 - an OOM, or the script's own error, is the result
            if is_oom(exc):
                rec.update(status="oom", oom=True, error=str(exc).splitlines()[0][:300])
            else:
                rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            sys.argv = old_argv
            os.chdir(old_cwd)
    rec["steps"] = state["steps"]
    if cuda:
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        rec["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scripts", nargs="*", help="training scripts to run as written")
    p.add_argument("--one", metavar="SCRIPT", help=argparse.SUPPRESS)
    p.add_argument("--out", help="JSON lines file to append to (one line per script)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per script (default 3)")
    p.add_argument("--cap", default="rtx4090", help="allocator budget: a catalog GPU or NGiB (default rtx4090); "
                   "'none' for the whole card")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per script (default 1200)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same architecture (CPU tests)")
    p.add_argument("--model", help="the catalog model when the script's is not in the catalog")
    a = p.parse_args(argv)
    cap = None if a.cap in ("none", "") else a.cap
    if a.one:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("WANDB_DISABLED", "true")
        rec = run_one(a.one, steps=a.steps, cap=cap, device=a.device, tiny=a.tiny, model=a.model)
        print(json.dumps(rec), flush=True)
        return 0
    if not a.scripts or not a.out:
        p.error("give SCRIPT... and --out FILE.jsonl")
    child = ["--steps", str(a.steps), "--cap", a.cap, "--device", a.device]
    child += ["--tiny"] if a.tiny else []
    child += ["--model", a.model] if a.model else []
    run_all(a.scripts, a.out, a.timeout, child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
