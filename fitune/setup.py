"""TrainSetup: how a run trains. One dataclass shared by estimate, plan, train and profile.

Each field declares its schema (fitune/schema.py): the `fitune train` YAML key (`seq_len`, `lora.rank`), the
flag every command accepts (`--seq-len`, `--lora-rank`), its type, choices, the spellings other trainers use for
its values, and its help line. The keys, flags, `to_dict` / `from_dict` and `--json`'s `setup` object are all
generated from that. Each default lives here and nowhere else; `validate()` lists every problem at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .schema import _BAD, Key, Problems, coerce, key, keys_of, label
from .specs import optimizers as optimizer_specs

METHODS = ("lora", "qlora", "full", "freeze")
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("sdpa", "flash", "eager")
OPTIMIZERS = optimizer_specs.names()  # the registry: fitune/specs/optimizers.py
LOSSES = ("hf", "chunked")
STACKS = ("hf", "fitune")
KERNELS = ("torch", "liger")
COMPILES = ("none", "layers")
CHECKPOINTING = ("none", "full", "offload", "selective:K")
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload")
ALL_LINEAR = "all-linear"


_DTYPE_ALIASES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16", "torch.float16": "fp16",
                  "half": "fp16", "float32": "fp32", "torch.float32": "fp32", "float": "fp32"}
_ATTN_ALIASES = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flash-attn": "flash",
                 "flash_attn": "flash", "fa2": "flash", "torch": "sdpa", "spda": "sdpa"}
_OPTIMIZER_ALIASES = optimizer_specs.aliases()
_METHOD_ALIASES = {"full_finetune": "full", "full-finetune": "full", "fft": "full", "qlora_nf4": "qlora"}
_STRATEGY_ALIASES = {"fsdp2": "fsdp", "full_shard": "fsdp", "deepspeed_zero2": "zero2", "zero-2": "zero2",
                     "zero_2": "zero2", "deepspeed_zero3": "zero3", "zero-3": "zero3", "zero_3": "zero3",
                     "zero3-offload": "zero3_offload", "zero_offload": "zero3_offload", "no": "ddp", "none": "ddp",
                     "data_parallel": "ddp"}
_COMPILE_ALIASES = {"true": "layers", "false": "none", "off": "none", "on": "layers", "regional": "layers",
                    "layer": "layers", "decoder_layers": "layers", "no": "none"}
_CKPT_ALIASES = {"true": "full", "false": "none", "off": "none", "on": "full", "unsloth": "offload",
                 "offloaded": "offload"}


@dataclass(frozen=True)
class TrainSetup:
    """How one training step runs: shared by estimate, plan, train and profile. Units are in the field names.

    Each field's YAML key, flag, type and help come from its `key(...)` metadata (fitune/schema.py)."""

    method: str = key("lora", kind="choice", choices=METHODS, aliases=_METHOD_ALIASES,
                      help="lora | qlora (NF4 base weights + LoRA) | full | freeze (train the last "
                           "freeze_trainable_layers layers)")
    lora_rank: int = key(8, yaml="lora.rank", flag="--lora-rank", kind="int", minimum=1, maximum=65536,
                         help="LoRA rank r (adapter matrices are r x in and out x r)")
    lora_alpha: int = key(16, yaml="lora.alpha", flag="--lora-alpha", kind="int", minimum=1, maximum=1 << 20,
                          help="LoRA alpha (scaling = alpha / r; no effect on memory)")
    lora_dropout: float = key(0.0, yaml="lora.dropout", flag="--lora-dropout", kind="float", minimum=0, maximum=0.9,
                              help="dropout on the adapter input (PEFT's lora_dropout)")
    lora_targets: tuple[str, ...] = key(("q_proj", "v_proj"), yaml="lora.targets", flag="--lora-targets",
                                        kind="targets", metavar="q_proj,v_proj|all-linear",
                                        help="modules LoRA wraps (comma-separated), or all-linear")
    dtype: str = key("bf16", kind="choice", choices=DTYPES, aliases=_DTYPE_ALIASES,
                     help="dtype of the weights and activations: bf16 | fp16 | fp32")
    grad_checkpointing: str = key("none", kind="checkpointing", choices=("none", "full", "offload"),
                                  aliases=_CKPT_ALIASES, metavar="none|full|offload|selective:K",
                                  help="activation checkpointing: none, full (every layer recomputed), offload "
                                       "(checkpoints in pinned CPU memory), selective:K (the first K layers); "
                                       "true/false mean full/none")
    attn: str = key("sdpa", kind="choice", choices=ATTNS, aliases=_ATTN_ALIASES,
                    help="attention: sdpa (torch scaled_dot_product_attention) | flash (flash-attention 2: the "
                         "flash_attn package, a CUDA GPU) | eager")
    optimizer: str = key("adamw", kind="choice", choices=OPTIMIZERS, aliases=_OPTIMIZER_ALIASES,
                         help=optimizer_specs.help_text())
    batch_size: int = key(2, kind="int", minimum=1, maximum=65536, help="sequences per micro-batch")
    seq_len_tokens: int = key(2048, yaml="seq_len", flag="--seq-len", kind="int", minimum=1, maximum=1 << 24,
                              unit="tokens", help="tokens per sequence")
    freeze_trainable_layers: int = key(2, kind="int", minimum=1, maximum=100000,
                                       help="with method freeze: how many of the last decoder layers train")
    grad_accum: int = key(1, kind="int", minimum=1, maximum=1 << 20,
                          help="micro-batches per optimizer step (no effect on activation memory)")
    loss: str = key("hf", kind="choice", choices=LOSSES,
                    help="hf (full logits upcast to fp32, as transformers does) | chunked (fitune's runner: the "
                         "logits never exist whole)")
    tiled_mlp: bool = key(False, kind="bool", help="fitune's runner: run each MLP a tile of tokens at a time")
    lean_lora: bool = key(False, kind="bool", help="fitune's runner: the LoRA branch in the activations' dtype "
                                                   "(no fp32 copy of each adapter input)")
    lean_norm: bool = key(False, kind="bool", help="fitune's runner: RMSNorm in fp32 tiles, saving only its "
                                                   "bf16 input")
    kernels: str = key("torch", kind="choice", choices=KERNELS, aliases={"liger-kernel": "liger", "liger_kernel": "liger"},
                       help="fitune's runner: torch (transformers' modules) | liger (Liger Kernel's RMSNorm, SwiGLU "
                            "and RoPE; a CUDA GPU)")
    compile: str = key("none", kind="choice", choices=COMPILES, aliases=_COMPILE_ALIASES,
                       help="fitune's runner: layers (torch.compile each decoder layer: fused norms, RoPE, SwiGLU and "
                            "LoRA arithmetic; with the chunked loss, its softmax gradient too; a CUDA GPU; the first "
                            "steps pay the compilation) | none")
    offload_embeddings: bool = key(False, kind="bool",
                                   help="fitune's runner: the input embedding table stays in CPU memory and each "
                                        "step's embeddings are looked up there and copied to the GPU (LoRA / "
                                        "QLoRA, untied embeddings: 1.05 GB less for Llama-3.1-8B)")
    expandable_segments: bool = key(False, kind="bool", help="fitune's runner: PyTorch's allocator with expandable "
                                                             "segments (little fragmentation)")
    keep_outputs: bool = key(False, kind="bool",
                             help="the step keeps the model output (and its logits) alive through backward, as "
                                  "`out = model(**batch); out.loss.backward()` does")
    stack: str = key("hf", kind="choice", choices=STACKS,
                     help="hf (a plain transformers + PEFT script) | fitune (fitune's runner and its techniques)")
    num_gpus: int = key(1, yaml="gpus", flag="--gpus", kind="int", minimum=1, maximum=4096,
                        help="GPUs the run uses (one process each; batch_size is per GPU)")
    strategy: str = key("ddp", kind="choice", choices=STRATEGIES, aliases=_STRATEGY_ALIASES,
                        help="how the GPUs share the model: ddp (a full copy on each) | fsdp (PyTorch FSDP2, "
                             "parameters, gradients and optimizer state sharded per decoder layer) | zero2 (DeepSpeed: "
                             "gradients and optimizer state sharded) | zero3 (DeepSpeed: parameters too) | "
                             "zero3_offload (ZeRO-3 with parameters and optimizer state in CPU memory)")

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
        """Every field by its name (the `setup` object of every `--json` output); tuples as lists."""
        return {k.field: (list(v) if isinstance(v := getattr(self, k.field), tuple) else v) for k in SETUP_KEYS}

    @classmethod
    def from_dict(cls, d: dict, *, strict: bool = True) -> "TrainSetup":
        """The inverse of `to_dict` (field names). `strict=False` ignores keys that are no field (a bench record's
        measurements beside its setup) and leaves absent fields at their defaults."""
        fields = {k.field: k for k in SETUP_KEYS}
        problems = Problems()
        values = {}
        for name, value in d.items():
            k = fields.get(name)
            if k is None:
                if strict:
                    problems.add(f"setup.{name}: not a TrainSetup field (known: {', '.join(fields)})")
                continue
            v = coerce(k, value, "json", problems)
            if v is not _BAD:
                values[name] = v
        problems.raise_if_any()
        return cls(**values)

    def validate(self, num_layers: int | None = None, hidden_size: int | None = None,
                 linear_names: list[str] | None = None, origin: dict[str, str] | None = None) -> "TrainSetup":
        """Check every field; raise one ConfigError listing all problems. Model-dependent checks when sizes given.

        `origin` says where each field's value came from ("flag" or "yaml"; default: flag), so that a problem
        names `--lora-rank` on the command line and `lora.rank:` in a config file."""
        by_field = {k.field: k for k in SETUP_KEYS}

        def name(f: str) -> str:
            return label(by_field[f], (origin or {}).get(f, "flag"))

        problems: list[str] = []
        problems += _value_problems(self, name, num_layers)
        problems += self._checkpointing_problems(name, num_layers)
        problems += _lora_problems(self, name, hidden_size, linear_names)
        problems += _runner_technique_problems(self, name)
        problems += _combination_problems(self, name)
        if problems:
            raise ConfigError(problems)
        return self

    def _checkpointing_problems(self, name, num_layers: int | None) -> list[str]:
        """grad_checkpointing: one of the modes; selective:K with K a whole number of the model's layers."""
        problems: list[str] = []
        mode = self.checkpointed_layers_mode
        if mode not in ("none", "full", "offload", "selective"):
            problems.append(f"{name('grad_checkpointing')} {self.grad_checkpointing!r} is not one of: "
                            f"{', '.join(CHECKPOINTING)}")
        elif mode == "selective":
            k_text = self.grad_checkpointing.split(":", 1)[1] if ":" in self.grad_checkpointing else ""
            if not k_text.isdigit():
                problems.append(f"{name('grad_checkpointing')} {self.grad_checkpointing!r}: write selective:K with K a "
                                "whole number of layers, e.g. selective:16")
            elif num_layers is not None and not 0 <= int(k_text) <= num_layers:
                problems.append(f"{name('grad_checkpointing')} {self.grad_checkpointing!r}: K must be between 0 and "
                                f"the model's {num_layers} layers")
        return problems


