"""ModelSpec: the shapes of a decoder-only LLM, read from a Hugging Face config.json or the built-in catalog.

Only what memory depends on is kept. Parameter counts are derived from the shapes here and cross-checked in
the tests against the real transformers module built on the `meta` device.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..errors import UnknownModelError, UnsupportedArchitectureError

#: model_type values whose decoder layer the analytic engine models (others: `--engine trace`).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe",
    "qwen2_moe",
)
#: The mixture-of-experts ones among them (routed experts; intermediate_size optional).
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class LinearSpec:
    """One `nn.Linear` of a decoder layer (a LoRA target candidate)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    count_per_layer: int = 1  # e.g. shared experts; always 1 for dense models


#: Models whose RMSNorm is transformers' Llama one, which fitune's lean RMSNorm replaces (lean_norm.py checks the
#: byte code at run time; these are the catalog's families that pass).
LEAN_NORM_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
#: Architectures whose Liger kernels fitune measured (docs/speed.md, "Loss kernels"; records in
#: bench/results/issue12/ and issue5/): there the planner uses Liger by default once liger-kernel is installed.
LIGER_MEASURED_MODEL_TYPES = ("llama", "qwen2")
#: Architectures whose compiled layers fitune measured (docs/speed.md; records in bench/results/speed/, groups
#: *_compile): there the planner compiles each decoder layer by default when Triton (torch.compile's GPU backend) is
#: installed. Qwen2 was measured too, but before the lean LoRA branch's fix (its LoRA gradients were zero when
#: compiled: docs/history.md), so its compiled runs are withdrawn until measured again.
COMPILE_MEASURED_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a causal LM, as memory sees it. All sizes are element counts, not bytes."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    fused_qkv: bool = False
    fused_gate_up: bool = False
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    full_attention_every_n_layers: int = 0
    """Which layers slide when config.json has no `layer_types`: every n-th layer (n, 2n, ...) attends to the whole
    sequence and the others slide (Gemma 2: 2, transformers' `layer_idx % 2 == 0` slides; Gemma 3:
    `sliding_window_pattern`, 6 by default). 0: the last `sliding_window_layers` layers slide (Qwen's
    `max_window_layers`; all of them for Mistral, Mixtral, Phi-3)."""
    rms_norm_one_plus_weight: bool = False
    """RMSNorm scales by `(1 + weight)` in fp32 before casting back (Gemma's `GemmaRMSNorm`: one more fp32
    temporary, no Liger / compiled / lean replacement); False: Llama's `weight * x.to(input_dtype)`."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    source: str = ""
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)
    source_note: str = field(default="", compare=False)
    """How MODEL was found, when it is not plain: "config.json from the Hub cache at ...", the catalog entry a Hub id
    stood for, the GGUF file's metadata."""
    gguf_weights_type: str = field(default="", compare=False)
    """A GGUF file's weight type ("Q4_1"), "" otherwise: the weights are dequantized on load (`describe_source`)."""

    # ---- derived shapes -------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection output: heads x head_dim (differs from hidden_size for Gemma, Qwen3...)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the key / value projections: kv_heads x head_dim (grouped-query attention)."""
        return self.num_kv_heads * self.head_dim

    @property
    def llama_rms_norm(self) -> bool:
        """Its RMSNorm is transformers' Llama one, which fitune's lean RMSNorm replaces."""
        return self.model_type in LEAN_NORM_MODEL_TYPES

    @property
    def liger_measured(self) -> bool:
        """Liger's kernels were measured on this architecture: the planner's default where liger-kernel is installed."""
        return self.model_type in LIGER_MEASURED_MODEL_TYPES

    @property
    def compile_measured(self) -> bool:
        """Compiled decoder layers were measured on this architecture: the planner's default where Triton is."""
        return self.model_type in COMPILE_MEASURED_MODEL_TYPES

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    def attention_linears(self) -> list[LinearSpec]:
        h = self.hidden_size
        if self.fused_qkv:
            qkv = [LinearSpec("qkv_proj", h, self.q_dim + 2 * self.kv_dim, self.qkv_bias)]
        else:
            qkv = [
                LinearSpec("q_proj", h, self.q_dim, self.qkv_bias),
                LinearSpec("k_proj", h, self.kv_dim, self.qkv_bias),
                LinearSpec("v_proj", h, self.kv_dim, self.qkv_bias),
            ]
        return qkv + [LinearSpec("o_proj", self.q_dim, h, self.o_bias)]

    def dense_mlp_linears(self, intermediate: int | None = None) -> list[LinearSpec]:
        h, i = self.hidden_size, intermediate or self.intermediate_size
        if self.fused_gate_up:
            up = [LinearSpec("gate_up_proj", h, 2 * i, self.mlp_bias)]
        else:
            up = [LinearSpec("gate_proj", h, i, self.mlp_bias), LinearSpec("up_proj", h, i, self.mlp_bias)]
        return up + [LinearSpec("down_proj", i, h, self.mlp_bias)]

    def linears(self, moe_layer: bool = False) -> list[LinearSpec]:
        """The `nn.Linear` modules of one decoder layer, the ones PEFT's `all-linear` targets.

        In transformers 5 the routed experts of Mixtral / Qwen-MoE are fused 3-D parameters, not `nn.Linear`,
        so LoRA (`all-linear` or by name) never reaches them; a shared expert (Qwen2-MoE) is made of Linears.
        """
        out = self.attention_linears()
        if not moe_layer:
            return out + self.dense_mlp_linears()
        if self.shared_expert_intermediate_size:
            out += self.dense_mlp_linears(self.shared_expert_intermediate_size)
            out.append(LinearSpec("shared_expert_gate", self.hidden_size, 1, False))
        return out

    def linear_names(self) -> list[str]:
        names = [lin.name for lin in self.linears(moe_layer=False)]
        if self.moe_layers:
            names += [lin.name for lin in self.linears(moe_layer=True) if lin.name not in names]
        return names


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


