"""Another trainer's config as a fitune config: `fitune train axolotl.yml --translate > run.yaml`.

An Axolotl, HF Trainer / TRL, PEFT or torchtune config file, read with the names fitune already knows
(`fitune.schema.FOREIGN_KEYS`: `learning_rate` -> `lr`, `lora_target_linear: true` -> `lora.targets: [all-linear]`),
becomes the YAML `fitune train` reads. What has no fitune equivalent, or needs a number fitune cannot know
(`warmup_ratio` without the step count), is never guessed: it is listed as a comment at the top of the output, and
the result is validated with fitune's own config reader, whose remaining problems are listed the same way.
Pure Python.
"""

from __future__ import annotations

from typing import Any

from .schema import FOREIGN_KEYS, FOREIGN_LORA_KEYS

NOT_TRANSLATED = {
    "warmup_ratio": "fitune counts warmup in steps: set warmup_steps to {value} x your step count",
    "val_set_size": "fitune does not split a validation set off the training file: give data.eval_path a file",
    "resume_from_checkpoint": "fitune resumes with `fitune train CONFIG --resume`",
    "tf32": "fitune leaves TF32 matmuls to PyTorch's default",
}
"""Foreign keys with a fitune counterpart that is not a value-for-value copy: the note said instead."""

TRUE_STRINGS = ("true", "yes", "1", "on")


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in TRUE_STRINGS
    return bool(value)


def _put(doc: dict, path: str, value: Any) -> None:
    *outer, last = path.split(".")
    node = doc
    for part in outer:
        node = node.setdefault(part, {})
    node[last] = value


def _known_paths() -> set[str]:
    from .config import ALL_KEYS

    return {k.yaml for k in ALL_KEYS}


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
    if items and isinstance(items[0], dict) and items[0].get("type"):
        notes.append(f"datasets: type {items[0]['type']!r}: fitune reads the format from the rows (chat messages, "
                     "prompt/completion or text); set data.format to force one")
    return (paths[0] if paths else None), notes


TORCHTUNE_INNER = {"checkpoint_dir": "model", "num_warmup_steps": "warmup_steps", "lora_rank": "lora.rank",
                   "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_attn_modules": "lora.targets",
                   "lr": "lr", "weight_decay": "weight_decay", "max_seq_len": "seq_len"}
"""Keys inside torchtune's `_component_` sections (model, optimizer, lr_scheduler, checkpointer, tokenizer) ->
fitune's; `tokenizer: {path}` is handled by name."""
TORCHTUNE_MODULES = {"output_proj": "o_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""torchtune's names of Llama's projections -> transformers' (torchtune/models/llama3/_component_builders.py)."""


def _component(name: str, section: dict, out: dict, notes: list[str]) -> None:
    """One torchtune `name: {_component_: ..., ...}` section: the keys fitune has, and a note on the rest."""
    component = str(section.get("_component_"))
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


def translate(doc: dict) -> tuple[dict, list[str]]:
    """(fitune config mapping, notes on what was not carried over) from another trainer's config mapping."""
    known = _known_paths()
    out: dict = {}
    notes: list[str] = []
    for raw, value in doc.items():
        name = str(raw)
        if isinstance(value, dict) and "_component_" in value:  # torchtune builds objects from these sections
            _component(name, value, out, notes)
            continue
        if value is None:  # `seed: null`: the default, whatever the trainer
            continue
        if name in known or name in ("lora", "data"):  # already fitune's
            if name == "lora" and isinstance(value, dict):
                for sub, v in value.items():
                    target = FOREIGN_LORA_KEYS.get(str(sub), f"lora.{sub}")
                    _put(out, target, v)
            elif name == "data" and isinstance(value, dict):
                for sub, v in value.items():
                    _put(out, f"data.{sub}", v)
            else:
                out[name] = value
            continue
        foreign = FOREIGN_KEYS.get(name) or FOREIGN_KEYS.get(name.lower())
        if name in NOT_TRANSLATED or name.lower() in NOT_TRANSLATED:
            notes.append(f"{name}: {value!r}: "
                         + NOT_TRANSLATED.get(name, NOT_TRANSLATED.get(name.lower(), "")).format(value=value))
            continue
        if name.startswith("wandb_"):  # Axolotl's wandb_project / wandb_entity / ...: W&B's own variables
            if value not in ("", False):
                out["report_to"] = sorted(set(out.get("report_to", [])) | {"wandb"})
                notes.append(f"{name}: {value!r}: report_to: [wandb] set; W&B reads the rest from its environment "
                             f"(WANDB_{name.removeprefix('wandb_').upper()}={value})")
            continue
        if foreign is None:
            notes.append(f"{name}: {value!r}: fitune has no such setting")
            continue
        path, _, fixed = (part.strip() for part in foreign.partition(":"))
        if " " in path:  # a sentence, not a key ("the --resume flag")
            notes.append(f"{name}: not carried over: use {foreign}")
            continue
        if value is None:
            continue
        if name in ("datasets", "dataset"):
            first, more = _dataset_path(value)
            notes += more
            if first is not None:
                _put(out, "data.path", first)
            continue
        if name == "adapter":  # Axolotl: lora | qlora; none means a full fine-tune
            _put(out, "method", str(value).lower() if value else "full")
            continue
        fixed = fixed.split(" (", 1)[0]  # `compile: layers (each decoder layer; ...)`: the value, not its gloss
        if fixed:  # `bf16: true` -> dtype: bf16; `sample_packing: false` says nothing
            if fixed.startswith("["):
                fixed = fixed.strip("[]")
            if _truthy(value):
                _put(out, path, [fixed] if path == "lora.targets" else fixed)
            else:
                notes.append(f"{name}: {value!r}: dropped, fitune's default for {path} applies (`fitune train "
                             "--help` shows it)")
            continue
        if path == "lora.targets" and isinstance(value, str):
            value = [value]
        _put(out, path, value)
    return out, notes


def validate(doc: dict, source: str) -> list[str]:
    """fitune's config reader on the translated mapping: its problems, one per line (none: it trains as is)."""
    from .config import config_from_dict
    from .errors import ConfigError

    placeholder = "<model>"
    probe = dict(doc)
    probe.setdefault("model", placeholder)
    try:
        config_from_dict(probe, source)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        problems = [line.strip().removeprefix("- ") for line in (lines[1:] if len(lines) > 1 else lines)]
        return [p for p in problems if placeholder not in p]  # the missing model is said once, by the caller
    return []


def translated_yaml(doc: dict, source: str) -> str:
    """The text `fitune train --translate` prints: notes and remaining problems as comments, then the YAML."""
    from .plan.emit import to_yaml

    out, notes = translate(doc)
    problems = validate(out, source)
    components = [str(v.get("_component_")) for k, v in doc.items() if k == "model" and isinstance(v, dict)]
    header = [f"translated by fitune from {source}"]
    if "model" not in out:
        why = f" (torchtune's {components[0]} names an architecture, not its weights)" if components else ""
        problems.insert(0, f"model: not given{why}: set the model (a Hugging Face folder or id, or a catalog name)")
    header += [f"not carried over, {n}" for n in notes]
    header += [f"to fix before training: {p}" for p in problems]
    return to_yaml(out, header)
