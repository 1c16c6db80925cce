"""`extract_setup`: the `TrainSetup` a training script runs, read from its syntax tree (never run).

What is read, and from where (each recovered field keeps the lines it came from):

| construct | fields |
| --- | --- |
| `AutoModelForCausalLM.from_pretrained(id, dtype=/torch_dtype=, attn_implementation=, load_in_4bit=, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=...))` | model, dtype, attn, method (qlora) |
| `LoraConfig(r=, lora_alpha=, lora_dropout=, target_modules=)`, `get_peft_model` | method, lora_* |
| `TrainingArguments` / `SFTConfig(per_device_train_batch_size=, gradient_accumulation_steps=, gradient_checkpointing=, optim=, max_length= / max_seq_length=, packing=)` | batch_size, grad_accum, grad_checkpointing, optimizer, seq_len_tokens |
| tokenizer calls `tokenizer(..., max_length=, padding="max_length", truncation=True)` | seq_len_tokens |
| plain loops: `DataLoader(batch_size=)`, `torch.optim.AdamW` / `bnb.optim.AdamW8bit`, `model.gradient_checkpointing_enable()`, `out = model(**batch); out.loss.backward()` | batch_size, optimizer, grad_checkpointing, keep_outputs |
| Unsloth (`FastLanguageModel`, `FastModel`, `FastVisionModel`): `.from_pretrained(model_name=, max_seq_length=, load_in_4bit=, dtype=)`, `.get_peft_model(r=, target_modules=, use_gradient_checkpointing=)` | model, seq_len_tokens, dtype, method, lora_*, grad_checkpointing |

A model loaded in 4 bits with no adapter in sight is estimated as QLoRA (4-bit weights cannot train themselves).

Module constants (`MAX_LEN = 2048`) and argparse defaults (`parser.add_argument("--max-len", default=2048)`) are
followed, and the line that holds the value is the one a fix edits. What the script does not state takes the
library's default when the library is known (TrainingArguments' batch of 8, SFTConfig's max_length of 1024,
PEFT's r=8), else fitune's default; either way it is listed as assumed, with the `fitune doctor` flag that sets it.
Pure Python (ast); no torch.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from ..schema import _BAD, Problems, coerce, show_int
from ..setup import DEFAULT_SETUP, SETUP_KEYS, TrainSetup
from ..specs import load_model_spec, optimizers as optimizer_specs
from ..specs.model import model_catalog
from ..units import gib
from .evidence import REFERENCE_MODEL, catalog_name as catalog_model
from .index import UNKNOWN, Call, Ref, ScriptIndex, is_unsloth_loader, tokenizer_calls

#: The TrainSetup fields a script decides; the others (stack, loss, fitune's techniques) are fixed for a plain
#: transformers + PEFT script: stack "hf", loss "hf", no technique.
SCRIPT_FIELDS = ("method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "dtype", "grad_checkpointing",
                 "attn", "optimizer", "batch_size", "seq_len_tokens", "grad_accum", "keep_outputs")
FLAGS = {k.field: k.flag for k in SETUP_KEYS}
_KEYS = {k.field: k for k in SETUP_KEYS}

#: Defaults of the libraries a script leaves unset (transformers 5.17, PEFT 0.21, current TRL and Unsloth).
TRAINING_ARGS_BATCH = 8
"""TrainingArguments.per_device_train_batch_size's default."""
SFT_MAX_LENGTH = 1024
"""TRL SFTConfig.max_length's default (trl/trainer/sft_config.py)."""
PEFT_RANK, PEFT_ALPHA = 8, 8
"""LoraConfig's r and lora_alpha defaults (peft/tuners/lora/config.py)."""
UNSLOTH_RANK, UNSLOTH_ALPHA = 16, 16
UNSLOTH_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
                        "qwen3": ("q_proj", "v_proj"), "gemma2": ("q_proj", "v_proj"), "gemma3_text": ("q_proj", "v_proj"),
                        "mixtral": ("q_proj", "v_proj"), "qwen3_moe": ("q_proj", "v_proj")}
"""PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the catalog's families (target_modules=None)."""
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

OPTIMIZER_CLASSES = {cls: s.name for s in optimizer_specs.REGISTRY for cls in s.script_classes}
"""Optimizer classes of torch.optim, bitsandbytes.optim and transformers -> TrainSetup.optimizer (the registry's
`script_classes`)."""
SEQ_LEN_KWARGS = ("max_length", "max_seq_length")


@dataclass(frozen=True)
class Edit:
    """Where a value is written, so that a fix can say which line to change and how."""

    line: int
    text: str
    """As written: `per_device_train_batch_size=2`, `MAX_LEN = 2048`, `default=2048`; "" when the keyword is absent."""
    kind: str
    """keyword (`name=value` in a call) | constant (`NAME = value`) | argparse (`add_argument(..., default=)`) |
    missing (the keyword is not in `call` yet)."""
    name: str
    """The keyword or constant name."""
    call: str = ""
    """The call the keyword belongs to, as written: `TrainingArguments(...)`; for argparse, the flag (`--rank`)."""


