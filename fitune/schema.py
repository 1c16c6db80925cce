"""The config schema: every YAML key, CLI flag and JSON name of a run comes from the dataclass fields.

`TrainSetup` (fitune/setup.py), `TrainConfig` and `DataConfig` (fitune/config.py) declare each field with
`key(...)` metadata: its YAML path (`lora.rank`), its flag (`--lora-rank`), its kind (int, float, bool, choice,
...), its choices and bounds, the value spellings other tools use (`bfloat16`, `flash_attention_2`) and a help
line. From that one declaration this module

- reads a YAML/JSON mapping into typed values (`values_from_mapping`), rejecting unknown keys at any depth
  with a "did you mean" that also knows the names of HF Trainer, TRL, PEFT, Axolotl and torchtune
  (`learning_rate` -> `lr`);
- adds the same flags to every command (`add_arguments`) and reads them back (`values_from_args`);
- writes the YAML form (`to_mapping`) that `values_from_mapping` reads back.

Problems are collected and raised once (`ConfigError`), each naming the YAML key when the value came from a
file and the flag when it came from the command line. Pure Python: PyYAML only when a YAML file is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from .errors import ConfigError

#: How deep a config mapping may nest (fitune's own configs nest 2 levels).
MAX_CONFIG_DEPTH = 8
#: The largest config file read (bytes): a config is a few hundred bytes; a huge file is a mistake.
MAX_CONFIG_BYTES = 1 << 20
#: How many values (keys' values and list items, at every depth) a config may hold.
MAX_CONFIG_VALUES = 100_000
#: The most digits `selective:K` may give K (no model has a million layers).
MAX_LAYER_DIGITS = 6


@dataclass(frozen=True)
class Key:
    """How one dataclass field appears to users."""

    field: str
    """The dataclass field name (also its name in JSON `setup` objects)."""
    yaml: str
    """Dotted YAML path: `seq_len`, `lora.rank`, `data.path`."""
    flag: str
    """The command-line flag: `--seq-len`."""
    kind: str
    """int | float | bool | str | choice | targets | names | checkpointing."""
    help: str
    choices: tuple[str, ...] = ()
    value_aliases: tuple[tuple[str, str], ...] = ()
    """Other tools' spellings of a value -> fitune's (`bfloat16` -> `bf16`)."""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    optional: bool = False
    """None is a valid value (`max_grad_norm: null` turns clipping off)."""
    unit: str = ""
    metavar: str | None = None
    owner: str = ""
    """The dataclass that holds the field: TrainSetup, TrainConfig or DataConfig (filled in by `keys_of`)."""


def key(default: Any = dataclasses.MISSING, *, yaml: str | None = None, flag: str | None = None, kind: str,
        help: str, choices: Iterable[str] = (), aliases: dict[str, str] | None = None, minimum: float | None = None,
        maximum: float | None = None, exclusive_minimum: bool = False, optional: bool = False, unit: str = "",
        metavar: str | None = None, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with its schema (see `Key`); yaml and flag default to the field's own name."""
    meta = {"schema": dict(yaml=yaml, flag=flag, kind=kind, help=help, choices=tuple(choices),
                           value_aliases=tuple((aliases or {}).items()), minimum=minimum, maximum=maximum,
                           exclusive_minimum=exclusive_minimum, optional=optional, unit=unit, metavar=metavar)}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def keys_of(cls) -> list[Key]:
    """The schema of every field of `cls` that declares one, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("schema")
        if meta is None:
            continue
        m = dict(meta)
        m["yaml"] = m["yaml"] or f.name
        m["flag"] = m["flag"] or "--" + m["yaml"].replace(".", "-").replace("_", "-")
        out.append(Key(field=f.name, owner=cls.__name__, **m))
    return out


def field_default(cls, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


# ---- names other tools use ------------------------------------------------------------------------------------

#: Keys of HF Trainer / TRL / PEFT / Axolotl / torchtune configs -> what to write in fitune (shown as "did you mean").
FOREIGN_KEYS: dict[str, str] = {
    # HF TrainingArguments / TRL SFTConfig
    "learning_rate": "lr", "num_train_epochs": "epochs", "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "gradient_checkpointing": "grad_checkpointing",
    "bf16": "dtype: bf16", "fp16": "dtype: fp16", "tf32": "dtype", "optim": "optimizer",
    "lr_scheduler_type": "schedule", "warmup_ratio": "warmup_steps", "save_steps": "save_every",
    "eval_steps": "eval_every", "logging_steps": "log_every", "save_total_limit": "keep_checkpoints",
    "max_seq_length": "seq_len", "max_length": "seq_len", "model_name_or_path": "model",
    "resume_from_checkpoint": "the --resume flag", "use_liger_kernel": "kernels: liger",
    "dataset_text_field": "data.format: text", "train_file": "data.path", "eval_file": "data.eval_path",
    "torch_dtype": "dtype", "attn_implementation": "attn", "load_in_4bit": "method: qlora",
    "report_to": "report_to", "max_grad_norm": "max_grad_norm", "seed": "seed",
    "use_peft": "method: lora",  # TRL's ModelConfig
    # PEFT LoraConfig, also written flat
    "lora_r": "lora.rank", "lora_rank": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.targets", "target_modules": "lora.targets", "r": "lora.rank",
    # Axolotl
    "base_model": "model", "sequence_len": "seq_len", "micro_batch_size": "batch_size", "num_epochs": "epochs",
    "adapter": "method", "datasets": "data.path", "dataset": "data.path", "sample_packing": "packing",
    "flash_attention": "attn: flash", "sdp_attention": "attn: sdpa", "lr_scheduler": "schedule",
    "lora_target_linear": "lora.targets: all-linear", "val_set_size": "data.eval_path",
    # torchtune
    "lora_attn_modules": "lora.targets", "enable_activation_checkpointing": "grad_checkpointing",
    "enable_activation_offloading": "grad_checkpointing: offload", "epochs_": "epochs",
    "max_steps_per_epoch": "max_steps", "torch_compile": "compile: layers (each decoder layer; fitune's runner)",
}

#: What an unknown-key problem says when the key is another trainer's name for one of fitune's.
OTHER_TRAINERS_NAME = "is how other trainers spell it"

#: Keys under `lora:` that PEFT / torchtune spell otherwise.
FOREIGN_LORA_KEYS: dict[str, str] = {
    "r": "lora.rank", "lora_r": "lora.rank", "lora_rank": "lora.rank", "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout", "target_modules": "lora.targets", "lora_target_modules": "lora.targets",
    "lora_attn_modules": "lora.targets", "modules": "lora.targets",
}


# ---- reading values ---------------------------------------------------------------------------------------------


class Problems:
    """Collects problems, each naming the key as the user wrote it (YAML key or flag)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> None:
        self.items.append(text)

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


