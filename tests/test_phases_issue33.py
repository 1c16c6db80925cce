"""Issue 33: every phase of a run (load, train_step, eval_step, save, merge, export), GPU and host memory.

Each phase of llama-3.1-8b is checked against a number derived here from the architecture (Llama 3.1 8B: hidden
4,096, MLP 14,336, 32 layers, 32 query / 8 key-value heads of 128, vocabulary 128,256, untied lm_head) and from
what the code path does (fitune/memory/phases.py names it for each phase), not copied from the output.
"""

import dataclasses
import json

import pytest

from fitune.cli.main import main
from fitune.config import DataConfig, TrainConfig
from fitune.memory import estimate
from fitune.memory import phases as ph
from fitune.plan import PlanRequest, plan
from fitune.runtime import needs
from fitune.setup import TrainSetup
from fitune.specs.gpu import resolve_gpu
from fitune.specs.model import load_model_spec

GiB = 1024**3
H, I, V, L, KV = 4096, 14336, 128256, 32, 8 * 128
PER_LAYER = 2 * H * H + 2 * H * KV + 3 * H * I + 2 * H  # q, o; k, v; gate, up, down; two RMSNorms
PARAMS = 2 * V * H + L * PER_LAYER + H  # embedding, lm_head, layers, final norm
EMBED = V * H  # the largest tensor
MLP = H * I  # the largest linear
BASE = 2 * GiB  # the training process's baseline (phases.HOST_RUNTIME_BASELINE_BYTES, measured 1.85-1.92 GiB)
LOAD_BASE = int(1.33 * GiB)  # before training: load, a QLoRA merge (HOST_LOAD_BASELINE_BYTES)
CPU_BASE = int(0.85 * GiB)  # a process without CUDA: a LoRA merge, export (HOST_CPU_BASELINE_BYTES)
LORA_QV_R8 = L * 8 * ((H + H) + (H + KV))  # LoRA r8 on q_proj (h -> h) and v_proj (h -> kv): A and B


