"""TrainSetup: how a run trains. One dataclass shared by estimate, plan, train and profile.

Its YAML form is `fitune train`'s config; the CLI flags of `fitune estimate` map one to one onto its fields
(`--seq-len` -> `seq_len_tokens`, ...). Each default lives here and nowhere else; `validate()` lists every
problem at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError

METHODS = ("lora", "qlora", "full", "freeze")
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("sdpa", "flash", "eager")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd")
LOSSES = ("hf", "chunked")
STACKS = ("hf", "fitune")
KERNELS = ("torch", "liger")
CHECKPOINTING = ("none", "full", "offload", "selective:K")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class TrainSetup:
    """A training configuration. Units are in the field names; every field has a default."""

    method: str = "lora"
    """lora | qlora (NF4 + double quantisation, bf16 compute) | full | freeze (train the last `freeze_trainable_layers` layers, no adapters)."""
    lora_rank: int = 8
    """LoRA rank r (adapter matrices are r x in and out x r)."""
    lora_alpha: int = 16
    """LoRA alpha (scaling = alpha / r); no effect on memory."""
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Module names LoRA wraps, or ("all-linear",) for every Linear of the decoder layers."""
    dtype: str = "bf16"
    """Compute dtype of the model weights and activations: bf16 | fp16 | fp32."""
    grad_checkpointing: str = "none"
    """none | full (every layer recomputed) | offload (checkpoints in pinned CPU memory) | selective:K (K of L layers)."""
    attn: str = "sdpa"
    """Attention implementation: sdpa (PyTorch scaled_dot_product_attention) | flash (flash-attention 2) | eager."""
    optimizer: str = "adamw"
    """adamw (torch, fp32 states) | adamw8bit | paged_adamw8bit (bitsandbytes) | adafactor | sgd."""
    batch_size: int = 2
    """Sequences per micro-batch."""
    seq_len_tokens: int = 2048
    """Tokens per sequence."""
    freeze_trainable_layers: int = 2
    """With method freeze: how many of the last decoder layers train (LLaMA-Factory's default: 2)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (no effect on per-step activation memory)."""
    loss: str = "hf"
    """hf (full logits upcast to fp32, as transformers does) | chunked (logits never materialised whole)."""
    tiled_mlp: bool = False
    """fitune's runner: run each MLP a tile of tokens at a time (its intermediates never exist for the whole sequence)."""
    lean_lora: bool = False
    """fitune's runner: the LoRA branch in the activations' dtype, saving no fp32 copy of each adapter's input."""
    lean_norm: bool = False
    """fitune's runner: RMSNorm a tile of tokens at a time in fp32, saving only its bf16 input."""
    kernels: str = "torch"
    """fitune's runner: torch (transformers' modules) | liger (Liger Kernel's fused RMSNorm, SwiGLU and RoPE; a
    CUDA GPU with liger-kernel installed)."""
    expandable_segments: bool = False
    """fitune's runner: PyTorch's allocator maps memory in growable segments (PYTORCH_CUDA_ALLOC_CONF), so freed
    blocks are not stranded between live ones."""
    stack: str = "hf"
    """hf (a plain transformers + PEFT script, the recipe in fitune/profile/hf_recipe.py) | fitune (fitune's runner)."""

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len_tokens

    @property
    def all_linear(self) -> bool:
        return tuple(self.lora_targets) == (ALL_LINEAR,)

    @property
    def checkpointed_layers_mode(self) -> str:
        """'none', 'full', 'offload' or 'selective' (without the K)."""
        return self.grad_checkpointing.split(":", 1)[0]

    def selective_k(self) -> int | None:
        if self.grad_checkpointing.startswith("selective:"):
            return int(self.grad_checkpointing.split(":", 1)[1])
        return None

    def replace(self, **changes) -> "TrainSetup":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d

    def validate(self, num_layers: int | None = None, hidden_size: int | None = None,
                 linear_names: list[str] | None = None) -> "TrainSetup":
        """Check every field; raise one ConfigError listing all problems. Model-dependent checks when sizes given."""
        problems: list[str] = []

        def one_of(flag: str, value, allowed):
            if value not in allowed:
                problems.append(f"{flag} {value!r} is not one of: {', '.join(allowed)}")

        one_of("--method", self.method, METHODS)
        one_of("--dtype", self.dtype, DTYPES)
        one_of("--attn", self.attn, ATTNS)
        one_of("--optimizer", self.optimizer, OPTIMIZERS)
        one_of("--loss", self.loss, LOSSES)
        one_of("--stack", self.stack, STACKS)
        for flag, value in (("--batch-size", self.batch_size), ("--seq-len", self.seq_len_tokens),
                            ("--grad-accum", self.grad_accum)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{flag} must be a positive integer, got {value!r}")
        mode = self.checkpointed_layers_mode
        if mode not in ("none", "full", "offload", "selective"):
            problems.append(f"--grad-checkpointing {self.grad_checkpointing!r} is not one of: {', '.join(CHECKPOINTING)}")
        elif mode == "selective":
            k_text = self.grad_checkpointing.split(":", 1)[1] if ":" in self.grad_checkpointing else ""
            if not k_text.isdigit():
                problems.append(f"--grad-checkpointing {self.grad_checkpointing!r}: write selective:K with K a whole number of layers, e.g. selective:16")
            elif num_layers is not None and not 0 <= int(k_text) <= num_layers:
                problems.append(f"--grad-checkpointing {self.grad_checkpointing!r}: K must be between 0 and the model's {num_layers} layers")
        if self.method in ("lora", "qlora"):
            if not isinstance(self.lora_rank, int) or self.lora_rank < 1:
                problems.append(f"--lora-rank must be a positive integer, got {self.lora_rank!r}")
            elif hidden_size is not None and self.lora_rank > hidden_size:
                problems.append(f"--lora-rank {self.lora_rank} is above the model's hidden size {hidden_size}; a LoRA rank is a small number (8-128)")
            if not self.lora_targets:
                problems.append("--lora-targets is empty; name modules (q_proj,v_proj) or use all-linear")
            elif linear_names is not None and not self.all_linear:
                unknown = [t for t in self.lora_targets if t not in linear_names]
                if unknown:
                    problems.append(f"--lora-targets {','.join(unknown)}: not a Linear of this model; it has {', '.join(linear_names)} (or use all-linear)")
        if self.loss == "chunked" and self.stack == "hf":
            problems.append("--loss chunked is a technique of fitune's runner; a plain transformers script computes "
                            "full logits: use --stack fitune with it (or --loss hf)")
        for flag, on in (("--tiled-mlp", self.tiled_mlp), ("--lean-lora", self.lean_lora),
                         ("--lean-norm", self.lean_norm), ("--expandable-segments", self.expandable_segments)):
            if on and self.stack == "hf":
                problems.append(f"{flag} is a technique of fitune's runner: use --stack fitune with it")
        one_of("--kernels", self.kernels, KERNELS)
        if self.kernels == "liger" and self.stack == "hf":
            problems.append("--kernels liger is a technique of fitune's runner: use --stack fitune with it")
        if self.kernels == "liger" and self.lean_norm:
            problems.append("--kernels liger and --lean-norm both replace RMSNorm: keep one (Liger's is faster, "
                            "the lean one works without a GPU)")
        if self.lean_lora and self.method not in ("lora", "qlora"):
            problems.append(f"--lean-lora applies to LoRA adapters; --method {self.method} has none")
        if self.method == "qlora" and self.dtype == "fp32":
            problems.append("--method qlora computes in bf16/fp16; --dtype fp32 does not apply (use --dtype bf16)")
        if problems:
            raise ConfigError(problems)
        return self


def parse_targets(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); 'all-linear' -> ('all-linear',)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [t.strip() for t in items if t.strip()]
    if ALL_LINEAR in items:
        return (ALL_LINEAR,)
    return tuple(items)


DEFAULT_SETUP = TrainSetup()


#: `fitune train` config keys that map onto TrainSetup fields (YAML name -> field).
_YAML_FIELDS = {
    "method": "method", "dtype": "dtype", "grad_checkpointing": "grad_checkpointing", "attn": "attn",
    "optimizer": "optimizer", "batch_size": "batch_size", "seq_len": "seq_len_tokens", "grad_accum": "grad_accum",
    "loss": "loss", "stack": "stack", "freeze_trainable_layers": "freeze_trainable_layers", "tiled_mlp": "tiled_mlp",
    "lean_lora": "lean_lora", "lean_norm": "lean_norm", "expandable_segments": "expandable_segments",
    "kernels": "kernels",
}


def setup_from_config(doc: dict, source: str = "config") -> tuple[str | None, TrainSetup]:
    """(model, TrainSetup) from a `fitune train` config mapping; unknown TrainSetup keys are left to the caller."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model:, method:, lora:, seq_len: ...)")
    kwargs = {field_name: doc[key] for key, field_name in _YAML_FIELDS.items() if key in doc}
    lora = doc.get("lora") or {}
    if not isinstance(lora, dict):
        raise ConfigError(f"{source}: `lora` must be a mapping like {{rank: 8, alpha: 16, targets: [q_proj, v_proj]}}")
    if "rank" in lora:
        kwargs["lora_rank"] = lora["rank"]
    if "alpha" in lora:
        kwargs["lora_alpha"] = lora["alpha"]
    if "targets" in lora:
        kwargs["lora_targets"] = parse_targets(lora["targets"])
    return doc.get("model"), TrainSetup(**kwargs)


def load_config_file(path: str) -> dict:
    """Read a YAML (or JSON) config file into a mapping, with a clear error for a missing file or bad syntax."""
    import os

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        import json

        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("reading a YAML config needs PyYAML: pip install pyyaml") from exc
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
