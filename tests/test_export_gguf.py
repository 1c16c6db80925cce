"""`fitune export --gguf`: the model written as GGUF reads back through transformers' GGUF loader (an independent
reader: it undoes llama.cpp's q/k permutation, dequantizes q8_0 and rebuilds the tokenizer) with the source model's
logits, token ids and chat template; its metadata keys are those of a GGUF that llama.cpp itself wrote.

Measured (logits, max |difference|, SmolLM2-135M-Instruct in fp32, logits up to ~38): f16 0.035 (on short
prompts; asserted < 0.1 on these), the top token equal at every position; q8_0 1.74, the top token equal at 74 of 76
positions, and 0 (bit-identical) against the source whose matrices were rounded through q8_0 first: the export adds
no error of its own. The asserted bounds leave room above those.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from fitune.cli.main import main  # noqa: E402
from fitune.export.gguf import ExportError, export_gguf  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé naïve café 日本語 🦙 3.14159 ---",
]
TOKENIZER_STRINGS = PROMPTS + ["  two spaces\tand a tab\n\nnewlines", "<|endoftext|>after", "x" * 40, "12345 678"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


F16_LOGITS_ATOL = 0.1  # measured 0.035
Q8_0_LOGITS_ATOL = 2.5  # measured 1.74 (against the fp32 source)
Q8_0_EXPORT_ATOL = 1e-4  # measured 0: bit-identical (against the source rounded through q8_0)


def _load_gguf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _logits(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _field(reader, key):
    return reader.fields[key].contents()


# ---- the real model --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(real_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def exported(real_model_dir, tmp_path_factory):
    """{qtype: (path, result)}: the real model exported once per type."""
    out = tmp_path_factory.mktemp("gguf")
    return {q: (str(out / f"smollm2.{q}.gguf"),
                export_gguf(real_model_dir, str(out / f"smollm2.{q}.gguf"), q)) for q in ("f16", "q8_0")}


def _check_round_trip(path, source, atol):
    src_model, src_tok = source
    model, tok = _load_gguf(path)
    worst = 0.0
    for prompt in PROMPTS:
        ids = src_tok(prompt).input_ids
        a, b = _logits(src_model, ids), _logits(model, ids)
        worst = max(worst, (a - b).abs().max().item())
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), prompt  # the same next token at every position
    for text in TOKENIZER_STRINGS:
        assert tok(text).input_ids == src_tok(text).input_ids, text
    assert tok.chat_template == src_tok.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        src_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return worst


@pytest.mark.slow
def test_real_model_f16_reads_back_with_the_same_logits_tokens_and_template(exported, source, real_gguf):
    path, result = exported["f16"]
    assert {k: result[k] for k in ("architecture", "qtype", "tensors", "tensor_types", "parameters")} == {
        "architecture": "llama", "qtype": "f16", "tensors": 272,
        # 30 blocks x 7 matrices + token_embd (tied: no output.weight) in f16; 30 x 2 norms + output_norm in f32
        "tensor_types": {"F16": 211, "F32": 61}, "parameters": 134_515_008}
    assert result["tokenizer"] == {"model": "gpt2", "pre": "smollm", "tokens": 49152, "chat_template": True}
    assert result["special_ids"] == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    reader = gguf.GGUFReader(path)
    assert "output.weight" not in {t.name for t in reader.tensors}
    data_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert data_bytes == 2 * (result["parameters"] - 61 * 576) + 4 * 61 * 576
    # the vocabulary is exactly what llama.cpp's converter wrote for the same model
    real = gguf.GGUFReader(real_gguf)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.chat_template"):
        assert _field(reader, key) == _field(real, key), key
    worst = _check_round_trip(path, source, F16_LOGITS_ATOL)
    assert worst > 0  # f16 rounding is visible: the comparison is real


@pytest.mark.slow
def test_real_model_q8_0_reads_back_within_the_stated_tolerance(exported, source):
    path, result = exported["q8_0"]
    assert result["tensor_types"] == {"Q8_0": 211, "F32": 61}  # 576 and 1536 are whole 32-value blocks
    assert result["notes"] == []  # no tensor kept f16; tokenizer and generation config agree on eos
    reader = gguf.GGUFReader(path)
    q8 = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0)
    # q8_0: each block of 32 values is 32 int8 + one f16 scale = 34 bytes
    assert sum(int(t.n_bytes) for t in reader.tensors) == q8 // 32 * 34 + 4 * 61 * 576
    assert result["bytes"] < 0.55 * exported["f16"][1]["bytes"]
    # the export itself adds nothing to q8_0's rounding: against the source with every matrix rounded through
    # q8_0 (gguf-py's quantize, dequantize) the file reads back with the same logits and tokens
    import copy

    src_model, src_tok = source
    rounded = copy.deepcopy(src_model)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for param in rounded.parameters():
            if param.dim() == 2:
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8_0), q8_0)))
    print(f"q8_0 against the source rounded through q8_0: {_check_round_trip(path, (rounded, src_tok), Q8_0_EXPORT_ATOL):.4f}")
    # against the unrounded source: q8_0's own error
    model, _ = _load_gguf(path)
    worst, same = 0.0, []
    for prompt in PROMPTS:
        ids = src_tok(prompt).input_ids
        a, b = _logits(src_model, ids), _logits(model, ids)
        worst = max(worst, (a - b).abs().max().item())
        same += (a.argmax(-1) == b.argmax(-1)).tolist()
    print(f"q8_0 against the fp32 source: max |logits difference| {worst:.3f}, top token the same at "
          f"{sum(same)}/{len(same)} positions")
    assert worst < Q8_0_LOGITS_ATOL
    assert sum(same) >= len(same) - 2  # measured: 74 of 76 positions (the two others are near-ties)


#: keys llama.cpp's file has and fitune's not: the model card's metadata (organization, license, ...), which a
#: trained folder has no model card to read from
ONLY_IN_LLAMA_CPP = {"general.organization", "general.finetune", "general.basename", "general.license",
                     "general.languages"}
#: keys fitune writes and that file has not: config.json now carries head_dim (transformers 5 writes it), and
#: llama.cpp's converter writes key/value length whenever it does (TextModel.set_gguf_parameters)
ONLY_IN_FITUNE = {"llama.attention.key_length", "llama.attention.value_length"}


@pytest.mark.slow
def test_metadata_keys_and_values_match_a_file_llama_cpp_wrote(exported, real_gguf):
    ours = gguf.GGUFReader(exported["f16"][0])
    real = gguf.GGUFReader(real_gguf)
    ours_keys = {k for k in ours.fields if not k.startswith("GGUF.")}
    real_keys = {k for k in real.fields if not k.startswith("GGUF.")}
    assert real_keys - ours_keys == ONLY_IN_LLAMA_CPP
    assert ours_keys - real_keys == ONLY_IN_FITUNE
    assert set(exported["f16"][1]["metadata_keys"]) == ours_keys
    differ = {k for k in ours_keys & real_keys
              if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
              and _field(ours, k) != _field(real, k)}
    # the name (the folder's), the file type (f16 = 1; that file is Q4_1 = 3); every other value is the same,
    # eos and pad included (generation_config's <|im_end|>, where the folder's tokenizer_config names <|im_start|>)
    assert differ == {"general.name", "general.file_type"}
    assert _field(ours, "general.file_type") == 1
    assert _field(gguf.GGUFReader(exported["q8_0"][0]), "general.file_type") == 7


# ---- tiny Qwen2 and Mistral ------------------------------------------------------------------------------------


def _tiny(kind: str, folder: str, real_model_dir: str, **overrides) -> str:
    """A random model with the real tokenizer: every weight random (biases and norms too), so a misplaced row,
    a wrong permutation or a dropped bias shows in the logits."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2)
    config = (Qwen2Config if kind == "qwen2" else MistralConfig)(**{**common, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if param.dim() == 1 and param.shape[0] == 64 else 0.0))
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(real_model_dir, name), folder)
    return folder


