"""A Hugging Face folder of full weights as one GGUF file that llama.cpp and Ollama run.

What is written follows llama.cpp's own converter, `convert_hf_to_gguf.py` (github.com/ggml-org/llama.cpp; read at
commit 0024aa7), for the architectures it registers as `LlamaModel` (LlamaForCausalLM, MistralForCausalLM: GGUF
architecture "llama") and `Qwen2Model` (Qwen2ForCausalLM: "qwen2"). The code is fitune's own; where a rule comes
from that file, the comment says which of its functions:

- hyperparameters: `TextModel.set_gguf_parameters` (block count, context, widths, heads, rope base and scaling,
  RMS-norm epsilon, key/value length when config.json gives head_dim) and `LlamaModel.set_gguf_parameters`
  (vocab size, rope dimension count);
- tensors: names through gguf-py's `TensorNameMap`; Llama's q_proj / k_proj rows permuted (`LlamaModel.permute`:
  HF stores each head's rotary halves apart, llama.cpp's rope wants them interleaved); the `rope_freqs` tensor of
  Llama 3's "llama3" rope scaling (`LlamaModel.generate_extra_tensors`); tied embeddings write no output.weight
  (llama.cpp's loader falls back to token_embd);
- tensor types: `ModelBase.prepare_tensors`: 1-D tensors (norms, biases, rope_freqs) stay f32; with q8_0 a tensor
  whose rows are not a whole number of 32-value blocks falls back to f16;
- tokenizer: byte-level BPE (Llama 3, Qwen2, SmolLM2; GGUF "gpt2"): `TextModel.get_vocab_base` / `_set_vocab_gpt2`
  (tokens, token types, merges through gguf-py's `SpecialVocab`) and `get_vocab_base_pre` (the pre-tokenizer named
  by the sha256 of the token ids of a fixed text), for the pre-tokenizers of `PRE_TOKENIZERS`; SentencePiece-style
  BPE from a tokenizer.json (Llama 2, Mistral 7B v0.1-v0.3: byte fallback, \u2581 for spaces; GGUF "llama"):
  `LlamaModel.set_vocab` -> `_set_vocab_llama_hf` with gguf-py's `LlamaHfVocab` (tokens, scores, token types), with
  scores in the order a tokenizer.model's have and the unk token typed as `_set_vocab_sentencepiece` types it (see
  `_read_llama_vocab`).

Other tokenizers (a tokenizer.model without tokenizer.json, Unigram, WordPiece) are refused with a message saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FituneError
from ..files import atomic_writer, check_regular, check_target, open_regular

log = logging.getLogger(__name__)

QTYPES = ("f16", "q8_0")
"""The tensor types `export_gguf` writes: f16 (2-D tensors in half precision) or q8_0 (8-bit blocks of 32 values
with one f16 scale each, 8.5 bits per weight)."""

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # llama.cpp registers Mistral under LlamaModel: the same graph, GGUF arch "llama"
    "Qwen2ForCausalLM": "qwen2",
}
"""config.json `architectures[0]` -> the GGUF architecture it is written as."""

# convert_hf_to_gguf.py `get_vocab_base_pre`: the text whose token ids identify a BPE pre-tokenizer, and the
# sha256 of `str(tokenizer.encode(text))` for the tokenizers fitune exports (each line names the model llama.cpp
# took the hash from). llama.cpp picks its pre-tokenizer regex by the name written to tokenizer.ggml.pre.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make "
    "it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B (Qwen2, 2.5)
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # mistralai/Mistral-Nemo-Base-2407
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
}
SUPPORTED_PRE = "llama-bpe (Llama 3), qwen2 (Qwen2, Qwen2.5), smollm (SmolLM, SmolLM2), tekken (Mistral Nemo), gpt-2"
SUPPORTED = (f"byte-level BPE with the pre-tokenizers {SUPPORTED_PRE}; and SentencePiece-style BPE with byte fallback "
             "(Llama 2, Mistral 7B v0.1-v0.3), written as llama.cpp's \"llama\" tokenizer")
"""The tokenizers `export_gguf` writes, as its refusals name them."""

# A tokenizer whose hash is not listed (a fine-tune that added tokens, another vocabulary) is still named when its
# pre-tokenizer is one of these: llama.cpp's pre-tokenizer name selects only the splitting regex (llama-vocab.cpp),
# which these tokenizer.json pre-tokenizers spell the same way; the hash is llama.cpp's proxy for it.
_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                 "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace("\\p{N}{1,3}", "\\p{N}")
PRE_TOKENIZER_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
"""Split regex (then ByteLevel without its own regex) -> the llama.cpp pre-tokenizer that splits the same way."""

ROPE_TYPES = ("default", "linear", "yarn", "llama3")
"""rope scaling kinds written (`TextModel.set_gguf_parameters`, `LlamaModel.generate_extra_tensors`)."""

Q8_0_BLOCK = 32
"""Values per q8_0 block (gguf-py GGML_QUANT_SIZES): a row must be a multiple of it to be quantized."""
F16_MAX = 65504.0

Progress = Callable[[int, int], None]


class ExportError(FituneError):
    """A model folder or an output path `fitune export` cannot use; the message says why and what to do."""


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: where it is read from, its GGUF name and type, how it is transformed."""

    source: str  # the HF tensor name ("" for a tensor fitune computes: rope_freqs)
    file: str  # the safetensors file holding it
    name: str  # the GGUF tensor name
    shape: tuple[int, ...]  # HF (row-major) order: (out_features, in_features) for a Linear
    ggml_type: str  # "F32", "F16" or "Q8_0"
    permute_heads: int = 0  # Llama q_proj / k_proj: the number of heads whose rows are interleaved; 0: none


