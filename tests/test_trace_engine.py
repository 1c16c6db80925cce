"""Tests of the trace engine (`fitune.trace`): fake-tensor tracing of the HF recipe, CPU only, no network.

The reference for every tiny model is the recipe run for real (real small tensors on the CPU), measured
independently of the engine: parameter / gradient / optimizer-state storages read off the objects,
saved activations with `fitune.runtime.step.count_saved_tensors` (the GPU bench's counter), and live bytes after
the forward with a small dispatch-mode tracker written here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.errors import ConfigError, FituneError, UnknownModelError  # noqa: E402
from fitune.runtime import model as recipe  # noqa: E402  (the HF recipe: build, LoRA, checkpointing)
from fitune.runtime.step import count_saved_tensors  # noqa: E402
from fitune.setup import TrainSetup, parse_targets  # noqa: E402
from fitune.trace import TraceModelError, TraceUnsupportedError, trace_training_step  # noqa: E402
from fitune.trace.configs import PHI3_MINI_4K_INSTRUCT  # noqa: E402
from fitune.trace.engine import _trace  # noqa: E402

SEED_MODELS = os.path.join(ROOT, "fitune", "specs", "data", "models_seed.json")

# Tiny configs of each family: the real architecture classes, with small widths.
TINY = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False,
    ),
    "mistral": dict(
        model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=1000, sliding_window=None,
    ),
    "qwen2": dict(  # Qwen2 has q/k/v biases; tied embeddings like the small Qwen2.5 models
        model_type="qwen2", hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, tie_word_embeddings=True,
    ),
    "gemma2": dict(
        model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, query_pre_attn_scalar=32, sliding_window=16,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    ),
    "phi3": dict(  # fused qkv_proj and gate_up_proj, as Phi-3-mini
        model_type="phi3", hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1000, pad_token_id=0, tie_word_embeddings=False,
    ),
}
QV = ["q_proj", "v_proj"]
TARGETS = {"phi3": ["qkv_proj", "o_proj"]}


# ------------------------------------------------------------------------------------- the real reference


def _unique_nbytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Storages created by ops inside the mode, followed weakly: which are still alive, and their bytes."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ref = self.refs.get(st.data_ptr())
                if ref is None or ref() is None:  # addresses are reused once a storage is freed
                    self.refs[st.data_ptr()] = weakref.ref(st)
        return out

    def live_bytes(self, exclude_ptrs=()) -> int:
        total = 0
        for ptr, ref in list(self.refs.items()):
            st = ref()
            if st is None or st.data_ptr() != ptr:
                self.refs.pop(ptr)
                continue
            if ptr not in exclude_ptrs:
                total += st.nbytes()
        return total


def real_recipe(cfg, *, method="lora", rank=8, targets=QV, batch=2, seq=32, ckpt=False, attn="sdpa",
                dtype="bf16", steps=2):
    """The HF recipe for real on the CPU; returns what the engine should report."""
    torch.manual_seed(0)
    model = recipe.build_random_model(cfg, attn=attn, device="cpu", dtype_name=dtype)
    if method == "lora":
        model = recipe.wrap_lora(model, rank, targets)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    if ckpt:
        recipe.enable_checkpointing(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for step in range(steps):
        last = step == steps - 1
        if last:
            ctx, seen = count_saved_tensors()
            live = _LiveStorages()
            with live, ctx:
                loss = model(input_ids=ids, labels=ids).loss
            out["saved_hooks"] = sum(n for p, n in seen.items() if p not in param_ptrs)
            out["live_after_forward"] = live.live_bytes(exclude_ptrs=param_ptrs)
            out["saved_storages"] = dict(seen)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if last:
            out["grads"] = _unique_nbytes(p.grad for p in trainable)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    out["weights"] = _unique_nbytes(frozen + list(model.buffers()))
    out["adapter"] = _unique_nbytes(trainable)
    out["optimizer"] = _unique_nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    out["model"] = model
    return out


def _setup(family, **over) -> TrainSetup:
    """The tests' setup: LoRA r8 on q_proj,v_proj (phi3: qkv_proj,o_proj), 2 x 32 tokens, bf16, sdpa, AdamW."""
    kw = dict(method="lora", lora_rank=8, lora_targets=TARGETS.get(family, QV), batch_size=2, seq_len_tokens=32,
              grad_checkpointing="none", attn="sdpa", dtype="bf16", optimizer="adamw")
    kw.update(over)
    kw["lora_targets"] = parse_targets(kw["lora_targets"])
    return TrainSetup(**kw)


