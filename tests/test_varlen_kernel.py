"""The varlen kernel path of packed attention (issue 32): one `varlen_attn` call over all the rows of a packed batch,
its segment bounds computed once per batch from the position ids.

`varlen_attn` runs on CUDA only, so on the CPU it is replaced by a reference written from its documented semantics
(causal softmax attention within each segment of the packed tokens), in two ways: the whole function
(`python` below), and torch's own custom op given a CPU kernel (`torch_op`: torch's wrapper, argument conventions,
fake implementation and autograd formula run as on the GPU, only the flash kernels are the reference). Logits and
every LoRA gradient are compared with the segment loop and with transformers' block-diagonal mask; the op path
also runs inside a decoder layer compiled with `fullgraph=True` (no graph break). The real kernel: the `gpu` test.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.runtime import step  # noqa: E402
from fitune.runtime.model import wrap_lora  # noqa: E402
from fitune.runtime.techniques import varlen_attention as va  # noqa: E402

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=120)
LAYOUT = [[5, 9, 2], [16], [3, 1, 12]]  # three rows of 16 tokens: many segments, one, a one-token segment


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False, **_):
    """varlen_attn's documented semantics: (T, H, D) tokens; segment i is tokens cu[i]:cu[i+1]; each query attends
    to the keys of its segment (causal with window (-1, 0)); kv heads shared by H_q / H_kv query heads (GQA)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    assert window_size in ((-1, 0), (-1, -1)) and (enable_gqa or heads == kv_heads)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(query)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for a, b, c, d in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        assert b - a <= max_q and d - c <= max_k, "max_q / max_k bound every segment"
        if b == a:  # an empty (padding) segment: no query, no output
            continue
        q = query[a:b].transpose(0, 1).float()  # (H, n, D)
        k = key[c:d].transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)
        v = value[c:d].transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        if window_size == (-1, 0):
            scores = scores.masked_fill(torch.ones(b - a, d - c, dtype=torch.bool).triu(1 + (d - c) - (b - a)),
                                        float("-inf"))
        out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
    return out


# ---- torch's own varlen op with the reference as its CPU kernel -------------------------------------------------
_OP_ON_CPU = {"on": False, "registered": False}


def _op_forward_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    if not _OP_ON_CPU["on"]:
        raise NotImplementedError("torch_attn::_varlen_attn: the test's CPU kernel is off")
    out = reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                window_size=(-1, 0) if is_causal else (-1, -1), enable_gqa=True)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float)  # not used by the reference backward
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _op_backward_cpu(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                     scale=None, window_size=None):
    """Attention's gradients worked by hand per segment (an op's kernel runs below autograd). Flash's backward has
    no enable_gqa argument: dK / dV have the key's heads, summed over each group of query heads."""
    if not _OP_ON_CPU["on"]:
        raise NotImplementedError("torch_attn::_varlen_attn_backward: the test's CPU kernel is off")
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    group, scale = heads // kv_heads, dim ** -0.5 if scale is None else scale
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        q, g = query[a:b].transpose(0, 1).float(), grad_out[a:b].transpose(0, 1).float()  # (H, n, D)
        k, v = (t[a:b].transpose(0, 1).float().repeat_interleave(group, dim=0) for t in (key, value))
        scores = q @ k.transpose(1, 2) * scale
        if is_causal:
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        dp = g @ v.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax's backward
        dq[a:b] = (ds @ k * scale).transpose(0, 1).to(dq.dtype)
        dk[a:b] = (ds.transpose(1, 2) @ q * scale).view(kv_heads, group, b - a, dim).sum(1).transpose(0, 1)
        dv[a:b] = (p.transpose(1, 2) @ g).view(kv_heads, group, b - a, dim).sum(1).transpose(0, 1)
    return dq, dk, dv


