"""Run checks inside a live run: FituneCallback in a real transformers.Trainer on a tiny random Llama (CPU), and
RunMonitor in a plain loop; numerics, allocator, estimate and OOM logic driven by fake probes and scalers."""

import json
import logging
import sys
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fitune.doctor.runtime import MemorySample, MonitorLimits, RunMonitor  # noqa: E402
from fitune.integrations.hf import FituneCallback  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402

MiB = 2**20
STEPS = 6


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


class TokenData(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class LeakEveryStep(transformers.TrainerCallback):
    """The planted leak: keeps a 1 MiB tensor from every step."""

    def __init__(self):
        self.kept = []

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(MiB // 4))


def train(tmp_path, callbacks, gradient_checkpointing: bool, steps: int = STEPS):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
        gradient_checkpointing=gradient_checkpointing,
    )
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=TokenData(), callbacks=callbacks)
    trainer.train()
    return trainer


class PhaseProbe:
    """Records where the monitor reads memory; returns a distinct peak per phase (stands in for CUDA counters)."""

    PEAKS = {"step_begin": 1, "forward": 300 * MiB, "backward": 500 * MiB, "optimizer": 200 * MiB}

    def __init__(self):
        self.points = []

    def __call__(self, point):
        self.points.append(point)
        return MemorySample(allocated_bytes=100 * MiB, peak_allocated_bytes=self.PEAKS[point], alloc_retries=0)


def test_trainer_with_checkpointing_recomputes_and_records_phase_peaks(tmp_path):
    probe = PhaseProbe()
    cb = FituneCallback(memory_probe=probe)
    train(tmp_path, [cb], gradient_checkpointing=True)
    mon = cb.monitor
    assert len(mon.steps) == STEPS
    assert mon.checkpointing_recomputes is True
    assert mon.layer_calls_per_forward() == [2.0] * STEPS  # forward + recompute in backward, per layer
    assert all(s.checkpointing for s in mon.steps)
    # a Trainer step's phase boundaries: on_step_begin, the model's forward hook, on_pre_optimizer_step, on_step_end
    assert probe.points == ["step_begin", "forward", "backward", "optimizer"] * STEPS
    assert all(s.phase_peak_bytes == {"forward": 300 * MiB, "backward": 500 * MiB, "optimizer": 200 * MiB}
               for s in mon.steps)
    assert all(s.loss is not None and s.grad_norm is not None for s in mon.steps)  # from on_log
    assert cb.findings == []
    assert "checkpointing on: 2.0 decoder-layer calls per forward pass (recomputed in backward)" in cb.report


def test_trainer_without_checkpointing_runs_each_layer_once_and_finds_nothing(tmp_path, caplog):
    cb = FituneCallback()  # default probe on the CPU: live tensor bytes after each step
    with caplog.at_level(logging.WARNING, logger="fitune.doctor"):
        train(tmp_path, [cb], gradient_checkpointing=False)
    mon = cb.monitor
    assert mon.checkpointing_recomputes is False
    assert mon.layer_calls_per_forward() == [1.0] * STEPS
    assert all(s.post_step_bytes and s.post_step_bytes > 0 for s in mon.steps)
    assert cb.findings == []
    assert "fitune doctor (run): no findings" in caplog.text  # the report is logged at train end


def test_trainer_leak_is_detected(tmp_path):
    cb = FituneCallback(limits=MonitorLimits(leak_window_steps=4, leak_min_growth_bytes=2 * MiB), write_report=True)
    trainer = train(tmp_path, [cb, LeakEveryStep()], gradient_checkpointing=False)
    (f,) = cb.findings
    assert f.rule == "memory-grows-every-step" and f.severity == "warning" and f.line is None
    assert "1.00 MiB per step" in f.message
    with open(tmp_path / "fitune_doctor.json", encoding="utf-8") as fh:
        assert [d["rule"] for d in json.load(fh)] == ["memory-grows-every-step"]
    # in the Trainer's own logs too (trainer_state.json's log_history): no finding at first, the leak once seen
    logged = [h for h in trainer.state.log_history if "fitune/findings" in h and "loss" in h]  # each step
    assert len(logged) == STEPS and logged[0]["fitune/findings"] == 0 and logged[0]["fitune/finding_rules"] == []
    assert logged[-1]["fitune/findings"] == 1 and logged[-1]["fitune/finding_rules"] == ["memory-grows-every-step"]


def test_trainer_logs_carry_the_phase_peak(tmp_path):
    trainer = train(tmp_path, [FituneCallback(memory_probe=PhaseProbe())], gradient_checkpointing=False)
    logged = [h for h in trainer.state.log_history if "fitune/peak_allocated_gib" in h and "loss" in h]
    assert len(logged) == STEPS and all(h["fitune/peak_allocated_gib"] == round(500 * MiB / 2**30, 3) for h in logged)