def _real_for(family, s: TrainSetup, steps=2):
    targets = "all-linear" if s.all_linear else list(s.lora_targets)
    return real_recipe(
        TINY[family], method=s.method, rank=s.lora_rank, targets=targets, batch=s.batch_size, seq=s.seq_len_tokens,
        ckpt=s.grad_checkpointing == "full", attn=s.attn, dtype=s.dtype, steps=steps,
    )


# ------------------------------------------------------------------------------------------------- tests


CASES = [
    ("llama", {}),
    ("llama", {"attn": "eager", "lora_targets": "all-linear", "lora_rank": 4}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {"lora_targets": "all-linear"}),
    ("gemma2", {"attn": "eager"}),
    ("gemma2", {}),
    ("phi3", {}),
    ("llama", {"method": "full"}),
    ("qwen2", {"dtype": "fp32"}),
]


CASE_IDS = [f"{f}-{'-'.join(map(str, o.values())) or 'default'}" for f, o in CASES]


@pytest.mark.parametrize("family,over", CASES, ids=CASE_IDS)
def test_fake_trace_matches_real_recipe(family, over):
    setup = _setup(family, **over)
    fake = trace_training_step(TINY[family], setup)
    real = _real_for(family, setup)
    assert fake.setup is setup
    assert fake.weights_bytes == real["weights"]
    assert fake.adapter_weights_bytes == real["adapter"]
    assert fake.gradients_bytes == real["grads"]
    assert fake.optimizer_states_bytes == real["optimizer"]
    assert real["saved_hooks"] > 0
    assert fake.saved_activations_bytes == pytest.approx(real["saved_hooks"], rel=0.01)
    # what is alive after the forward = saved activations + the loss scalar (fp32)
    assert fake.after_forward_bytes - fake.step_start_bytes == pytest.approx(real["live_after_forward"], rel=0.01)
    assert fake.forward_peak_bytes > fake.after_forward_bytes > fake.step_start_bytes
    assert fake.peak_bytes == max(fake.forward_peak_bytes, fake.backward_peak_bytes, fake.optimizer_peak_bytes)
    assert sum(fake.by_category.values()) == fake.peak_bytes


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_checkpointed_trace_matches_real_live_bytes(family):
    setup = _setup(family, grad_checkpointing="full")
    fake = trace_training_step(TINY[family], setup)
    real = _real_for(family, setup)
    assert fake.saved_activations_bytes == fake.after_forward_bytes - fake.step_start_bytes
    assert fake.saved_activations_bytes == pytest.approx(real["live_after_forward"], rel=0.01)
    # an outer hook only sees what is saved outside the checkpointed layers
    assert fake.saved_hooks_bytes == pytest.approx(real["saved_hooks"], rel=0.01)
    assert fake.saved_hooks_bytes < fake.saved_activations_bytes
    assert fake.gradients_bytes == real["grads"]
    assert fake.optimizer_states_bytes == real["optimizer"]
    no_ckpt = trace_training_step(TINY[family], _setup(family))
    assert fake.saved_activations_bytes < no_ckpt.saved_activations_bytes
    assert fake.peak_bytes < no_ckpt.peak_bytes


IDENTICAL_CASES = {
    "none": {},
    "full": {"grad_checkpointing": "full"},
    "selective-1": {"grad_checkpointing": "selective:1"},
    "freeze-1": {"method": "freeze", "freeze_trainable_layers": 1},
    "full-ft-accum-3": {"method": "full", "grad_accum": 3},
    "sgd": {"method": "full", "optimizer": "sgd"},
    "adafactor": {"method": "full", "optimizer": "adafactor"},
    "lora-dropout": {"lora_dropout": 0.1, "attn": "eager"},
    "fp16-alpha": {"dtype": "fp16", "lora_alpha": 64},
    "keep-outputs-accum-2": {"keep_outputs": True, "grad_accum": 2},
}