@dataclass(frozen=True)
class Recovered:
    """One TrainSetup field as the script states it, or as assumed."""

    field: str
    value: Any
    lines: tuple[int, ...]
    origin: str
    """script (stated in it) | library (the default of the library the script calls) | fitune (fitune's default:
    nothing in the script decides it) | flag (given on the command line)."""
    why: str
    """`per_device_train_batch_size=2`, `TrainingArguments' default`, ..."""
    edit: Edit | None = None

    @property
    def assumed(self) -> bool:
        return self.origin in ("library", "fitune")

    @property
    def flag(self) -> str:
        return "--model" if self.field == "model" else FLAGS[self.field]


@dataclass(frozen=True)
class ScriptSetup:
    """The model and TrainSetup of a script as written, with where each came from."""

    model: str
    """Catalog name estimates use (the script's model, or the reference model when it is not recognised)."""
    model_id: str | None
    """The id as written in the script (`meta-llama/Llama-3.1-8B-Instruct`); None when none was found."""
    setup: TrainSetup
    fields: dict[str, Recovered]
    """Every SCRIPT_FIELDS field and "model"."""
    style: str
    """trainer | sft | unsloth | loop | unknown: how the script trains."""
    notes: tuple[str, ...] = ()
    gpu: str = "rtx4090"
    """The GPU (catalog name or budget) estimates of this script are judged on: `fitune doctor --gpu`."""
    anchors: dict[str, int] = field(default_factory=dict)
    """Lines a fix refers to: model_load, training_args, lora_config, backward, output (the kept model output),
    optimizer, dataloader."""

    @property
    def model_known(self) -> bool:
        """The model is a catalog model named by the script or by --model (not the reference model assumed)."""
        return self.fields["model"].origin in ("script", "flag")

    def lines(self) -> dict[str, list[int]]:
        return {f: list(r.lines) for f, r in self.fields.items() if r.lines}

    def assumed(self) -> dict[str, dict]:
        return {f: {"value": _json_value(r.value), "why": r.why, "flag": r.flag}
                for f, r in self.fields.items() if r.assumed}

    def to_dict(self) -> dict:
        """The `setup` object of `fitune doctor --json`: every TrainSetup field, the model, where each field came
        from (`lines`), what was assumed (`assumed`: value, why, the flag that sets it), and notes."""
        return {"model": self.model, "model_id": self.model_id, **self.setup.to_dict(), "style": self.style,
                "lines": self.lines(), "assumed": self.assumed(),
                "origin": {f: r.origin for f, r in self.fields.items()}, "notes": list(self.notes)}


def _json_value(v):
    return list(v) if isinstance(v, tuple) else v


# ---- the extraction -----------------------------------------------------------------------------------------------
def extract_setup(ix: ScriptIndex, overrides: dict[str, Any] | None = None,
                  model_override: str | None = None, gpu: str | None = None) -> ScriptSetup:
    """The script's model and TrainSetup, each field with its lines; `overrides` (field -> value, from the setup
    flags) and `model_override` (--model) win over the script."""
    return _Extractor(ix).run(overrides or {}, model_override, gpu or "rtx4090")