def label(k: Key, origin: str) -> str:
    """How a problem names the key: the flag for values from the command line, else the YAML key."""
    return k.flag if origin == "flag" else k.yaml + ":"


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) < 80 else repr(value[:77] + "...")
    if isinstance(value, (list, tuple)):
        return f"a list ({len(value)} items)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, int) and not isinstance(value, bool):
        return show_int(value)
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


#: Integers with more digits than this are described by their length, not written out.
SHOWN_INT_DIGITS = 30


def int_digits(n: int) -> int:
    """The number of decimal digits of `n` (without its sign), computed without str() (which refuses integers over
    sys.get_int_max_str_digits() digits, 4,300 by default)."""
    n = abs(n)
    if n < 10 ** 18:
        return len(str(n))
    digits = int(n.bit_length() * 0.30102999566398120)  # log10(2): exact or one short
    return digits + 1 if n >= 10 ** digits else digits


def show_int(n: int) -> str:
    """`n` as text, or "a number of 5,000 digits" when it is too long to show (or to convert at all)."""
    digits = int_digits(n)
    if digits <= SHOWN_INT_DIGITS:
        return str(n)
    return f"a{' negative' if n < 0 else ''} number of {digits:,} digits"


def too_many_digits(digits: int) -> str:
    """The problem of an integer written with more digits than Python converts."""
    return (f"a number of {digits:,} digits: more than Python reads ({sys.get_int_max_str_digits():,} digits at "
            "most), and far more than any fitune setting takes")