@dataclass
class _Vocab:
    tokens: list[str]
    token_types: list[int]
    pre: str
    merges: list[str]  # "gpt2" only; "llama" stores none (llama.cpp merges by score)
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    chat_template: str | list | None
    notes: list[str] = field(default_factory=list)
    model: str = "gpt2"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    scores: list[float] | None = None  # "llama" only: llama.cpp first joins the pair whose join scores highest
    add_space_prefix: bool = False  # "llama": the tokenizer puts \u2581 before the text's first word


# ---- the entry point -----------------------------------------------------------------------------------------


def export_gguf(model_folder: str, out_path: str, qtype: str = "f16", *, overwrite: bool = False,
                name: str | None = None, progress: Progress | None = None) -> dict:
    """Write the model in `model_folder` (config.json, safetensors weights, tokenizer.json) as one GGUF file.

    Args:
        model_folder: a Hugging Face folder of full weights (a merged fine-tune, a base model).
        out_path: the .gguf file to write; written as a temporary file in the same folder, renamed at the end.
        qtype: "f16" or "q8_0" (`QTYPES`).
        overwrite: replace `out_path` if it exists (otherwise an existing file is refused).
        name: general.name in the file (default: the folder's name).
        progress: `progress(done, total)` after each tensor written.

    Returns:
        what was written: path, architecture, qtype, tensors, bytes, parameters, tensor_types (type -> count),
        tokenizer ({model, pre, tokens, chat_template}), special_ids, metadata_keys, notes (choices the user should
        know about, e.g. a tensor kept f16 under q8_0).

    Raises:
        ExportError: an unknown qtype, an existing out_path, a folder that is not a model of a supported
            architecture, a tokenizer that cannot be written.
    """
    if qtype not in QTYPES:
        raise ExportError(f"--gguf {qtype!r} is not a type fitune exports; choose one of: {', '.join(QTYPES)}")
    out_path = os.path.abspath(out_path)
    check_output_path(out_path, overwrite)
    config = _read_config(model_folder)
    arch = _architecture(config, model_folder)
    hp = _hyperparameters(config, model_folder)
    files = _weight_files(model_folder)
    tensors, notes = _plan_tensors(model_folder, files, arch, hp, qtype)
    vocab = _read_vocab(model_folder, hp["vocab_size"])
    notes += vocab.notes
    if arch == "llama" and config.get("sliding_window") and config.get("architectures", [""])[0].startswith("Mistral"):
        if int(config["sliding_window"]) < hp["context_length"]:
            notes.append(f"sliding_window {config['sliding_window']} is not written (llama.cpp's llama graph, like "
                         "its own converter, attends to the whole context): outputs differ from transformers' only "
                         f"past {config['sliding_window']} tokens")
    name = name or os.path.basename(os.path.normpath(model_folder))
    return _write(out_path, arch, hp, vocab, tensors, model_folder, qtype, name, notes, progress)


