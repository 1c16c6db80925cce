"""fitune.runtime's one training step and optimizer factory on a tiny random Llama (CPU)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.errors import FituneError  # noqa: E402
from fitune.runtime.model import wrap_lora  # noqa: E402
from fitune.runtime.oom import is_oom  # noqa: E402
from fitune.runtime.optim import build_optimizer  # noqa: E402
from fitune.runtime.step import StepStats, forward_loss, train_step  # noqa: E402

from tiny import init_lora_b  # noqa: E402

VOCAB = 200


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB)
    model = wrap_lora(transformers.LlamaForCausalLM(cfg), 8, ["q_proj", "v_proj"])
    init_lora_b(model, 0.02)
    model.train()
    return model


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


class _KeepGrads(torch.optim.SGD):
    """An SGD with lr 0 that remembers the gradients it was stepped with (train_step zeroes them after)."""

    def __init__(self, model):
        super().__init__(_trainable(model), lr=0.0)
        self.model, self.seen = model, None

    def step(self, closure=None):
        self.seen = _grads(self.model)
        return super().step(closure)


def _batch(ids, trained_from=1):
    labels = ids.clone()
    labels[:, :trained_from] = -100  # like a prompt: not trained
    return SimpleNamespace(input_ids=ids, labels=labels, attention_mask=None, position_ids=None,
                           trained_tokens=int((labels[:, 1:] != -100).sum()))


def test_gradient_does_not_depend_on_the_micro_batch_split():
    """num_items = the step's trained tokens: one micro-batch of 4 rows == two of 2 rows (loss and gradients)."""
    ids = torch.randint(0, VOCAB, (4, 16))
    whole = _batch(ids, trained_from=5)
    halves = [_batch(ids[:2], trained_from=5), _batch(ids[2:], trained_from=5)]
    num_items = whole.trained_tokens
    assert num_items == sum(h.trained_tokens for h in halves)
    results = []
    for micro in ([whole], halves):
        model = _model()
        opt = _KeepGrads(model)
        stats = train_step(model, opt, micro, num_items=num_items)
        assert stats.micro_batches == len(micro) and stats.loss_scale is None and not stats.overflowed
        results.append((stats.loss, opt.seen))
    (loss1, g1), (loss2, g2) = results
    assert loss1 == pytest.approx(loss2, rel=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6)


def test_step_zeroes_gradients_and_moves_the_weights():
    model = _model()
    before = [p.detach().clone() for p in _trainable(model)]
    opt = build_optimizer("adamw", _trainable(model), lr=1e-2)
    stats = train_step(model, opt, [torch.randint(0, VOCAB, (2, 16))])
    assert isinstance(stats, StepStats) and stats.loss > 0
    assert all(p.grad is None for p in _trainable(model))  # zero_grad(set_to_none=True)
    assert any(not torch.equal(a, p) for a, p in zip(before, _trainable(model)))


def test_without_num_items_the_step_loss_is_the_mean_over_micro_batches():
    ids = torch.randint(0, VOCAB, (4, 16))
    model = _model()
    with torch.no_grad():
        expected = (forward_loss(model, ids[:2]) + forward_loss(model, ids[2:])) / 2
    opt = torch.optim.SGD(_trainable(model), lr=0.0)
    stats = train_step(model, opt, list(ids.split(2)))
    assert stats.loss == pytest.approx(float(expected), rel=1e-5)


def test_recipe_chunked_and_hf_losses_agree():
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        hf = forward_loss(model, ids)
        recipe = forward_loss(model, ids, recipe=True)
        chunked = forward_loss(model, ids, loss="chunked")
        summed = forward_loss(model, ids, num_items=1)
    torch.testing.assert_close(recipe, hf)
    torch.testing.assert_close(chunked, hf, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(summed / (2 * 23), hf, rtol=1e-5, atol=1e-6)


def test_recipe_calls_the_model_as_users_write_it():
    calls = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, **kwargs):
            calls.append(sorted(kwargs))
            return SimpleNamespace(loss=self.w * 2)

    model, ids = Recorder(), torch.zeros(1, 4, dtype=torch.long)
    forward_loss(model, ids, recipe=True)
    forward_loss(model, ids, num_items=3)
    assert calls == [["input_ids", "labels"], ["input_ids", "labels", "num_items_in_batch", "use_cache"]]