def coerce(k: Key, value: Any, origin: str, problems: Problems) -> Any:
    """`value` as the field's type, or a problem added (and the sentinel `_BAD` returned)."""
    name = label(k, origin)
    if value is None:
        if k.optional:
            return None
        problems.add(f"{name} needs a value ({k.help})")
        return _BAD
    if k.kind == "bool":
        if isinstance(value, bool):
            return value
        if origin == "flag" and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        quoted = " (unquoted: a quoted \"false\" is text, not a boolean)" if isinstance(value, str) else ""
        problems.add(f"{name} must be true or false{quoted}, got {_describe(value)}")
        return _BAD
    if k.kind in ("int", "float"):
        return _number(k, value, name, problems)
    if k.kind == "choice":
        if isinstance(value, bool) and "true" in dict(k.value_aliases):  # torchtune's / Axolotl's `compile: true`
            value = "true" if value else "false"
        return _choice(k, value, name, problems)
    if k.kind == "checkpointing":
        if isinstance(value, bool):  # HF's gradient_checkpointing: true
            return "full" if value else "none"
        return _choice(k, value, name, problems)
    if k.kind == "targets":
        return _names(k, value, name, problems, targets=True)
    if k.kind == "names":
        return _names(k, value, name, problems, targets=False)
    # str
    if not isinstance(value, str) or isinstance(value, bool):
        problems.add(f"{name} must be text, got {_describe(value)}")
        return _BAD
    if not value.strip():
        problems.add(f"{name} is empty ({k.help})")
        return _BAD
    if "\x00" in value or "\n" in value or "\r" in value:
        problems.add(f"{name} must be one line without control characters, got {_describe(value)}")
        return _BAD
    return value


_BAD = object()


_INT_TEXT = re.compile(r"[-+]?[0-9]+")


def _number_from_text(text: str) -> int | float | str:
    """The number `text` spells (`16`, `2e-4`, `1_000`), or a problem (a str starting "must be" / "a number of")."""
    text = text.strip().replace("_", "")
    if _INT_TEXT.fullmatch(text):
        digits = len(text.lstrip("+-"))
        if digits > sys.get_int_max_str_digits():
            return too_many_digits(digits)
        return int(text)
    try:
        return float(text)
    except ValueError:
        return "must be a number"


def _number(k: Key, value: Any, name: str, problems: Problems) -> Any:
    number: Any = value
    if isinstance(value, bool):
        problems.add(f"{name} must be a number, got {value!r}")
        return _BAD
    if isinstance(value, str):
        number = _number_from_text(value)
        if isinstance(number, str):
            problems.add(f"{name} must be a number, got {_describe(value)}" if number == "must be a number" else
                         f"{name} is {number}")
            return _BAD
    if not isinstance(number, (int, float)):
        problems.add(f"{name} must be a number, got {_describe(value)}")
        return _BAD
    if isinstance(number, float) and not math.isfinite(number):
        problems.add(f"{name} must be a finite number, got {_describe(value)}")
        return _BAD
    if isinstance(number, int) and k.kind == "float" and number.bit_length() > 1000:  # float() would overflow
        problems.add(f"{name} must be a number a float holds (below 1e300), got {show_int(number)}")
        return _BAD
    if k.kind == "int":
        if isinstance(number, float):
            if not number.is_integer():
                problems.add(f"{name} must be a whole number, got {value!r}")
                return _BAD
            number = int(number)
    else:
        number = float(number)
    low, high = k.minimum, k.maximum
    if low is not None and (number < low or (k.exclusive_minimum and number == low)):
        if k.kind == "int" and low == 1:
            bound = "a positive integer"
        elif k.kind == "int" and low == 0:
            bound = "a whole number >= 0"
        else:
            bound = f"above {low:g}" if k.exclusive_minimum else f"at least {low:g}"
        problems.add(f"{name} must be {bound}, got {_show_number(number)}" + _range_hint(k))
        return _BAD
    if high is not None and number > high:
        problems.add(f"{name} must be at most {_show_number(high)}, got {_show_number(number)}" + _range_hint(k))
        return _BAD
    if k.kind == "int" and high is None and number.bit_length() > 63:  # an int64 everywhere downstream
        problems.add(f"{name} must be below 2**63, got {_show_number(number)}" + _range_hint(k))
        return _BAD
    return number