@pytest.mark.parametrize("case", list(IDENTICAL_CASES))
def test_fake_and_real_tensors_give_identical_traces(case):
    """The same engine on real tensors: every number, peaks included, must be the same byte for byte."""
    setup = _setup("llama", **IDENTICAL_CASES[case])
    fake = _trace(TINY["llama"], setup, fake=True)
    real = _trace(TINY["llama"], setup, fake=False)
    for name in ("weights_bytes", "adapter_weights_bytes", "gradients_bytes", "optimizer_states_bytes",
                 "saved_activations_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                 "peak_bytes", "step_start_bytes", "after_forward_bytes", "saved_hooks_bytes"):
        assert getattr(fake, name) == getattr(real, name), name
    assert fake.by_category == real.by_category
    assert fake.phase_peaks_by_category == real.phase_peaks_by_category


def test_steady_state_is_reached_on_the_second_step():
    setup = _setup("llama", grad_checkpointing="full")
    two = trace_training_step(TINY["llama"], setup)
    three = trace_training_step(TINY["llama"], setup, steps=3)
    assert (two.step_start_bytes, two.peak_bytes) == (three.step_start_bytes, three.peak_bytes)
    one = trace_training_step(TINY["llama"], setup, steps=1)
    assert one.step_start_bytes == two.step_start_bytes - two.optimizer_states_bytes


def test_lora_adapter_arithmetic():
    """PEFT keeps LoRA weights (and so their gradients and AdamW state) in fp32 on a bf16 model."""
    cfg = TINY["llama"]
    res = trace_training_step(cfg, _setup("llama"))
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv_dim = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    lora_params = layers * 8 * ((h + h) + (h + kv_dim))  # q: A r x h, B h x r; v: A r x h, B kv_dim x r
    assert res.trainable_params == lora_params
    assert res.adapter_weights_bytes == 4 * lora_params == res.gradients_bytes
    assert res.optimizer_states_bytes == 2 * 4 * lora_params + 4 * 2 * layers * 2  # exp_avg, exp_avg_sq, step


def test_peft_saves_an_fp32_copy_of_each_adapted_layer_input(monkeypatch):
    """On a bf16 model PEFT casts each LoRA layer's input to fp32 (the adapter's dtype) and autograd saves that copy
    for lora_A's weight gradient: one fp32 copy per adapted layer, even when q_proj and v_proj share the input."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    casts = []
    orig = BaseTunerLayer._cast_input_dtype

    def recording(self, x, dtype):
        y = orig(self, x, dtype)
        if y is not None and y is not x:
            casts.append((y.untyped_storage().data_ptr(), y.untyped_storage().nbytes(), y.dtype))
        return y

    monkeypatch.setattr(BaseTunerLayer, "_cast_input_dtype", recording)
    cfg, batch, seq = TINY["llama"], 2, 32
    real = real_recipe(cfg, batch=batch, seq=seq, steps=1)
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert len(casts) == 2 * layers  # q_proj and v_proj each make their own copy of the same hidden states
    assert {d for _, _, d in casts} == {torch.float32}
    assert all(real["saved_storages"].get(ptr) == n == batch * seq * h * 4 for ptr, n, _ in casts)


def test_8b_fake_trace_is_exact():
    """The trace of a full-size 8B step on fake tensors (how long it takes is not asserted here: a timed assertion
    fails on a loaded machine, 139 s in one CI run against about 40 s usually)."""
    with open(SEED_MODELS) as f:
        cfg = json.load(f)["llama-3.1-8b"]["config"]
    res = trace_training_step(cfg, TrainSetup(batch_size=2, seq_len_tokens=2048))
    base_params = 8_030_261_248
    rotary_buffers = 2 * 64 * 4  # inv_freq and original_inv_freq, fp32, head_dim / 2 each
    assert res.frozen_params == base_params
    assert res.weights_bytes == 2 * base_params + rotary_buffers
    lora_params = 32 * 8 * ((4096 + 4096) + (4096 + 1024))  # q_proj and v_proj, rank 8
    assert res.trainable_params == lora_params
    assert res.adapter_weights_bytes == 4 * lora_params
    # activations: 20-30 GB for batch 2 x 2048 without checkpointing (the H200 bench measured 24.7 GB)
    assert 20e9 < res.saved_activations_bytes < 30e9
    assert res.peak_phase == "backward"
    assert res.peak_bytes > res.weights_bytes + res.saved_activations_bytes


def test_phi3_mini_full_size_parameter_count():
    res = trace_training_step(PHI3_MINI_4K_INSTRUCT, TrainSetup(lora_targets=("qkv_proj",), batch_size=1,
                                                                seq_len_tokens=128, grad_checkpointing="full"))
    assert res.frozen_params == 3_821_079_552
    assert res.trainable_params == 32 * 8 * (3072 + 3 * 3072)


REFUSED = [
    ({"method": "qlora"}, "--method qlora"),
    ({"attn": "flash"}, "--attn flash"),
    ({"grad_checkpointing": "offload"}, "--grad-checkpointing offload"),
    ({"optimizer": "adamw8bit"}, "--optimizer adamw8bit"),
    ({"optimizer": "paged_adamw8bit"}, "--optimizer paged_adamw8bit"),
    ({"stack": "fitune"}, "--stack fitune"),
    ({"stack": "fitune", "loss": "chunked"}, "--loss chunked"),
    ({"stack": "fitune", "tiled_mlp": True}, "--tiled-mlp"),
    ({"stack": "fitune", "lean_lora": True}, "--lean-lora"),
    ({"stack": "fitune", "lean_norm": True}, "--lean-norm"),
    ({"stack": "fitune", "kernels": "liger"}, "--kernels liger"),
    ({"stack": "fitune", "expandable_segments": True}, "--expandable-segments"),
]


@pytest.mark.parametrize("change,flag", REFUSED, ids=[f for _, f in REFUSED])
def test_settings_it_cannot_model_are_refused_by_name(change, flag):
    with pytest.raises(TraceUnsupportedError, match="cannot model") as info:
        trace_training_step(TINY["llama"], TrainSetup(**change))
    assert flag in str(info.value)
    assert "analytic" in str(info.value)
    assert isinstance(info.value, FituneError)  # the CLI prints it and exits 2


def test_every_refused_setting_is_listed_at_once():
    with pytest.raises(TraceUnsupportedError) as info:
        trace_training_step(TINY["llama"], TrainSetup(method="qlora", attn="flash", grad_checkpointing="offload"))
    msg = str(info.value)
    assert "3 settings" in msg and "--method qlora" in msg and "--attn flash" in msg and "offload" in msg


def test_a_trainsetup_field_newer_than_the_engine_is_refused_unless_at_its_default():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class NewerSetup(TrainSetup):
        future_knob: int = 0

    with pytest.raises(TraceUnsupportedError, match="--future-knob 3"):
        trace_training_step(TINY["llama"], NewerSetup(future_knob=3, seq_len_tokens=16))
    res = trace_training_step(TINY["llama"], NewerSetup(seq_len_tokens=16))
    assert any("--future-knob" in n and "default" in n for n in res.notes)


def test_selective_checkpointing_checkpoints_the_first_k_layers():
    cfg = TINY["llama"]  # 2 layers
    by_mode = {m: trace_training_step(cfg, _setup("llama", grad_checkpointing=m))
               for m in ("none", "selective:0", "selective:1", "selective:2", "full")}
    saved = {m: r.saved_activations_bytes for m, r in by_mode.items()}
    assert saved["selective:2"] == saved["full"]  # every layer checkpointed
    assert saved["full"] < saved["selective:1"] < saved["selective:0"]
    # each checkpointed layer drops about one layer's saved activations (the first and last layers share a little
    # differently with the embedding and the final norm, hence not exactly)
    assert saved["selective:0"] - saved["selective:1"] == pytest.approx(saved["selective:1"] - saved["full"], rel=0.1)
    with pytest.raises(ConfigError, match="selective:3.*2 layers"):
        trace_training_step(cfg, _setup("llama", grad_checkpointing="selective:3"))


def test_freeze_trains_the_last_layers():
    cfg = TINY["llama"]
    res = trace_training_step(cfg, _setup("llama", method="freeze", freeze_trainable_layers=1))
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    layer_params = h * (h + 2 * kv + h) + 3 * h * i + 2 * h  # q k v o, gate up down, two RMSNorms
    assert res.trainable_params == layer_params
    assert res.adapter_weights_bytes == res.gradients_bytes == 2 * layer_params  # bf16, as the model
    assert res.optimizer_states_bytes == 2 * 2 * layer_params + 4 * 9  # exp_avg, exp_avg_sq (bf16); 9 fp32 steps


def test_gradient_accumulation_keeps_the_gradients_alive_through_the_next_forward():
    one = trace_training_step(TINY["llama"], _setup("llama", method="full"))
    four = trace_training_step(TINY["llama"], _setup("llama", method="full", grad_accum=4))
    assert four.micro_batches_traced == 2
    assert four.saved_activations_bytes == one.saved_activations_bytes
    assert four.gradients_bytes == one.gradients_bytes
    # the second micro-batch's forward runs with every gradient allocated
    assert four.forward_peak_bytes == pytest.approx(one.forward_peak_bytes + one.gradients_bytes, abs=64)


def test_optimizers_other_than_adamw():
    adamw = trace_training_step(TINY["llama"], _setup("llama", method="full"))
    sgd = trace_training_step(TINY["llama"], _setup("llama", method="full", optimizer="sgd"))
    ada = trace_training_step(TINY["llama"], _setup("llama", method="full", optimizer="adafactor"))
    assert sgd.optimizer_states_bytes == 0  # momentum 0
    assert 0 < ada.optimizer_states_bytes < adamw.optimizer_states_bytes / 10  # factored second moment
    assert sgd.peak_bytes < adamw.peak_bytes


def test_lora_dropout_saves_its_mask_and_output():
    plain = trace_training_step(TINY["llama"], _setup("llama"))
    dropped = trace_training_step(TINY["llama"], _setup("llama", lora_dropout=0.1))
    assert dropped.saved_activations_bytes > plain.saved_activations_bytes
    assert dropped.adapter_weights_bytes == plain.adapter_weights_bytes


def test_keep_outputs_holds_the_logits_through_the_backward():
    cfg = TINY["llama"]
    plain = trace_training_step(cfg, _setup("llama"))
    kept = trace_training_step(cfg, _setup("llama", keep_outputs=True))
    logits_bytes = 2 * 32 * cfg["vocab_size"] * 2  # bf16 logits of 2 x 32 tokens
    assert kept.backward_peak_bytes >= plain.backward_peak_bytes + logits_bytes
    assert kept.saved_activations_bytes == plain.saved_activations_bytes
    assert kept.optimizer_peak_bytes == plain.optimizer_peak_bytes  # gone before the optimizer step


def test_any_architecture_transformers_builds():
    neox = dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=1000, max_position_embeddings=256)
    res = trace_training_step(neox, TrainSetup(lora_targets=("query_key_value",), seq_len_tokens=32))
    assert res.model_type == "gpt_neox"
    assert res.trainable_params == 2 * 8 * (64 + 3 * 64)  # query_key_value: A r x h, B 3h x r
    assert res.peak_bytes > res.weights_bytes > 0
    frozen = trace_training_step(neox, TrainSetup(method="freeze", freeze_trainable_layers=1, seq_len_tokens=32,
                                                  grad_checkpointing="selective:1"))
    assert 0 < frozen.trainable_params < frozen.total_params


def test_lora_targets_the_model_lacks_name_what_it_has():
    neox = dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=1000)
    with pytest.raises(ConfigError, match="lora.targets: q_proj,k_proj.*query_key_value, dense"):
        trace_training_step(neox, TrainSetup(lora_targets=("q_proj", "k_proj"), seq_len_tokens=16))


def test_fituness_default_targets_the_model_lacks_become_pefts_default():
    neox = dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=1000)
    setup = TrainSetup(seq_len_tokens=16)
    res = trace_training_step(neox, setup)
    assert res.setup == setup.replace(lora_targets=("query_key_value",))
    assert "--lora-targets not given: PEFT's default for gpt_neox, query_key_value" in res.notes
    given = trace_training_step(neox, TrainSetup(lora_targets=("query_key_value",), seq_len_tokens=16))
    assert res.peak_bytes == given.peak_bytes and res.trainable_params == given.trainable_params


def test_import_does_not_import_torch():
    code = "import sys, fitune.trace; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_clear_errors_for_bad_arguments():
    with pytest.raises(ConfigError, match="--dtype 'int8'"):
        trace_training_step(TINY["llama"], TrainSetup(dtype="int8"))
    with pytest.raises(ConfigError, match="selective"):
        trace_training_step(TINY["llama"], TrainSetup(grad_checkpointing="selective"))
    with pytest.raises(ConfigError, match="--method 'dora'"):
        trace_training_step(TINY["llama"], TrainSetup(method="dora"))
    with pytest.raises(UnknownModelError, match="model_type"):
        trace_training_step({"hidden_size": 64}, TrainSetup())
    with pytest.raises(TraceModelError, match="does not know model_type 'no_such_model'"):
        trace_training_step({"model_type": "no_such_model"}, TrainSetup())
    with pytest.raises(TraceModelError, match="cannot build a causal LM.*t5"):
        trace_training_step({"model_type": "t5"}, TrainSetup())
    with pytest.raises(TraceModelError, match="hidden size"):
        trace_training_step({**TINY["llama"], "hidden_size": 65}, TrainSetup())