class _Extractor:
    def __init__(self, ix: ScriptIndex):
        self.ix = ix
        self.fields: dict[str, Recovered] = {}
        self.notes: list[str] = []
        self.anchors: dict[str, int] = {}
        self.const_lines = _constant_lines(ix.tree)
        self.arg_lines = _argparse_lines(ix)

    # ---- values with their lines -------------------------------------------------------------------------------
    def resolve(self, node: ast.AST | None, call: Call | None = None, kw: str = "") -> tuple[Any, tuple[int, ...],
                                                                                              Edit | None]:
        """(value, lines, edit) of an argument: literal, module constant or argparse default."""
        if node is None:
            return UNKNOWN, (), None
        value = self.ix.value(node)
        here = (node.lineno,)
        if isinstance(node, ast.Name) and node.id in self.const_lines:
            line = self.const_lines[node.id]
            return value, tuple(sorted({node.lineno, line})), Edit(line, f"{node.id} = {_code(value)}", "constant",
                                                                   node.id)
        if isinstance(node, ast.Attribute) and node.attr in self.arg_lines and value is not UNKNOWN:
            line, flag = self.arg_lines[node.attr]
            return value, tuple(sorted({node.lineno, line})), Edit(line, f"default={_code(value)}", "argparse",
                                                                   node.attr, flag)
        text = f"{kw}={ast.unparse(node)}" if kw else ast.unparse(node)
        return value, here, Edit(node.lineno, text, "keyword", kw, _call_text(call)) if kw else None

    def kw(self, call: Call | None, *names: str):
        """(value, lines, edit) of the first of `names` given to `call`; UNKNOWN when absent."""
        if call is None:
            return UNKNOWN, (), None
        for n in names:
            node = call.kw(n)
            if node is not None:
                return self.resolve(node, call, n)
        return UNKNOWN, (), Edit(call.line, "", "missing", names[0], _call_text(call))

    def put(self, f: str, value, lines, origin: str, why: str, edit: Edit | None = None) -> None:
        self.fields[f] = Recovered(f, value, tuple(lines), origin, why, edit)

    def put_kw(self, f: str, call: Call | None, names: tuple[str, ...], convert, default, default_origin: str,
               default_why: str) -> bool:
        """The field from a keyword of `call` (converted), else the default. True when the script states it."""
        value, lines, edit = self.kw(call, *names)
        if value is not UNKNOWN and value is not None:
            v = convert(value)
            if v is not None:
                kw = next(n for n in names if call.kw(n) is not None)
                self.put(f, v, lines, "script", f"{kw}={_show(value)}", edit)
                return True
            self.notes.append(f"{names[0]}={_show(value)} (line {lines[0]}) is not something fitune models; "
                              f"assumed {_show(default)} ({FLAGS[f]} sets it)")
        elif call is not None and call.open_kwargs and value is UNKNOWN:
            default_why += f"; {_call_text(call)} at line {call.line} takes **kwargs fitune cannot read"
        self.put(f, default, lines if value is not UNKNOWN else (), default_origin, default_why, edit)
        return False

    # ---- the run ----------------------------------------------------------------------------------------------
    def run(self, overrides: dict[str, Any], model_override: str | None, gpu: str) -> ScriptSetup:
        ix = self.ix
        self.load = self._model_load()
        self.args = self._training_args()
        self.sft = bool(ix.calls_named("SFTTrainer", "SFTConfig"))
        self.unsloth_load = next((c for c in ix.calls if c.tail == "from_pretrained"
                                  and is_unsloth_loader(c.receiver)), None)
        self.unsloth_peft = next((c for c in ix.calls if c.tail == "get_peft_model"
                                  and is_unsloth_loader(c.receiver)), None)
        self.lora = next(iter(ix.calls_named("LoraConfig")), None)
        style = ("unsloth" if self.unsloth_load else "sft" if self.sft else "trainer" if ix.uses_trainer else
                 "loop" if ix.trains else "unknown")
        for name, c in (("model_load", self.load), ("training_args", self.args), ("lora_config", self.lora or
                                                                                  self.unsloth_peft)):
            if c is not None:
                self.anchors[name] = c.line

        model_name, model_id = self._model(model_override)
        spec = load_model_spec(model_name)
        self._method()
        self._lora(spec)
        self._dtype(model_name)
        self._checkpointing()
        self._attn()
        self._optimizer()
        self._batch()
        self._seq_len()
        self._keep_outputs()
        self._within_bounds()
        for f, v in overrides.items():
            if f in SCRIPT_FIELDS or f in _KEYS:
                self.put(f, v, (), "flag", f"{FLAGS[f]} {_show(v)}")
        values = {f: self.fields[f].value for f in SCRIPT_FIELDS}
        extra = {f: v for f, v in overrides.items() if f not in SCRIPT_FIELDS}
        values = _fit_to_model(values, spec, self.notes)
        self._kbit_note(spec)
        setup = DEFAULT_SETUP.replace(**values, **extra)
        return ScriptSetup(model_name, model_id, setup, dict(self.fields), style, tuple(dict.fromkeys(self.notes)),
                           gpu, dict(self.anchors))

    def _within_bounds(self) -> None:
        """A value the script states that no setting of fitune's takes (`per_device_train_batch_size=0`, a 400-digit
        `max_length`): noted with the bound it breaks, and fitune's default assumed in its place (the flag sets it),
        as for a value fitune does not model; the estimate never sees it."""
        for f in SCRIPT_FIELDS:
            r = self.fields.get(f)
            if r is None or r.origin != "script" or f not in _KEYS:
                continue
            problems = Problems()
            if coerce(_KEYS[f], r.value, "yaml", problems) is not _BAD and not problems.items:
                continue
            why = problems.items[0].removeprefix(f"{_KEYS[f].yaml}: ") if problems.items else "not a value it takes"
            default = getattr(DEFAULT_SETUP, f)
            where = f" (line {r.lines[0]})" if r.lines else ""
            self.notes.append(f"{r.why}{where}: {why}; assumed {_show(default)} ({FLAGS[f]} sets it)")
            self.put(f, default, r.lines, "fitune", f"{r.why} is outside what fitune models", r.edit)

    def _kbit_note(self, spec) -> None:
        kbit = self.ix.calls_named("prepare_model_for_kbit_training")
        if not kbit:
            return
        upcast = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2) * 2
        self.notes.append(f"prepare_model_for_kbit_training (line {kbit[0].line}) casts the weights bitsandbytes "
                          f"leaves in 16 bits (embeddings, lm_head, norms) to float32: about {gib(upcast)} more than "
                          "this estimate counts")

    # ---- model ----------------------------------------------------------------------------------------------
    def _model_load(self) -> Call | None:
        loads = self.ix.model_loads
        causal = [c for c in loads if "CausalLM" in c.receiver or is_unsloth_loader(c.receiver)]
        return (causal or loads or [None])[0]

    def _training_args(self) -> Call | None:
        args = self.ix.training_args
        return args[0] if args else None

    def _model(self, override: str | None) -> tuple[str, str | None]:
        if override:
            name = catalog_model(override) or override
            self.put("model", name, (), "flag", f"--model {override}")
            return name, override
        candidates = []
        if self.load is not None:
            candidates.append((self.load, ("pretrained_model_name_or_path", "model_name", "model_id"), 0))
        for c in self.ix.trainer_calls:
            candidates.append((c, ("model",), 0))
        for c in self.ix.calls:
            if c.tail == "from_pretrained" and "Tokenizer" in c.receiver:
                candidates.append((c, ("pretrained_model_name_or_path",), 0))
        written = None
        for call, kws, pos in candidates:
            node = call.arg(pos) if call.arg(pos) is not None else next(
                (call.kw(k) for k in kws if call.kw(k) is not None), None)
            value, lines, edit = self.resolve(node)
            if not isinstance(value, str):
                continue
            written = written or (value, lines)
            name = catalog_model(value)
            if name:
                self.put("model", name, lines, "script", f"{value!r}", edit)
                return name, value
        if written:
            self.put("model", REFERENCE_MODEL, written[1], "fitune",
                     f"{written[0]!r} is not in fitune's catalog (fitune estimate --list-models); estimated as "
                     f"{REFERENCE_MODEL}")
            return REFERENCE_MODEL, written[0]
        self.put("model", REFERENCE_MODEL, (), "fitune", f"no literal model id in the script; estimated as "
                 f"{REFERENCE_MODEL}")
        return REFERENCE_MODEL, None

    # ---- method and adapters ------------------------------------------------------------------------------------
    def _quantized(self) -> tuple[str | None, tuple[int, ...], Call | None]:
        """("4bit" | "8bit" | None, lines, the BitsAndBytesConfig call) of the model load."""
        load = self.load
        if load is None:
            return None, (), None
        if self.unsloth_load is not None and load is self.unsloth_load:
            v, lines, _ = self.kw(load, "load_in_4bit")
            if v is False:
                return None, lines, None
            return "4bit", lines or (load.line,), None  # Unsloth loads in 4 bits unless told otherwise
        for bits in ("4bit", "8bit"):
            v, lines, _ = self.kw(load, f"load_in_{bits}")
            if v is True:
                return bits, lines, None
        qc = load.kw("quantization_config")
        bnb = self._call_of(qc, "BitsAndBytesConfig")
        if bnb is not None:
            for bits in ("4bit", "8bit"):
                v, lines, _ = self.kw(bnb, f"load_in_{bits}")
                if v is True:
                    return bits, tuple(sorted({qc.lineno, *lines})), bnb
        return None, (), None

    def _call_of(self, node: ast.AST | None, tail: str) -> Call | None:
        """The `tail(...)` call `node` is, or the one the variable `node` names was assigned from."""
        if node is None:
            return None
        if isinstance(node, ast.Name):
            sources = [a.value for a in self.ix.assignments_to(node.id) if isinstance(a.value, ast.Call)]
            node = sources[-1] if sources else node
        if isinstance(node, ast.Call):
            return next((c for c in self.ix.calls if c.node is node and c.tail == tail), None)
        return None

    def _method(self) -> None:
        ix = self.ix
        bits, qlines, _ = self._quantized()
        peft_sites = [c for c in ix.calls if c.tail in ("LoraConfig", "get_peft_model")] + [
            c for c in ix.calls if c.has_kw("peft_config")]
        lora_lines = tuple(sorted({c.line for c in peft_sites}))
        if peft_sites or self.unsloth_peft:
            lines = tuple(sorted({*lora_lines, *qlines}))
            if bits == "4bit":
                self.put("method", "qlora", lines, "script", "4-bit base weights + LoRA")
            else:
                if bits == "8bit":
                    self.notes.append("load_in_8bit: 8-bit base weights are not modelled; estimated with bf16 base "
                                      "weights (more memory than the script needs)")
                self.put("method", "lora", lines, "script", "LoRA (PEFT)")
            return
        if ix.trains and self.load is not None and bits == "4bit":
            self.notes.append(f"the model is loaded in 4 bits (line {qlines[0]}) and no adapter was found: 4-bit "
                              "weights cannot train themselves (bitsandbytes keeps them frozen), so the script can "
                              "only train LoRA adapters on them; estimated as QLoRA with the default adapters "
                              "(--lora-rank, --lora-targets set them)")
            self.put("method", "qlora", qlines, "script", "4-bit base weights: trains adapters (QLoRA)")
            return
        if ix.trains and self.load is not None:
            if ix.freezes_parameters:
                self.notes.append("parameters are frozen by hand: estimated as a full fine-tune (an upper bound); "
                                  "--method freeze with --freeze-trainable-layers K is closer")
            self.put("method", "full", (self.load.line,), "script", "no adapter: every weight trains")
            return
        self.put("method", DEFAULT_SETUP.method, (), "fitune", "no training found in the script")

    def _lora(self, spec) -> None:
        unsloth = self.unsloth_peft
        call = self.lora or unsloth
        rank_default, alpha_default = (UNSLOTH_RANK, UNSLOTH_ALPHA) if unsloth and not self.lora else (PEFT_RANK,
                                                                                                       PEFT_ALPHA)
        owner = f"{ast.unparse(unsloth.node.func)}" if unsloth and not self.lora else "LoraConfig"
        if call is None:
            self.put("lora_rank", DEFAULT_SETUP.lora_rank, (), "fitune", "no LoraConfig in the script")
            self.put("lora_alpha", DEFAULT_SETUP.lora_alpha, (), "fitune", "no LoraConfig in the script")
            self.put("lora_dropout", DEFAULT_SETUP.lora_dropout, (), "fitune", "no LoraConfig in the script")
            self.put("lora_targets", DEFAULT_SETUP.lora_targets, (), "fitune", "no LoraConfig in the script")
            return
        self.put_kw("lora_rank", call, ("r", "rank"), _int, rank_default, "library", f"{owner}'s default r")
        self.put_kw("lora_alpha", call, ("lora_alpha",), _int, alpha_default, "library", f"{owner}'s default")
        self.put_kw("lora_dropout", call, ("lora_dropout",), _float, 0.0, "library", f"{owner}'s default")
        if unsloth and not self.lora:
            default, why = UNSLOTH_TARGETS, "get_peft_model's default (every linear layer)"
        else:
            default = PEFT_DEFAULT_TARGETS.get(spec.model_type, DEFAULT_SETUP.lora_targets)
            why = f"PEFT's default target_modules for {spec.model_type}"
        self.put_kw("lora_targets", call, ("target_modules",), _targets, default, "library", why)

    # ---- precision, checkpointing, attention, optimizer -----------------------------------------------------------
    def _dtype(self, model_name: str) -> None:
        ix, load = self.ix, self.load
        bits, qlines, bnb = self._quantized()
        if load is not None and load is self.unsloth_load:
            self._unsloth_dtype(load)
            return
        if bits == "4bit":
            v, lines, edit = self.kw(bnb, "bnb_4bit_compute_dtype") if bnb else (UNKNOWN, (), None)
            d = ix.dtype_of(bnb.kw("bnb_4bit_compute_dtype")) if bnb else None
            if d == "fp16":
                self.put("dtype", "fp16", lines, "script", "bnb_4bit_compute_dtype=float16", edit)
            else:
                self.put("dtype", "bf16", lines or qlines, "script" if d == "bf16" else "library",
                         "4-bit weights computed in bf16" if d == "bf16" else
                         "QLoRA computes in bf16 (bnb_4bit_compute_dtype not given: bitsandbytes' float32 default "
                         "is not modelled)", edit)
            return
        for c in ix.calls:  # model.half(), model.bfloat16(), model.to(torch.bfloat16)
            if c.receiver in ix.model_variables and c.tail in ("half", "bfloat16", "float") and not c.node.args:
                d = {"half": "fp16", "bfloat16": "bf16", "float": "fp32"}[c.tail]
                self.put("dtype", d, (c.line,), "script", f"{c.receiver}.{c.tail}()")
                return
            if c.receiver in ix.model_variables and c.tail == "to":
                for a in c.node.args:
                    d = ix.dtype_of(a)
                    if d in ("fp32", "bf16", "fp16"):
                        self.put("dtype", d, (c.line,), "script", f"{c.receiver}.to({ast.unparse(a)})")
                        return
        if load is not None:
            node = load.kw("dtype") if load.kw("dtype") is not None else load.kw("torch_dtype")
            d = ix.dtype_of(node)
            if d in ("fp32", "bf16", "fp16"):
                _, lines, edit = self.resolve(node, load, "dtype" if load.kw("dtype") is not None else "torch_dtype")
                self.put("dtype", d, lines, "script", f"{edit.text if edit else ast.unparse(node)}", edit)
                self._autocast_note(d)
                return
        cfg = model_catalog().get(model_name, {}).get("config", {})
        ckpt = TORCH_DTYPES.get(str(cfg.get("torch_dtype", "bfloat16")), "bf16")
        said = "dtype='auto'" if load is not None and load.kw("dtype") is not None else "no dtype"
        edit = Edit(load.line, "", "missing", "dtype", _call_text(load)) if load is not None else None
        self.put("dtype", ckpt, (load.line,) if load else (), "library",
                 f"from_pretrained with {said}: transformers 5 loads the checkpoint's dtype "
                 f"({cfg.get('torch_dtype', 'bfloat16')}); transformers 4 loaded float32", edit)
        self._autocast_note(ckpt)

    def _unsloth_dtype(self, load: Call) -> None:
        """Unsloth's `dtype=`: the compute dtype (of the 4-bit layers too); None picks bf16 where the GPU has it."""
        node = load.kw("dtype")
        d = self.ix.dtype_of(node)
        if d in ("bf16", "fp16", "fp32"):
            _, lines, edit = self.resolve(node, load, "dtype")
            self.put("dtype", d, lines, "script", edit.text if edit else f"dtype={d}", edit)
            return
        edit = Edit(load.line, "", "missing", "dtype", _call_text(load)) if node is None else None
        self.put("dtype", "bf16", (load.line,), "library",
                 "Unsloth's dtype=None: bf16 on a GPU that has it (Ampere or newer), else float16", edit)

    def _autocast_note(self, dtype: str) -> None:
        if dtype == "fp32" and self.args is not None and (self.ix.is_true(self.args.kw("bf16"))
                                                          or self.ix.is_true(self.args.kw("fp16"))):
            self.notes.append("fp32 weights with bf16/fp16 mixed precision: the estimate takes every activation in "
                              "fp32 (autocast keeps many in 16 bits: an upper bound)")

    def _checkpointing(self) -> None:
        ix = self.ix
        enables = ix.calls_named("gradient_checkpointing_enable")
        kbit = [c for c in ix.calls_named("prepare_model_for_kbit_training")
                if c.kw("use_gradient_checkpointing") is None or ix.is_true(c.kw("use_gradient_checkpointing"))]
        if self.unsloth_peft is not None:
            v, lines, edit = self.kw(self.unsloth_peft, "use_gradient_checkpointing")
            if v is UNKNOWN:
                self.put("grad_checkpointing", "offload", (), "library",
                         "get_peft_model's default use_gradient_checkpointing='unsloth' (offloaded to CPU)", edit)
            else:
                mode = "offload" if v == "unsloth" else "full" if v is True else "none"
                self.put("grad_checkpointing", mode, lines, "script", f"use_gradient_checkpointing={v!r}", edit)
            return
        if ix.uses_trainer:
            v, lines, edit = self.kw(self.args, "gradient_checkpointing")
            if v is True:
                self.put("grad_checkpointing", "full", lines, "script", "gradient_checkpointing=True", edit)
            elif enables or kbit:
                c = (enables or kbit)[0]
                self.put("grad_checkpointing", "full", (c.line,), "script", f"{c.tail}()")
            elif v is False:
                self.put("grad_checkpointing", "none", lines, "script", "gradient_checkpointing=False", edit)
            elif self.sft and self.args is not None and self.args.tail == "SFTConfig":
                self.put("grad_checkpointing", "full", (), "library",
                         "SFTConfig's default gradient_checkpointing=True (current TRL; older releases: False)", edit)
            else:
                self.put("grad_checkpointing", "none", (), "library",
                         "TrainingArguments' default gradient_checkpointing=False", edit)
            return
        if enables or kbit:
            c = (enables or kbit)[0]
            if ix.calls_named("train"):
                self.put("grad_checkpointing", "full", (c.line,), "script", f"{c.tail}()")
            else:
                self.put("grad_checkpointing", "none", (c.line,), "script",
                         f"{c.tail}() without model.train(): from_pretrained returns the model in eval mode, where "
                         "no layer recomputes")
            return
        if any(c.name.startswith("torch.utils.checkpoint.") for c in ix.calls):
            c = next(c for c in ix.calls if c.name.startswith("torch.utils.checkpoint."))
            self.notes.append(f"torch.utils.checkpoint at line {c.line}: estimated as every layer checkpointed")
            self.put("grad_checkpointing", "full", (c.line,), "script", "torch.utils.checkpoint")
            return
        if self.args is not None and ix.is_true(self.args.kw("gradient_checkpointing")):
            self.put("grad_checkpointing", "none", (self.args.line,), "script",
                     "gradient_checkpointing=True but no Trainer reads it")
            return
        self.put("grad_checkpointing", "none", (), "fitune" if not ix.trains else "script",
                 "no checkpointing in the script")

    def _attn(self) -> None:
        v, lines, edit = self.kw(self.load, "attn_implementation")
        if isinstance(v, str):
            c = _coerce("attn", v)
            if c is not None:
                self.put("attn", c, lines, "script", f"attn_implementation={v!r}", edit)
                return
            self.notes.append(f"attn_implementation={v!r} (line {lines[0]}): not modelled; estimated as sdpa")
        self.put("attn", "sdpa", (), "library", "transformers' default attention (sdpa)", edit)

    def _optimizer(self) -> None:
        ix = self.ix
        for c in ix.calls:
            cls = c.tail
            if cls in OPTIMIZER_CLASSES and (c.name.startswith(("torch.optim", "bitsandbytes", "bnb", "transformers"))
                                             or c.name == cls):
                self.anchors["optimizer"] = c.line
                self.put("optimizer", OPTIMIZER_CLASSES[cls], (c.line,), "script", f"{ast.unparse(c.node.func)}",
                         Edit(c.line, ast.unparse(c.node.func), "class", cls))
                if cls == "SGD" and c.kw("momentum") is not None:
                    self.notes.append("SGD with momentum keeps one state per trained parameter; the estimate's sgd "
                                      "keeps none")
                return
            if "PagedAdamW32bit" in cls or cls == "PagedAdamW":
                self.put("optimizer", "adamw", (c.line,), "script", f"{cls} (32-bit states: as adamw)")
                return
        if self.args is not None and ix.uses_trainer:
            def convert(v):
                return _coerce("optimizer", v) if isinstance(v, str) else None
            self.put_kw("optimizer", self.args, ("optim",), convert, "adamw", "library",
                        "TrainingArguments' default optim (adamw_torch_fused)")
            return
        self.put("optimizer", "adamw", (), "fitune", "no optimizer found in the script")

    # ---- shapes --------------------------------------------------------------------------------------------------
    def _batch(self) -> None:
        ix = self.ix
        if self.args is not None and ix.uses_trainer:
            self.put_kw("batch_size", self.args, ("per_device_train_batch_size",), _int, TRAINING_ARGS_BATCH,
                        "library", f"{self.args.tail}'s default per_device_train_batch_size={TRAINING_ARGS_BATCH}")
            self.put_kw("grad_accum", self.args, ("gradient_accumulation_steps",), _int, 1, "library",
                        f"{self.args.tail}'s default")
            return
        loaders = [c for c in ix.calls if c.tail == "DataLoader"]
        if loaders:
            c = loaders[0]
            self.anchors["dataloader"] = c.line
            node = c.kw("batch_size") if c.kw("batch_size") is not None else c.arg(1)
            value, lines, edit = self.resolve(node, c, "batch_size") if node is not None else (UNKNOWN, (), Edit(
                c.line, "", "missing", "batch_size", _call_text(c)))
            if isinstance(value, int) and not isinstance(value, bool):
                self.put("batch_size", value, lines, "script", f"batch_size={value}", edit)
            else:
                self.put("batch_size", 1 if node is None else DEFAULT_SETUP.batch_size, (c.line,),
                         "library" if node is None else "fitune",
                         "DataLoader's default batch_size=1" if node is None else "batch_size not a constant", edit)
        else:
            self.put("batch_size", DEFAULT_SETUP.batch_size, (), "fitune", "no batch size found in the script")
        accum = [(n, line) for n, line in self.const_lines.items()
                 if "accum" in n.lower() and isinstance(ix.constants.get(n), int)]
        if accum:
            n, line = accum[0]
            self.put("grad_accum", ix.constants[n], (line,), "script", f"{n} = {ix.constants[n]}",
                     Edit(line, f"{n} = {ix.constants[n]}", "constant", n))
        else:
            self.put("grad_accum", 1, (), "fitune", "no gradient accumulation found in the script")

    def _seq_len(self) -> None:
        ix = self.ix
        sft_calls = ix.calls_named("SFTConfig", "SFTTrainer")
        for c in sft_calls:
            v, lines, edit = self.kw(c, *SEQ_LEN_KWARGS)
            if isinstance(v, int) and not isinstance(v, bool):
                self.put("seq_len_tokens", v, lines, "script", f"{edit.name}={v}"
                         + self._packing_note(sft_calls), edit)
                return
        for c in tokenizer_calls(ix):
            if c.grad_disabled or any(w in c.function.lower() for w in ("generate", "infer", "predict", "demo")):
                continue
            v, lines, edit = self.kw(c, "max_length")
            if isinstance(v, int) and not isinstance(v, bool):
                padded = ix.value(c.kw("padding")) == "max_length"
                self.put("seq_len_tokens", v, lines, "script",
                         f"max_length={v}" + (" with padding='max_length': every batch" if padded else
                                              ": the longest batch (shorter ones pad less)"), edit)
                return
        if self.unsloth_load is not None:
            v, lines, edit = self.kw(self.unsloth_load, "max_seq_length")
            if isinstance(v, int) and not isinstance(v, bool):
                self.put("seq_len_tokens", v, lines, "script", f"max_seq_length={v}", edit)
                return
        if sft_calls:
            c = next((c for c in sft_calls if c.tail == "SFTConfig"), sft_calls[0])
            self.put("seq_len_tokens", SFT_MAX_LENGTH, (), "library",
                     f"SFTConfig's default max_length={SFT_MAX_LENGTH}",
                     Edit(c.line, "", "missing", "max_length", _call_text(c)))
            return
        self.put("seq_len_tokens", DEFAULT_SETUP.seq_len_tokens, (), "fitune",
                 "no max_length in the script: a batch is as long as its longest example")

    def _packing_note(self, calls: list[Call]) -> str:
        if any(self.ix.is_true(c.kw("packing")) for c in calls):
            return " with packing: every row is full"
        return ": the longest batch (shorter ones pad less)"

    def _keep_outputs(self) -> None:
        """True when the model output object is still referenced while backward runs: `out = model(**b);
        out.loss.backward()`, or `loss = out.loss; loss.backward()` without `del out` first."""
        ix = self.ix
        if ix.uses_trainer:
            self.put("keep_outputs", False, (ix.trainer_calls[0].line,), "script",
                     f"{ix.trainer_calls[0].tail} drops the model output before backward")
            return
        backwards = [c for c in ix.calls if c.tail == "backward"]
        if not backwards:
            self.put("keep_outputs", False, (), "fitune", "no backward() in the script")
            return
        b = backwards[0]
        self.anchors["backward"] = b.line
        loss = b.node.func.value if isinstance(b.node.func, ast.Attribute) and b.receiver != "accelerator" else (
            b.arg(0))
        if b.receiver.endswith("accelerator") or b.receiver.endswith("scaler"):
            loss = b.arg(0)
        held = self._held_output(loss, b)
        if held:
            name, line = held
            self.anchors["output"] = line
            self.put("keep_outputs", True, tuple(sorted({line, b.line})), "script",
                     f"`{name}` (line {line}) still holds the model output, logits included, when backward runs "
                     f"(line {b.line})")
        else:
            self.put("keep_outputs", False, (b.line,), "script", "the model output is not held through backward")

    def _held_output(self, loss: ast.AST | None, b: Call) -> tuple[str, int] | None:
        """(variable, line) of a model output alive at the backward call `b`, or None."""
        ix = self.ix
        if loss is None:
            return None
        # `scaler.scale(loss).backward()` and the like: look through one wrapping call
        if isinstance(loss, ast.Call) and loss.args:
            loss = loss.args[0]
        out_var = None
        if isinstance(loss, ast.Attribute) and isinstance(loss.value, ast.Name):
            out_var = loss.value.id  # out.loss.backward()
        elif isinstance(loss, ast.Subscript) and isinstance(loss.value, ast.Name):
            out_var = loss.value.id  # out["loss"] / out[0]
        elif isinstance(loss, ast.Name):
            for a in ix.assignments_to(loss.id, b.scope):
                src = a.value
                if isinstance(src, ast.BinOp):  # loss = out.loss / accum
                    src = src.left
                if isinstance(src, (ast.Attribute, ast.Subscript)) and isinstance(src.value, ast.Name):
                    out_var = src.value.id
        if out_var is None:
            return None
        sources = [a for a in ix.assignments_to(out_var, b.scope) if isinstance(a.value, ast.Call)
                   and a.line <= b.line and self._is_model_call(a.value)]
        if not sources:
            return None
        line = sources[-1].line
        if _deleted_between(ix.tree, out_var, line, b.line):
            return None
        return out_var, line

    def _is_model_call(self, node: ast.Call) -> bool:
        name = self.ix.dotted(node.func)
        return name in self.ix.model_variables or name.rsplit(".", 1)[-1] in ("model", "forward") or (
            name.startswith("model"))