#: The largest value fitune accepts for each size a config.json gives (and the smallest): well above every real
#: model (the catalog's largest: hidden 16,384, intermediate 53,248, 126 layers, 128 heads, vocabulary 262,208,
#: 128 experts), low enough that no loop or product over them runs away. A documented limit, not a guess at
#: what exists: a config beyond it is a typo (`num_hidden_layers: 1e12`).
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "shared_expert_intermediate_size": (0, 1 << 22),
    "num_hidden_layers": (1, 2_048),  # the estimate replays every layer: ~1.5 ms each on a 2-core machine
    "num_attention_heads": (1, 1 << 14),
    "num_key_value_heads": (1, 1 << 14),
    "head_dim": (1, 1 << 14),
    "vocab_size": (1, 1 << 24),
    "num_local_experts": (0, 1 << 16),
    "num_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1 << 16),
    "decoder_sparse_step": (0, 10_000),
    "sliding_window": (0, 1 << 30),
    "sliding_window_pattern": (1, 10_000),
    "max_window_layers": (0, 1 << 30),
}
#: Keys every analytic architecture needs (intermediate_size too, except for the MoE ones).
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _describe_json(value) -> str:
    """How a config.json value is named in a message: as JSON spells it (NaN, Infinity, null, true)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, str):
        return f"the text {value[:40]!r}"
    if isinstance(value, list):
        return f"a list ({len(value)} items)"
    if isinstance(value, dict):
        return "an object {...}"
    return repr(value)


def check_hf_config(cfg: dict, model_type: str, required: tuple[str, ...] = REQUIRED_KEYS,
                    bounds_only: bool = False) -> list[str]:
    """Every value of `cfg` (a config.json) the analytic engine would compute with that is not a usable size, as
    problems ("hidden_size must be a whole number from 1 to 1,048,576, got NaN"); [] when all are usable.

    JSON allows NaN, Infinity, null, text and lists where a size belongs, and typos like `1e12`; each becomes a
    problem here instead of a ValueError, a ZeroDivisionError or a loop that never ends further on.
    """
    problems = []
    for k, (low, high) in SIZE_LIMITS.items():
        if k not in cfg or (cfg[k] is None and k not in required):
            continue  # absent or null: the default applies (missing required keys are reported by the caller)
        v = cfg[k]
        ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
        if not ok or not low <= v <= high:
            problems.append(f"{k} must be a whole number from {low:,} to {high:,}, got {_describe_json(v)}")
    if problems or bounds_only:  # bounds_only: what transformers does not check itself (it builds 10**12 layers)
        return problems
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and int(heads) % int(kv):
        problems.append(f"num_attention_heads {int(heads)} is not a multiple of num_key_value_heads {int(kv)} "
                        "(grouped-query attention shares each key/value head among whole groups of query heads)")
    if heads and cfg.get("head_dim") is None and cfg.get("hidden_size") and int(cfg["hidden_size"]) % int(heads):
        problems.append(f"hidden_size {int(cfg['hidden_size'])} is not divisible by num_attention_heads {int(heads)} "
                        "and there is no head_dim key; give head_dim (or fix one of them)")
    for k in ("layer_types", "mlp_only_layers"):
        v = cfg.get(k)
        if v is not None and not (isinstance(v, list) and len(v) <= SIZE_LIMITS["num_hidden_layers"][1]):
            problems.append(f"{k} must be a list (one entry per layer), got {_describe_json(v)}")
    mlp_only = cfg.get("mlp_only_layers")
    if isinstance(mlp_only, list) and not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        problems.append("mlp_only_layers must list layer numbers (whole numbers)")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = cfg.get(k)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            problems.append(f"{k} must be a positive number or null, got {_describe_json(v)}")
    experts = _get(cfg, "num_local_experts", "num_experts", default=0)
    per_token = cfg.get("num_experts_per_tok")
    if model_type in MOE_MODEL_TYPES and experts and per_token is not None \
            and not 1 <= per_token <= experts:
        problems.append(f"num_experts_per_tok must be from 1 to the {int(experts)} experts, got {per_token!r}")
    return problems


def model_spec_from_hf_config(cfg: dict, name: str = "", source: str = "") -> ModelSpec:
    """Build a ModelSpec from a config.json dict.

    Raises:
        UnsupportedArchitectureError: the model_type is not modelled (the message suggests `--engine trace`).
        UnknownModelError: a key the architecture needs is missing (the message names it).
    """
    label = name or source or "config.json"
    cfg = _text_config(cfg, label)
    model_type = _supported_model_type(cfg, label)
    is_moe = model_type in MOE_MODEL_TYPES
    _check_sizes(cfg, model_type, is_moe, label, source)

    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    flags = _architecture_flags(cfg, model_type)
    window, sliding_layers = _sliding_window(cfg, model_type, layers, flags["full_attention_every_n_layers"])
    num_experts, moe_i, moe_layers = _moe_shape(cfg, is_moe, layers)
    return ModelSpec(
        name=name or cfg.get("_name_or_path", "") or "custom",
        model_type=model_type,
        hidden_size=h,
        intermediate_size=int(_get(cfg, "intermediate_size", default=moe_i)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=h // heads)),
        vocab_size=int(cfg["vocab_size"]),
        sliding_window=window,
        sliding_window_layers=sliding_layers,
        num_experts=num_experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=moe_i,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        moe_layers=moe_layers,
        source=source,
        hf_config=dict(cfg),
        **flags,
    )


def _text_config(cfg, label: str) -> dict:
    """`cfg` itself, or its `text_config` (a multimodal model's language model) with the model_type it names."""
    if not isinstance(cfg, dict):
        raise UnknownModelError(f"{label}: a config.json holds a JSON object {{...}}, got {_describe_json(cfg)}")
    if "text_config" in cfg and "hidden_size" not in cfg:
        if not isinstance(cfg["text_config"], dict):
            raise UnknownModelError(f"{label}: config.json's text_config must be an object {{...}}, got "
                                    f"{_describe_json(cfg['text_config'])}")
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return cfg


def _supported_model_type(cfg: dict, label: str) -> str:
    """config.json's model_type, when the analytic engine models it."""
    model_type = cfg.get("model_type")
    if not model_type:
        raise UnknownModelError(f"{label}: config.json has no 'model_type' key; is this a Hugging Face model config?")
    if not isinstance(model_type, str):
        raise UnknownModelError(f"{label}: config.json's model_type must be text (e.g. \"llama\"), got "
                                f"{_describe_json(model_type)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{label}: model_type {model_type!r} is not modelled by the analytic engine "
            f"(it knows {', '.join(SUPPORTED_MODEL_TYPES)}); use `--engine trace`, which runs the real "
            "transformers model on fake tensors."
        )
    return model_type


def _check_sizes(cfg: dict, model_type: str, is_moe: bool, label: str, source: str) -> None:
    """Raise UnknownModelError when a key the architecture needs is missing or a size is unusable."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    if "intermediate_size" not in cfg and not is_moe:
        missing.append("intermediate_size")
    if missing:
        raise UnknownModelError(f"{label}: config.json lacks {', '.join(repr(k) for k in missing)}, needed to size the model")
    problems = check_hf_config(cfg, model_type, REQUIRED_KEYS + (() if is_moe else ("intermediate_size",)))
    if problems:
        where = source if source and source != label else label
        raise UnknownModelError(f"{where}: config.json has values fitune cannot size a model with:\n"
                                + "\n".join(f"  - {p}" for p in problems)
                                + "\nfix them in the file (transformers writes each size as a whole number)")


def _architecture_flags(cfg: dict, model_type: str) -> dict:
    """The ModelSpec flags that tell an architecture's decoder layer from Llama's (transformers' modeling_*.py):
    the one place, with `_sliding_window`, that reads model_type; everything downstream reads the flags."""
    gemma_like = model_type in ("gemma", "gemma2", "gemma3_text")
    attention_bias = bool(cfg.get("attention_bias", False))
    qwen2 = model_type in ("qwen2", "qwen2_moe")  # biased q/k/v, unbiased o_proj whatever attention_bias says
    full_every = 0
    if model_type == "gemma2":
        full_every = 2
    elif model_type == "gemma3_text":
        full_every = int(_get(cfg, "sliding_window_pattern", default=6))
    return dict(
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma_like)),
        qkv_bias=attention_bias or qwen2,
        o_bias=attention_bias and not qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma_like else None,
        rms_norm_one_plus_weight=gemma_like,
        full_attention_every_n_layers=full_every,
    )


def _sliding_window(cfg: dict, model_type: str, layers: int, full_every: int) -> tuple[int | None, int]:
    """(the sliding window in tokens, how many layers use it); (None, 0) when none does."""
    window = cfg.get("sliding_window")
    sliding_layers = 0
    layer_types = cfg.get("layer_types")
    if layer_types:
        sliding_layers = sum(1 for t in layer_types if t == "sliding_attention")
    elif window and full_every:  # Gemma 2 / 3: every n-th layer is global, the others slide
        sliding_layers = sum(1 for i in range(layers) if (i + 1) % full_every != 0)
    elif window and model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if cfg.get("use_sliding_window"):
            sliding_layers = max(0, layers - int(_get(cfg, "max_window_layers", default=layers)))
    elif window and model_type in ("mistral", "mixtral", "phi3"):
        sliding_layers = layers
    if not sliding_layers:
        window = None
    return (int(window) if window else None), sliding_layers


def _moe_shape(cfg: dict, is_moe: bool, layers: int) -> tuple[int, int, int]:
    """(experts, the intermediate size of one expert, how many layers route to experts); zeros for a dense model."""
    num_experts = int(_get(cfg, "num_local_experts", "num_experts", default=0)) if is_moe else 0
    moe_layers = 0
    if num_experts:
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
    moe_i = int(_get(cfg, "moe_intermediate_size", default=cfg.get("intermediate_size", 0))) if num_experts else 0
    return num_experts, moe_i, moe_layers


# ---- the catalog --------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def model_catalog() -> dict[str, dict]:
    """name -> {"hf_id", "source", "config", ...} from fitune/specs/data/models.json (plain data, with sources)."""
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    for fname in ("models.json", "models_seed.json"):
        path = os.path.join(data_dir, fname)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    return {}


def catalog_model_names() -> list[str]:
    return sorted(model_catalog())


def catalog_key(model: str) -> str | None:
    """The catalog name for MODEL: a catalog name (`llama-3.1-8b`) or the Hugging Face id that `--list-models`
    prints beside it (`meta-llama/Llama-3.1-8B`), in any letter case; None when it is neither."""
    catalog = model_catalog()
    key = model.strip().lower()
    if key in catalog:
        return key
    by_hf_id = {str(e.get("hf_id", "")).lower(): name for name, e in catalog.items() if e.get("hf_id")}
    return by_hf_id.get(key)


#: What Hub ids add around a catalog model's architecture (doctor's and estimate's id matching): the weights differ
#: (instruction-tuned, quantized, converted), the shapes do not.
_HUB_ID_NOISE = ("-instruct", "-chat", "-hf", "-base", "-bnb-4bit", "-4bit", "-8bit", "-unsloth", "-awq", "-gptq",
                 "-it")


def catalog_key_for_hub_id(model_id: str) -> str | None:
    """The catalog name whose architecture a Hub id has, or None.

    Exact first (`catalog_key`: catalog names and the Hub ids the catalog lists), then tolerant of what Hub ids add
    around the same architecture: an owner (`unsloth/`, `NousResearch/`), `Meta-` before `Llama`, and `-Instruct`,
    `-chat`, `-hf`, `-it`, `-bnb-4bit` anywhere after the name. A version stays: `Mistral-7B-Instruct-v0.3` is the
    v0.3 entry (`mistralai/Mistral-7B-v0.3`), and `-v0.2` matches nothing rather than another version.
    """
    if not isinstance(model_id, str) or not model_id.strip():
        return None
    exact = catalog_key(model_id)
    if exact:
        return exact
    names = {}
    for name, entry in model_catalog().items():
        names[_normalise_hub_id(name)] = name
        if entry.get("hf_id"):
            names.setdefault(_normalise_hub_id(entry["hf_id"]), name)
    return names.get(_normalise_hub_id(model_id))


def _normalise_hub_id(model_id: str) -> str:
    base = model_id.strip().lower().rstrip("/").rsplit("/", 1)[-1]
    if base.startswith("meta-llama-"):
        base = base[len("meta-"):]
    changed = True
    while changed:
        changed = False
        for noise in _HUB_ID_NOISE:
            for form in (noise + "-", noise):
                i = base.find(form)
                if i > 0 and (form.endswith("-") or i + len(form) == len(base)):
                    base = base[:i] + ("-" if form.endswith("-") else "") + base[i + len(form):]
                    changed = True
    return base.strip("-")


def closest_catalog_names(model: str, n: int = 4) -> list[str]:
    """Catalog names that read like `model` (its Hub-id noise removed), closest first."""
    key = _normalise_hub_id(model) if model.strip() else ""
    return difflib.get_close_matches(key, list(model_catalog()), n=n, cutoff=0.5)


@dataclass(frozen=True)
class ModelSource:
    """MODEL resolved to its config.json, before any architecture check.

    The analytic engine turns it into a `ModelSpec` (known architectures only); `--engine trace` builds the real
    transformers model from `hf_config`, whatever its architecture, and counts the parameters on it.
    """

    name: str
    hf_config: dict = field(repr=False)
    source: str = ""  # the catalog's source, the config.json path or the .gguf path
    note: str = ""  # how MODEL was found when it is not plain (Hub cache, catalog entry for a Hub id, GGUF metadata)
    gguf_weights_type: str = ""  # a GGUF file's weight type ("Q4_1"): dequantized on load

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type") or "")


def load_model_spec(model: str) -> ModelSpec:
    """Resolve MODEL (a catalog name, a config.json path, a model folder, a Hub id or a .gguf file) into the
    analytic engine's spec; `source_note` and `gguf_weights_type` say where it came from.

    Raises:
        UnknownModelError: MODEL is none of those, or its config.json cannot be read or lacks a key.
        UnsupportedArchitectureError: the analytic engine does not model its architecture (use `--engine trace`).
    """
    src = resolve_model_source(model)
    spec = model_spec_from_hf_config(src.hf_config, name=src.name, source=src.source)
    if src.note or src.gguf_weights_type:
        spec = replace(spec, source_note=src.note, gguf_weights_type=src.gguf_weights_type)
    return spec


def describe_source(spec: ModelSpec, dtype_name: str, method: str = "") -> str | None:
    """The source note estimate and plan print (and put in --json as "source_note"): how MODEL was found, and for
    a GGUF file that its weights are dequantized to the run's dtype; None for a catalog name or a local config."""
    from .sources import dequantize_note

    parts = [spec.source_note] if spec.source_note else []
    if spec.gguf_weights_type:
        parts.append(dequantize_note(spec.gguf_weights_type, dtype_name, method))
    return "; ".join(parts) or None


def resolve_model_source(model: str) -> ModelSource:
    """Resolve MODEL: a catalog name, a config.json path, a model folder holding config.json, a .gguf file, or a
    Hugging Face Hub id (`org/name`).

    A Hub id reads its config.json from the Hub cache (huggingface_hub's, no network) when it is there; else the
    catalog entry with its architecture (`catalog_key_for_hub_id`), said in `note`. A .gguf file's architecture
    comes from its metadata. Reads the config but does not judge its architecture (`load_model_spec` does, for the
    analytic engine).

    Raises:
        UnknownModelError: MODEL is none of those, or its config.json is not a readable JSON object.
    """
    from . import sources

    if not model.strip():
        raise UnknownModelError("MODEL is empty; name a catalog model (e.g. llama-3.1-8b; `fitune estimate "
                                "--list-models` prints them), a config.json, a model folder, a .gguf file or a "
                                "Hugging Face Hub id")
    catalog = model_catalog()
    key = catalog_key(model)
    if key is not None and "/" not in model:
        entry = catalog[key]
        return ModelSource(name=key, hf_config=entry["config"], source=entry.get("source", ""))
    if sources.is_hub_id(model):
        return _hub_source(model.strip(), key)
    if key is not None:
        entry = catalog[key]
        return ModelSource(name=key, hf_config=entry["config"], source=entry.get("source", ""))
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            gguf = sorted(f for f in os.listdir(model) if sources.is_gguf_path(f))
            hint = f" (it holds {gguf[0]}: point MODEL at that file)" if gguf else ""
            raise UnknownModelError(f"{model} is a folder without a config.json{hint}; point MODEL at a Hugging Face "
                                    "model folder")
        return ModelSource(name=os.path.basename(os.path.normpath(model)), hf_config=_read_config(path), source=path)
    if os.path.isfile(model) and sources.is_gguf_path(model):
        g = sources.read_gguf(model)
        stem = os.path.basename(model)[: -len(sources.GGUF_SUFFIX)]
        return ModelSource(name=stem, hf_config=g.hf_config, source=model,
                           note=f"architecture from the GGUF metadata of {model}",
                           gguf_weights_type=g.weights_type)
    if os.path.isfile(model):
        folder = os.path.basename(os.path.dirname(os.path.abspath(model)))
        return ModelSource(name=folder, hf_config=_read_config(model), source=model)
    close = closest_catalog_names(model)
    hint = f"closest catalog names: {', '.join(close)}" if close else f"known: {', '.join(sorted(catalog))}"
    raise UnknownModelError(
        f"{model!r} is not a catalog model, a config.json, a model folder, a .gguf file or a Hub id (org/name); "
        f"{hint}. `fitune estimate --list-models` prints the catalog."
    )


def _hub_source(repo_id: str, key: str | None) -> ModelSource:
    """A Hub id: its cached config.json (the exact architecture), else the catalog entry of its architecture."""
    from . import sources

    path = sources.cached_hub_file(repo_id, "config.json")
    if path is not None:
        return ModelSource(name=repo_id, hf_config=_read_config(path), source=path,
                           note=f"config.json from the Hub cache at {path}")
    key = key or catalog_key_for_hub_id(repo_id)
    if key is not None:
        entry = model_catalog()[key]
        return ModelSource(name=key, hf_config=entry["config"], source=entry.get("source", ""),
                           note=f"{repo_id} is not in the Hub cache ({sources.hub_cache_dir()}); used the catalog "
                                f"entry {key} ({entry.get('hf_id', key)}), which has its architecture")
    close = closest_catalog_names(repo_id)
    hint = f"closest catalog names: {', '.join(close)}" if close else \
        "`fitune estimate --list-models` prints the catalog"
    raise UnknownModelError(
        f"{repo_id!r}: no such file or folder, and as a Hub id it is neither in the Hub cache "
        f"({sources.hub_cache_dir()}) nor in fitune's catalog; "
        f"download it with `{sources.download_command(repo_id)}` (its config.json is enough for an estimate: "
        f"`{sources.download_command(repo_id)} config.json`), or name a catalog model ({hint})")


#: The largest config.json read (bytes): real ones are a few KiB (with an id2label table, a few hundred).
MAX_CONFIG_JSON_BYTES = 16 << 20


def _read_config(path: str) -> dict:
    try:
        size = os.path.getsize(path)
        if size > MAX_CONFIG_JSON_BYTES:
            raise UnknownModelError(f"{path}: {size:,} bytes is too large for a config.json (at most "
                                    f"{MAX_CONFIG_JSON_BYTES:,}); point MODEL at the model's config.json or folder")
        with open(path, "rb") as f:
            raw = f.read()
        cfg = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise UnknownModelError(f"{path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                                "a config.json is UTF-8 JSON: re-save it as UTF-8") from exc
    except RecursionError as exc:
        raise UnknownModelError(f"{path}: JSON nested too deeply to be a config.json; point MODEL at the model's "
                                "config.json") from exc
    except ValueError as exc:  # json.JSONDecodeError, or a number too long to convert
        why = "a number of thousands of digits" if "digits" in str(exc) else str(exc)
        raise UnknownModelError(f"cannot read {path} as a config.json: {why}; fix the JSON (or point MODEL at the "
                                "model's own config.json)") from exc
    except OSError as exc:
        raise UnknownModelError(f"cannot read {path}: {exc.strerror or exc}; check the path and its permissions") \
            from exc
    if not isinstance(cfg, dict):
        raise UnknownModelError(f"{path} is not a JSON object ({_describe_json(cfg)}); expected a Hugging Face "
                                "config.json {\"model_type\": ..., \"hidden_size\": ...}")
    return cfg
