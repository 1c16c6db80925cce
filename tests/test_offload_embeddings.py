"""`offload_embeddings` (fitune/runtime/techniques/offload_embeddings.py): the frozen input embedding table in CPU
memory. On the CPU the "GPU" is the CPU too, so these tests check what can be checked here: the same loss and LoRA
gradients as without it, the hooks that move tensors (with a stand-in device), the refusals, and the estimator's
term (the table's bytes leave the weights). Not yet measured on a GPU: the planner never proposes it."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.errors import ConfigError  # noqa: E402
from fitune.memory import estimate  # noqa: E402
from fitune.runtime.model import prepare_model  # noqa: E402
from fitune.runtime.step import forward_loss  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=96)


def _setup(**kw):
    return TrainSetup(**{**dict(method="lora", lora_rank=4, lora_targets=("q_proj", "v_proj"), stack="fitune",
                                loss="chunked", dtype="fp32"), **kw})


def _model(setup, tie=False):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, tie_word_embeddings=tie))
    m = prepare_model(m, setup)
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return m.train()


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_the_same_loss_and_gradients(ckpt):
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    runs = []
    for offload in (False, True):
        model = _model(_setup(grad_checkpointing=ckpt, offload_embeddings=offload))
        loss = forward_loss(model, ids, loss="chunked")
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
    assert runs[1][1].keys() == runs[0][1].keys()
    for n, g in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][n], g, rtol=0, atol=0, msg=n)


def test_ids_go_to_the_table_and_embeddings_come_back_to_the_compute_device():
    """With the lm_head on another device (`meta` stands in for the GPU), the hooks send the ids to the CPU table
    and the looked-up rows to the lm_head's device; `compute_device` names that device, not the table's."""
    from fitune.runtime.techniques import offload_embeddings as oe

    model = _model(_setup())
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head.to("meta")
    oe.enable_offloaded_embeddings(model)
    assert emb.weight.device.type == "cpu" and oe.compute_device(model).type == "meta"
    out = emb(torch.tensor([[1, 2, 3]]))
    assert out.device.type == "meta" and out.shape == (1, 3, CFG["hidden_size"])


def test_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="ties its lm_head"):
        _model(_setup(offload_embeddings=True), tie=True)
    with pytest.raises(ConfigError, match="frozen embedding table"):
        _setup(method="full", offload_embeddings=True).validate()
    with pytest.raises(ConfigError, match="fitune's runner"):
        _setup(stack="hf", loss="hf", offload_embeddings=True).validate()


def test_the_estimate_leaves_the_table_out():
    """Llama-3.1-8B QLoRA: vocabulary x hidden x 2 bytes (1.0 GB) fewer weights; a tied model keeps them."""
    spec = load_model_spec("llama-3.1-8b")
    base = dict(method="qlora", lora_rank=32, lora_targets=("all-linear",), seq_len_tokens=4096, batch_size=1,
                stack="fitune", loss="chunked", lean_lora=True, grad_checkpointing="full")
    on = estimate(spec, TrainSetup(**base, offload_embeddings=True))
    off = estimate(spec, TrainSetup(**base))
    table = spec.vocab_size * spec.hidden_size * 2
    assert off.breakdown["weights"] - on.breakdown["weights"] == table == 128256 * 4096 * 2
    assert off.peak_allocated_bytes - on.peak_allocated_bytes == table
    tied = load_model_spec("llama-3.2-1b")
    a = estimate(tied, TrainSetup(**base, offload_embeddings=True))
    b = estimate(tied, TrainSetup(**base))
    assert a.peak_allocated_bytes == b.peak_allocated_bytes and any("ties its lm_head" in n for n in a.notes)