def _deleted_between(tree: ast.AST, name: str, start: int, end: int) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Delete) and start < node.lineno <= end:
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
    return False


def _fit_to_model(values: dict, spec, notes: list[str]) -> dict:
    """Make the recovered values valid for this model: targets it lacks are dropped (noted), a rank above the hidden
    size is capped, qlora in fp32 computes in bf16."""
    targets = values["lora_targets"]
    if tuple(targets) != ("all-linear",):
        known = spec.linear_names()
        kept = tuple(t for t in targets if t in known)
        dropped = [t for t in targets if t not in known]
        if dropped:
            notes.append(f"target_modules {', '.join(dropped)}: not a Linear of {spec.name} (it has "
                         f"{', '.join(known)}); left out of the estimate")
        values["lora_targets"] = kept or DEFAULT_SETUP.lora_targets
    if values["method"] == "qlora" and values["dtype"] == "fp32":
        values["dtype"] = "bf16"
    if values["lora_rank"] > spec.hidden_size:
        notes.append(f"r={values['lora_rank']} is above {spec.name}'s hidden size {spec.hidden_size}; estimated at "
                     f"{spec.hidden_size}")
        values["lora_rank"] = spec.hidden_size
    return values


# ---- small helpers ---------------------------------------------------------------------------------------------
def _constant_lines(tree: ast.Module) -> dict[str, int]:
    """NAME -> line, for module-level names bound once to a literal."""
    seen: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            seen.setdefault(node.targets[0].id, []).append(node.lineno if isinstance(node.value, ast.Constant)
                                                           else -1)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            seen.setdefault(node.target.id, []).append(node.lineno if isinstance(node.value, ast.Constant) else -1)
    return {n: lines[0] for n, lines in seen.items() if len(lines) == 1 and lines[0] > 0}