def _show_number(number: int | float) -> str:
    """16777216, 0.9, 2e-05, or "a number of 400 digits": never 1.67772e+07 for a whole number."""
    if isinstance(number, float) and number.is_integer() and abs(number) < 1e15:
        number = int(number)
    return show_int(number) if isinstance(number, int) else f"{number:g}"


def _range_hint(k: Key) -> str:
    return f" ({k.help})" if k.help else ""



def _choice(k: Key, value: Any, name: str, problems: Problems) -> Any:
    if not isinstance(value, str):
        problems.add(f"{name} must be one of {', '.join(k.choices)}, got {_describe(value)}")
        return _BAD
    text = value.strip()
    aliases = dict(k.value_aliases)
    low = text.lower()
    if low in aliases:
        return aliases[low]
    if low in k.choices:
        return low
    if k.kind == "checkpointing" and low.startswith("selective:"):
        k_text = low.split(":", 1)[1].strip()
        if not (k_text.isascii() and k_text.isdigit()):
            problems.add(f"{name} {_describe(text)}: write selective:K with K a whole number of layers, e.g. "
                         "selective:16")
            return _BAD
        if len(k_text.lstrip("0")) > MAX_LAYER_DIGITS:
            problems.add(f"{name} selective:K with K a number of {len(k_text):,} digits: K is how many layers to "
                         f"checkpoint (at most {MAX_LAYER_DIGITS} digits; a model has tens of layers), e.g. "
                         "selective:16")
            return _BAD
        return f"selective:{int(k_text)}"
    close = closest_of_same_width(low, list(k.choices) + list(aliases))
    width = _bit_width(low)
    same = f" (the same {width}-bit precision)" if width else ""
    hint = f"; did you mean {aliases.get(close, close)}?{same}" if close else ""
    problems.add(f"{name} {text!r} is not one of: {', '.join(k.choices)}{hint}")
    return _BAD


_BIT_WIDTH = re.compile(r"(\d+)[_-]?bit")


def _bit_width(name: str) -> int | None:
    """The bit width a value's name states (`paged_adamw_32bit` -> 32, `adamw8bit` -> 8), None when none."""
    m = _BIT_WIDTH.search(name)
    return int(m.group(1)) if m else None


def closest_of_same_width(value: str, candidates: list[str]) -> str | None:
    """The candidate closest to `value` among those of the same bit width (a name without one counts as 32-bit:
    `adamw` keeps 32-bit states), so that `paged_adamw_32bit` is never offered `paged_adamw8bit`, another precision.
    When no full name is close, the names are compared without the width and bitsandbytes' `paged` prefix
    (`paged_adamw_32bit` -> `adamw`). None when nothing is close."""
    width = _bit_width(value) or 32
    same = [c for c in candidates if (_bit_width(c) or 32) == width]
    close = difflib.get_close_matches(value, same, n=1, cutoff=0.6)
    if not close and _bit_width(value):
        core = _BIT_WIDTH.sub("", value).replace("paged", "").strip("_-")
        close = difflib.get_close_matches(core, same, n=1, cutoff=0.6) if core else []
    return close[0] if close else None


def _names(k: Key, value: Any, name: str, problems: Problems, targets: bool) -> Any:
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        items = list(value)
    else:
        problems.add(f"{name} must be a list of names (or comma-separated text), got {_describe(value)}")
        return _BAD
    items = [x.strip() for x in items if x.strip()]
    if targets:
        items = ["all-linear" if x.lower() in ("all-linear", "all_linear", "all") else x for x in items]
        if "all-linear" in items:
            return ("all-linear",)
    elif k.choices:
        if [x.lower() for x in items] == ["none"]:  # HF's report_to="none"
            return ()
        if [x.lower() for x in items] == ["all"]:  # HF's report_to="all": every one fitune has
            return tuple(k.choices)
        bad = [x for x in items if x.lower() not in k.choices]
        if bad:
            problems.add(f"{name} {', '.join(bad)}: not one of {', '.join(k.choices)}")
            return _BAD
        items = [x.lower() for x in items]
    return tuple(items)


# ---- mappings (YAML / JSON) --------------------------------------------------------------------------------------