# ---- reading the folder --------------------------------------------------------------------------------------


def check_output_path(out_path: str, overwrite: bool) -> None:
    """Raise ExportError when `out_path` cannot be written: a folder, an existing file without `overwrite`, a
    missing parent folder; and UnsafeFileError (even with `overwrite`) when a symbolic link, FIFO, socket or
    device is in its place."""
    if os.path.isdir(out_path) and not os.path.islink(out_path):
        raise ExportError(f"--out {out_path} is a folder; give the file to write, e.g. {out_path}/model.gguf")
    check_target(out_path, "--out")
    if os.path.lexists(out_path) and not overwrite:
        raise ExportError(f"--out {out_path} exists; pass --force to replace it, or choose another file name")
    parent = os.path.dirname(out_path)
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out_path}: its folder {parent} does not exist; create it first")


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        found = sorted(os.listdir(folder))[:12] if os.path.isdir(folder) else []
        raise ExportError(f"{folder} has no config.json, so it is not a Hugging Face model folder (it holds: "
                          f"{', '.join(found) or 'nothing'}); give a folder written by save_pretrained, `fitune "
                          "merge`, or a fitune run folder")
    try:
        with open_regular(path, what="the model's") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path}: {exc}; it should be the JSON config.json that save_pretrained "
                          "writes") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{path} is not a JSON object; it should be the config.json that save_pretrained writes")
    return config


def _architecture(config: dict, folder: str) -> str:
    archs = config.get("architectures") or []
    hf_arch = archs[0] if archs else f"(none; model_type {config.get('model_type')!r})"
    if hf_arch not in ARCHITECTURES:
        raise ExportError(f"{folder}: architecture {hf_arch} cannot be exported to GGUF by fitune; it exports "
                          f"{', '.join(ARCHITECTURES)}. For others use llama.cpp's convert_hf_to_gguf.py")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ExportError(f"{folder} holds quantized weights (quantization_config: {method}); export needs full "
                          "weights: merge the adapter into a bf16/fp32 base (`fitune merge`, which loads the base "
                          "unquantized) and export that folder")
    return ARCHITECTURES[hf_arch]


def _hyperparameters(config: dict, folder: str) -> dict:
    """The numbers the GGUF header needs, from config.json (transformers 4 and 5 spellings of rope)."""
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise ExportError(f"{folder}/config.json lacks {', '.join(missing)} (integers every Llama / Qwen2 config "
                          "has); is the file complete?")
    n_head = config["num_attention_heads"]
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ExportError(f"{folder}: rope scaling {rope_type!r} is not one fitune writes to GGUF (it writes "
                          f"{', '.join(ROPE_TYPES)}); use llama.cpp's convert_hf_to_gguf.py for this model")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return {
        "block_count": config["num_hidden_layers"],
        "context_length": config.get("max_position_embeddings", 2048),
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "head_count": n_head,
        "head_count_kv": config.get("num_key_value_heads") or n_head,
        "head_dim": config.get("head_dim") or config["hidden_size"] // n_head,
        "head_dim_in_config": config.get("head_dim") is not None,
        "rms_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "rope": rope,
        "rope_type": rope_type,
        "vocab_size": config["vocab_size"],
        "tied": bool(config.get("tie_word_embeddings", False)),
    }


def _weight_files(folder: str) -> dict[str, str]:
    """{tensor name: safetensors file} from model.safetensors(.index.json) or model-*.safetensors shards."""
    # safetensors, gguf, transformers, numpy, torch: optional, imported where used
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open_regular(index, what="the model's") as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        for path in set(files.values()):
            check_regular(path, "the model's")  # safetensors opens it by name: a FIFO would block it
        return files
    shards = sorted(n for n in os.listdir(folder) if n.startswith("model") and n.endswith(".safetensors"))
    if not shards:
        found = [n for n in sorted(os.listdir(folder)) if n.endswith((".bin", ".pt", ".pth", ".safetensors"))]
        raise ExportError(f"{folder} has no model*.safetensors weights (found: {', '.join(found) or 'none'}); "
                          "save the model with save_pretrained(..., safe_serialization=True) or `fitune merge`")
    files: dict[str, str] = {}
    for shard in shards:
        path = os.path.join(folder, shard)
        check_regular(path, "the model's")
        with safe_open(path, framework="pt") as f:
            files.update({name: path for name in f.keys()})
    return files