@pytest.fixture
def torch_op_on_cpu():
    """torch's `varlen_attn` whose custom ops run the reference on CPU tensors (only inside this fixture)."""
    from torch.nn.attention import varlen

    if not _OP_ON_CPU["registered"]:
        varlen._varlen_attn.register_kernel("cpu")(_op_forward_cpu)
        varlen._varlen_attn_backward.register_kernel("cpu")(_op_backward_cpu)
        _OP_ON_CPU["registered"] = True
    _OP_ON_CPU["on"] = True
    va.load_kernel()  # reads whether this torch's varlen_attn takes enable_gqa (2.11's does not)
    yield varlen.varlen_attn
    _OP_ON_CPU["on"] = False


def _use_kernel(monkeypatch, kernel) -> list:
    """Make fitune's varlen attention take its kernel path on the CPU with `kernel`; the list counts its calls."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3])  # cu_seq_q
        return kernel(*args, **kwargs)

    monkeypatch.setattr(va, "_kernel", lambda query: counted)
    monkeypatch.setattr(va, "kernel_available", lambda device: True)
    return calls


@pytest.fixture(params=["python", "torch_op"])
def kernel(request):
    if request.param == "python":
        return reference_varlen_attn
    pytest.importorskip("torch.nn.attention.varlen")
    return request.getfixturevalue("torch_op_on_cpu")


# ---- the model and the batch ------------------------------------------------------------------------------------
def _model(attn: str = "sdpa", **cfg):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CFG, **cfg}, attn_implementation="sdpa"))
    model = wrap_lora(model, 4, "all-linear")
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    if attn == va.NAME:
        assert va.enable_varlen_attention(model)
    return model.train()


def _positions(layout) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in layout])


def _packed(layout=LAYOUT):
    torch.manual_seed(1)
    pos = _positions(layout)
    return torch.randint(0, CFG["vocab_size"], pos.shape), pos


def _run(model, ids, pos, **extra):
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same(got, ref):
    logits, loss, grads = got
    torch.testing.assert_close(logits, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref[1])
    assert grads.keys() == ref[2].keys()
    for n, g in ref[2].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


# ---- segment bounds ---------------------------------------------------------------------------------------------
def test_cu_seqlens_follow_the_restarting_positions_of_every_row():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2],   # three examples
                        [3, 4, 5, 6, 0, 1, 2, 3],   # the tail of an example cut by the previous row, then one
                        [0, 1, 2, 3, 4, 5, 6, 7]])  # one example
    cu = va.packed_cu_seqlens(pos, bucket=False)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 8, 12, 16, 24]
    # the same bounds as the segment loop's, row by row, offset by the row's start
    loop = [a + 8 * r for r, row in enumerate(va._segments(pos)) for a, _ in row] + [24]
    assert cu.tolist() == loop
    # six segments pad to eight: two empty ones at the end
    assert va.packed_cu_seqlens(pos).tolist() == [0, 3, 5, 8, 12, 16, 24, 24, 24]
    assert va.packed_cu_seqlens(torch.arange(8)[None]).tolist() == [0, 8]  # one row, one example
    assert va.packed_cu_seqlens(_positions([[2, 2, 2, 2]])).tolist() == [0, 2, 4, 6, 8]  # a full bucket: no pad


def test_segment_buckets_are_powers_of_two():
    assert [va.segment_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 300)] == [1, 1, 2, 4, 4, 8, 8, 16, 512]


def test_varlen_inputs_only_for_the_varlen_attention_on_a_kernel_device(monkeypatch):
    _, pos = _packed()
    model = _model(va.NAME)
    assert va.varlen_inputs(model, pos, 3, "cpu") == {}  # no kernel on the CPU: the segment loop needs nothing
    monkeypatch.setattr(va, "kernel_available", lambda device: True)
    assert va.varlen_inputs(_model(), pos, 3, "cpu") == {}  # transformers' sdpa: nothing to add
    assert va.varlen_inputs(model, None, 3, "cpu") == {}
    got = va.varlen_inputs(model, pos, 3, "cpu")
    assert got["cu_seq_lens_q"].tolist() == [0, 5, 14, 16, 32, 35, 36, 48, 48] and got["max_length_q"] == 16
    assert got["cu_seq_lens_k"] is got["cu_seq_lens_q"] and got["max_length_k"] == 16
    assert va.varlen_inputs(model, pos, 3, "cpu")["cu_seq_lens_q"] is got["cu_seq_lens_q"]  # once per batch
    one_row = va.varlen_inputs(model, pos[:1], 2, "cpu")  # one row of positions for a batch of two rows
    assert one_row["cu_seq_lens_q"].tolist() == [0, 5, 14, 16, 21, 30, 32, 32, 32]


def test_kernel_needs_cuda():
    assert va._kernel(torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)) is None
    assert not va.kernel_available("cpu")


def test_the_kernel_path_is_on_by_default_and_0_turns_it_off(monkeypatch):
    """Since its GPU run (bench/results/issue32/packed: the loop's outputs, gradients and losses) the kernel path runs
    wherever it can (a CUDA device, torch's varlen_attn present); FITUNE_VARLEN_KERNEL=0 keeps the segment loop."""
    monkeypatch.setattr(va, "load_kernel", lambda: object())
    monkeypatch.delenv(va.KERNEL_ENV, raising=False)
    assert va.kernel_available("cuda")
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(va.KERNEL_ENV, off)
        assert not va.kernel_available("cuda"), off
    monkeypatch.setenv(va.KERNEL_ENV, "1")
    assert va.kernel_available("cuda")
    monkeypatch.setattr(va, "load_kernel", lambda: None)  # an older torch
    assert not va.kernel_available("cuda")


# ---- parity: the kernel path against the segment loop and transformers' mask ------------------------------------
def test_kernel_path_equals_the_segment_loop_and_the_mask(monkeypatch, kernel):
    ids, pos = _packed()
    masked = _run(_model(), ids, pos)  # transformers' block-diagonal mask (sdpa)
    loop = _run(_model(va.NAME), ids, pos)  # the segment loop (no kernel on the CPU)
    _assert_same(loop, masked)
    calls = _use_kernel(monkeypatch, kernel)
    model = _model(va.NAME)
    got = _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert len(calls) == CFG["num_hidden_layers"]  # one call per layer, for all the rows
    _assert_same(got, loop)
    _assert_same(got, masked)


def test_a_varlen_attn_without_enable_gqa_gets_repeated_kv_heads(monkeypatch):
    """torch 2.11's varlen_attn has no `enable_gqa` (it failed so on the GPU machine): K and V are then repeated to
    the query's heads before the call, and the result is the segment loop's."""
    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1], "K and V repeated to the query's heads"
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size)

    assert not va.takes_keyword(varlen_attn_2_11, "enable_gqa")
    assert va.takes_keyword(reference_varlen_attn, "enable_gqa") and va.takes_keyword(lambda **kw: 0, "enable_gqa")
    ids, pos = _packed()
    loop = _run(_model(va.NAME), ids, pos)
    monkeypatch.setattr(va, "_KERNEL_GQA", ["repeat"])
    calls = _use_kernel(monkeypatch, varlen_attn_2_11)
    model = _model(va.NAME)
    got = _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert len(calls) == CFG["num_hidden_layers"]
    _assert_same(got, loop)