def yaml_tree(keys: Iterable[Key]) -> dict:
    """{'lora': {'rank': Key, ...}, 'seq_len': Key, ...}: the nesting the YAML form uses."""
    tree: dict = {}
    for k in keys:
        node = tree
        *outer, last = k.yaml.split(".")
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = k
    return tree


def values_from_mapping(doc: Any, keys: list[Key], source: str, problems: Problems,
                        shorthand: dict[str, str] | None = None) -> dict[str, Any]:
    """{field: typed value} for the keys present in a YAML/JSON mapping; unknown keys become problems.

    `shorthand` maps a section given as plain text onto one of its keys (`data: train.jsonl` -> `data.path`).
    """
    if not isinstance(doc, dict):
        problems.add(f"{source}: expected a mapping of keys (model:, method:, lora:, seq_len: ...), got "
                     f"{_describe(doc)}")
        return {}
    out: dict[str, Any] = {}
    _walk(doc, yaml_tree(keys), "", out, problems, shorthand or {}, source)
    return out


def _walk(doc: dict, tree: dict, prefix: str, out: dict, problems: Problems, shorthand: dict, source: str) -> None:
    for raw_name, value in doc.items():
        name = str(raw_name)
        path = prefix + name
        node = tree.get(name)
        if node is None:
            problems.add(_unknown_key(path, tree, prefix))
            continue
        if isinstance(node, Key):
            v = coerce(node, value, "yaml", problems)
            if v is not _BAD:
                out[node.field] = v
            continue
        if isinstance(value, str) and path in shorthand:
            k = node[shorthand[path]]
            v = coerce(k, value, "yaml", problems)
            if v is not _BAD:
                out[k.field] = v
            continue
        if value is None:
            continue
        if not isinstance(value, dict):
            inner = ", ".join(f"{n}: ..." for n in node)
            problems.add(f"{path}: expected a mapping {{{inner}}}, got {_describe(value)}")
            continue
        _walk(value, node, path + ".", out, problems, shorthand, source)


def _unknown_key(path: str, tree: dict, prefix: str) -> str:
    """'lora.r: not a fitune key; did you mean lora.rank (PEFT's r)?'"""
    name = path[len(prefix):]
    known = _paths(tree, prefix)
    foreign = (FOREIGN_LORA_KEYS if prefix == "lora." else FOREIGN_KEYS).get(name)
    if foreign is None and prefix == "":
        foreign = FOREIGN_KEYS.get(name.lower())
    if foreign:
        return f"{path}: not a fitune key; did you mean {foreign}? (`{name}` {OTHER_TRAINERS_NAME})"
    sections = {prefix + n: node for n, node in tree.items() if not isinstance(node, Key)}
    close = difflib.get_close_matches(path, known + list(sections), n=1, cutoff=0.6)
    if close and close[0] in sections:  # `loar:` -> the lora section, not the key lr
        inner = ", ".join(_paths(sections[close[0]], close[0] + "."))
        return f"{path}: not a fitune key; did you mean {close[0]}? (a section: {inner})"
    if close:
        return f"{path}: not a fitune key; did you mean {' or '.join(close)}?"
    where = f"under {prefix.rstrip('.')}: " if prefix else ""
    return f"{path}: not a fitune key ({where}{KNOWN_LIST}{', '.join(sorted(known))})"


#: How an unknown-key problem starts its list of fitune's keys (`without_known_list` cuts it).
KNOWN_LIST = "known: "


def without_known_list(problem: str) -> str:
    """An unknown-key problem without its list of fitune's keys (`x: not a fitune key (known: a, b, ...)` ->
    `x: not a fitune key`): for a listing of many such problems, where the list would repeat on every line."""
    return re.sub(r" \((?:under [^:()]+: )?" + re.escape(KNOWN_LIST) + r"[^()]*\)$", "", problem)