# ---- TrainSetup.validate's checks: each returns its problems, in the order they are listed ----------------------
# `name(field)` is the field as the user wrote it: `--lora-rank` on the command line, `lora.rank:` in a config file.


def _one_of(name, f: str, value, allowed) -> list[str]:
    return [] if value in allowed else [f"{name(f)} {value!r} is not one of: {', '.join(allowed)}"]


def _turned_on(name, f: str) -> str:
    """An on/off key as the user writes it on: `--lean-lora` / `lean_lora: true`."""
    return name(f) if name(f).startswith("--") else f"{name(f)} true"


def _value_problems(s: TrainSetup, name, num_layers: int | None) -> list[str]:
    """Choices that are not among the known ones, sizes that are not positive, the LoRA dropout, freeze's layers."""
    problems = _one_of(name, "method", s.method, METHODS)
    problems += _one_of(name, "dtype", s.dtype, DTYPES)
    problems += _one_of(name, "attn", s.attn, ATTNS)
    problems += _one_of(name, "optimizer", s.optimizer, optimizer_specs.names())
    problems += _one_of(name, "loss", s.loss, LOSSES)
    problems += _one_of(name, "stack", s.stack, STACKS)
    problems += _one_of(name, "strategy", s.strategy, STRATEGIES)
    for f in ("batch_size", "seq_len_tokens", "grad_accum", "freeze_trainable_layers", "num_gpus"):
        value = getattr(s, f)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name(f)} must be a positive integer, got {value!r}")
    if not isinstance(s.lora_dropout, (int, float)) or not 0 <= s.lora_dropout < 1:
        problems.append(f"{name('lora_dropout')} must be at least 0 and below 1, got {s.lora_dropout!r}")
    if (s.method == "freeze" and num_layers is not None and isinstance(s.freeze_trainable_layers, int)
            and s.freeze_trainable_layers > num_layers):
        problems.append(f"{name('freeze_trainable_layers')} {s.freeze_trainable_layers} is more than the "
                        f"model's {num_layers} layers (use method full to train them all)")
    return problems