def _argparse_lines(ix: ScriptIndex) -> dict[str, tuple[int, str]]:
    """dest -> (line of `add_argument(..., default=literal)`, its flag)."""
    out = {}
    for c in ix.calls:
        if c.tail != "add_argument" or not isinstance(c.kw("default"), ast.Constant):
            continue
        flags = [a.value for a in c.node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        dest = ix.value(c.kw("dest"))
        if not isinstance(dest, str):
            long_flags = [f for f in flags if f.startswith("--")]
            if not long_flags:
                continue
            dest = long_flags[0][2:].replace("-", "_")
        out[dest] = (c.line, next((f for f in flags if f.startswith("--")), flags[0] if flags else dest))
    return out


def _call_text(call: Call | None) -> str:
    return f"{ast.unparse(call.node.func)}(...)" if call is not None else ""


def _show(v) -> str:
    """A value as a message quotes it: a 400-digit integer by its length (`a number of 400 digits`)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return show_int(v)
    return _code(v)


def _code(v) -> str:
    """A value as Python source writes it (what an edit of the script puts in)."""
    if isinstance(v, Ref):
        return v.text
    if isinstance(v, tuple):
        return ",".join(v)
    return repr(v) if isinstance(v, str) else str(v)


def _coerce(field_name: str, value):
    problems = Problems()
    v = coerce(_KEYS[field_name], value, "yaml", problems)
    return None if v is _BAD or problems.items else v


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _float(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 else None


def _targets(v):
    if isinstance(v, str):
        return ("all-linear",) if v.lower() in ("all-linear", "all_linear") else (v,)
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return tuple(v)
    return None