def unknown_flag_hint(flag: str, known_flags: list[str], keys: list[Key]) -> str:
    """'; did you mean --batch-size? (`per_device_train_batch_size` is how other trainers spell it)' for a flag the
    command does not have: another trainer's name for one of fitune's keys (FOREIGN_KEYS, written with - or _), else
    the closest of the command's own flags; '' when nothing is close."""
    name = flag.lstrip("-").split("=", 1)[0]
    foreign = FOREIGN_KEYS.get(name.replace("-", "_").lower())
    if foreign is not None:
        target, _, value = (part.strip() for part in foreign.partition(":"))
        match = next((k for k in keys if target in (k.yaml, k.field) and k.flag in known_flags), None)
        if match is not None:
            return (f"; did you mean {match.flag}{' ' + value if value else ''}? (`{name}` is how other trainers "
                    "spell it)")
        return f"; `{name}` is fitune's `{foreign}`, which this command does not take"
    close = difflib.get_close_matches(flag.split("=", 1)[0], known_flags, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _paths(tree: dict, prefix: str) -> list[str]:
    out = []
    for name, node in tree.items():
        if isinstance(node, Key):
            out.append(prefix + name)
        else:
            out.extend(_paths(node, prefix + name + "."))
    return out


def to_mapping(values: dict[str, Any], keys: list[Key], keep_none: Iterable[str] = ()) -> dict:
    """The nested YAML form of {field: value} (tuples as lists). None is left out, except for the fields in
    `keep_none` (those whose default is not None: `max_grad_norm: null` turns clipping off)."""
    doc: dict = {}
    keep_none = set(keep_none)
    for k in keys:
        if k.field not in values:
            continue
        v = values[k.field]
        if v is None and k.field not in keep_none:
            continue
        node = doc
        *outer, last = k.yaml.split(".")
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = list(v) if isinstance(v, tuple) else v
    return doc


# ---- command-line flags -----------------------------------------------------------------------------------------


def add_arguments(parser, keys: Iterable[Key], skip: Iterable[str] = (), defaults: dict[str, Any] | None = None,
                  group_title: str | None = None) -> None:
    """Add one flag per key. Flags default to None ("not given"), so a config file's value stands unless the
    flag is given; the help shows the dataclass default."""
    skip = set(skip)
    target = parser.add_argument_group(group_title) if group_title else parser
    for k in keys:
        if k.field in skip or k.flag in skip:
            continue
        shown = (defaults or {}).get(k.field, _MISSING)
        default_text = "" if shown is _MISSING else f" (default {_show(shown)})"
        dest = "cfg_" + k.field
        if k.kind == "bool":
            target.add_argument(k.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=k.help + default_text)
            continue
        metavar = k.metavar or ("|".join(k.choices) if k.kind == "choice" and len(k.choices) <= 5 else
                                 {"int": "N", "float": "X", "str": "TEXT"}.get(k.kind, "VALUE"))
        target.add_argument(k.flag, dest=dest, default=None, metavar=metavar, help=k.help + default_text)


_MISSING = object()


def _show(v: Any) -> str:
    if v is None:
        return "not set"
    if isinstance(v, tuple):
        return ",".join(v) if v else "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def values_from_args(args, keys: Iterable[Key], problems: Problems) -> dict[str, Any]:
    """{field: typed value} for the flags given on the command line (flags not given are absent)."""
    out = {}
    for k in keys:
        raw = getattr(args, "cfg_" + k.field, None)
        if raw is None:
            continue
        if isinstance(raw, str) and k.optional and raw.lower() in ("none", "null", "off"):
            out[k.field] = None
            continue
        v = coerce(k, raw, "flag", problems)
        if v is not _BAD:
            out[k.field] = v
    return out


# ---- files ------------------------------------------------------------------------------------------------------


def load_config_file(path: str) -> dict:
    """Read a YAML (or JSON) config into a mapping: UTF-8 text, no duplicate keys, YAML 1.2 numbers (`2e-4` is a
    float), safe types only. Every failure is a ConfigError naming the file."""
    if not isinstance(path, str) or not path:
        raise ConfigError("the config path is empty; give a YAML file, e.g. run.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} is not a file (a folder?); give a YAML file")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes is too large for a config (at most {MAX_CONFIG_BYTES:,}); "
                          "is it the data file?")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    text = decode_text(raw, path)
    if path.endswith(".json"):
        try:
            doc = json.loads(text, parse_constant=_no_constant(path), parse_int=_json_int(path))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise ConfigError(f"{path}: nested too deeply to be a fitune config") from exc
    else:
        doc = _load_yaml(text, path)
    if doc is None:
        raise ConfigError(f"{path} is empty; a config needs at least model: and data:")
    _check_depth(doc, path)
    return doc