def _lora_problems(s: TrainSetup, name, hidden_size: int | None, linear_names: list[str] | None) -> list[str]:
    """LoRA / QLoRA: a positive rank below the hidden size, targets the model has."""
    problems: list[str] = []
    if s.method not in ("lora", "qlora"):
        return problems
    if not isinstance(s.lora_rank, int) or s.lora_rank < 1:
        problems.append(f"{name('lora_rank')} must be a positive integer, got {s.lora_rank!r}")
    elif hidden_size is not None and s.lora_rank > hidden_size:
        problems.append(f"{name('lora_rank')} {s.lora_rank} is above the model's hidden size {hidden_size}; "
                        "a LoRA rank is a small number (8-128)")
    if not s.lora_targets:
        problems.append(f"{name('lora_targets')} is empty; name modules (q_proj,v_proj) or use all-linear")
    elif linear_names is not None and not s.all_linear:
        unknown = [t for t in s.lora_targets if t not in linear_names]
        if unknown:
            problems.append(unknown_targets_problem(name("lora_targets"), unknown, linear_names))
    return problems


def _runner_technique_problems(s: TrainSetup, name) -> list[str]:
    """fitune's techniques (chunked loss, lean kernels, Liger, compiled layers) need its runner and go together."""
    problems: list[str] = []
    if s.loss == "chunked" and s.stack == "hf":
        problems.append(f"{name('loss')} chunked is a technique of fitune's runner; a plain transformers script "
                        f"computes full logits: use {name('stack')} fitune with it (or {name('loss')} hf)")
    for f in ("tiled_mlp", "lean_lora", "lean_norm", "expandable_segments", "offload_embeddings"):
        if getattr(s, f) and s.stack == "hf":
            problems.append(f"{name(f)} is a technique of fitune's runner: use {name('stack')} fitune with it")
    problems += _one_of(name, "kernels", s.kernels, KERNELS)
    if s.kernels == "liger" and s.stack == "hf":
        problems.append(f"{name('kernels')} liger is a technique of fitune's runner: use {name('stack')} fitune "
                        "with it")
    if s.kernels == "liger" and s.lean_norm:
        problems.append(f"{name('kernels')} liger and {name('lean_norm')} both replace RMSNorm: keep one "
                        "(Liger's is faster, the lean one works without a GPU)")
    problems += _one_of(name, "compile", s.compile, COMPILES)
    if s.compile == "layers":
        problems += _compiled_layers_problems(s, name)
    return problems