@pytest.fixture(scope="module")
def tiny_qwen2(real_model_dir, tmp_path_factory):
    return _tiny("qwen2", str(tmp_path_factory.mktemp("qwen2")), real_model_dir, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_mistral(real_model_dir, tmp_path_factory):
    # intermediate_size 72: ffn_down's rows (72 values) are not whole q8_0 blocks, so it stays f16
    return _tiny("mistral", str(tmp_path_factory.mktemp("mistral")), real_model_dir, intermediate_size=72)


def _check_tiny(folder: str, path: str, atol: float, q8_0: bool = False):
    """The GGUF read back against the source model; with `q8_0` the source's matrices are first rounded through
    q8_0 (gguf-py's quantize, then dequantize), so what is left is the export's own error: none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if q8_0:
        q8 = gguf.GGMLQuantizationType.Q8_0
        with torch.no_grad():
            for param in src.parameters():
                if param.dim() == 2 and param.shape[-1] % 32 == 0:
                    rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8), q8)
                    param.copy_(torch.from_numpy(rounded))
    src_tok = AutoTokenizer.from_pretrained(folder)
    model, tok = _load_gguf(path)
    ids = src_tok(PROMPTS[1] + PROMPTS[2]).input_ids
    a, b = _logits(src, ids), _logits(model, ids)
    torch.testing.assert_close(b, a, atol=atol, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    for text in TOKENIZER_STRINGS:
        assert tok(text).input_ids == src_tok(text).input_ids, text
    print(f"{os.path.basename(path)}: max |logits difference| {(a - b).abs().max().item():.4g}")
    return model


@pytest.mark.slow
def test_tiny_qwen2_f16_untied_with_biases_reads_back(tiny_qwen2, tmp_path):
    result = export_gguf(tiny_qwen2, str(tmp_path / "q.gguf"), "f16")
    assert (result["architecture"], result["tensors"]) == ("qwen2", 2 * 12 + 3)  # + q/k/v biases; output.weight
    assert result["tensor_types"] == {"F16": 2 * 7 + 2, "F32": 2 * 5 + 1}
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert {"output.weight", "blk.1.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= names
    model = _check_tiny(tiny_qwen2, str(tmp_path / "q.gguf"), atol=0.02)  # measured 0.0045
    assert type(model).__name__ == "Qwen2ForCausalLM"


@pytest.mark.slow
def test_tiny_mistral_q8_0_reads_back_and_keeps_partial_blocks_f16(tiny_mistral, tmp_path):
    result = export_gguf(tiny_mistral, str(tmp_path / "m.gguf"), "q8_0")
    assert result["architecture"] == "llama"  # as llama.cpp writes Mistral
    # per block: q, k, v, o, gate, up in q8_0 (rows of 64), down (rows of 72) in f16; embeddings and output q8_0
    assert result["tensor_types"] == {"Q8_0": 2 * 6 + 2, "F16": 2, "F32": 2 * 2 + 1}
    assert result["notes"] == [f"blk.{i}.ffn_down.weight stays f16: its rows of 72 values are not a multiple of "
                               "q8_0's 32-value blocks (as llama.cpp does)" for i in (0, 1)]
    # against the source with its q8_0 matrices rounded as q8_0 rounds them: measured 0.0011 (f16's rounding of
    # ffn_down); against the unrounded source it is 0.11, too close to this random model's
    # near-ties for its top token to be the same everywhere
    model = _check_tiny(tiny_mistral, str(tmp_path / "m.gguf"), atol=0.01, q8_0=True)
    assert type(model).__name__ == "LlamaForCausalLM"


# ---- SentencePiece-style tokenizers (Llama 2, Mistral 7B v0.3) ---------------------------------------------------

SPM_TEXT = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there! How are you today?",
            "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
            "Mistral and Llama tokenize text with SentencePiece pieces and byte fallback.",
            "The capital of France is Paris; the capital of Italy is Rome."]
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
                    "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
                    "{% endfor %}")
#: strings the file tokenizes exactly as the source does: ASCII, byte fallback (unicode the vocabulary lacks),
#: control tokens after text or alone
SPM_SAME = ["Hello world", "The capital of France is Paris.", "naïve café 日本語 🦙 ½", "def fib(n):\n\treturn n",
            "xyzzy QQQ  two  spaces", "What is the capital? [/INST]", "Paris</s>", "Hi [INST]", "[INST][/INST]</s>"]
#: strings where llama.cpp's SentencePiece rule differs from transformers': a space before the text's first word
#: even when there is one already, and before text that follows a control token (llama.cpp's llama-vocab.cpp
#: `is_prev_special`; github.com/ggml-org/llama.cpp/issues/8584); transformers 5's LlamaTokenizer adds neither
SPM_LEGACY = [" The quick  brown fox", "   leading spaces", "[INST] What is the capital? [/INST] Paris</s>",
              "<s>x</s>", "[INST]hi[/INST]"]


def _spm_tiny(kind: str, folder: str) -> str:
    """A tiny random Mistral ("mistral": Mistral 7B v0.3's tokenizer.json shape, with [INST] [/INST]) or Llama
    ("llama": Llama 2's) with a SentencePiece-style tokenizer.json built offline: <unk> <s> </s> (and [INST]
    [/INST]) first, then the 256 byte pieces <0x00>..<0xFF>, then BPE pieces learned from SPM_TEXT; byte fallback;
    spaces made \u2581 by a Metaspace pre-tokenizer (v0.3) or a Prepend + Replace normalizer (Llama 2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaTokenizerFast, MistralConfig

    specials = ["<unk>", "<s>", "</s>"] + (["[INST]", "[/INST]"] if kind == "mistral" else [])
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    learner.train_from_iterator(SPM_TEXT, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in learned["merges"]], unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if kind == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              chat_template=MISTRAL_TEMPLATE)
    config = (MistralConfig if kind == "mistral" else LlamaConfig)(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if param.dim() == 1 else 0.0))
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _legacy_ids(folder: str, text: str) -> list[int]:
    """`text` tokenized by SentencePiece's legacy rule, the one llama.cpp applies: the folder's vocabulary and
    merges with Llama 2's normalizer (\u2581 before every text piece, spaces made \u2581); no bos."""
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return tok.encode(text, add_special_tokens=False).ids


def _ids(tokenizer, text: str) -> list[int]:
    # without bos: transformers' GGUF reader does not read tokenizer.ggml.add_bos_token (asserted in the file)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("kind", ["mistral", "llama"])
def test_sentencepiece_style_tokenizer_is_written_as_llama_and_reads_back(kind, tmp_path):
    from transformers import AutoTokenizer

    # a folder named *mistral* would make transformers' GGUF reader build MistralForCausalLM from general.name,
    # whose tensors it then cannot map (modeling_gguf_pytorch_utils: "Unknown gguf model_type: mistral")
    folder = _spm_tiny(kind, str(tmp_path / {"mistral": "v0.3-shape", "llama": "llama2-shape"}[kind]))
    src_tok = AutoTokenizer.from_pretrained(folder)
    n_special = 5 if kind == "mistral" else 3
    n_tokens = len(src_tok)
    path = str(tmp_path / f"{kind}.gguf")
    result = export_gguf(folder, path, "f16")
    assert result["tokenizer"] == {"model": "llama", "pre": "default", "tokens": n_tokens, "chat_template": True}
    assert result["special_ids"] == {"bos": 1, "eos": 2, "unk": 0}
    assert result["notes"] == []

    reader = gguf.GGUFReader(path)
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert "tokenizer.ggml.merges" not in reader.fields  # llama.cpp's SentencePiece tokenizer merges by score
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is True
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True
    assert "tokenizer.ggml.add_eos_token" not in reader.fields
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    assert tokens == [t for t, _ in sorted(src_tok.get_vocab().items(), key=lambda kv: kv[1])]
    T = gguf.TokenType
    assert types == [T.UNKNOWN] + [T.CONTROL] * (n_special - 1) + [T.BYTE] * 256 + \
        [T.NORMAL] * (n_tokens - n_special - 256)
    # a piece scores minus the rank of the merge that makes it; bytes, control tokens and single characters 0
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    made = {a + b: -float(r) for r, (a, b) in enumerate(merges)}
    assert scores == [made.get(t, 0.0) for t in tokens]
    assert sum(score < 0 for score in scores) == len(merges) - 1  # each merge makes its own piece; the first -0.0

    model, tok = _load_gguf(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert src_tok("a").input_ids[0] == 1  # the source adds bos, as the file says llama.cpp should
    for text in SPM_SAME:
        assert _ids(tok, text) == _ids(src_tok, text), text
        assert _legacy_ids(folder, text) == _ids(src_tok, text), text  # both rules agree on these
    for text in SPM_LEGACY:
        assert _ids(tok, text) == _legacy_ids(folder, text), text
        if kind == "mistral" or "[INST]" not in text:  # (Llama 2's vocabulary has no [INST]: plain text there)
            assert _ids(tok, text) != _ids(src_tok, text), text  # transformers 5 reads both shapes non-legacy
    assert tok.chat_template == src_tok.chat_template == MISTRAL_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == src_tok.apply_chat_template(messages, tokenize=False) \
        == "<s>[INST] Hi [/INST]"
    # the file's eos is </s>; transformers' GGUF reader (5.17) names bos's text as eos when it rebuilds a "llama"
    # tokenizer (GGUFLlamaConverter.tokenizer: `eos_token = proto.tokens[proto.bos_token_id]`), so not compared
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2

    src = _source_model(folder)
    ids = src_tok(SPM_TEXT[2] + " [INST] Hello [/INST]").input_ids
    a, b = _logits(src, ids), _logits(model, ids)
    torch.testing.assert_close(b, a, atol=0.02, rtol=0)  # as the tiny Qwen2; measured 0.0024 (v0.3), 0.0036
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    print(f"{kind}: max |logits difference| {(a - b).abs().max().item():.4g}")


def _source_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- the command and its refusals ------------------------------------------------------------------------------


def test_cli_exports_a_folder_and_a_run_folders_merged_weights(tiny_qwen2, tmp_path, capsys):
    out = tmp_path / "a.gguf"
    assert main(["export", tiny_qwen2, "--gguf", "f16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: ")
    assert "qwen2, f16 (27 tensors: 16 f16, 11 f32)" in printed
    # transformers' Qwen2Tokenizer splits with Qwen2's regex whatever the vocabulary: llama.cpp's "qwen2"
    assert "tokenizer: gpt2 / qwen2, 49152 tokens, chat template included" in printed
    assert f"llama-cli -m {out} -cnv" in printed and f"llama-server -m {out}" in printed
    assert os.listdir(tmp_path) == ["a.gguf"]  # no temporary file left beside it

    run = tmp_path / "run"
    shutil.copytree(tiny_qwen2, run / "merged")
    (run / "run.json").write_text(json.dumps({"config": {"model": tiny_qwen2, "method": "lora"}}))
    assert main(["export", str(run), "--gguf", "q8_0", "--out", str(tmp_path / "b.gguf")]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "b.gguf"))
    assert _field(reader, "general.name") == "run" and _field(reader, "general.architecture") == "qwen2"


def test_an_existing_out_is_refused_without_force(tiny_qwen2, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep me")
    assert main(["export", tiny_qwen2, "--gguf", "f16", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"fitune export: error: --out {out} exists; pass --force to replace it, or "
                                       "choose another file name\n")
    assert out.read_bytes() == b"keep me"
    assert main(["export", tiny_qwen2, "--gguf", "f16", "--out", str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_an_architecture_it_cannot_export_is_refused_naming_those_it_can(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the architecture is refused first
    with pytest.raises(ExportError, match=r"architecture GPT2LMHeadModel cannot be exported to GGUF by fitune; it "
                                          r"exports LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        export_gguf(str(tmp_path), str(tmp_path / "x.gguf"), "f16")
    assert main(["export", str(tmp_path), "--gguf", "q8_0", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "GPT2LMHeadModel cannot be exported" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_refusals_name_the_problem(tiny_mistral, tmp_path):
    with pytest.raises(ExportError, match=r"--gguf 'q4_0' is not a type fitune exports; choose one of: f16, q8_0"):
        export_gguf(tiny_mistral, str(tmp_path / "x.gguf"), "q4_0")
    with pytest.raises(ExportError, match=r"has no config.json, so it is not a Hugging Face model folder"):
        export_gguf(str(tmp_path), str(tmp_path / "x.gguf"), "f16")
    with pytest.raises(ExportError, match=r"its folder .*missing does not exist"):
        export_gguf(tiny_mistral, str(tmp_path / "missing" / "x.gguf"), "f16")
    # a tokenizer that splits in a way none of llama.cpp's known pre-tokenizers does: whitespace dropped
    odd = tmp_path / "odd"
    shutil.copytree(tiny_mistral, odd)
    spec = json.loads((odd / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, spec["pre_tokenizer"]]}
    (odd / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ExportError, match=r"pre-tokenizer is not one fitune knows \(check hash [0-9a-f]{64}.*"
                                          r"llama-bpe \(Llama 3\), qwen2 \(Qwen2, Qwen2.5\), smollm"):
        export_gguf(str(odd), str(tmp_path / "x.gguf"), "f16")
    # a tokenizer.json of another kind (here a Unigram model): neither of the two fitune writes
    (odd / "tokenizer.json").write_text(json.dumps({**spec, "model": {"type": "Unigram", "vocab": []}}))
    with pytest.raises(ExportError, match=r"tokenizer.json is a Unigram tokenizer that is neither byte-level BPE nor "
                                          r"SentencePiece-style BPE .*; fitune writes byte-level BPE with the "
                                          r"pre-tokenizers llama-bpe"):
        export_gguf(str(odd), str(tmp_path / "x.gguf"), "f16")
    # a SentencePiece tokenizer.model without tokenizer.json: nothing fitune reads the vocabulary from
    os.remove(odd / "tokenizer.json")
    (odd / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ExportError, match=r"has tokenizer.model \(SentencePiece\) but no tokenizer.json; fitune "
                                          r"writes the tokenizer from tokenizer.json \(byte-level BPE .*and "
                                          r"SentencePiece-style BPE with byte fallback \(Llama 2, Mistral 7B"):
        export_gguf(str(odd), str(tmp_path / "x.gguf"), "f16")
    assert sorted(os.listdir(tmp_path)) == ["odd"]  # nothing written


def test_an_interrupted_export_leaves_no_file(tiny_mistral, tmp_path):
    def stop(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_gguf(tiny_mistral, str(tmp_path / "x.gguf"), "f16", progress=stop)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_cli_merges_a_run_folders_adapter_first(tiny_mistral, tmp_path, capsys):
    """A LoRA run folder (run.json + adapter/) is merged into its base (fitune.infer.merge), then exported; the
    file computes what the base with the adapter computes, and the temporary merged folder is gone."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    base = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapter change the model (and q/k's permutation)
                param.copy_(torch.randn_like(param) * 0.1)
    peft_model.save_pretrained(run / "adapter")
    (run / "run.json").write_text(json.dumps({"config": {"model": tiny_mistral, "method": "lora", "dtype": "fp32"}}))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(run), "--gguf", "f16", "--out", str(out / "run.gguf")]) == 0
    assert f"merging the adapter of {run}" in capsys.readouterr().err
    assert os.listdir(out) == ["run.gguf"]

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32),
                                          str(run / "adapter")).eval()
    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="run.gguf", dtype=torch.float32).eval()
    ids = list(range(100, 140))
    a, b = _logits(reference, ids), _logits(model, ids)
    torch.testing.assert_close(b, a, atol=0.02, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval(), ids)
    assert (base_logits - a).abs().max() > 0.1  # the adapter does change the model