def nf4(n: int) -> int:
    """QLoRA's NF4 with double quantisation: 4 bits per weight, one byte per 64-block, one fp32 per 256 blocks."""
    blocks = -(-n // 64)
    return n // 2 + blocks + 4 * -(-blocks // 256)


NF4_WEIGHTS = L * (2 * nf4(H * H) + 2 * nf4(H * KV) + 3 * nf4(MLP)) + 2 * (2 * V * H + L * 2 * H + H)


def tiny_llama(**sizes) -> dict:
    """A 2-layer Llama config.json for the CPU (4 query / 2 key-value heads), with `sizes`."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 10000.0, **sizes}


@pytest.fixture(scope="module")
def llama():
    return load_model_spec("llama-3.1-8b")


def _peaks(llama, setup, **kw):
    est = estimate(llama, setup, resolve_gpu("rtx4090"))
    return est, {p.name: p for p in ph.phase_peaks(setup, llama, est, **kw)}


def test_the_hand_counts_are_the_models(llama):
    assert PARAMS == 8_030_261_248 == estimate(llama, TrainSetup()).total_params


# ---- load ------------------------------------------------------------------------------------------------------


def test_load_from_a_folder_goes_straight_to_the_gpu(llama):
    _, p = _peaks(llama, TrainSetup(), source="folder")
    assert p["load"].gpu_allocated_bytes == 2 * PARAMS  # every bf16 weight copied to its place, no transient
    assert p["load"].host_bytes == LOAD_BASE  # the mapped shards are page cache, copied straight to the GPU
    assert p["load"].host_bytes < 2 * PARAMS  # the model is never whole in host RAM
    _, hub = _peaks(llama, TrainSetup(), source="hub")
    assert hub["load"].host_bytes == p["load"].host_bytes  # a Hub id is read from its cache snapshot, a folder


def test_qlora_load_quantizes_one_linear_at_a_time(llama):
    _, p = _peaks(llama, TrainSetup(method="qlora"), source="folder")
    assert p["load"].gpu_allocated_bytes == NF4_WEIGHTS + 2 * MLP  # NF4 model + one bf16 MLP weight arriving
    assert p["load"].host_bytes == LOAD_BASE + 2 * MLP  # measured: about 0.1 GB more than bf16


def test_gguf_is_dequantized_whole_on_the_cpu(llama):
    _, p = _peaks(llama, TrainSetup(), source="gguf")
    assert p["load"].host_bytes == LOAD_BASE + 2 * PARAMS + 2 * 4 * EMBED  # state dict + fp32 array and its copy
    assert p["load"].host_bytes > 16 * GiB


def test_random_weights_are_drawn_on_the_device(llama):
    _, p = _peaks(llama, TrainSetup(method="qlora"), source="random")
    assert p["load"].host_bytes == LOAD_BASE
    assert p["load"].gpu_allocated_bytes == NF4_WEIGHTS + 2 * (2 * H * H + 2 * H * KV + 3 * MLP)  # one bf16 layer
    with pytest.raises(ValueError, match="source 'disk'"):
        ph.load_host_bytes(llama, TrainSetup(), "disk")


# ---- the training step and evaluation ------------------------------------------------------------------------


def test_train_step_is_the_estimate_with_its_pinned_host_memory(llama):
    s = TrainSetup(method="qlora", grad_checkpointing="offload", stack="fitune", seq_len_tokens=8192, batch_size=1)
    est, p = _peaks(llama, s)
    assert (p["train_step"].gpu_allocated_bytes, p["train_step"].gpu_reserved_bytes) == \
        (est.peak_allocated_bytes, est.peak_reserved_bytes)
    pinned = 8192 * H * 2 * L  # every layer's bf16 input waits in pinned host memory
    assert p["train_step"].host_bytes == BASE + pinned
    assert p["eval_step"].host_bytes == BASE + pinned  # the host allocator keeps the pinned blocks cached
    assert ph.train_step_phase(llama, s, est, host_pinned_bytes=0).host_bytes == BASE


def test_eval_step_holds_the_full_fp32_logits(llama):
    s = TrainSetup()  # batch 2 x 2048, hf loss
    est, p = _peaks(llama, s)
    T = 2 * 2048
    resident = sum(est.resident_bytes.values())  # weights, adapters, optimizer state, cuBLAS workspaces
    # at log_softmax: bf16 logits (2 B), their fp32 copy (4 B) and the fp32 log-probs (4 B) per token x vocab, the
    # final norm's output (2 x hidden), input ids and labels (int64), RoPE's bf16 cos and sin (sdpa: no mask)
    by_hand = resident + 10 * V * T + 2 * H * T + 2 * 8 * T + 2 * 2048 * 128 * 2
    assert p["eval_step"].gpu_allocated_bytes == by_hand
    assert p["eval_step"].gpu_allocated_bytes < p["train_step"].gpu_allocated_bytes  # nothing saved for backward
    assert p["eval_step"].gpu_reserved_bytes >= est.peak_reserved_bytes  # the steps' cache is still there
    _, longer = _peaks(llama, s, eval_rows_tokens=4096)
    assert longer["eval_step"].gpu_allocated_bytes - by_hand == 10 * V * T + 2 * H * T + 2 * 8 * T + 2 * 2048 * 128 * 2
    _, chunked = _peaks(llama, s.replace(loss="chunked", stack="fitune"))
    assert chunked["eval_step"].gpu_allocated_bytes < by_hand - 4 * V * T  # one chunk of logits at a time


def test_eval_step_agrees_with_the_trace_engines_tracker():
    """The eval step's no_grad forward, run for real on a tiny Llama on the CPU with the trace engine's storage
    tracker, against the analytic eval tape."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from fitune.runtime.model import build_random_model, prepare_model
    from fitune.runtime.step import forward_loss
    from fitune.specs.model import model_spec_from_hf_config
    from fitune.trace.tracker import make_tracker

    cfg = tiny_llama(hidden_size=256, intermediate_size=688, head_dim=64, vocab_size=8000,
                     max_position_embeddings=1024)
    s = TrainSetup(stack="fitune", batch_size=2, seq_len_tokens=256)
    model = prepare_model(build_random_model(cfg, device="cpu", dtype_name="bf16"), s)
    model.eval()
    ids = torch.randint(0, 8000, (2, 256))
    tracker = make_tracker()
    tracker.track(model.parameters(), "params")
    tracker.track(model.buffers(), "buffers")
    tracker.track([ids], "inputs")
    tracker.start_phase("activations")
    with torch.no_grad(), tracker:
        forward_loss(model, ids, loss="hf", num_items=1)
    measured, _ = tracker.end_phase()
    spec = model_spec_from_hf_config(cfg, "tiny")
    resident = {k: v for k, v in estimate(spec, s, device="cpu").resident_bytes.items()
                if k in ("weights", "adapter_weights")}  # the tracker follows tensors only: no optimizer yet
    modelled = ph.eval_forward_peak_bytes(spec, s, 256, resident)
    assert modelled == pytest.approx(measured, rel=0.02)


def test_eval_keeps_the_training_batch_and_loss_when_they_fit(llama):
    s = TrainSetup()  # 2 x 2048, hf loss: the eval step is below the training step (by_hand above)
    est = estimate(llama, s)
    chosen, phase = ph.eval_choice(llama, s, est, est.peak_reserved_bytes)
    assert (chosen.batch_size, chosen.loss) == (2, "hf")
    assert phase.gpu_allocated_bytes == ph.eval_step_phase(llama, s, est).gpu_allocated_bytes


def test_eval_that_would_not_fit_takes_the_chunked_loss_then_fewer_rows(llama):
    """A budget between the candidates' peaks picks the first that fits: the training rows with the chunked loss
    (the same loss, one chunk of logits at a time), then one row fewer; nothing fits: None."""
    s = TrainSetup(stack="fitune", batch_size=4, seq_len_tokens=4096)
    est = estimate(llama, s)
    frag = est.peak_reserved_bytes - est.peak_allocated_bytes

    def need(rows, loss):
        return ph.eval_step_phase(llama, s.replace(batch_size=rows, loss=loss), est).gpu_allocated_bytes + frag

    assert need(4, "chunked") < need(4, "hf") and need(3, "hf") < need(4, "hf")
    chosen, _ = ph.eval_choice(llama, s, est, need(4, "hf") - 1)
    assert (chosen.batch_size, chosen.loss) == (4, "chunked")
    below_chunked = min(need(4, "chunked"), need(3, "hf")) - 1
    chosen, phase = ph.eval_choice(llama, s, est, below_chunked)
    assert chosen.batch_size < 4 and phase.gpu_allocated_bytes + frag <= below_chunked
    assert ph.eval_choice(llama, s, est, need(1, "chunked") - 1) is None
    # the run phases with the budget show the eval step that will run, without it the training micro-batch's
    budget = need(4, "hf") - 1
    peaks = {p.name: p for p in ph.phase_peaks(s, llama, est, gpu_budget_bytes=budget)}
    assert peaks["eval_step"].gpu_allocated_bytes == need(4, "chunked") - frag
    assert "chunked loss" in peaks["eval_step"].note


def test_train_says_when_evaluation_runs_fewer_rows_or_the_chunked_loss(tmp_path, llama):
    s = TrainSetup(stack="fitune", batch_size=4, seq_len_tokens=4096)
    cfg = TrainConfig(model="llama-3.1-8b", setup=s, data=DataConfig(path="train.jsonl", eval_path="eval.jsonl"))
    est = estimate(llama, s)
    frag = est.peak_reserved_bytes - est.peak_allocated_bytes
    hf = ph.eval_step_phase(llama, s, est).gpu_allocated_bytes + frag
    rows, loss, line = needs.eval_setting(cfg, hf - 1)
    assert (rows, loss) == (4, "chunked")
    assert "evaluation runs 4 row(s) per forward with the chunked loss" in line and "the eval loss is the same" in line
    assert needs.eval_setting(cfg, hf) == (4, "hf", None)
    assert needs.eval_setting(cfg, None) == (4, "hf", None)  # no GPU: the training micro-batch and loss


def test_evaluation_with_fewer_rows_and_the_chunked_loss_gives_the_same_eval_loss(tmp_path):
    """What `fitune train` changes to make evaluation fit leaves the eval loss as it was (a tiny Llama on the CPU)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from fitune.data import Example
    from fitune.runtime.model import build_random_model, prepare_model
    from fitune.train.loop import _evaluate

    cfg_hf = tiny_llama(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=500,
                        max_position_embeddings=256)
    s = TrainSetup(stack="fitune", batch_size=4, seq_len_tokens=32, dtype="fp32")
    torch.manual_seed(0)
    model = prepare_model(build_random_model(cfg_hf, device="cpu", dtype_name="fp32"), s)
    g = torch.Generator().manual_seed(1)
    rows = [tuple(torch.randint(1, 500, (n,), generator=g).tolist()) for n in (32, 20, 31, 7, 25)]
    items = [Example(ids, (-100,) + ids[1:]) for ids in rows]
    cfg = TrainConfig(model="tiny", setup=s, data=DataConfig(path="train.jsonl", eval_path="eval.jsonl"))
    reference = _evaluate(model, items, 0, cfg, "cpu")
    assert _evaluate(model, items, 0, cfg, "cpu", rows=1, loss_name="chunked") == pytest.approx(reference, rel=1e-5)
    assert _evaluate(model, items, 0, cfg, "cpu", rows=3, loss_name="hf") == pytest.approx(reference, rel=1e-5)


# ---- save, merge, export ----------------------------------------------------------------------------------------


def test_save_copies_the_trainable_weights_and_one_optimizer_shard(llama):
    est, p = _peaks(llama, TrainSetup())
    adapter = 4 * LORA_QV_R8  # PEFT's adapters are fp32
    assert p["save"].host_bytes == BASE + adapter + 2 * adapter  # the copies, then AdamW's two fp32 moments
    assert p["save"].gpu_allocated_bytes == 2 * PARAMS + adapter + 2 * adapter + est.resident_bytes["workspaces"]
    _, full = _peaks(llama, TrainSetup(method="full"))
    assert full["save"].host_bytes == BASE + 2 * PARAMS + 2 * GiB  # every weight, then a 2 GiB optimizer shard


def test_merge_lora_on_the_cpu_and_qlora_on_the_gpu(llama):
    _, lora = _peaks(llama, TrainSetup())
    adapter = 4 * LORA_QV_R8
    assert lora["merge"].gpu_allocated_bytes == 0
    merged_qv = 2 * L * (H * H + H * KV)  # q_proj and v_proj rewritten (copy on write); the rest stays mapped
    assert lora["merge"].host_bytes == CPU_BASE + merged_qv + adapter + 4 * MLP  # + adapter, one fp32 delta
    _, q = _peaks(llama, TrainSetup(method="qlora"))
    assert q["merge"].gpu_allocated_bytes == 2 * PARAMS + adapter + 4 * MLP  # the whole model dequantized to bf16
    assert q["merge"].gpu_reserved_bytes == q["merge"].gpu_allocated_bytes  # the freed NF4 blocks are reused
    assert q["merge"].host_bytes == LOAD_BASE + 5 * 10**9  # one 5 GB shard copied to the host by save_pretrained
    assert "merge" not in _peaks(llama, TrainSetup(method="full"))[1]  # nothing to merge


def test_export_works_one_tensor_at_a_time(llama):
    _, p = _peaks(llama, TrainSetup())
    assert p["export"].host_bytes == CPU_BASE + 8 * EMBED and p["export"].gpu_allocated_bytes == 0
    # q8_0: the same fp32 tensor and its abs; gguf-py quantizes 16 rows at a time (measured: bench/export_host.py)
    assert ph.export_phase(llama, TrainSetup(), "q8_0").host_bytes == CPU_BASE + 8 * EMBED


def test_the_worst_phase_is_named(llama):
    s = TrainSetup(method="qlora", grad_checkpointing="full")
    est = estimate(llama, s, resolve_gpu("12GiB"))
    peaks = ph.phase_peaks(s, llama, est)
    assert [p.name for p in peaks] == ["load", "train_step", "eval_step", "save", "merge", "export"]
    assert ph.worst_phase(peaks).name == "merge"  # the dequantized bf16 model (15 GiB) is more than training
    assert ph.host_peak(peaks).name == "save"  # the adapter and an optimizer shard copied out, on the baseline


# ---- the CLI --------------------------------------------------------------------------------------------------------


def test_estimate_text_has_a_line_per_phase_and_the_verdict(capsys):
    argv = ["estimate", "llama-3.1-8b", "--method", "qlora", "--grad-checkpointing", "full", "--gpu", "13GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "every phase of the run (GPU allocated / reserved; host memory):" in out
    for name in ph.PHASES:
        assert f"\n    {name} " in out
    assert "FITS" in out.split("every phase")[0]  # the training step alone fits (12.35 GiB)...
    assert "whole run -> DOES NOT FIT: merge needs 15.19 GiB > 13.00 GiB budget (worst: merge)" in out  # ...the run not


def test_estimate_json_adds_run_phases_and_keeps_the_step(capsys):
    assert main(["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--source", "gguf", "--eval-seq-len", "4096",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["phases"]) == {"forward", "backward", "optimizer"}  # the step's phases, unchanged
    assert [p["name"] for p in doc["run_phases"]] == list(ph.PHASES)
    for p in doc["run_phases"]:
        assert {k for k in p if k != "name" and k != "note"} == {"gpu_allocated_bytes", "gpu_reserved_bytes",
                                                                 "host_bytes"}
    load = doc["run_phases"][0]
    assert load["host_bytes"] == LOAD_BASE + 2 * PARAMS + 8 * EMBED  # --source gguf
    assert doc["worst_phase"] == "train_step" and doc["run_fits"] is False  # no checkpointing: 41.9 GiB
    assert doc["host_peak_phase"] == "load" and doc["host_peak_bytes"] == load["host_bytes"]


def test_estimate_refuses_a_bad_eval_length(capsys):
    assert main(["estimate", "llama-3.1-8b", "--eval-seq-len", "0"]) == 2
    assert "--eval-seq-len 0" in capsys.readouterr().err


# ---- plan ------------------------------------------------------------------------------------------------------------


def test_plan_rejects_what_the_host_ram_cannot_hold(llama):
    gpu, host = resolve_gpu("rtx4090"), 16 * GiB
    from_gguf = dataclasses.replace(llama, gguf_weights_type="Q4_K")
    result = plan(PlanRequest(from_gguf, gpu, host_ram_bytes=host, methods=("lora",)))
    (r,) = [r for r in result.rejected if r.reason == "host_ram"]
    need = LOAD_BASE + 2 * PARAMS + 2 * 4 * EMBED  # the GGUF dequantized on the CPU
    assert r.message == (f"LoRA: loading needs {need / GiB:.2f} GiB of host RAM (the GGUF file dequantized on the "
                         "CPU) > 16.00 GiB --host-ram")
    full = plan(PlanRequest(llama, gpu, host_ram_bytes=host, methods=("full", "qlora")))
    assert any(r.reason == "host_ram" and r.option == "full fine-tune" and
               f"saving needs {(BASE + 2 * PARAMS) / GiB:.2f} GiB" in r.message for r in full.rejected)
    # bf16 LoRA from a folder streams its weights to the GPU (runtime/model.py device_map): 16 GiB is enough
    folder = plan(PlanRequest(llama, gpu, host_ram_bytes=host, methods=("lora",)))
    assert not [r for r in folder.rejected if r.reason == "host_ram"]


def test_plan_says_the_host_ram_it_assumed(capsys, monkeypatch):
    monkeypatch.setattr(ph, "local_nvidia_gpu", lambda: False)
    assert main(["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--method", "qlora", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["request"]["host_ram_bytes"] == 64 * GiB
    assert doc["request"]["host_ram_origin"] == "host RAM (assumed; --host-ram to change)"
    assert "host RAM: 64.00 GiB assumed (--host-ram to change)" in doc["notes"]


def test_plan_takes_this_machines_ram_when_its_gpu_is_here():
    from fitune.cli.plan import resolve_host_ram

    got = resolve_host_ram(None, has_gpu=lambda: True, mem_total=lambda: 31 * GiB)
    assert got == (31 * GiB, "host RAM (this machine's)", "host RAM: 31.00 GiB, this machine's (--host-ram to change)")
    assert resolve_host_ram("8GiB")[:2] == (8 * GiB, "--host-ram")


def test_meminfo_is_read_in_bytes():
    text = "MemTotal:       32780544 kB\nMemFree:         1000 kB\nMemAvailable:   10240000 kB\n"
    assert ph.meminfo_bytes("MemTotal", text) == 32780544 * 1024
    assert ph.meminfo_bytes("MemAvailable", text) == 10240000 * 1024
    assert ph.meminfo_bytes("SwapTotal", text) is None
    assert ph.meminfo_bytes("MemTotal", path="/nonexistent/meminfo") is None


# ---- fitune train's preflight ----------------------------------------------------------------------------------------


def test_train_refuses_a_clear_host_shortfall_before_loading(monkeypatch):
    monkeypatch.setattr(ph, "meminfo_bytes", lambda key, *a, **k: 4 * GiB if key == "MemAvailable" else None)
    cfg = TrainConfig(model="llama-3.1-8b")  # bf16 LoRA from the Hub cache: straight from the mapped files
    assert needs.host_ram_problems(cfg, on_cuda=True) == []  # 4 GiB are enough to load it onto the GPU
    on_cpu = needs.host_ram_problems(cfg, on_cuda=False)  # on the CPU the model lives in host memory
    (problem,) = on_cpu
    need = (LOAD_BASE + 2 * PARAMS) / GiB
    assert problem.startswith(f"loading needs ~{need:.2f} GiB of host RAM (")
    assert "4.00 GiB available: train on a machine with a GPU" in problem
    assert needs.host_ram_problems(cfg, on_cuda=False, mem_available_bytes=64 * GiB) == []
    spec = load_model_spec("llama-3.1-8b")
    from_gguf = (spec, "gguf", ph.phase_peaks(cfg.setup, spec, estimate(spec, cfg.setup), source="gguf"))
    (gguf,) = needs.host_ram_problems(cfg, on_cuda=True, mem_available_bytes=8 * GiB, phases=from_gguf)
    assert "point model: at the model's safetensors folder or Hub id instead of the .gguf file" in gguf


def test_train_leaves_tiny_models_alone(real_model_dir):
    cfg = TrainConfig(model=real_model_dir)  # SmolLM2-135M: its own share is well under 1 GiB
    assert needs.host_ram_problems(cfg, on_cuda=False, mem_available_bytes=256 * 1024**2) == []


def test_train_warns_before_the_run_about_a_phase_over_the_card(llama):
    cfg = TrainConfig(model="llama-3.1-8b", data=DataConfig(path="train.jsonl", eval_path="eval.jsonl"), merge=True)
    _, _, peaks = needs.run_phases_for(cfg, True)
    eval_bytes = next(p.gpu_allocated_bytes for p in peaks if p.name == "eval_step")
    lines = needs.phase_warnings(cfg, gpu_budget_bytes=GiB)  # not even one row with the chunked loss fits
    assert any(line.startswith(f"the eval_step phase needs {eval_bytes / GiB:.2f} GiB of GPU memory > ")
               and "even one row per forward with the chunked loss does not fit" in line for line in lines)
    # just under the training micro-batch's eval peak: fitune evaluates with the chunked loss instead, no warning
    assert not [x for x in needs.phase_warnings(cfg, gpu_budget_bytes=eval_bytes - 1) if "eval_step" in x]
    assert any(line.startswith("merge: true writes the merged model") for line in lines)
    assert not [x for x in needs.phase_warnings(cfg, gpu_budget_bytes=None) if "phase needs" in x]  # no GPU
    no_eval = dataclasses.replace(cfg, data=DataConfig(path="train.jsonl"))
    assert not [x for x in needs.phase_warnings(no_eval, gpu_budget_bytes=eval_bytes - 1) if "eval_step" in x]


def test_train_preflight_hands_warnings_over_and_returns_problems(monkeypatch):
    monkeypatch.setattr(ph, "meminfo_bytes", lambda key, *a, **k: 512 * GiB)
    cfg = TrainConfig(model="llama-3.1-8b", merge=True)
    warned = []
    assert needs.memory_problems(cfg, on_cuda=False, warn=warned.append) == []
    assert warned and warned[0].startswith("fitune train: merge: true writes the merged model")


# ---- PyTorch older than 2.13: pinned blocks rounded up to a power of two --------------------------------------------


def test_a_64_gib_computer_offloads_140k_tokens_in_exact_size_buffers(llama):
    """QLoRA r32 all-linear at 140,288 tokens offloads 32 x 1.07 GiB of checkpoints: exact-size page-locked buffers
    (offload.py `PinnedPool`) fit 64 GiB of host RAM on any PyTorch, 32 GiB does not."""
    gpu = resolve_gpu("rtx4090")
    kw = dict(seq_len_tokens=140288, batch_size=1, methods=("qlora",), lora_rank=32, lora_targets=("all-linear",))
    assert any(p.setup.grad_checkpointing == "offload" for p in plan(PlanRequest(llama, gpu, host_ram_bytes=64 * GiB,
                                                                                 **kw)).plans)
    assert not any(p.setup.grad_checkpointing == "offload" for p in plan(PlanRequest(llama, gpu,
                                                                                     host_ram_bytes=32 * GiB,
                                                                                     **kw)).plans)