def _kernel_without_gqa_keyword(grouped: str, calls: list):
    """A varlen_attn of torch 2.11's signature (no `enable_gqa`) given K and V of fewer heads: `grouped` "native"
    computes GQA as flash attention does, "raises" refuses them, "wrong" maps query head i to kv head i % kv_heads."""
    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
        calls.append((query.shape[1], key.shape[1]))
        if key.shape[1] != query.shape[1] and grouped == "raises":
            raise RuntimeError("Expect query and key/value to have the same number of heads")
        if key.shape[1] != query.shape[1] and grouped == "wrong":
            key, value = (t.repeat(1, query.shape[1] // key.shape[1], 1) for t in (key, value))
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size, enable_gqa=True)

    return varlen_attn_2_11


@pytest.mark.parametrize("grouped, mode", [("native", "native"), ("raises", "repeat"), ("wrong", "repeat")])
def test_settle_gqa_tries_grouped_heads_once_and_keeps_what_agrees(monkeypatch, grouped, mode):
    """A kernel without `enable_gqa` is tried once with K and V of fewer heads against the repeated call, forward
    and backward: "native" only where it runs and agrees; a refusal or a wrong head mapping keeps the repeat."""
    calls = []
    monkeypatch.setattr(va, "_VARLEN_ATTN", [_kernel_without_gqa_keyword(grouped, calls)])
    monkeypatch.setattr(va, "_KERNEL_GQA", ["unknown"])
    assert va.settle_gqa("cpu") == mode
    assert calls == [(4, 4), (4, 2)]  # the repeated call, then the grouped one
    assert va.settle_gqa("cpu") == mode and len(calls) == 2  # decided once
    monkeypatch.setattr(va, "_KERNEL_GQA", ["keyword"])
    assert va.settle_gqa("cpu") == "keyword" and len(calls) == 2  # a kernel with enable_gqa is not tried


def test_a_kernel_with_native_gqa_gets_the_fewer_kv_heads(monkeypatch):
    """In "native" mode the model's layers hand the kernel K and V with the config's kv heads (no copies) and the
    result is the segment loop's."""
    ids, pos = _packed()
    loop = _run(_model(va.NAME), ids, pos)
    shapes = []
    monkeypatch.setattr(va, "_KERNEL_GQA", ["native"])
    _use_kernel(monkeypatch, _kernel_without_gqa_keyword("native", shapes))
    model = _model(va.NAME)
    got = _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert shapes == [(CFG["num_attention_heads"], CFG["num_key_value_heads"])] * CFG["num_hidden_layers"]
    _assert_same(got, loop)


def test_the_training_step_passes_the_bounds(monkeypatch, kernel):
    """fitune.runtime.step.forward_loss computes the bounds from the batch's positions and passes them."""
    from types import SimpleNamespace

    ids, pos = _packed()
    batch = SimpleNamespace(input_ids=ids, labels=ids, position_ids=pos)
    ref = step.forward_loss(_model(va.NAME), batch, loss="chunked", num_items=40)
    calls = _use_kernel(monkeypatch, kernel)
    got = step.forward_loss(_model(va.NAME), batch, loss="chunked", num_items=40)
    assert len(calls) == CFG["num_hidden_layers"] and calls[0].tolist() == [0, 5, 14, 16, 32, 35, 36, 48, 48]
    torch.testing.assert_close(got, ref)
    unpacked = SimpleNamespace(input_ids=ids, labels=ids, position_ids=torch.arange(16).expand(3, 16))
    step.forward_loss(_model(va.NAME), unpacked)  # default positions are dropped: plain causal attention, no kernel
    assert len(calls) == CFG["num_hidden_layers"]


def test_dropout_keeps_the_segment_loop(monkeypatch):
    ids, pos = _packed()
    calls = _use_kernel(monkeypatch, reference_varlen_attn)
    model = _model(va.NAME, attention_dropout=0.1)
    _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert calls == []  # flash's dropout is not the same random stream: the loop, as before


def test_kernel_path_traces_in_a_compiled_layer_without_graph_break(monkeypatch, torch_op_on_cpu):
    """Each decoder layer compiled with fullgraph=True (a graph break raises) through AOT autograd, so the op's
    fake implementation and autograd formula are traced: same logits and gradients as the eager loop; a new
    layout with the same bucket of segments compiles nothing new."""
    from fitune.runtime.layers import find_decoder_layers

    ids, pos = _packed()
    loop = _run(_model(va.NAME), ids, pos)
    monkeypatch.setattr(va, "_kernel", lambda query: torch_op_on_cpu)  # not `_use_kernel`: its list is guarded
    monkeypatch.setattr(va, "kernel_available", lambda device: True)
    graphs = []

    def backend(gm, example_inputs):  # AOT autograd (fake tensors, the op's fake and backward) then eager
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    model = _model(va.NAME)
    for layer in find_decoder_layers(model):
        layer.compile(fullgraph=True, backend=backend)
    got = _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert graphs and all("torch_attn._varlen_attn" in code for code in graphs)  # the one op, inside the graph
    _assert_same(got, loop)
    compiled = len(graphs)
    model.zero_grad()
    ids2, pos2 = _packed([[8, 8], [1, 15], [16]])  # 5 segments: the same bucket of 8 as LAYOUT's 7
    got2 = _run(model, ids2, pos2, **va.varlen_inputs(model, pos2, ids2.shape[0], "cpu"))
    assert len(graphs) == compiled  # no recompile for a new layout
    monkeypatch.undo()
    _assert_same(got2, _run(_model(va.NAME), ids2, pos2))


def test_compile_layers_runs_the_kernel_path_in_one_graph_per_layer(monkeypatch, torch_op_on_cpu):
    """`compile: layers` as fitune installs it (Inductor, dynamic=None) on a training step of packed rows: no graph
    break (the segment loop has one per layer), the loss and gradients of the eager segment loop."""
    from torch._dynamo.utils import counters

    from fitune.runtime.techniques.compile_layers import enable_compiled_layers

    ids, pos = _packed()
    loop = _run(_model(va.NAME), ids, pos)
    monkeypatch.setattr(va, "_kernel", lambda query: torch_op_on_cpu)
    monkeypatch.setattr(va, "kernel_available", lambda device: True)
    torch._dynamo.reset()
    counters.clear()
    model = _model(va.NAME)
    enable_compiled_layers(model)
    got = _run(model, ids, pos, **va.varlen_inputs(model, pos, ids.shape[0], "cpu"))
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    _assert_same(got, loop)


# ---- the real kernel (GPU) ----------------------------------------------------------------------------------------
def _has_varlen_kernel() -> bool:
    return torch.cuda.is_available() and va.load_kernel() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _has_varlen_kernel(), reason="needs a CUDA GPU and torch >= 2.10 (varlen_attn)")