def _plan_tensors(folder: str, files: dict[str, str], arch: str, hp: dict, qtype: str) -> tuple[list[_Tensor], list[str]]:
    """Every tensor to write, in GGUF order (token_embd, the blocks, output_norm, output), with its type."""
    import gguf
    from safetensors import safe_open

    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, hp["block_count"])
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for hf_name in f.keys():
                if files.get(hf_name) == path:
                    shapes[hf_name] = tuple(f.get_slice(hf_name).get_shape())
    notes: list[str] = []
    out: list[_Tensor] = []
    unknown = []
    for hf_name in sorted(shapes):
        if hf_name.endswith(".rotary_emb.inv_freq"):  # a buffer recomputed at load (llama.cpp skips it too)
            continue
        if hf_name == "lm_head.weight" and hp["tied"]:  # tied: llama.cpp reads token_embd for the output
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            unknown.append(hf_name)
            continue
        shape = shapes[hf_name]
        permute = 0
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            permute = hp["head_count"]
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            permute = hp["head_count_kv"]
        ggml_type = _ggml_type(shape, qtype)
        if qtype == "q8_0" and len(shape) == 2 and ggml_type == "F16":
            notes.append(f"{gguf_name} stays f16: its rows of {shape[-1]} values are not a multiple of q8_0's "
                         f"{Q8_0_BLOCK}-value blocks (as llama.cpp does)")
        out.append(_Tensor(hf_name, files[hf_name], gguf_name, shape, ggml_type, permute))
    if unknown:
        raise ExportError(f"{folder}: {len(unknown)} tensor(s) have no GGUF name for {arch}: "
                          f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}; is this a plain "
                          "model folder (not an adapter, not a model with extra heads)?")
    names = {t.name for t in out}
    if "output.weight" not in names and not hp["tied"]:
        raise ExportError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight; the folder is "
                          "incomplete (save it again with save_pretrained)")
    if hp["rope_type"] == "llama3":
        out.append(_Tensor("", "", "rope_freqs.weight", (hp["head_dim"] // 2,), "F32"))
    out.sort(key=_gguf_order)
    return out, notes


def _ggml_type(shape: tuple[int, ...], qtype: str) -> str:
    """f16: 2-D f16, 1-D f32; q8_0: 2-D q8_0 when its rows are whole blocks, else f16; 1-D f32 (prepare_tensors)."""
    if len(shape) <= 1:
        return "F32"
    if qtype == "q8_0" and shape[-1] % Q8_0_BLOCK == 0:
        return "Q8_0"
    return "F16"


def _gguf_order(t: _Tensor) -> tuple:
    if t.name.startswith("blk."):
        block, rest = t.name[4:].split(".", 1)
        return (1, int(block), rest)
    return ({"token_embd.weight": 0, "rope_freqs.weight": 0}.get(t.name, 2), 0, t.name)


# ---- the tokenizer -------------------------------------------------------------------------------------------


def _read_vocab(folder: str, vocab_size: int) -> _Vocab:
    """Tokens, token types, merges, special ids, chat template (`get_vocab_base`, `_set_vocab_gpt2`)."""
    import gguf
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        what = "tokenizer.model (SentencePiece) but no tokenizer.json" if \
            os.path.isfile(os.path.join(folder, "tokenizer.model")) else "no tokenizer.json"
        raise ExportError(f"{folder} has {what}; fitune writes the tokenizer from tokenizer.json ({SUPPORTED}); "
                          "copy the base model's tokenizer files (tokenizer.json, tokenizer_config.json) into the "
                          "folder, or use llama.cpp's convert_hf_to_gguf.py")
    with open_regular(os.path.join(folder, "tokenizer.json"), what="the model's") as f:
        spec = json.load(f)
    if _is_sentencepiece_style(spec):
        return _read_llama_vocab(folder, spec, vocab_size)
    model_type = (spec.get("model") or {}).get("type")
    if model_type != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ExportError(f"{folder}/tokenizer.json is a {model_type} tokenizer that is neither byte-level BPE nor "
                          "SentencePiece-style BPE (byte fallback and a \u2581 Metaspace pre-tokenizer or "
                          f"normalizer); fitune writes {SUPPORTED}; use llama.cpp's convert_hf_to_gguf.py for it")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    pre = PRE_TOKENIZERS.get(digest) or _pre_from_splits(json.loads(tokenizer.backend_tokenizer.to_str()))
    if pre is None:
        raise ExportError(f"{folder}: the tokenizer's pre-tokenizer is not one fitune knows (check hash {digest}, "
                          f"as llama.cpp's convert_hf_to_gguf.py computes it); fitune writes {SUPPORTED_PRE}. "
                          "llama.cpp picks its splitting rules by this name, so a wrong one would tokenize "
                          "differently; use llama.cpp's convert_hf_to_gguf.py if it knows this tokenizer")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"{folder}: the tokenizer has token id {max(vocab.values())} but config.json's "
                          f"vocab_size is {vocab_size}; the tokenizer does not belong to this model")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:  # embedding rows past the tokenizer (padded vocabularies): unused
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp wants control / user tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)

    special = gguf.SpecialVocab(Path(folder), load_merges=True)
    ids, add_bos, add_eos, notes = _special_ids(folder, tokenizer, special)
    return _Vocab(tokens, types, pre, list(special.merges), ids, add_bos, add_eos, special.chat_template, notes)


def _special_ids(folder: str, tokenizer, special) -> tuple[dict[str, int], bool, bool, list[str]]:
    """bos / eos / unk / pad / sep ids (gguf-py's `SpecialVocab`, eos from generation_config.json when it names one
    other token), whether the tokenizer adds bos / eos itself, and notes."""
    ids = {k: v for k, v in special.special_token_ids.items() if k in ("bos", "eos", "unk", "pad", "sep")}
    notes = []
    eos = _generation_eos(folder)
    if eos is not None and ids.get("eos") != eos:
        # transformers' generate stops at generation_config's eos; a tokenizer_config that names another token
        # (the test model's, rebuilt from a GGUF, names <|im_start|>) would make llama.cpp stop elsewhere
        shown = tokenizer.convert_ids_to_tokens(eos)
        notes.append(f"eos is {eos} ({shown}, from generation_config.json, what transformers' generate stops at); "
                     f"tokenizer_config.json names {ids.get('eos')}")
        ids["eos"] = eos
    with_special = tokenizer.encode("a")
    without = tokenizer.encode("a", add_special_tokens=False)
    bos, eos_id = ids.get("bos"), ids.get("eos")
    add_bos = bos is not None and with_special[:1] == [bos] and without[:1] != [bos]
    add_eos = eos_id is not None and with_special[-1:] == [eos_id] and without[-1:] != [eos_id]
    return ids, add_bos, add_eos, notes


def _is_sentencepiece_style(spec: dict) -> bool:
    """A tokenizer.json shaped as Llama 2's and Mistral 7B's (converted from SentencePiece): a BPE model with byte
    fallback, spaces turned into \u2581 by a Metaspace pre-tokenizer (Mistral v0.3) or a Replace normalizer (Llama 2).
    gguf-py's `LlamaHfVocab` takes the same shape (BPE, byte_fallback)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return False
    steps = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")], ensure_ascii=False)
    return "ByteLevel" not in steps and ('"Metaspace"' in steps or "\u2581" in steps)


def _read_llama_vocab(folder: str, spec: dict, vocab_size: int) -> _Vocab:
    """A SentencePiece-style tokenizer.json as llama.cpp's "llama" (SentencePiece) vocabulary: convert_hf_to_gguf.py
    `_set_vocab_llama_hf` with gguf-py's `LlamaHfVocab` (tokens as they are, \u2581 for spaces; <0xNN> byte tokens
    BYTE; special tokens CONTROL; other added tokens USER_DEFINED; `SpecialVocab` for ids and the chat template; no
    merges), with two changes, both what `_set_vocab_sentencepiece` writes from a tokenizer.model:

    - scores: `LlamaHfVocab` gives every token -1000, so llama.cpp's tokenizer, which joins the adjacent pair whose
      join has the highest score, would join left to right; here a token scores minus the rank of the first merge of
      tokenizer.json that makes it: the order of a tokenizer.model's scores, from which transformers' converter
      (convert_slow_tokenizer.py, `SentencePieceExtractor`) ordered the merges of Llama 2's and Mistral's
      tokenizer.json; tokens no merge makes score 0 (bytes, control tokens, single characters: never a join's result);
    - the unk token is UNKNOWN (a SentencePiece model's type for it), not CONTROL.
    """
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"{folder}: the tokenizer has token id {max(vocab.values())} but config.json's "
                          f"vocab_size is {vocab_size}; the tokenizer does not belong to this model")
    rank: dict[str, int] = {}
    for r, merge in enumerate(spec["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, r)
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    unk = tokenizer.unk_token_id
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i not in reverse:  # embedding rows past the tokenizer (padded vocabularies): unused
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse[i]
        score = -float(rank[token]) if token in rank else 0.0
        if i == unk:
            kind = gguf.TokenType.UNKNOWN
        elif _is_byte_token(token):
            kind = gguf.TokenType.BYTE
        elif i in added and added[i].special:
            kind = gguf.TokenType.CONTROL
        elif i in added:
            kind = gguf.TokenType.USER_DEFINED
            token = token.replace("\u2581", " ")  # user-defined tokens are matched before \u2581 replaces spaces
            score = -1000.0
        else:
            kind = gguf.TokenType.NORMAL
        tokens.append(token)
        scores.append(score)
        types.append(int(kind))
    special = gguf.SpecialVocab(Path(folder), load_merges=False, n_vocab=vocab_size)
    ids, add_bos, add_eos, notes = _special_ids(folder, tokenizer, special)
    # SentencePiece's add_dummy_prefix: "a" becomes "\u2581a" (Metaspace prepend_scheme first/always, or Llama 2's
    # Prepend normalizer); llama.cpp reads it as tokenizer.ggml.add_space_prefix
    first = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
    add_space_prefix = bool(first) and first[0].startswith("\u2581")
    return _Vocab(tokens, types, "default", [], ids, add_bos, add_eos, special.chat_template, notes, model="llama",
                  scores=scores, add_space_prefix=add_space_prefix)


def _is_byte_token(token: str) -> bool:
    """<0x00> .. <0xFF>: SentencePiece's byte-fallback pieces (gguf-py `LlamaHfVocab.get_token_type`)."""
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">") and \
        all(c in "0123456789ABCDEFabcdef" for c in token[3:5])


def _pre_from_splits(spec: dict) -> str | None:
    """The llama.cpp pre-tokenizer of a tokenizer whose effective pre-tokenizer (after transformers' tokenizer class
    has set it up) is a known Split regex followed by a byte-level step with no regex of its own, else None."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel" or \
            steps[1].get("use_regex", True) or steps[0].get("behavior") != "Isolated" or steps[0].get("invert"):
        return None
    return PRE_TOKENIZER_SPLITS.get((steps[0].get("pattern") or {}).get("Regex"))


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py `does_token_look_special`: added tokens that are control tokens whatever they say."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def _generation_eos(folder: str) -> int | None:
    """generation_config.json's eos_token_id: the id, or of a list the first (None when absent)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open_regular(path, what="the model's") as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, list):
        return None  # several stop tokens (Llama 3, Qwen2.5): the tokenizer's eos is one of them; keep it
    return value if isinstance(value, int) else None


# ---- writing -------------------------------------------------------------------------------------------------


def _write(out_path: str, arch: str, hp: dict, vocab: _Vocab, tensors: list[_Tensor], folder: str, qtype: str,
           name: str, notes: list[str], progress: Progress | None) -> dict:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path=None, arch=arch)
    n_params = sum(math.prod(t.shape) for t in tensors if t.source)
    _add_metadata(writer, arch, hp, vocab, qtype, name, n_params)
    for t in tensors:
        ggml = gguf.GGMLQuantizationType[t.ggml_type]
        if ggml == gguf.GGMLQuantizationType.Q8_0:
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, ggml)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=ggml)
        else:
            dtype = np.dtype(np.float16 if t.ggml_type == "F16" else np.float32)
            writer.add_tensor_info(t.name, t.shape, dtype, math.prod(t.shape) * dtype.itemsize)
    metadata_keys = sorted(writer.kv_data[0])

    try:  # a temporary file beside out_path (O_EXCL, never a link), renamed over it once complete
        with atomic_writer(out_path, what="--out") as f:
            _attach(writer, f)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            clipped = []
            for done, t in enumerate(tensors, 1):
                data, peak = _tensor_data(t, hp, folder)
                if peak > F16_MAX and t.ggml_type != "F32":
                    clipped.append(f"{t.name} (max |x| {peak:.4g})")
                writer.write_tensor_data(data)
                if progress is not None:
                    progress(done, len(tensors))
    finally:
        writer.close()  # idempotent; after an error it drops the writer's hold on the removed temporary file
    if clipped:
        notes.append(f"values beyond f16's range ({F16_MAX:g}) were clipped to it in: {', '.join(clipped)}")
    types: dict[str, int] = {}
    for t in tensors:
        types[t.ggml_type] = types.get(t.ggml_type, 0) + 1
    return {
        "path": out_path,
        "architecture": arch,
        "qtype": qtype,
        "tensors": len(tensors),
        "bytes": os.path.getsize(out_path),
        "parameters": n_params,
        "tensor_types": types,
        "tokenizer": {"model": vocab.model, "pre": vocab.pre, "tokens": len(vocab.tokens),
                      "chat_template": vocab.chat_template is not None},
        "special_ids": dict(vocab.special_ids),
        "metadata_keys": metadata_keys,
        "notes": notes,
    }