def parse_yaml_value(text: str, source: str) -> Any:
    """One YAML value typed on the command line (`--set lora.rank=16`), read as a config file's value is."""
    source = source if len(source) <= 100 else source[:97] + "..."  # `--set seed=<5,000 digits>`
    value = _load_yaml(text, source)
    _check_depth(value, source)
    return value


def decode_text(raw: bytes, path: str) -> str:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path} is UTF-16 text; save it as UTF-8 (most editors: 'Save with encoding')")
    if b"\x00" in raw:
        raise ConfigError(f"{path} holds binary data (NUL bytes); a config is UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as "
                          "UTF-8") from exc


def _json_int(path: str):
    """json's `parse_int`: int(), with a ConfigError for more digits than Python converts (instead of ValueError)."""
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > sys.get_int_max_str_digits():
            raise ConfigError(f"{path}: {too_many_digits(digits)}")
        return int(text)

    return parse


def _no_constant(path: str):
    def reject(name: str):
        raise ConfigError(f"{path}: {name} is not a number a config can hold")

    return reject


def _load_yaml(text: str, path: str) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("reading a YAML config needs PyYAML: pip install pyyaml") from exc
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except _BadValue as exc:
        raise ConfigError(f"{path}: {exc.text()}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path}: nested too deeply to be a fitune config") from exc


class _BadValue(ConfigError):
    """A YAML value its tag's constructor cannot build (`lr: !!int abc`, `seed: !!bool 0`, a 5,000-digit integer,
    an unknown tag `!foo`): where it is (line and, once known, the dotted key) and why."""

    def __init__(self, line: int, problem: str):
        super().__init__(problem)
        self.line = line
        self.problem = problem
        self.keys: list[str] = []

    def text(self) -> str:
        where = f"{'.'.join(self.keys)}: " if self.keys else ""
        return f"line {self.line}: {where}{self.problem}"


_YAML_TAG = "tag:yaml.org,2002:"
#: What the YAML tags of the core schema read (`!!bool 0` "is not true or false").
_TAG_READS = {"int": "a whole number", "float": "a number", "bool": "true or false", "null": "null",
              "str": "text", "binary": "base64 data", "timestamp": "a date (2024-01-31) or time",
              "map": "a mapping", "omap": "a list of one-key mappings", "pairs": "a list of one-key mappings",
              "set": "a mapping of keys without values", "seq": "a list"}


def _bad_value(loader, node, exc: Exception) -> _BadValue:
    """The problem of a YAML node its constructor failed on (`exc`): the tag as written, the value and why."""
    import yaml

    tag = str(node.tag)
    short = "!!" + tag[len(_YAML_TAG):] if tag.startswith(_YAML_TAG) else tag
    name = short[2:] if short.startswith("!!") else ""
    line = node.start_mark.line + 1
    # A tag the plain text would not resolve to was written (`!!int abc`); else YAML took the text for it (`2024-13-45`)
    explicit = not isinstance(node, yaml.ScalarNode) or loader.resolve(yaml.ScalarNode, node.value,
                                                                        (True, False)) != node.tag
    if isinstance(node, yaml.ScalarNode):
        raw = str(node.value)
        value = _describe(raw)
        written = f"`{short} {raw if len(raw) < 40 else raw[:37] + '...'}`"
        digits = raw.strip().lstrip("+-").replace("_", "")
        if name == "int" and digits.isdigit() and len(digits) > sys.get_int_max_str_digits():
            return _BadValue(line, too_many_digits(len(digits)))
    else:
        value = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
        written = f"`{short}` on {value}"
    if isinstance(exc, yaml.constructor.ConstructorError) and "could not determine a constructor" in str(exc):
        return _BadValue(line, f"{written}: not valid YAML for a config: `{short}` is a tag fitune does not read "
                               "(a config holds plain values: text, numbers, true/false, lists, mappings); remove "
                               "the tag")
    # ValueError's text says what int()/float()/date() could not read; PyYAML's own errors say what it expected
    detail = str(getattr(exc, "problem", None) or exc).strip() if type(exc) is ValueError or isinstance(
        exc, yaml.YAMLError) else ""
    detail = f" ({detail if len(detail) < 100 else detail[:97] + '...'})" if detail else ""
    reads = _TAG_READS.get(name, f"what {short} reads")
    if not explicit:  # a plain value YAML took for a date (`2024-13-45`)
        return _BadValue(line, f"{value} reads as {reads} (YAML's {short}) but is not one{detail}; quote it to "
                               "keep it as text")
    return _BadValue(line, f"{written} is not {reads}{detail}; write the value without the tag")


