"""Another trainer's config as a fitune config: `fitune train axolotl.yml --translate > run.yaml`.

An Axolotl, HF Trainer / TRL, PEFT or torchtune config file, read with the names fitune already knows
(`fitune.schema.FOREIGN_KEYS`: `learning_rate` -> `lr`, `lora_target_linear: true` -> `lora.targets: [all-linear]`),
becomes the YAML `fitune train` reads. Everything the translation changes is said as a comment at the top of the
output ("carried over, ..."):

- the method is carried: LoRA keys (`lora_r`, `adapter: lora`, `use_peft: true`, a `lora:` section) give `method:
  lora`; none give `method: full`, the full fine-tune the source runs;
- quantized loading: `load_in_4bit` with LoRA is `qlora`; `load_in_8bit` (fitune has no 8-bit base weights) stays
  LoRA with the weights in the compute dtype, and the comment gives the weight memory that costs;
- optimizers map to fitune's of the same precision (`paged_adamw_32bit` -> `adamw`, `adamw_bnb_8bit` -> `adamw8bit`);
- "unset" sentinels are dropped (HF's `max_steps: -1`, `max_grad_norm: 0`, `save_steps` under `save_strategy: no`).

What has no fitune equivalent, or needs a number fitune cannot know (`warmup_ratio` without the step count), is never
guessed: it is listed ("not carried over, ..."), and the result is checked with fitune's own config reader, whose
remaining problems are listed too ("to fix before training: ...", a missing model and data among them). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import ALL_KEYS, config_from_values
from .errors import ConfigError
from .memory.weights import DTYPE_BYTES, weight_bytes
from .plan.emit import to_yaml
from .setup import OPTIMIZERS
from .specs import optimizers as optimizer_specs
from .specs.model import catalog_key_for_hub_id, model_catalog, model_spec_from_hf_config
from .schema import (FOREIGN_KEYS, FOREIGN_LORA_KEYS, OTHER_TRAINERS_NAME, Problems, _describe, load_config_file,
                     values_from_mapping, without_known_list)
from .units import gib

NOT_TRANSLATED = {
    "warmup_ratio": "fitune counts warmup in steps: set warmup_steps to {value} x your step count",
    "val_set_size": "fitune does not split a validation set off the training file: give data.eval_path a file",
    "resume_from_checkpoint": "fitune resumes with `fitune train CONFIG --resume`",
    "tf32": "fitune leaves TF32 matmuls to PyTorch's default",
}
"""Foreign keys with a fitune counterpart that is not a value-for-value copy: the note said instead."""

TRUE_STRINGS = ("true", "yes", "1", "on")

_FUSED = ("the same AdamW update and 32-bit states; fitune runs torch.optim.AdamW with PyTorch's default "
          "(multi-tensor) kernel")
_PAGED = ("paging dropped: bitsandbytes moves paged states to CPU memory only when the GPU runs out; adamw keeps "
          "the same 32-bit states on the GPU, where `fitune estimate` counts them (paged_adamw8bit pages 8-bit ones)")
FOREIGN_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    **{alias: (name, None) for alias, name in optimizer_specs.aliases().items()},  # the registry's spellings
    "adamw_torch_fused": ("adamw", _FUSED), "adamw_apex_fused": ("adamw", _FUSED),
    "paged_adamw_32bit": ("adamw", _PAGED), "paged_adamw": ("adamw", _PAGED),
}
"""HF Trainer / TRL / Axolotl `optim` names -> fitune's optimizer of the same state precision, and what the change
means (None: a spelling of the same optimizer, from fitune/specs/optimizers.py's aliases; fitune's own names are
taken as they are). A name not here is copied: fitune's reader then refuses it with the closest name of the same
precision."""

TORCHTUNE_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "torch.optim.AdamW": ("adamw", None), "torch.optim.SGD": ("sgd", None),
    "bitsandbytes.optim.AdamW8bit": ("adamw8bit", None), "bitsandbytes.optim.PagedAdamW8bit": ("paged_adamw8bit", None),
    "bitsandbytes.optim.PagedAdamW": ("adamw", _PAGED), "bitsandbytes.optim.PagedAdamW32bit": ("adamw", _PAGED),
    "torchao.optim.AdamW8bit": ("adamw8bit", "torchao's 8-bit AdamW as bitsandbytes' (the same 8-bit states)"),
}
"""torchtune's `optimizer: {_component_: ...}` classes -> fitune's optimizer."""

PEFT_KEYS = ("lora", "peft_config", "adapter", "use_peft", "r", "target_modules", "lora_target_linear",
             "lora_attn_modules", "lora_modules_to_save")
"""Keys that say the source trains an adapter (besides every `lora_*` / `peft_*` key)."""

TRAINER_MARKERS = {
    "Axolotl": ("base_model", "micro_batch_size", "sequence_len", "adapter", "lora_target_linear", "sample_packing",
                "train_on_inputs", "val_set_size", "num_epochs", "datasets", "wandb_project", "special_tokens",
                "flash_attention", "lr_scheduler", "load_in_8bit"),
    "HF Trainer / TRL": ("model_name_or_path", "per_device_train_batch_size", "num_train_epochs", "optim",
                         "lr_scheduler_type", "max_seq_length", "use_peft", "dataset_text_field", "save_strategy",
                         "eval_strategy", "evaluation_strategy", "per_device_eval_batch_size", "logging_strategy",
                         "dataset_name", "torch_dtype"),
}
"""Keys only one family of trainers uses: the family a config is said to come from (the most of its keys)."""

DEFAULT_EPOCHS = {"Axolotl": ("num_epochs", 1), "HF Trainer / TRL": ("num_train_epochs", 3)}
"""How long each trainer trains when its config gives neither epochs nor max_steps (Axolotl's schema:
`num_epochs: float = 1.0`; transformers' TrainingArguments: `num_train_epochs: float = 3.0`, `max_steps = -1`)."""

FOREIGN_PROBLEMS_SHOWN = 5
"""How many of a foreign config's problems `fitune train OTHER.yaml` shows under its pointer to --translate."""

MODEL_PLACEHOLDER = "<model>"
DATA_PLACEHOLDER = "<data>"


@dataclass
class Translation:
    """A foreign config as fitune's, and every comment on it."""

    config: dict = field(default_factory=dict)
    """The fitune config mapping (nested like its YAML)."""
    changed: list[str] = field(default_factory=list)
    """What was carried over with another value or meaning, each said ("carried over, ...")."""
    dropped: list[str] = field(default_factory=list)
    """What was not carried over, and why ("not carried over, ...")."""
    trainer: str | None = None
    """The trainer the config reads as (`trainer_of`), None for fitune's own or an unknown one."""


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in TRUE_STRINGS
    return bool(value)


def _put(doc: dict, path: str, value: Any) -> None:
    """doc[a][b] = value for path "a.b". A section given as a value is made a mapping first: `data: train.jsonl`
    becomes {path: train.jsonl} (its shorthand); anything else there (`lora: 5`, which `_copy_known` notes) is
    replaced."""
    *outer, last = path.split(".")
    node = doc
    for part in outer:
        inner = node.get(part)
        if not isinstance(inner, dict):
            inner = {"path": inner} if part == "data" and isinstance(inner, str) and inner else {}
            node[part] = inner
        node = inner
    node[last] = value


def _known_paths() -> set[str]:
    return {k.yaml for k in ALL_KEYS}


def trainer_of(doc: Any) -> str | None:
    """'Axolotl', 'HF Trainer / TRL' or 'torchtune': the trainer whose config `doc` reads as, else None."""
    if not isinstance(doc, dict):
        return None
    if any(isinstance(v, dict) and "_component_" in v for v in doc.values()):
        return "torchtune"
    names = {str(k) for k in doc}
    counts = {trainer: len(names & set(keys)) for trainer, keys in TRAINER_MARKERS.items()}
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def _is_foreign(doc: dict, known: set[str]) -> bool:
    """Whether `doc` holds a key (or a torchtune section) fitune does not read as its own."""
    return any(str(k) not in known and str(k) not in ("lora", "data") or isinstance(v, dict) and "_component_" in v
               for k, v in doc.items())


def _dataset_path(value: Any) -> tuple[str | None, list[str]]:
    """Axolotl's `datasets:` (a list of {path, type, ...}) or a plain path: the first local path, and notes."""
    notes = []
    items = value if isinstance(value, list) else [value]
    paths = []
    for item in items:
        path = item.get("path") if isinstance(item, dict) else item
        if isinstance(path, str) and path:
            paths.append(path)
    if len(paths) > 1:
        notes.append(f"datasets: {len(paths)} data sets; fitune trains on one file: data.path is the first "
                     f"({paths[0]}); concatenate the others into it")
    if not paths:
        notes.append(f"datasets: {value!r}: no file path in it; set data.path")
    return (paths[0] if paths else None), notes


AXOLOTL_TYPES = {"alpaca": "alpaca", "sharegpt": "sharegpt", "chat_template": "chat", "completion": "text",
                 "pretrain": "text"}
"""Axolotl's dataset `type:` -> fitune's data.format (Axolotl's `completion` is raw text under a `text` key;
`chat_template` reads `messages`, its default field)."""


def _dataset_format(value: Any, t: Translation) -> None:
    """The first data set's Axolotl `type:` as data.format, or a note when fitune has no such format."""
    first = value[0] if isinstance(value, list) and value else value
    kind = first.get("type") if isinstance(first, dict) else None
    if not kind:
        return
    fmt = AXOLOTL_TYPES.get(str(kind).strip().lower())
    if fmt is None:
        t.dropped.append(f"datasets: type {kind!r}: not a format fitune reads (alpaca, sharegpt, OpenAI messages, "
                         "prompt/completion, text: docs/data.md); fitune detects the format from the rows, or set "
                         "data.format")
        return
    _put(t.config, "data.format", fmt)
    if fmt != kind:
        t.changed.append(f"datasets: type {kind!r} -> data.format: {fmt}")


TORCHTUNE_INNER = {"checkpoint_dir": "model", "num_warmup_steps": "warmup_steps", "lora_rank": "lora.rank",
                   "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_attn_modules": "lora.targets",
                   "lr": "lr", "weight_decay": "weight_decay", "max_seq_len": "seq_len"}
"""Keys inside torchtune's `_component_` sections (model, optimizer, lr_scheduler, checkpointer, tokenizer) ->
fitune's; `tokenizer: {path}` is handled by name."""
TORCHTUNE_MODULES = {"output_proj": "o_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""torchtune's names of Llama's projections -> transformers' (torchtune/models/llama3/_component_builders.py)."""


def _component(name: str, section: dict, t: Translation) -> None:
    """One torchtune `name: {_component_: ..., ...}` section: the keys fitune has, and a note on the rest."""
    out, notes = t.config, t.dropped
    component = str(section.get("_component_"))
    if name == "model":  # lora_llama3_1_8b / qlora_llama3_1_8b / llama3_1_8b: the method is in the builder's name
        builder = component.rsplit(".", 1)[-1]
        out["method"] = "qlora" if builder.startswith("qlora_") else "lora" if builder.startswith("lora_") else "full"
    elif name == "optimizer":
        _optimizer_component(component, t)
    left = []
    for sub, v in section.items():
        if sub == "_component_" or v is None:
            continue
        if name == "tokenizer" and sub == "path":
            if str(v).endswith(".model"):  # the original tokenizer file, not a Hugging Face tokenizer folder
                notes.append(f"tokenizer: {v}: fitune loads the Hugging Face tokenizer of the model folder")
            else:
                out["tokenizer"] = v
        elif sub == "lora_attn_modules":
            _put(out, "lora.targets", [TORCHTUNE_MODULES.get(m, m) for m in (v if isinstance(v, list) else [v])])
        elif sub == "apply_lora_to_mlp":
            if _truthy(v):
                out.setdefault("lora", {}).setdefault("targets", [])
                out["lora"]["targets"] += ["gate_proj", "up_proj", "down_proj"]
        elif sub == "apply_lora_to_output" and not _truthy(v):
            continue
        elif sub == "checkpoint_dir" and name != "checkpointer":
            left.append(sub)
        elif sub in TORCHTUNE_INNER:
            target = TORCHTUNE_INNER[sub]
            _put(out, target, [v] if target == "lora.targets" and isinstance(v, str) else v)
        else:
            left.append(sub)
    if name in ("dataset", "loss"):
        notes.append(f"{name}: torchtune's {component}: fitune reads data.path (chat, prompt/completion or text "
                     "rows)" if name == "dataset" else f"{name}: torchtune's {component}: fitune's loss is set by loss: "
                     "hf | chunked")
    if left:
        notes.append(f"{name}: {', '.join(left)} ({component}): no fitune equivalent")


def _optimizer_component(component: str, t: Translation) -> None:
    target, why = TORCHTUNE_OPTIMIZERS.get(component, (None, None))
    if target is None:
        t.dropped.append(f"optimizer: {component}: not one of fitune's ({_optimizer_names()}); set optimizer: to "
                         "the one of the same state precision")
        return
    t.config["optimizer"] = target
    if why:
        t.changed.append(f"optimizer: {component} -> {target}: {why}")


def _optimizer_names() -> str:
    return ", ".join(OPTIMIZERS)


def _optimizer(t: Translation, name: str, value: Any) -> None:
    """HF's `optim:` / Axolotl's `optimizer:`: fitune's optimizer of the same state precision."""
    low = value.strip().lower() if isinstance(value, str) else None
    if low is None or low in OPTIMIZERS or low not in FOREIGN_OPTIMIZERS:
        t.config["optimizer"] = value  # fitune's own, or unknown: fitune's reader names the closest of its precision
        return
    target, why = FOREIGN_OPTIMIZERS[low]
    t.config["optimizer"] = target
    if why:
        t.changed.append(f"{name}: {value} -> {'' if name == 'optimizer' else 'optimizer: '}{target}: {why}")


def _sentinel(t: Translation, name: str, value: Any, doc: dict) -> bool:
    """Drop a value that means "not set" in the source trainer (said in a note); True when dropped."""
    if name == "max_steps" and isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        t.dropped.append(f"max_steps: {value}: HF Trainer's 'not set' (train num_train_epochs instead); dropped")
        return True
    if name == "max_grad_norm" and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        t.config["max_grad_norm"] = None
        t.changed.append("max_grad_norm: 0 -> max_grad_norm: null: HF Trainer clips only above 0, so 0 means no "
                         "clipping, which fitune writes null")
        return True
    if name in ("warmup_ratio", "val_set_size") and value == 0:
        what = "no warm-up: fitune's default (warmup_steps: 0)" if name == "warmup_ratio" else \
            "no validation split: fitune's default (no data.eval_path)"
        t.dropped.append(f"{name}: 0: {what}")
        return True
    for strategy, steps, meaning in (("save_strategy", "save_steps", "checkpoints"),
                                     ("eval_strategy", "eval_steps", "evaluation"),
                                     ("evaluation_strategy", "eval_steps", "evaluation"),
                                     ("logging_strategy", "logging_steps", "logging")):
        if name == steps and strategy in doc and _strategy(doc[strategy]) == "no":
            t.dropped.append(f"{name}: {value!r}: unused in the source ({strategy}: no); dropped")
            return True
    return False


def _strategy(value: Any) -> str:
    """HF's IntervalStrategy as text: `save_strategy: no` is YAML's false."""
    return "no" if value is False or value is None else str(value).strip().lower()


def _strategy_note(t: Translation, name: str, value: Any) -> None:
    """HF's save / eval / logging strategies: fitune counts every interval in steps."""
    text = _strategy(value)
    if text == "steps":
        return  # the *_steps key carries the interval
    if text == "no":
        what = {"save_strategy": "fitune still checkpoints at the end and every save_every_minutes (default 30; "
                                 "save_every_minutes: null turns that off)",
                "logging_strategy": "fitune logs every log_every steps to metrics.jsonl"}.get(
            name, "fitune evaluates only when data.eval_path is set")
        t.dropped.append(f"{name}: no: {what}")
        return
    t.dropped.append(f"{name}: {value!r}: fitune counts intervals in steps (save_every, eval_every, log_every); "
                     "set one to your steps per epoch")


def _train_on_inputs(t: Translation, value: Any) -> None:
    if not _truthy(value):
        t.changed.append("train_on_inputs: false: fitune trains only the answers (assistant turns, the completion, "
                         "the alpaca output) already")
        return
    t.dropped.append("train_on_inputs: true: fitune takes the loss on the answers only (chat, prompt/completion, "
                     "alpaca rows); to train on every token, write each example as one {\"text\": ...} row "
                     "(data.format: text)")


def _peft(t: Translation, name: str, value: Any) -> None:
    """TRL's `use_peft`, a `peft_config:` section (PEFT's LoraConfig), Axolotl's `adapter:`."""
    if name == "adapter":  # Axolotl: lora | qlora; none means a full fine-tune
        t.config["method"] = str(value).lower() if value else "full"
    elif name == "use_peft":
        t.config["method"] = "lora" if _truthy(value) else "full"
        if not _truthy(value):
            t.changed.append("use_peft: false -> method: full: TRL trains every weight (its lora_* values unused)")
    elif isinstance(value, dict):  # peft_config: {r, lora_alpha, target_modules, ...}
        left = []
        for sub, v in value.items():
            target = FOREIGN_LORA_KEYS.get(str(sub))
            if target is not None and v is not None:
                _put(t.config, target, [v] if target == "lora.targets" and isinstance(v, str) else v)
            elif str(sub) not in ("peft_type", "task_type"):
                left.append(str(sub))
        if left:
            t.dropped.append(f"{name}: {', '.join(left)}: no fitune equivalent")
    else:
        t.dropped.append(f"{name}: {value!r}: expected a mapping of LoRA settings (r, lora_alpha, target_modules)")


def _peft_keys(doc: dict, t: Translation) -> list[str]:
    """The source's keys that say it trains an adapter."""
    found = [str(k) for k in doc if str(k) in PEFT_KEYS or str(k).startswith(("lora_", "peft_"))]
    return found or (["lora"] if "lora" in t.config else [])


def _settle_method(doc: dict, t: Translation) -> None:
    """The method of a foreign config: carried from the source (LoRA keys or not), then its quantized loading."""
    out = t.config
    quant4, quant8 = _truthy(doc.get("load_in_4bit")), _truthy(doc.get("load_in_8bit"))
    if "method" not in out:
        peft = _peft_keys(doc, t)
        if peft:
            out["method"] = "lora"
            t.changed.append(f"method: lora: the source trains LoRA ({', '.join(peft[:3])})")
        elif quant4 or quant8:
            out["method"] = "lora"  # quantized weights do not train: HF and Axolotl train an adapter on them
        else:
            out["method"] = "full"
            t.changed.append("method: full: no PEFT keys: a full fine-tune, as in the source; add lora keys for LoRA")
    if quant4 and out["method"] == "lora":
        out["method"] = "qlora"
        t.changed.append("load_in_4bit: true -> method: qlora: LoRA on 4-bit (NF4) base weights")
    if quant8 and out["method"] in ("lora", "full"):
        out["method"] = "lora"
        t.changed.append(_eight_bit_note(out))


def _eight_bit_note(out: dict) -> str:
    """load_in_8bit: kept LoRA with the weights in the compute dtype; what that costs in weight memory."""
    dtype = str(out.get("dtype", "bf16"))
    sizes = _weight_sizes(out.get("model"), dtype)
    width = {"fp32": 4}.get(dtype, 2)
    if sizes is None:
        cost = f"about {width}x the 8-bit weight memory ({width} bytes a weight instead of 1)"
        qlora = ""
    else:
        name, wide, int8, nf4 = sizes
        cost = (f"about {wide / int8:.1f}x the 8-bit weight memory ({_gib(wide)} vs {_gib(int8)} for {name} in "
                "fitune's catalog)")
        qlora = f": {_gib(nf4)}"
    return (f"load_in_8bit: true -> method: lora with the weights in {dtype}: fitune has no 8-bit base weights; "
            f"{cost}; method: qlora (4-bit NF4) takes less than 8-bit{qlora}")


def _gib(n: int) -> str:
    return gib(n)


def _weight_sizes(model: Any, dtype: str) -> tuple[str, int, int, int] | None:
    """(catalog name, weight bytes in `dtype`, in LLM.int8, in NF4) for a model fitune's catalog knows, else None.

    LLM.int8 (bitsandbytes `Int8Params`): each decoder nn.Linear weight as int8 codes plus one fp32 scale per output
    row (`SCB`); embeddings, lm_head and norms stay in `dtype`, as `memory.weights.weight_bytes` keeps them for NF4.
    """
    if not isinstance(model, str) or dtype not in DTYPE_BYTES:
        return None
    key = catalog_key_for_hub_id(model)
    if key is None:
        return None
    try:
        spec = model_spec_from_hf_config(model_catalog()[key]["config"], name=key)
    except Exception:  # noqa: BLE001 - a catalog entry the analytic engine does not model: no numbers, said so
        return None
    layers = [(lin, spec.dense_layers) for lin in spec.linears(False)]
    layers += [(lin, spec.moe_layers) for lin in spec.linears(True)] if spec.moe_layers else []
    linear_numel = sum(lin.in_features * lin.out_features * n for lin, n in layers)
    row_scales = sum(4 * lin.out_features * n for lin, n in layers)
    wide = weight_bytes(spec, "lora", dtype)
    int8 = wide - linear_numel * (DTYPE_BYTES[dtype] - 1) + row_scales
    return key, wide, int8, weight_bytes(spec, "qlora", dtype)


def _settle_length(doc: dict, t: Translation) -> None:
    """HF and Axolotl: a positive max_steps overrides the epochs; neither given trains the trainer's default."""
    out = t.config
    if "max_steps" in out and "epochs" in out and "epochs" not in doc:
        epochs = out.pop("epochs")
        t.dropped.append(f"epochs {epochs}: max_steps {out['max_steps']} overrides it in the source; dropped")
    if "max_steps" not in out and "epochs" not in out and t.trainer in DEFAULT_EPOCHS:
        name, epochs = DEFAULT_EPOCHS[t.trainer]
        out["epochs"] = epochs
        t.changed.append(f"epochs: {epochs}: {name} not given; {t.trainer}'s default is {epochs}")


def _copy_known(t: Translation, name: str, value: Any) -> None:
    """A key fitune reads as its own (a `lora:` or `data:` section too)."""
    if name == "lora" and isinstance(value, dict):
        for sub, v in value.items():
            _put(t.config, FOREIGN_LORA_KEYS.get(str(sub), f"lora.{sub}"), v)
    elif name == "data" and isinstance(value, dict):
        for sub, v in value.items():
            _put(t.config, f"data.{sub}", v)
    elif name == "lora":  # `lora: 5`: a section given a value
        t.dropped.append(f"lora: {_shown(value)}: fitune's lora: is a section (rank, alpha, dropout, targets), not a "
                         f"value; if {_shown(value)} is the rank, write lora: {{rank: {_shown(value)}}}")
    elif name == "data" and not (isinstance(value, str) and value):
        t.dropped.append(f"data: {_shown(value)}: not a data file; data: takes the training file (data: train.jsonl) "
                         "or a section {path: train.jsonl, format: chat, ...}")
    elif name == "data" and isinstance(t.config.get("data"), dict):  # `train_file:` came first: keep both
        _put(t.config, "data.path", value)
    else:
        t.config[name] = value


def _shown(value: Any) -> str:
    """A value as a note quotes it: short, and a huge integer by its length (str() refuses over 4,300 digits)."""
    return _describe(value)


SPECIAL = {"optim": "optimizer", "optimizer": "optimizer", "adapter": "peft", "use_peft": "peft",
           "peft_config": "peft", "train_on_inputs": "train_on_inputs", "save_strategy": "strategy",
           "eval_strategy": "strategy", "evaluation_strategy": "strategy", "logging_strategy": "strategy",
           "load_in_8bit": "quantized", "load_in_4bit": "quantized"}
"""Keys whose value is translated, not copied: each by its handler in `_one_key`."""


def _one_key(t: Translation, name: str, value: Any, doc: dict, known: set[str]) -> None:
    """One top-level key of the source into `t`."""
    special = SPECIAL.get(name)
    if special == "optimizer" and not isinstance(value, dict):
        return _optimizer(t, name, value)
    if special == "peft":
        return _peft(t, name, value)
    if special == "train_on_inputs":
        return _train_on_inputs(t, value)
    if special == "strategy":
        return _strategy_note(t, name, value)
    if special == "quantized":
        return  # `_settle_method`, once the method is known
    if _sentinel(t, name, value, doc):
        return
    if name in known or name in ("lora", "data"):  # already fitune's
        return _copy_known(t, name, value)
    lookup = name if name in NOT_TRANSLATED or name in FOREIGN_KEYS else name.lower()
    if lookup in NOT_TRANSLATED:
        t.dropped.append(f"{name}: {value!r}: " + NOT_TRANSLATED[lookup].format(value=value))
        return
    if name.startswith("wandb_"):  # Axolotl's wandb_project / wandb_entity / ...: W&B's own variables
        if value not in ("", False):
            t.config["report_to"] = sorted(set(t.config.get("report_to", [])) | {"wandb"})
            t.dropped.append(f"{name}: {value!r}: report_to: [wandb] set; W&B reads the rest from its environment "
                             f"(WANDB_{name.removeprefix('wandb_').upper()}={value})")
        return
    foreign = FOREIGN_KEYS.get(lookup)
    if foreign is None:
        t.dropped.append(f"{name}: {value!r}: fitune has no such setting")
        return
    _foreign_value(t, name, value, foreign)


def _foreign_value(t: Translation, name: str, value: Any, foreign: str) -> None:
    """Another trainer's key with a fitune counterpart (`FOREIGN_KEYS`): the value under fitune's name."""
    path, _, fixed = (part.strip() for part in foreign.partition(":"))
    if " " in path:  # a sentence, not a key ("the --resume flag")
        t.dropped.append(f"{name}: not carried over: use {foreign}")
        return
    if name in ("datasets", "dataset"):
        first, more = _dataset_path(value)
        t.dropped.extend(more)
        _dataset_format(value, t)
        if first is not None:
            _put(t.config, "data.path", first)
        return
    fixed = fixed.split(" (", 1)[0]  # `compile: layers (each decoder layer; ...)`: the value, not its gloss
    if fixed:  # `bf16: true` -> dtype: bf16; `sample_packing: false` says nothing
        if fixed.startswith("["):
            fixed = fixed.strip("[]")
        if _truthy(value):
            _put(t.config, path, [fixed] if path == "lora.targets" else fixed)
        else:
            t.dropped.append(f"{name}: {value!r}: dropped, fitune's default for {path} applies (`fitune train "
                             "--help` shows it)")
        return
    if path == "lora.targets" and isinstance(value, str):
        value = [value]
    _put(t.config, path, value)


def translate_doc(doc: dict) -> Translation:
    """Another trainer's config mapping as a fitune config, with every change and every drop said.

    fitune's own config comes back unchanged (no comment); a foreign one also gets its method carried
    (`_settle_method`) and its length (`_settle_length`), its keys in the order fitune writes them."""
    known = _known_paths()
    t = Translation(trainer=trainer_of(doc))
    for raw, value in doc.items():
        name = str(raw)
        if isinstance(value, dict) and "_component_" in value:  # torchtune builds objects from these sections
            _component(name, value, t)
        elif value is not None:  # `seed: null`: the default, whatever the trainer
            _one_key(t, name, value, doc, known)
    if _is_foreign(doc, known):
        _settle_method(doc, t)
        _settle_length(doc, t)
        t.config = _in_fitune_order(t.config)
    return t


def translate(doc: dict) -> tuple[dict, list[str]]:
    """(fitune config mapping, notes: what was changed, then what was not carried over) from another trainer's
    config mapping."""
    t = translate_doc(doc)
    return t.config, t.changed + t.dropped


def _in_fitune_order(out: dict) -> dict:
    """The top-level keys in the order `fitune train`'s config writes them (model, data, method, lora, ...)."""
    order: list[str] = []
    for k in ALL_KEYS:
        top = k.yaml.split(".", 1)[0]
        if top not in order:
            order.append(top)
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(out.items(), key=lambda item: rank.get(item[0], len(rank))))


def validate(doc: dict, source: str) -> list[str]:
    """fitune's config reader on the translated mapping: every problem, one per line (none: it trains as is).

    Unlike `config_from_dict`, the checks of the whole config run even when a value is refused, so that one pass
    lists everything; a missing model or data path is left to the caller (`missing_pieces`)."""
    probe = dict(doc)
    probe.setdefault("model", MODEL_PLACEHOLDER)
    data = probe.get("data")
    if not (isinstance(data, str) and data or isinstance(data, dict) and data.get("path")):
        probe["data"] = {**(data if isinstance(data, dict) else {}), "path": DATA_PLACEHOLDER}
    problems = Problems()
    values = values_from_mapping(probe, ALL_KEYS, source, problems, shorthand={"data": "path"})
    try:
        config_from_values(values).validate()
    except ConfigError as exc:
        problems.items += [p for p in exc.problems if p not in problems.items]
    return [p for p in problems.items if MODEL_PLACEHOLDER not in p and DATA_PLACEHOLDER not in p]


def missing_pieces(out: dict, doc: dict) -> list[str]:
    """The model and the data, when the translation has none: each said, with what to write."""
    missing = []
    if "model" not in out:
        components = [str(v.get("_component_")) for k, v in doc.items() if k == "model" and isinstance(v, dict)]
        why = f" (torchtune's {components[0]} names an architecture, not its weights)" if components else ""
        missing.append(f"model: not set{why}: the model to fine-tune (a Hugging Face folder or Hub id, or a .gguf "
                       "file)")
    data = out.get("data")
    if not (isinstance(data, str) and data or isinstance(data, dict) and data.get("path")):
        missing.append("data.path: not set: the training data (a .jsonl / .json / .csv / .parquet file, a dataset "
                       "folder or a Hub data set id ORG/NAME)")
    return missing


def translated_yaml(doc: dict, source: str) -> str:
    """The text `fitune train --translate` prints: changes, drops and remaining problems as comments, then the YAML."""
    t = translate_doc(doc)
    problems = missing_pieces(t.config, doc) + validate(t.config, source)
    header = [f"translated by fitune from {source}"]
    header += [f"carried over, {n}" for n in t.changed]
    header += [f"not carried over, {n}" for n in t.dropped]
    header += [f"to fix before training: {p}" for p in problems]
    return to_yaml(t.config, header)


def foreign_config_error(exc: ConfigError, path: str, doc: Any = None, then: str = "") -> ConfigError | None:
    """What `fitune train OTHER.yaml` and `fitune estimate --config OTHER.yaml` say about another trainer's config:
    one line pointing to `--translate`, then its first FOREIGN_PROBLEMS_SHOWN problems (without the list of fitune's
    keys); `then` is the command to run on the result (`fitune estimate --config run.yaml`). None when `exc` is not
    about such a config (fitune's own with a wrong value)."""
    if doc is None:
        try:
            doc = load_config_file(path)
        except ConfigError:
            return None
    trainer = trainer_of(doc)
    if trainer is None and not any(OTHER_TRAINERS_NAME in p for p in exc.problems):
        return None
    whose = f"another trainer's config ({trainer})" if trainer else "a config with other trainers' key names"
    after = f" (then `{then}`)" if then else ""
    lines = [f"this looks like {whose}: `fitune train {path} --translate > run.yaml` writes it with fitune's names "
             f"and says what it could not carry over{after}; its problems as a fitune config:"]
    shown = exc.problems[:FOREIGN_PROBLEMS_SHOWN]
    lines += [f"  - {without_known_list(p)}" for p in shown]
    if len(exc.problems) > len(shown):
        lines.append(f"  ... and {len(exc.problems) - len(shown)} more")
    return ConfigError("\n".join(lines))