def _compiled_layers_problems(s: TrainSetup, name) -> list[str]:
    """compile layers: fitune's runner, without what the compiled layer fuses itself, measured with lean LoRA."""
    problems: list[str] = []
    if s.stack == "hf":
        problems.append(f"{name('compile')} layers is a technique of fitune's runner: use {name('stack')} "
                        "fitune with it")
    if s.kernels == "liger" or s.lean_norm:
        problems.append(f"{name('compile')} layers fuses RMSNorm, RoPE and SwiGLU itself: drop "
                        f"{name('kernels')} liger / {name('lean_norm')} (the compiled layer was measured "
                        "without them)")
    if s.tiled_mlp or s.checkpointed_layers_mode == "offload":
        problems.append(f"{name('compile')} layers was not measured with {name('tiled_mlp')} or offloaded "
                        f"checkpointing: turn those off, or use {name('compile')} none")
    if s.method in ("lora", "qlora") and not s.lean_lora:
        problems.append(f"{name('compile')} layers is modelled with the lean LoRA branch: add "
                        f"{_turned_on(name, 'lean_lora')}")
    return problems


def _combination_problems(s: TrainSetup, name) -> list[str]:
    """Options that do not apply together: kept outputs on fitune's runner, offloaded embeddings, lean LoRA
    without LoRA, QLoRA in fp32."""
    problems: list[str] = []
    if s.keep_outputs and s.stack == "fitune":
        problems.append(f"{name('keep_outputs')} describes a script's own loop; fitune's runner never keeps the "
                        f"model output: use {name('stack')} hf with it")
    if s.offload_embeddings and s.method not in ("lora", "qlora"):
        problems.append(f"{name('offload_embeddings')} keeps a frozen embedding table on the CPU; with "
                        f"{name('method')} {s.method} it trains: use lora or qlora, or drop it")
    if s.offload_embeddings and s.num_gpus > 1:
        problems.append(f"{name('offload_embeddings')} was written for one GPU: drop it, or train on one GPU")
    if s.lean_lora and s.method not in ("lora", "qlora"):
        problems.append(f"{name('lean_lora')} applies to LoRA adapters; {name('method')} {s.method} has none")
    if s.method == "qlora" and s.dtype == "fp32":
        problems.append(f"{name('method')} qlora computes in bf16/fp16; {name('dtype')} fp32 does not apply "
                        "(use bf16)")
    return problems


