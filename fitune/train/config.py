"""TrainConfig: everything `fitune train` needs, as typed dataclasses; its YAML is the saved form.

```yaml
model: path/to/hf-model-folder      # or a catalog name with `init: random` (and `tokenizer:`)
data: {path: train.jsonl, format: chat, eval_path: eval.jsonl}
method: lora
lora: {rank: 8, alpha: 16, targets: [q_proj, v_proj]}
seq_len: 2048
batch_size: 2
grad_accum: 1
max_steps: 1000                     # or epochs
lr: 2.0e-4
output_dir: runs/x
```
How the step trains (method, LoRA, dtype, checkpointing, attention, optimizer, batch, sequence, loss) is the
shared `TrainSetup`; the rest is here. `validate()` lists every problem at once, naming the YAML key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..setup import TrainSetup, setup_from_config

SCHEDULES = ("cosine", "linear", "constant")
DATA_FORMATS = ("chat", "completion", "text")


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    """Training data: .jsonl, .json, .parquet, or a saved Hugging Face dataset folder."""
    format: str | None = None
    """chat | completion | text; detected from the records when omitted."""
    eval_path: str | None = None
    """Optional evaluation data, same formats."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = ""
    """A Hugging Face model folder, or a catalog name / config.json with `init: random`."""
    setup: TrainSetup = field(default_factory=TrainSetup)
    data: DataConfig = field(default_factory=DataConfig)
    output_dir: str = "runs/fitune"
    """Where checkpoints, metrics.jsonl, the adapter (and merged weights) go."""
    init: str = "pretrained"
    """pretrained (load the folder's weights) | random (random weights from the config: smoke runs, benchmarks)."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model folder."""
    trust_remote_code: bool = False
    """Run code shipped with the model (off unless you trust it)."""
    max_steps: int | None = None
    """Optimizer steps; or give `epochs`."""
    epochs: float | None = None
    lr: float = 2.0e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    schedule: str = "cosine"
    """cosine | linear | constant, after the warm-up."""
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    """Gradient clipping (None: off)."""
    seed: int = 0
    packing: bool = False
    """Pack short examples into full sequences (attention kept inside each example)."""
    packing_attention: str = "varlen"
    """With packing: varlen (each example attended on its own, no mask tensor; sdpa models without a sliding
    window) | mask (transformers' block-diagonal mask, rows x length^2 bytes)."""
    eval_every: int | None = None
    """Evaluate every N steps (and at the end) when data.eval_path is set."""
    save_every: int | None = None
    """Write a resumable checkpoint every N steps (and at the end)."""
    log_every: int = 1
    merge: bool = False
    """Also write the base model with the adapter merged in (safetensors)."""
    oom_guard: bool = True
    """On a CUDA out-of-memory error, re-plan (smaller micro-batches, then checkpointing) and retry the step."""
    cap: str | None = None
    """Limit PyTorch's allocator to this GPU's budget (`rtx4090`, `23.4GiB`): rehearse a smaller card on a big one."""

    def validate(self) -> "TrainConfig":
        problems: list[str] = []
        try:
            self.setup.validate()
        except ConfigError as exc:
            problems += exc.problems
        if not self.model:
            problems.append("model: missing; give a Hugging Face model folder (or a catalog name with init: random)")
        if self.init not in ("pretrained", "random"):
            problems.append(f"init: {self.init!r} is not one of: pretrained, random")
        if self.packing_attention not in ("varlen", "mask"):
            problems.append(f"packing_attention: {self.packing_attention!r} is not one of: varlen, mask")
        if self.init == "pretrained" and self.model and not os.path.isdir(self.model):
            problems.append(f"model: {self.model!r} is not a folder; pretrained weights load from a Hugging Face model "
                            "folder (for a catalog name use `init: random` and `tokenizer:`)")
        if not self.data.path:
            problems.append("data.path: missing; point it at a .jsonl / .json / .parquet file or a dataset folder")
        elif not os.path.exists(self.data.path):
            problems.append(f"data.path: {self.data.path} does not exist")
        if self.data.eval_path and not os.path.exists(self.data.eval_path):
            problems.append(f"data.eval_path: {self.data.eval_path} does not exist")
        if self.data.format is not None and self.data.format not in DATA_FORMATS:
            problems.append(f"data.format: {self.data.format!r} is not one of: {', '.join(DATA_FORMATS)}")
        if (self.max_steps is None) == (self.epochs is None):
            problems.append("max_steps / epochs: give exactly one of them")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            problems.append(f"max_steps: must be a positive integer, got {self.max_steps!r}")
        if self.epochs is not None and not (isinstance(self.epochs, (int, float)) and self.epochs > 0):
            problems.append(f"epochs: must be a positive number, got {self.epochs!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            problems.append(f"lr: must be a positive number, got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule: {self.schedule!r} is not one of: {', '.join(SCHEDULES)}")
        for key in ("warmup_steps",):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                problems.append(f"{key}: must be a whole number >= 0, got {v!r}")
        for key in ("eval_every", "save_every", "log_every"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or v < 1):
                problems.append(f"{key}: must be a positive integer, got {v!r}")
        if self.cap is not None:
            from ..errors import UnknownGpuError
            from ..specs.gpu import resolve_gpu

            try:
                resolve_gpu(str(self.cap))
            except UnknownGpuError as exc:
                problems.append(f"cap: {exc}")
        if self.init == "random" and not self.tokenizer and not (self.model and os.path.isdir(self.model)):
            problems.append("tokenizer: needed with init: random and a catalog model (a tokenizer folder)")
        if problems:
            raise ConfigError(problems)
        return self

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("setup", "data")}
        s = self.setup
        d.update({
            "method": s.method, "lora": {"rank": s.lora_rank, "alpha": s.lora_alpha, "targets": list(s.lora_targets)},
            "dtype": s.dtype, "grad_checkpointing": s.grad_checkpointing, "attn": s.attn, "optimizer": s.optimizer,
            "batch_size": s.batch_size, "seq_len": s.seq_len_tokens, "grad_accum": s.grad_accum, "loss": s.loss,
            "stack": s.stack, "tiled_mlp": s.tiled_mlp, "lean_lora": s.lean_lora, "lean_norm": s.lean_norm,
            "expandable_segments": s.expandable_segments, "kernels": s.kernels,
            "data": {k: v for k, v in dataclasses.asdict(self.data).items() if v is not None},
        })
        return {k: v for k, v in d.items() if v is not None}