# ---- plain loops ---------------------------------------------------------------------------------------------------
def plain_steps(monitor, model, steps=3, loss_fn=None):
    x = torch.randint(0, 100, (2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        monitor.step_begin()
        loss = model(input_ids=x, labels=x).loss if loss_fn is None else loss_fn(model, x)
        monitor.after_forward()
        loss.backward()
        monitor.after_backward()
        opt.step()
        opt.zero_grad()
        monitor.step_end(loss)


def test_checkpointing_in_eval_mode_is_reported():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    model.eval()  # what from_pretrained returns; the loop forgot model.train()
    mon = RunMonitor(model, memory_probe=lambda point: None)
    plain_steps(mon, model)
    assert mon.checkpointing_recomputes is False
    assert [f.rule for f in mon.findings()] == ["checkpointing-not-recomputing"]
    model.train()
    mon2 = RunMonitor(model, memory_probe=lambda point: None)
    plain_steps(mon2, model)
    assert mon2.checkpointing_recomputes is True and mon2.findings() == []
    mon.close()
    mon2.close()


def test_non_finite_loss_and_gradients():
    model = tiny_llama()
    mon = RunMonitor(model, memory_probe=lambda point: None)
    plain_steps(mon, model, steps=2, loss_fn=lambda m, x: m(input_ids=x, labels=x).loss * float("nan"))
    assert {f.rule for f in mon.findings()} == {"loss-not-finite", "gradients-not-finite"}
    assert all(f.severity == "error" for f in mon.findings())


class FakeScaler:
    def __init__(self, scales):
        self.scales = iter(scales)

    def is_enabled(self):
        return True

    def get_scale(self):
        return next(self.scales)


def run_fake_steps(mon, n, scaler=None):
    for _ in range(n):
        mon.step_begin()
        mon.after_forward()
        mon.after_backward()
        mon.step_end(loss=1.0, scaler=scaler)


def test_loss_scale_collapse_and_repeated_overflow():
    scales = [65536.0 / 2**i for i in range(4)] + [4096.0] * 8 + [2048.0, 1024.0, 512.0, 256.0] + [0.5]
    mon = RunMonitor(torch.nn.Linear(2, 2), memory_probe=lambda p: None, limits=MonitorLimits(check_gradients=False))
    run_fake_steps(mon, len(scales), FakeScaler(scales))
    found = {f.rule: f for f in mon.findings()}
    assert set(found) == {"loss-scale-collapse", "fp16-overflow-steps"}
    assert "fell to 0.5" in found["loss-scale-collapse"].message
    assert "5 in a row (steps 12-16)" in found["fp16-overflow-steps"].message  # warm-up drops (steps 1-3) ignored


def test_a_healthy_loss_scale_is_quiet():
    scales = [65536.0, 32768.0, 16384.0] + [16384.0] * 20 + [32768.0]
    mon = RunMonitor(torch.nn.Linear(2, 2), memory_probe=lambda p: None)
    run_fake_steps(mon, len(scales), FakeScaler(scales))
    assert mon.findings() == []


def test_allocator_retries_and_peaks_above_the_estimate():
    from fitune.memory import estimate
    from fitune.specs import load_model_spec

    setup = TrainSetup(grad_checkpointing="full")
    est = estimate(load_model_spec("llama-3.1-8b"), setup)
    phases = {p: ph.peak_allocated_bytes for p, ph in est.phases.items()}
    retries = iter(range(100))

    def probe(point):  # backward 30 % above the estimate, the rest on it; retries grow every reading
        peak = {"forward": phases["forward"], "backward": int(phases["backward"] * 1.3),
                "optimizer": phases["optimizer"]}.get(point, 0)
        return MemorySample(allocated_bytes=phases["optimizer"], peak_allocated_bytes=peak, alloc_retries=next(retries))

    mon = RunMonitor(torch.nn.Linear(2, 2), setup=setup, model_name="llama-3.1-8b", memory_probe=probe)
    run_fake_steps(mon, 3)
    found = {f.rule: f for f in mon.findings()}
    assert set(found) == {"allocator-retries", "peak-above-estimate"}
    assert "the backward peak reached" in found["peak-above-estimate"].message and "(+30 %)" in \
        found["peak-above-estimate"].message
    assert any("(estimate " in line for line in mon.summary_lines())


def test_oom_post_mortem_falls_back_without_the_runtime_post_mortem(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fitune.runtime.oom", None)  # import fails: the fallback path
    mon = RunMonitor(torch.nn.Linear(2, 2), memory_probe=lambda p: None)
    mon.step_begin()
    with pytest.raises(torch.OutOfMemoryError), caplog.at_level(logging.WARNING):
        with mon.watch():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    (f,) = mon.findings()
    assert f.rule == "cuda-oom" and "step 0, forward" in f.message
    assert "Tried to allocate 2.00 GiB" in f.evidence and "did not run here" in f.evidence


def test_oom_post_mortem_uses_the_runtime_post_mortem_when_present(monkeypatch):
    calls = []
    fake = types.ModuleType("fitune.runtime.oom")
    fake.report_oom = lambda exc, **kw: calls.append((exc, kw)) or "REPORT"
    fake.format_report = lambda rep: f"formatted {rep}"
    monkeypatch.setitem(sys.modules, "fitune.runtime.oom", fake)
    mon = RunMonitor(torch.nn.Linear(2, 2), memory_probe=lambda p: None)
    with pytest.raises(torch.OutOfMemoryError):
        with mon.watch():
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert len(calls) == 1 and mon.oom.evidence == "formatted REPORT"


def test_monitor_errors_never_reach_the_training_loop(caplog):
    def broken(point):
        raise RuntimeError("probe exploded")

    model = tiny_llama()
    mon = RunMonitor(model, memory_probe=broken)
    with caplog.at_level(logging.WARNING):
        plain_steps(mon, model, steps=2)  # does not raise
    assert "run checks stopped after an internal error" in caplog.text
    assert mon._handles == []  # hooks removed
