"""fitune.runtime's one model builder, its layer finder and `prepare_model` on tiny models (CPU)."""

import json
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.errors import ConfigError  # noqa: E402
from fitune.runtime.device import DTYPES, torch_dtype  # noqa: E402
from fitune.runtime.layers import find_decoder_layers  # noqa: E402
from fitune.runtime.model import build_model, build_model_for_setup, load_tokenizer, prepare_model  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402

from tiny import make_model_folder  # noqa: E402

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
          "max_position_embeddings": 512, "torch_dtype": "bfloat16"}


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_dtype_map():
    assert {k: torch_dtype(k) for k in DTYPES} == {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                   "fp32": torch.float32}


def test_random_init_from_a_dict_a_spec_and_a_config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    a = build_model(CONFIG, dtype_name="fp32", init="random")
    b = build_model(load_model_spec(str(path)), dtype_name="bf16", attn="flash", init="auto")
    c = build_model(str(path), dtype_name="fp32", attn="eager")
    assert _count(a) == _count(b) == _count(c)
    assert a.training and b.training
    assert next(a.parameters()).dtype == torch.float32 and next(b.parameters()).dtype == torch.bfloat16
    assert b.config._attn_implementation == "sdpa"  # fitune's "flash" runs as sdpa
    assert c.config._attn_implementation == "eager"


def test_a_folder_with_weights_loads_them(tmp_path):
    folder = make_model_folder(str(tmp_path / "model"), seed=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = build_model(folder, dtype_name="fp32")  # init auto: the folder has safetensors
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), n
    assert model.training
    tok = load_tokenizer(folder)
    assert tok.pad_token_id is not None


def test_qlora_needs_cuda_and_bad_init_is_refused():
    with pytest.raises(ConfigError, match="qlora needs a CUDA GPU"):
        build_model_for_setup(CONFIG, TrainSetup(method="qlora"), "cpu")
    with pytest.raises(ConfigError, match="init: 'zeros' is not one of: auto, pretrained, random"):
        build_model(CONFIG, init="zeros")


def test_find_decoder_layers_plain_and_peft_wrapped():
    model = build_model(CONFIG, dtype_name="fp32")
    layers = find_decoder_layers(model)
    assert layers == list(model.model.layers)
    wrapped = prepare_model(model, TrainSetup(method="lora", dtype="fp32"))
    assert find_decoder_layers(wrapped) == layers

    class NoHF(torch.nn.Module):  # no transformers layer class: the longest ModuleList of one class
        def __init__(self):
            super().__init__()
            self.head = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    plain = NoHF()
    assert find_decoder_layers(plain) == list(plain.blocks)


def test_prepare_model_for_the_hf_recipe_is_peft_and_checkpointing_only():
    model = build_model(CONFIG, dtype_name="fp32")
    setup = TrainSetup(method="lora", lora_rank=4, lora_targets=("q_proj", "v_proj"), grad_checkpointing="full",
                       stack="hf")
    model = prepare_model(model, setup)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(layer.gradient_checkpointing for layer in find_decoder_layers(model))
    assert all(type(m).__name__ == "LlamaRMSNorm" for m in model.modules() if "RMSNorm" in type(m).__name__)


def test_prepare_model_freeze_trains_the_last_layers():
    model = prepare_model(build_model(CONFIG, dtype_name="fp32"), TrainSetup(method="freeze", freeze_trainable_layers=1))
    layers = find_decoder_layers(model)
    assert all(p.requires_grad for p in layers[-1].parameters())
    assert not any(p.requires_grad for layer in layers[:-1] for p in layer.parameters())
    assert not model.get_input_embeddings().weight.requires_grad


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_meta_built_model_is_made_one_layer_at_a_time_like_a_plain_random_init(model_type, tied):
    """QLoRA's random init (`materialize_randomly`): built on meta, each decoder layer made real (and quantised on
    a GPU) before the next exists; the result is the model a plain random init gives, up to the draws."""
    from fitune.runtime.model import materialize_randomly

    cfg = dict(CONFIG, model_type=model_type, tie_word_embeddings=tied, initializer_range=0.02)
    hf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                         if k not in ("architectures", "torch_dtype", "model_type")})
    plain = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    layers = find_decoder_layers(model)
    seen = []

    replaced = []

    def each_layer(layer):
        i = layers.index(layer)
        replaced.append(weakref.ref(layer.mlp.down_proj.weight))  # as quantising does: the weight is replaced
        layer.mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(1))
        real = [not p.is_meta for lay in layers for p in lay.parameters()]
        assert all(not p.is_meta for lay in layers[:i + 1] for p in lay.parameters())
        assert all(p.is_meta for lay in layers[i + 1:] for p in lay.parameters())  # the next is not made yet
        seen.append((i, sum(real)))

    materialize_randomly(model, "cpu", each_layer=each_layer)
    assert [i for i, _ in seen] == list(range(CONFIG["num_hidden_layers"]))
    assert all(r() is None for r in replaced)  # nothing kept the replaced full-precision weights alive
    for layer in layers:
        layer.mlp.down_proj.weight = torch.nn.Parameter(torch.randn(CONFIG["hidden_size"], CONFIG["intermediate_size"])
                                                        * 0.02)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert a.shape == b.shape, name
        if "norm" in name:
            assert torch.equal(b, torch.ones_like(b)), name  # norms at one, as transformers initialises them
        elif name.endswith("bias"):
            assert torch.equal(b, torch.zeros_like(b)), name
        else:
            assert abs(b.std().item() - 0.02) < 0.01, name  # linears and embeddings: normal(0, 0.02)
    for (name, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.allclose(a, b), name  # the rotary tables are computed, not left empty
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 0.5