#: YAML keys that are TrainConfig fields (the TrainSetup keys are read by `setup_from_config`).
_CONFIG_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - {"setup", "data"}
_SETUP_KEYS = {"method", "dtype", "grad_checkpointing", "attn", "optimizer", "batch_size", "seq_len", "grad_accum",
               "loss", "stack", "freeze_trainable_layers", "lora", "tiled_mlp",
               "lean_lora", "lean_norm", "expandable_segments", "kernels"}


def config_from_dict(doc: dict, source: str = "config", overrides: dict | None = None) -> TrainConfig:
    """Build and validate a TrainConfig from a YAML mapping (+ CLI overrides: the same keys, dotted for nesting)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model:, data:, method:, ...)")
    doc = dict(doc)
    for key, value in (overrides or {}).items():
        if "." in key:
            outer, inner = key.split(".", 1)
            doc[outer] = {**(doc.get(outer) or {}), inner: value}
        else:
            doc[key] = value
    unknown = sorted(set(doc) - _CONFIG_KEYS - _SETUP_KEYS - {"data"})
    problems = [f"{k}: not a fitune train key (known: {', '.join(sorted(_CONFIG_KEYS | _SETUP_KEYS | {'data'}))})"
                for k in unknown]
    data = doc.get("data") or {}
    if isinstance(data, str):
        data = {"path": data}
    if not isinstance(data, dict):
        problems.append("data: expected a mapping {path:, format:, eval_path:}")
        data = {}
    bad_data = sorted(set(data) - {"path", "format", "eval_path"})
    problems += [f"data.{k}: not a data key (known: path, format, eval_path)" for k in bad_data]
    doc.setdefault("stack", "fitune")  # `fitune train` is fitune's runner
    try:
        _, setup = setup_from_config(doc, source)
    except (ConfigError, TypeError) as exc:
        problems += getattr(exc, "problems", [str(exc)])
        setup = TrainSetup()
    kwargs = {k: doc[k] for k in _CONFIG_KEYS if k in doc}
    cfg = TrainConfig(setup=setup, data=DataConfig(**{k: data[k] for k in ("path", "format", "eval_path") if k in data}),
                      **kwargs)
    try:
        cfg.validate()
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return cfg
