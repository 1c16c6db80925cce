"""TrainConfig: everything `fitune train` needs; its YAML is the saved form.

```yaml
model: path/to/hf-model-folder      # or model.gguf, or a Hub id (org/name); a catalog name with `init: random`
data: {path: train.jsonl, format: chat, eval_path: eval.jsonl}
method: lora
lora: {rank: 8, alpha: 16, dropout: 0.0, targets: [q_proj, v_proj]}
seq_len: 2048
batch_size: 2
grad_accum: 1
max_steps: 1000                     # or epochs
lr: 2e-4
output_dir: runs/x
```
How the step trains (method, LoRA, dtype, checkpointing, attention, optimizer, batch, sequence, loss) is the
shared `TrainSetup` (fitune/setup.py); the rest is here. Keys, flags and types come from the fields' schema
(fitune/schema.py); `validate()` lists every problem at once, naming the YAML key or the flag.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .datasource import (FORMAT_ALIASES as _FORMAT_ALIASES, FORMATS as DATA_FORMATS, SUFFIXES as DATA_SUFFIXES,
                         data_path_problem, is_hub_id as is_data_hub_id, tokenizer_source_problem)
from .errors import ConfigError, FituneError, UnknownGpuError, UnsupportedArchitectureError
from .schema import (Key, Problems, key, keys_of, label, to_mapping, values_from_args, values_from_mapping)
from .setup import SETUP_KEYS, TrainSetup
from .specs.gpu import resolve_gpu
from .specs.model import catalog_key_for_hub_id, check_hf_config, model_spec_from_hf_config, resolve_model_source

SCHEDULES = ("cosine", "linear", "constant")
LOGGERS = ("tensorboard", "wandb")
_SCHEDULE_ALIASES = {"constant_with_warmup": "constant", "cosine_with_warmup": "cosine", "linear_with_warmup": "linear",
                     "cosine_with_restarts": "cosine"}


@dataclass(frozen=True)
class DataConfig:
    path: str = key("", yaml="data.path", flag="--data", kind="str",
                    help="training data: .jsonl, .json, .csv, .tsv, .txt, .parquet, a saved Hugging Face dataset "
                         "folder, or a Hub data set id ORG/NAME (read from the Hugging Face cache; docs/data.md)")
    format: str | None = key(None, yaml="data.format", flag="--data-format", kind="choice", choices=DATA_FORMATS,
                             aliases=_FORMAT_ALIASES, optional=True,
                             help=" | ".join(DATA_FORMATS) + "; detected from the records when omitted")
    eval_path: str | None = key(None, yaml="data.eval_path", flag="--eval-data", kind="str", optional=True,
                                help="evaluation data, same formats (a local file or folder; read whole)")
    split: str = key("train", yaml="data.split", flag="--data-split", kind="str",
                     help="the split to read of a Hub data set or of a saved DatasetDict folder")
    subset: str | None = key(None, yaml="data.subset", flag="--data-subset", kind="str", optional=True,
                             help="the subset (configuration name, load_dataset's name=) of a Hub data set")
    streaming: bool = key(False, yaml="data.streaming", flag="--data-streaming", kind="bool",
                          help="read records lazily as training needs them, never the whole set in memory; needs "
                               "max_steps (the record count is unknown), records in file order (no shuffle)")


@dataclass(frozen=True)
class TrainConfig:
    model: str = key("", kind="str", help="a Hugging Face model folder, a .gguf file or a Hub id (org/name: from "
                                          "the Hub cache, else downloaded), or a catalog name / config.json with "
                                          "init: random")
    setup: TrainSetup = dataclasses.field(default_factory=lambda: TrainSetup(stack="fitune"))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    output_dir: str = key("runs/fitune", kind="str", help="where checkpoints, metrics.jsonl, the adapter (and "
                                                         "merged weights) go")
    init: str = key("pretrained", kind="choice", choices=("pretrained", "random"),
                    help="pretrained (load the folder's weights) | random (random weights from the config: smoke "
                         "runs, benchmarks)")
    tokenizer: str | None = key(None, kind="str", optional=True, help="tokenizer folder (default: the model folder)")
    trust_remote_code: bool = key(False, kind="bool", help="run code shipped with the model (only with the literal "
                                                           "true)")
    max_steps: int | None = key(None, kind="int", optional=True, minimum=1, maximum=10**9,
                                help="optimizer steps (or give epochs)")
    epochs: float | None = key(None, kind="float", optional=True, minimum=0, exclusive_minimum=True, maximum=10**4,
                               help="passes over the data (or give max_steps)")
    lr: float = key(2.0e-4, kind="float", minimum=0, exclusive_minimum=True, maximum=1.0,
                    help="peak learning rate")
    weight_decay: float = key(0.0, kind="float", minimum=0, maximum=10.0, help="AdamW weight decay")
    schedule: str = key("cosine", kind="choice", choices=SCHEDULES, aliases=_SCHEDULE_ALIASES,
                        help="cosine | linear | constant, after the warm-up")
    warmup_steps: int = key(0, kind="int", minimum=0, maximum=10**9, help="linear warm-up steps")
    max_grad_norm: float | None = key(1.0, kind="float", optional=True, minimum=0, exclusive_minimum=True,
                                      maximum=1e6, help="gradient clipping norm (null: off)")
    seed: int = key(0, kind="int", minimum=0, maximum=2**32 - 1, help="seed of the data order, init and dropout")
    packing: bool = key(False, kind="bool", help="pack short examples into full sequences (attention kept inside "
                                                 "each example)")
    packing_attention: str = key("varlen", kind="choice", choices=("varlen", "mask"),
                                 help="with packing: varlen (each example attended on its own, no mask tensor) | "
                                      "mask (a block-diagonal mask, rows x length^2 bytes)")
    eval_every: int | None = key(None, kind="int", optional=True, minimum=1, maximum=10**9,
                                 help="evaluate every N steps (and at the end) when data.eval_path is set")
    save_every: int | None = key(None, kind="int", optional=True, minimum=1, maximum=10**9,
                                 help="write a resumable checkpoint every N steps (and at the end)")
    save_every_minutes: float | None = key(30.0, kind="float", optional=True, minimum=0, exclusive_minimum=True,
                                           maximum=10**6, unit="minutes",
                                           help="also checkpoint when this many minutes passed since the last one "
                                                "(null: off), so a killed run loses at most that")
    keep_checkpoints: int = key(2, kind="int", minimum=1, maximum=10**6,
                                help="how many of this run's newest checkpoints to keep (another run's are never "
                                     "deleted)")
    report_to: tuple[str, ...] = key((), kind="names", choices=LOGGERS, metavar="tensorboard,wandb",
                                     help="loggers besides metrics.jsonl: tensorboard | wandb (offline without a key)")
    log_every: int = key(1, kind="int", minimum=1, maximum=10**9, help="without the progress bar (--no-progress): a progress line every N steps")
    merge: bool = key(False, kind="bool", help="also write the base model with the adapter merged in")
    oom_guard: bool = key(True, kind="bool", help="on CUDA out of memory, re-plan (smaller micro-batches, then "
                                                  "checkpointing) and retry the step")
    cap: str | None = key(None, kind="str", optional=True, metavar="GPU|NGiB",
                          help="limit PyTorch's allocator to this GPU's budget (rtx4090, 23.4GiB): rehearse a smaller "
                               "card on a big one")

    def validate(self, origin: dict[str, str] | None = None, config_dir: str | None = None) -> "TrainConfig":
        """Every problem at once; each names the YAML key (or the flag, when `origin` says the value came from one).

        `config_dir`: the folder of the config file the values came from. Relative paths are read from the current
        directory; a missing one that came from the file says so, and names the file beside the config if there is
        one (`relative_path_note`)."""
        origin = origin or {}
        by_field = {k.field: k for k in ALL_KEYS}

        def name(f: str) -> str:
            return label(by_field[f], origin.get(f, "yaml"))

        def from_file(f: str) -> str | None:  # the config's folder, for a value the config file gave
            return config_dir if origin.get(f, "yaml") == "yaml" else None

        problems: list[str] = []
        try:
            self.setup.validate(origin={f: origin.get(f, "yaml") for f in (k.field for k in SETUP_KEYS)})
        except ConfigError as exc:
            problems += exc.problems
        if not self.model:
            problems.append(f"{name('model')} missing; give a Hugging Face model folder, a .gguf file or a Hub id "
                            "(or a catalog name with init: random)")
        problems += _path_problems(self, name, from_file)
        problems += _data_problems(self, name, from_file)
        if self.packing and self.setup.attn == "flash" and self.setup.batch_size > 1:
            # transformers' flash_attention_2 finds packed examples in the position ids of a batch of ONE row only
            # (modeling_flash_attention_utils._is_packed_sequence); with more, examples would attend to each other
            rows, accum = self.setup.batch_size, self.setup.batch_size * self.setup.grad_accum
            problems.append(f"packing with attn flash and batch_size {rows}: flash-attention 2 keeps packed examples "
                            f"apart only with one row per micro-batch; use batch_size 1 (with grad_accum {accum}: the "
                            "same step), or attn sdpa, with which fitune attends each packed example on its own")
        if (self.max_steps is None) == (self.epochs is None):
            problems.append(f"{name('max_steps')} / {name('epochs')} give exactly one of them")
        if self.cap is not None:
            try:
                resolve_gpu(str(self.cap), name("cap").rstrip(":"))
            except UnknownGpuError as exc:
                problems.append(str(exc))
        if self.init == "random" and not self.tokenizer and not (self.model and _has_tokenizer(self.model)):
            problems.append(f"{name('tokenizer')} needed with init: random and a catalog model (a tokenizer folder)")
        if self.output_dir and os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            problems.append(f"{name('output_dir')} {self.output_dir} is a file; give a folder")
        elif self.output_dir:
            problems += [f"{name('output_dir')} {p}" for p in _output_dir_problems(self.output_dir)]
        for f, path in (("path", self.data.path), ("eval_path", self.data.eval_path)):
            if path and os.path.exists(path):
                problem = data_path_problem(path)
                if problem is None and os.path.isfile(path) and os.path.getsize(path) == 0:
                    problem = f"{path}: no records (the file is empty); point it at a file with training examples"
                elif problem:
                    problem = f"{path} {problem}"
                if problem:
                    problems.append(f"{name(f)} {problem}")
        if not problems:  # the model's sizes: what the setup asks of it (layers to checkpoint, LoRA rank, ...)
            problems += _model_problems(self, name, origin)
        if problems:
            raise ConfigError(problems)
        return self

    def to_dict(self) -> dict:
        """The YAML form (nested: lora:, data:), every field written; `config_from_dict` reads it back."""
        defaults = flat_values(TrainConfig())
        return to_mapping(flat_values(self), ALL_KEYS, keep_none=[f for f, v in defaults.items() if v is not None])


def _path_problems(cfg: "TrainConfig", name, from_file) -> list[str]:
    """model:, data.eval_path: and tokenizer: as paths (data.path: `_data_problems`). A relative path the config
    file gave that is missing here says where it was looked for (`relative_path_note`); `from_file(field)`: the
    config's folder when the field's value came from the config file."""
    def note(f: str, path: str | None) -> str:
        return relative_path_note(path, from_file(f))

    problems = []
    if cfg.model and beside_config(cfg.model, from_file("model")):  # whatever it looks like: the config meant it
        problems.append(f"{name('model')} {cfg.model} does not exist{note('model', cfg.model)}")
    elif cfg.init == "pretrained" and cfg.model:
        problem = _pretrained_source_problem(cfg.model, name("model"))
        if problem:
            problems.append(problem + note("model", cfg.model))
    evald = cfg.data.eval_path
    if evald and not os.path.exists(evald):
        problems.append(f"{name('eval_path')} {evald} does not exist{note('eval_path', evald)}")
    problem = cfg.tokenizer and tokenizer_source_problem(cfg.tokenizer, name("tokenizer"))
    if problem:
        problems.append(problem + note("tokenizer", cfg.tokenizer))
    return problems


def _data_problems(cfg: "TrainConfig", name, from_file) -> list[str]:
    """data.path (a local source, or a Hub data set id ORG/NAME) and what streaming needs. `from_file(field)`: the
    config's folder when the field's value came from the config file."""
    data = cfg.data
    problems = []
    if not data.path:
        problems.append(f"{name('path')} missing; point it at a .jsonl / .json / .csv / .tsv / .txt / .parquet file, "
                        "a dataset folder or a Hub data set id ORG/NAME")
    elif not os.path.exists(data.path) and (not is_data_hub_id(data.path, DATA_SUFFIXES)
                                            or beside_config(data.path, from_file("path"))):
        where = relative_path_note(data.path, from_file("path")) or " (a Hub data set id is written ORG/NAME)"
        problems.append(f"{name('path')} {data.path} does not exist{where}")
    if data.subset is not None and data.path and os.path.exists(data.path):
        problems.append(f"{name('subset')} {data.subset!r} names a subset of a Hub data set, but "
                        f"{name('path').rstrip(':')} {data.path} is a local file or folder; remove it")
    if not data.split.strip():
        problems.append(f"{name('split')} is empty; give a split name (default: train)")
    if data.streaming:
        if cfg.epochs is not None:
            problems.append(f"{name('epochs')} {cfg.epochs:g} cannot be counted with {name('streaming').rstrip(':')} "
                            "true: records are read as training needs them, so how many make an epoch is not known "
                            f"up front; give {name('max_steps').rstrip(':')} instead")
    return problems


def relative_path_note(path: str | None, config_dir: str | None) -> str:
    """For a path a config file in `config_dir` names that is missing here: that a relative path is read from the
    current directory, not the config's folder, and the file beside the config when there is one ("" for an
    absolute path, no config folder, or a config in the current directory)."""
    if not path or not config_dir or os.path.isabs(path):
        return ""
    cwd, folder = os.getcwd(), os.path.abspath(config_dir)
    if folder == cwd:
        return ""
    text = f" (relative to the current directory ({cwd}), not the config's folder ({folder})"
    beside = os.path.join(folder, path)
    if os.path.exists(beside):
        text += f"; {beside} exists: write that path in the config, or run fitune from {folder}"
    return text + ")"


def beside_config(path: str, config_dir: str | None) -> bool:
    """Whether the relative `path` is missing from the current directory but exists beside the config (then it is
    no Hub id or catalog name, whatever it looks like: the config meant that file)."""
    return bool(config_dir) and not os.path.isabs(path) and not os.path.exists(path) \
        and os.path.exists(os.path.join(config_dir, path))


#: Files a model folder's weights come in (transformers 5 loads safetensors and PyTorch pickles).
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _output_dir_problems(output_dir: str) -> list[str]:
    """Why `output_dir` cannot be created or written (its nearest existing folder decides), as problems."""
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return []
        path = parent
    if not os.path.isdir(path):
        return [f"{output_dir} cannot be made: {path} is a file, not a folder; choose another output_dir"]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"{output_dir} cannot be written: {path} is not writable by this user; choose a folder you can "
                "write (or fix its permissions)"]
    return []


def _pretrained_source_problem(model: str, key: str) -> str | None:
    """Why `model` cannot give pretrained weights (None when it can): a model folder, a .gguf file, or a Hub id
    that is in the Hub cache or can be downloaded (not when HF_HUB_OFFLINE is set)."""
    from .specs.sources import cached_hub_snapshot, hub_offline, is_gguf_path, is_hub_id, not_cached_message

    if os.path.isdir(model) or os.path.isfile(model) and is_gguf_path(model):
        return None
    if is_hub_id(model):
        if hub_offline() and cached_hub_snapshot(model) is None:
            return not_cached_message(model, key)
        return None  # cached, or downloaded when the run starts
    return (f"{key} {model!r} is not a folder, a .gguf file or a Hub id (org/name); pretrained weights load from one "
            "of those (for a catalog name use init: random and tokenizer:)")


def _has_tokenizer(model: str) -> bool:
    """Whether `model` carries a tokenizer: a model folder, a .gguf file, a Hub id."""
    from .specs.sources import is_gguf_path, is_hub_id

    return os.path.isdir(model) or os.path.isfile(model) and is_gguf_path(model) or is_hub_id(model)


def source_problems(cfg: "TrainConfig") -> list[str]:
    """The model folder (or a Hub id's cached snapshot: config.json, weights for init: pretrained) and a tokenizer:
    Hub id that is not cached while HF_HUB_OFFLINE is set: the part of `fitune train`'s preflight
    (`fitune.train.preflight.preflight_problems`) that needs nothing above the spine."""
    return _model_folder_problems(cfg) + _tokenizer_problems(cfg)


def _tokenizer_problems(cfg: "TrainConfig") -> list[str]:
    """A tokenizer: Hub id that is not cached while HF_HUB_OFFLINE is set (a missing path: `validate`)."""
    from .specs.sources import cached_hub_snapshot, hub_offline, is_hub_id, not_cached_message

    if cfg.tokenizer and is_hub_id(cfg.tokenizer) and hub_offline() and cached_hub_snapshot(cfg.tokenizer) is None:
        return [not_cached_message(cfg.tokenizer, "tokenizer:")]
    return []


def _model_folder_problems(cfg: "TrainConfig") -> list[str]:
    """The model folder (or a Hub id's cached snapshot): config.json, and weights for init: pretrained."""
    from .specs.sources import cached_hub_snapshot, hub_offline, is_hub_id, not_cached_message

    folder = cfg.model
    if is_hub_id(cfg.model):
        folder = cached_hub_snapshot(cfg.model)
        if folder is None:  # downloaded when the run starts, unless offline
            return [not_cached_message(cfg.model)] if hub_offline() else []
    if not os.path.isdir(folder):
        return []
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return [f"model: {cfg.model} is a folder without a config.json; point model: at a Hugging Face model folder"]
    if cfg.init == "pretrained" and not any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(folder)):
        where = cfg.model if folder == cfg.model else f"{cfg.model} (cached at {folder})"
        return [f"model: {where} holds no weights (no .safetensors or .bin file); download the model's weights "
                "into it, or use init: random (and tokenizer:) for a smoke run"]
    return []


def trained_positions(hf_config: dict) -> int | None:
    """The positions a model was trained (or scaled) for: max_position_embeddings, or rope scaling's reach when its
    config.json has one (factor x original_max_position_embeddings: Llama 3.1's 8 x 8192 = its 131072; YaRN,
    linear and dynamic scaling alike). None when the config does not say."""
    positions = hf_config.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        return None
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
        original = rope.get("original_max_position_embeddings")
        original = original if isinstance(original, int) and original > 0 else positions
        return max(positions, int(original * factor))
    return positions


def position_warning(cfg: "TrainConfig") -> str | None:
    """What `fitune train` warns before training when seq_len is beyond the positions the model was trained on
    (None when it is not, or the model's config.json cannot be read without a download). A warning, not a refusal:
    a plan may use longer sequences on purpose (llama-3.1-8b's 143k-token plans are beyond its 131072 positions)."""
    from .specs.sources import cached_hub_file, is_hub_id

    if is_hub_id(cfg.model) and cached_hub_file(cfg.model) is None and catalog_key_for_hub_id(cfg.model) is None:
        return None
    try:
        hf_config = resolve_model_source(cfg.model).hf_config
    except FituneError:
        return None
    positions = trained_positions(hf_config.get("text_config") or hf_config) or trained_positions(hf_config)
    seq = cfg.setup.seq_len_tokens
    if positions is None or seq <= positions:
        return None
    return (f"seq_len {seq} tokens is beyond the {positions} positions {cfg.model} was trained on "
            "(max_position_embeddings in its config.json, no rope_scaling that reaches further): rows longer than "
            f"{positions} tokens use positions the model was not trained on, and may train and generate worse; "
            f"keep rows within {positions} tokens, or use a model made for longer context")


def _model_problems(cfg: "TrainConfig", name, origin: dict[str, str]) -> list[str]:
    """What the model's config.json (read, never its weights) says against `cfg`: a config.json that is missing or
    unusable, and the setup checked against the model's sizes."""
    if os.path.isdir(cfg.model) and not os.path.exists(os.path.join(cfg.model, "config.json")):
        return []  # nothing to check yet (`preflight_problems` refuses to train from it)
    from .specs.sources import cached_hub_file, is_hub_id

    if is_hub_id(cfg.model) and cached_hub_file(cfg.model) is None and catalog_key_for_hub_id(cfg.model) is None:
        return []  # its config.json comes with the download when the run starts (offline: `validate` said so)
    try:
        src = resolve_model_source(cfg.model)
    except FituneError as exc:
        return [f"{name('model')} {exc}"]
    problems = []
    try:
        spec = model_spec_from_hf_config(src.hf_config, name=src.name, source=src.source)
        setup_origin = {k.field: origin.get(k.field, "yaml") for k in SETUP_KEYS}
        # linear_names: the LoRA targets checked as estimate checks them, with the same message
        cfg.setup.validate(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                           linear_names=spec.linear_names(), origin=setup_origin)
    except UnsupportedArchitectureError:  # the runner builds it all the same; only its sizes can be checked here
        found = check_hf_config(src.hf_config, src.model_type, required=())
        problems += [f"{name('model')} {src.source}: {p}" for p in found]
        if not cfg.trust_remote_code and not _transformers_knows(src.model_type):
            problems.append(f"{name('model')} {src.source}: model_type {src.model_type!r} is not an architecture this "
                            "transformers knows; fix model_type, upgrade transformers, or (for a model that ships its "
                            "code) set trust_remote_code: true")
    except ConfigError as exc:
        problems += exc.problems
    except FituneError as exc:
        problems.append(f"{name('model')} {exc}")
    return problems


def _transformers_knows(model_type: str) -> bool:
    """Whether transformers builds `model_type` itself (True when transformers is not installed: train says so)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return True
    return model_type in CONFIG_MAPPING


CONFIG_KEYS: list[Key] = keys_of(TrainConfig)
DATA_KEYS: list[Key] = keys_of(DataConfig)
#: Every key of a `fitune train` config, in the order the YAML form writes them.
ALL_KEYS: list[Key] = CONFIG_KEYS[:1] + DATA_KEYS + SETUP_KEYS + CONFIG_KEYS[1:]


def flat_values(cfg: TrainConfig) -> dict:
    """{field: value} over the config, its data and its setup (field names are unique across the three)."""
    out = {k.field: getattr(cfg, k.field) for k in CONFIG_KEYS}
    out.update({k.field: getattr(cfg.data, k.field) for k in DATA_KEYS})
    out.update({k.field: getattr(cfg.setup, k.field) for k in SETUP_KEYS})
    return out


def config_from_dict(doc: dict, source: str = "config", overrides: dict | None = None,
                     flag_values: dict | None = None) -> TrainConfig:
    """Build and validate a TrainConfig from a YAML mapping.

    `overrides`: dotted YAML keys from `--set key=value` (YAML values); `flag_values`: {field: value} from the
    command-line flags (`values_from_args`). Both win over the file; a problem names the flag for a flag's value.
    """
    problems = Problems()
    if not isinstance(doc, dict):
        problems.add(f"{source}: expected a mapping of keys (model:, data:, method:, ...)")
        problems.raise_if_any()
    merged = _merge(doc, overrides or {}, problems)
    for one, other in (("max_steps", "epochs"), ("epochs", "max_steps")):  # as for the flags below: one choice
        if one in (overrides or {}) and other not in (overrides or {}) and other in doc:
            merged.pop(other, None)
    remote = _remote_code_problem(merged, source, from_file="trust_remote_code" not in (overrides or {}))
    if remote:
        problems.add(remote)
        merged = {k: v for k, v in merged.items() if k != "trust_remote_code"}  # one problem, not two
    values = values_from_mapping(merged, ALL_KEYS, source, problems, shorthand={"data": "path"})
    origin = {f: "yaml" for f in values}
    for f, v in (flag_values or {}).items():
        values[f] = v
        origin[f] = "flag"
    # A given max_steps replaces the file's epochs (and the other way round): they are one choice.
    for one, other in (("max_steps", "epochs"), ("epochs", "max_steps")):
        if origin.get(one) == "flag" and origin.get(other) == "yaml":
            values.pop(other)
    problems.raise_if_any()
    cfg = config_from_values(values)
    cfg.validate(origin, config_dir=os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None)
    return cfg


REMOTE_CODE_KEY = "trust_remote_code"


def _remote_code_problem(doc: dict, source: str, from_file: bool) -> str | None:
    """Why the document's trust_remote_code is refused: it runs a model folder's own code, so only the literal
    `true` turns it on. YAML 1.1 also reads `yes`, `on`, `y`, `True` as true; the file's text is read again to tell
    them apart (a `--set` value, already parsed, is checked by type only)."""
    value = doc.get(REMOTE_CODE_KEY, False)
    if value is False:
        return None
    written = _written_scalar(source, REMOTE_CODE_KEY) if from_file else None
    if value is True and written in (None, "true"):
        return None
    shown = repr(written) if written is not None else repr(value)
    return (f"{REMOTE_CODE_KEY}: {shown} — only the literal true runs a model folder's own code; write "
            f"{REMOTE_CODE_KEY}: true (or false, or leave it out)")


def _written_scalar(source: str, top_key: str) -> str | None:
    """The text a YAML config file wrote for a top-level key's scalar value (quotes kept: `"true"`), or None when
    `source` is not a YAML file or the key is not a plain scalar there."""
    if not (isinstance(source, str) and os.path.isfile(source)) or source.endswith(".json"):
        return None
    try:
        import yaml

        with open(source, encoding="utf-8-sig") as f:
            root = yaml.compose(f, Loader=yaml.SafeLoader)
    except Exception:  # noqa: BLE001 - load_config_file already read the file; nothing more to learn here
        return None
    if not isinstance(root, yaml.MappingNode):
        return None
    for key_node, value_node in root.value:
        if getattr(key_node, "value", None) == top_key and isinstance(value_node, yaml.ScalarNode):
            quote = {"'": "'", '"': '"'}.get(value_node.style or "", "")
            return f"{quote}{value_node.value}{quote}"
    return None


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from {field: value} (fields of TrainConfig, DataConfig and TrainSetup), defaults elsewhere."""
    setup_fields = {k.field for k in SETUP_KEYS}
    data_fields = {k.field for k in DATA_KEYS}
    setup = TrainSetup(**{"stack": "fitune", **{f: v for f, v in values.items() if f in setup_fields}})
    data = DataConfig(**{f: v for f, v in values.items() if f in data_fields})
    rest = {f: v for f, v in values.items() if f not in setup_fields and f not in data_fields}
    return TrainConfig(setup=setup, data=data, **rest)


def train_values_from_args(args, skip: tuple[str, ...] = ()) -> dict:
    """{field: value} of every train-config flag given on the command line."""
    problems = Problems()
    values = values_from_args(args, [k for k in ALL_KEYS if k.field not in skip], problems)
    problems.raise_if_any()
    return values


def _merge(doc: dict, overrides: dict, problems: Problems) -> dict:
    """`doc` with dotted `--set` keys applied (`lora.rank=16` sets doc['lora']['rank'])."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        node = out
        for part in parts[:-1]:
            inner = node.get(part)
            if isinstance(inner, str) and part == "data":
                inner = {"path": inner}
            if inner is None:
                inner = {}
            if not isinstance(inner, dict):
                problems.add(f"--set {dotted}: {part} is not a section")
                break
            node[part] = inner = dict(inner)
            node = inner
        else:
            node[parts[-1]] = value
    return out


def config_keys_in(doc: dict, source: str) -> tuple[str | None, dict]:
    """(model, {setup field: value}) of a `fitune train` config, for commands that estimate or profile it: every
    key is checked against the schema (unknown ones get a "did you mean"), the setup values are returned."""
    problems = Problems()
    values = values_from_mapping(doc, ALL_KEYS, source, problems, shorthand={"data": "path"})
    problems.raise_if_any()
    setup_fields = {k.field for k in SETUP_KEYS}
    return values.get("model"), {f: v for f, v in values.items() if f in setup_fields}


def setup_from_config(doc: dict, source: str = "config") -> tuple[str | None, TrainSetup]:
    """(model, TrainSetup) of a `fitune train` config mapping (stack fitune unless the file says otherwise)."""
    model, values = config_keys_in(doc, source)
    return model, TrainSetup(**{"stack": "fitune", **values})