_LOADER = None


def _loader():
    """A SafeLoader that reads YAML 1.2 floats (`2e-4`, `1e-5`: PyYAML's YAML 1.1 reads them as text), refuses
    duplicate keys (the second would silently win), and turns any value its tag cannot build (`lr: !!int abc`,
    `!!bool 0`, `!foo`, a 5,000-digit integer) into one problem naming the line, the key, the value and why."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_object(self, node, deep=False):
            try:
                return super().construct_object(node, deep=deep)
            except (ConfigError, RecursionError, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - a constructor reading the user's text: any failure is the value's
                raise _bad_value(self, node, exc) from None

        def construct_document(self, node):
            # the root's list or set is filled after construct_object returns (PyYAML's generators), here
            try:
                return super().construct_document(node)
            except (ConfigError, RecursionError, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - as above
                raise _bad_value(self, node, exc) from None

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )

    def mapping(loader, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(None, None, f"expected a mapping, found {node.id}",
                                                    node.start_mark)
        seen, out = set(), {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _YAML_TAG + "merge":
                raise ConfigError(f"line {line}: `<<` (a YAML merge key) is not read in a fitune config; write the "
                                  "keys out")
            k = loader.construct_object(key_node, deep=True)
            if not isinstance(k, (str, int, float, bool)) or k is None or (isinstance(k, int) and k.bit_length() > 64):
                raise ConfigError(f"line {line}: a key must be a plain name, got {_describe(k)}")
            if k in seen:
                raise ConfigError(f"line {line}: key {_describe(k)} is given twice; keep one")
            seen.add(k)
            try:
                out[k] = loader.construct_object(value_node, deep=True)
            except _BadValue as exc:
                exc.keys.insert(0, str(k))
                raise
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    _LOADER = Loader
    return Loader


def _check_depth(doc: Any, path: str, depth: int = 0, seen: list[int] | None = None, where: str = "") -> None:
    """Refuse a document nested deeper than MAX_CONFIG_DEPTH or holding more than MAX_CONFIG_VALUES values (YAML
    aliases can repeat one list thousands of times over: `a: &a [x, x]`, `b: [*a, *a]`, ..., the billion laughs),
    or text that is not Unicode (a lone surrogate such as JSON's "\\ud800", which no file or terminal can write)."""
    seen = [0] if seen is None else seen
    seen[0] += 1
    if seen[0] > MAX_CONFIG_VALUES:
        raise ConfigError(f"{path}: more than {MAX_CONFIG_VALUES:,} values (YAML aliases repeating a list?); a fitune "
                          "config holds a few dozen")
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: nested more than {MAX_CONFIG_DEPTH} levels; a fitune config nests at most 2")
    if isinstance(doc, str):
        _check_unicode(doc, path, where)
    elif isinstance(doc, int) and doc.bit_length() > 14_000 and int_digits(doc) > sys.get_int_max_str_digits():
        key = f"{where}: " if where else ""  # `0x` and 3,600 hex digits: read, but no str() can write it
        raise ConfigError(f"{path}: {key}{too_many_digits(int_digits(doc))}")
    elif isinstance(doc, dict):
        for k, v in doc.items():
            name = k if isinstance(k, str) else ""
            _check_unicode(name, path, where)
            _check_depth(v, path, depth + 1, seen, f"{where}.{name}" if where else name)
    elif isinstance(doc, list):
        for v in doc:
            _check_depth(v, path, depth + 1, seen, where)


def _check_unicode(text: str, path: str, where: str) -> None:
    """Raise ConfigError when `text` holds a lone surrogate (JSON's "\\ud800", YAML's "\\udc80")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        key = f"{where}: " if where else ""
        raise ConfigError(f"{path}: {key}{ascii(text[:40])} holds a lone surrogate ({ascii(text[exc.start])}): "
                          "half of a UTF-16 pair, not a character; write the text itself (UTF-8)") from None