def test_real_kernel_equals_the_segment_loop_on_the_gpu(monkeypatch):  # pragma: no cover - GPU only
    """bf16 on CUDA, head size 64, GQA: torch's flash varlen kernel against the segment loop (SDPA per segment).
    LAYOUT's 7 segments pad to 8: an empty segment and max lengths above the real ones go through flash too.
    It passed on an H100 with torch 2.11 (bench/results/issue32/packed); the kernel path is the default since."""
    monkeypatch.delenv(va.KERNEL_ENV, raising=False)
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    ids, pos = _packed()
    ids, pos = ids.cuda(), pos.cuda()

    def run(kernel_inputs: bool):
        model = _model(va.NAME, **cfg).to("cuda", torch.bfloat16)
        extra = va.varlen_inputs(model, pos.cpu(), ids.shape[0], "cuda") if kernel_inputs else {}
        assert (extra != {}) == kernel_inputs
        extra = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        logits, loss, grads = _run(model, ids, pos, **extra)
        return logits.float(), loss.float(), {n: g.float() for n, g in grads.items()}

    loop, kernel = run(False), run(True)
    torch.testing.assert_close(kernel[0], loop[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kernel[1], loop[1], rtol=1e-2, atol=1e-2)
    for n, g in loop[2].items():
        torch.testing.assert_close(kernel[2][n], g, rtol=5e-2, atol=5e-3, msg=n)