def _attach(writer, f) -> None:
    """Hand the GGUFWriter our open temporary file. Its public way in, `write_header_to_file(path)`, opens a path
    by name (`open(path, "wb")`), which a link planted at that name would redirect; `open_output_file` returns
    early when `fout` is set and the state is EMPTY, the state it sets itself after opening (gguf >= 0.10)."""
    from gguf.gguf_writer import WriterState

    writer.fout = [f]
    writer.state = WriterState.EMPTY


def _add_metadata(writer, arch: str, hp: dict, vocab: _Vocab, qtype: str, name: str, n_params: int) -> None:
    """The key-value header: general.*, the architecture's hyperparameters, the tokenizer."""
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(n_params, 0, 0, 0))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["block_count"])
    writer.add_context_length(hp["context_length"])
    writer.add_embedding_length(hp["embedding_length"])
    writer.add_feed_forward_length(hp["feed_forward_length"])
    writer.add_head_count(hp["head_count"])
    writer.add_head_count_kv(hp["head_count_kv"])
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_eps"])
    if hp["head_dim_in_config"]:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    rope, rope_type = hp["rope"], hp["rope_type"]
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp["head_dim"])

    # _set_vocab_gpt2 / _set_vocab_llama_hf + SpecialVocab.add_to_gguf
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    if vocab.model == "gpt2":
        writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_eos:
        writer.add_add_eos_token(True)
    # byte-level BPE adds no space before the first word (SmolLM2's GGUF: False); SentencePiece-style does
    writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def _tensor_data(t: _Tensor, hp: dict, folder: str):
    """The tensor as the numpy array GGUF stores (f32, f16, or q8_0 bytes) and its largest magnitude."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    if t.name == "rope_freqs.weight":
        data = _llama3_rope_factors(hp)
    else:
        with safe_open(t.file, framework="pt") as f:
            data = f.get_tensor(t.source).to(torch.float32)
        if t.permute_heads:
            data = _permute(data, t.permute_heads)
    array = data.numpy()
    peak = float(np.abs(array).max()) if array.size else 0.0
    if t.ggml_type == "F32":
        return np.ascontiguousarray(array, dtype=np.float32), peak
    if peak > F16_MAX:
        array = np.clip(array, -F16_MAX, F16_MAX)
    if t.ggml_type == "F16":
        return np.ascontiguousarray(array, dtype=np.float16), peak
    return gguf.quants.quantize(np.ascontiguousarray(array), gguf.GGMLQuantizationType.Q8_0), peak


def _permute(weights, n_head: int):
    """convert_hf_to_gguf.py `LlamaModel.permute`: each head's rows [first half | second half] (HF's rotate_half
    layout) become interleaved pairs (llama.cpp's rope rotates adjacent values)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _llama3_rope_factors(hp: dict):
    """convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors`: Llama 3.1's per-frequency rope divisors."""
    import torch

    rope, dim = hp["rope"], hp["head_dim"]
    freqs = 1.0 / (hp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
