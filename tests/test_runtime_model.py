"""fitune.runtime's one model builder, its layer finder and `prepare_model` on tiny models (CPU)."""

import json

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