def test_phase_hook_sees_each_phase_in_order():
    import contextlib

    seen = []

    @contextlib.contextmanager
    def phase(name):
        seen.append(name + ":in")
        yield
        seen.append(name + ":out")

    model = _model()
    opt = torch.optim.SGD(_trainable(model), lr=0.0)
    train_step(model, opt, list(torch.randint(0, VOCAB, (2, 8)).split(1)), phase=phase,
               before_micro_batch=lambda i: seen.append(f"micro {i}"))
    assert seen == ["micro 0", "forward:in", "forward:out", "backward:in", "backward:out",
                    "micro 1", "forward:in", "forward:out", "backward:in", "backward:out",
                    "optimizer:in", "optimizer:out"]


def test_max_grad_norm_clips_before_the_optimizer():
    model = _model()
    opt = _KeepGrads(model)
    train_step(model, opt, [torch.randint(0, VOCAB, (2, 16))], max_grad_norm=1e-3)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in opt.seen.values()]))
    assert float(norm) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("name,cls,decay", [("adamw", "AdamW", 0.01), ("sgd", "SGD", 0.0),
                                            ("adafactor", "Adafactor", 0.0)])
def test_optimizer_factory(name, cls, decay):
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(name, p, lr=1e-3)
    assert type(opt).__name__ == cls
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == decay  # library default
    assert build_optimizer(name, p, lr=1e-3, weight_decay=0.5).param_groups[0]["weight_decay"] == 0.5


def test_optimizer_factory_foreach_and_errors():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert build_optimizer("adamw", p, lr=1e-3, foreach=True).defaults["foreach"] is True
    with pytest.raises(FituneError, match="'adam' is not one of: adamw, adamw8bit"):
        build_optimizer("adam", p, lr=1e-3)


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def test_keep_outputs_holds_the_model_output_through_the_optimizer_step():
    """`out = model(**batch); out.loss.backward()`: the output (its logits) is still referenced when the optimizer
    steps; without keep_outputs only the loss is (issue 12: the estimate's keep_outputs, measured by profile)."""
    import weakref

    class Out(SimpleNamespace):
        pass

    seen = {}

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, **kwargs):
            out = Out(loss=self.w * 2, logits=torch.zeros(3))
            seen["out"] = weakref.ref(out)
            return out

    class Probe(torch.optim.SGD):
        alive = None

        def step(self, closure=None):
            Probe.alive = seen["out"]() is not None
            return super().step(closure)

    model, ids = Recorder(), torch.zeros(1, 4, dtype=torch.long)
    for keep in (False, True):
        train_step(model, Probe(model.parameters(), lr=0.0), [ids], recipe=True, keep_outputs=keep)
        assert Probe.alive is keep
        assert seen["out"]() is None  # and it is freed once the step returns


def test_default_inputs_are_dropped_on_the_cpu_and_the_rest_kept():
    """What transformers would only test on the GPU (a sync) and then ignore goes; what changes the result stays."""
    from fitune.runtime.step import without_default_inputs

    ones = torch.ones(2, 6, dtype=torch.long)
    padded = ones.clone()
    padded[1, 4:] = 0
    arange = torch.arange(6).expand(2, 6).clone()
    packed = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    offset = arange + 3  # no restart, but not 0, 1, ...: the model would compute other positions
    assert without_default_inputs({"attention_mask": ones}) == {}
    assert without_default_inputs({"attention_mask": padded})["attention_mask"] is padded
    assert without_default_inputs({"position_ids": arange}) == {}
    assert without_default_inputs({"position_ids": packed})["position_ids"] is packed
    assert without_default_inputs({"position_ids": offset})["position_ids"] is offset
    kept = without_default_inputs({"attention_mask": padded, "position_ids": arange})
    assert set(kept) == {"attention_mask", "position_ids"}  # with a padding mask, positions are left as given
    src = {"attention_mask": ones}
    without_default_inputs(src)
    assert "attention_mask" in src  # the caller's dict is not changed