def unknown_targets_problem(key: str, unknown: list[str], linear_names: list[str]) -> str:
    """The one message for LoRA targets a model does not have (estimate, plan, train's config check, and the
    runner when PEFT matches none): the names given, and the Linear modules of a decoder layer the model has."""
    return (f"{key} {','.join(unknown)}: not a Linear of this model; it has {', '.join(linear_names)} "
            "(or use all-linear)")


def technique_labels(values) -> list[str]:
    """The runner techniques a setup turns on, as short labels ("lean lora", "kernels liger", "compiled layers"), from
    a TrainSetup or its `to_dict()` / JSON mapping: the line estimate and the reports print under the setup."""
    get = values.get if isinstance(values, dict) else (lambda f, default=None: getattr(values, f, default))
    on = [f.replace("_", " ") for f in ("tiled_mlp", "lean_lora", "lean_norm", "expandable_segments",
                                        "offload_embeddings") if get(f)]
    if get("kernels") and get("kernels") != "torch":
        on.append(f"kernels {get('kernels')}")
    if get("compile") and get("compile") != "none":
        on.append("compiled layers")
    return on


def parse_targets(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); 'all-linear' -> ('all-linear',)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [t.strip() for t in items if t.strip()]
    if ALL_LINEAR in items:
        return (ALL_LINEAR,)
    return tuple(items)


DEFAULT_SETUP = TrainSetup()

#: The schema of every TrainSetup field (YAML key, flag, kind, help): fitune/schema.py.
SETUP_KEYS: list[Key] = keys_of(TrainSetup)