@pytest.mark.parametrize("loss", ["hf", "chunked"])
def test_a_batch_with_default_inputs_trains_as_transformers_does_with_them(loss):
    """fitune.data's unpacked batch (a mask of ones) and a packed row of one example (positions 0, 1, ...): the loss
    and gradients of fitune's step, which drops those inputs, equal transformers' forward given them."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for extra in ({"attention_mask": torch.ones_like(ids)}, {"position_ids": torch.arange(12).expand(2, 12)}):
        batch = SimpleNamespace(input_ids=ids, labels=ids, **extra)
        model = _model()
        ref = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=torch.tensor(22), **extra).loss
        ref.backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        out = forward_loss(model, batch, loss=loss, num_items=22)
        out.backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for n, g in _grads(model).items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_to_device_pins_and_does_not_block_only_for_a_cpu_tensor_going_to_cuda():
    """A CPU tensor bound for CUDA goes through pinned memory with a non-blocking copy; anything else is a plain
    `.to` (a stand-in records the calls: no GPU here)."""
    from fitune.runtime.step import to_device

    class Fake:
        def __init__(self, device_type, calls):
            self.device, self.calls = SimpleNamespace(type=device_type), calls

        def pin_memory(self):
            self.calls.append("pin_memory")
            return self

        def to(self, device, non_blocking=False):
            self.calls.append(("to", str(device), non_blocking))
            return self

    calls = []
    to_device(Fake("cpu", calls), "cuda")
    assert calls == ["pin_memory", ("to", "cuda", True)]
    calls = []
    to_device(Fake("cuda", calls), "cuda")  # already there: no pinning
    assert calls == [("to", "cuda", False)]
    calls = []
    to_device(Fake("cpu", calls), torch.device("cpu"))
    assert calls == [("to", "cpu", False)]


def test_a_step_whose_gradients_are_all_zero_stops_before_the_optimizer():
    """`check_gradients` (fitune train's first step): a model whose trainable parameters all get zero gradients -
    what compiled layers did on CUDA with the earlier lean LoRA branch - raises before the optimizer runs, with what
    to do; the same step with real gradients passes, and so does LoRA at initialisation (B = 0: A's gradients are
    zero, B's are not)."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    model = _model()
    opt = _KeepGrads(model)
    handles = [p.register_hook(lambda g: torch.zeros_like(g)) for p in _trainable(model)]
    with pytest.raises(FituneError, match="zero gradient.*compile: none"):
        train_step(model, opt, [_batch(ids)], loss="chunked", num_items=22, check_gradients=True)
    assert opt.seen is None  # the optimizer never ran
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    train_step(model, opt, [_batch(ids)], loss="chunked", num_items=22, check_gradients=True)
    assert opt.seen is not None
    fresh = wrap_lora(transformers.LlamaForCausalLM(model.get_base_model().config), 8, ["q_proj", "v_proj"]).train()
    opt = _KeepGrads(fresh)
    train_step(fresh, opt, [_batch(ids)], loss="chunked", num_items=22, check_gradients=True)
    assert not any(g.any() for n, g in opt.seen.items() if "lora_A" in n)  # B = 0: no gradient reaches A yet
    # a step without a trained token has nothing to learn from: not checked
    zero = _model()
    zero.zero_grad(set_to_none=True)
    train_step(zero, _KeepGrads(zero), [_batch(ids, trained_from=12)], loss="chunked", num_items=0,
               check_gradients=True)
