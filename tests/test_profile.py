"""`fitune profile` on the CPU: tensor-level accounting of a real tiny training run, and OOM post-mortems."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.cli.main import main  # noqa: E402
from fitune.memory import estimate  # noqa: E402
from fitune.profile.run import profile  # noqa: E402
from fitune.profile.tracker import MAX_TIMELINE_POINTS  # noqa: E402
from fitune.setup import TrainSetup  # noqa: E402
from fitune.specs.gpu import resolve_gpu  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402

TINY = {
    "llama": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512},
    "qwen2": {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1200, "tie_word_embeddings": True,
              "max_position_embeddings": 512},
    "qwen3": {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
              "tie_word_embeddings": True, "max_position_embeddings": 512},
}


def _config(tmp_path, family="llama"):
    p = tmp_path / family / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(TINY[family]))
    return str(p)


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_categories_add_up_and_match_the_estimate(tmp_path, family, ckpt):
    path = _config(tmp_path, family)
    spec = load_model_spec(path)
    setup = TrainSetup(batch_size=2, seq_len_tokens=64, grad_checkpointing=ckpt, lora_targets=("q_proj", "v_proj"))
    r = profile(spec, setup, source=path, steps=2, device="cpu")
    assert r.oom is None and r.steps == 2
    assert sum(r.breakdown.values()) == r.peak_allocated_bytes  # the categories are the measured peak, split
    est = estimate(spec, setup, device="cpu")
    # the analytic engine against a real run, tensor for tensor, on the CPU
    assert abs(r.peak_allocated_bytes - est.peak_allocated_bytes) <= 0.02 * r.peak_allocated_bytes
    assert r.breakdown["weights"] == est.breakdown["weights"]
    assert r.breakdown["adapter_weights"] == est.breakdown["adapter_weights"]


@pytest.mark.parametrize("changes", [{"loss": "chunked"}, {"tiled_mlp": True, "grad_checkpointing": "offload"}])
def test_fitune_stack_techniques_match_the_estimate(tmp_path, changes):
    path = _config(tmp_path)
    spec = load_model_spec(path)
    setup = TrainSetup(batch_size=2, seq_len_tokens=64, stack="fitune", **changes)
    r = profile(spec, setup, source=path, steps=2, device="cpu")
    est = estimate(spec, setup, device="cpu")
    assert r.oom is None and sum(r.breakdown.values()) == r.peak_allocated_bytes
    assert abs(r.peak_allocated_bytes - est.peak_allocated_bytes) <= 0.05 * r.peak_allocated_bytes


def test_profile_json_keys_are_stable(tmp_path, capsys):
    path = _config(tmp_path)
    page = tmp_path / "profile.html"
    args = ["profile", path, "--device", "cpu", "--seq-len", "32", "--steps", "2", "--json", "--html", str(page)]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"model", "setup", "device", "steps", "cap_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                        "peak_phase", "phases", "breakdown", "estimate", "difference_bytes", "step_time_s",
                        "tokens_per_step", "tokens_per_s", "mfu", "num_alloc_retries", "fragmentation_bytes", "oom",
                        "timeline", "outside_allocator_bytes"}
    assert set(doc["phases"]) == {"forward", "backward", "optimizer"}
    assert set(doc["estimate"]) == {"peak_allocated_bytes", "peak_reserved_bytes", "cuda_context_bytes", "breakdown",
                                    "timeline"}
    assert doc["outside_allocator_bytes"] is None and doc["estimate"]["cuda_context_bytes"] is None  # the CPU
    # the memory timeline of the profiled steps: time order, every phase, the peak among the samples
    timeline = doc["timeline"]
    assert 0 < len(timeline) <= MAX_TIMELINE_POINTS
    assert all(set(x) == {"t_s", "phase", "live_bytes", "allocated_bytes", "reserved_bytes", "breakdown"}
               for x in timeline)
    assert [x["t_s"] for x in timeline] == sorted(x["t_s"] for x in timeline)
    assert {"forward", "backward", "optimizer"} <= {x["phase"] for x in timeline}
    assert all(x["allocated_bytes"] is None and x["reserved_bytes"] is None for x in timeline)  # the CPU: no allocator
    peak = max(timeline, key=lambda x: x["live_bytes"])
    assert peak["live_bytes"] == doc["peak_allocated_bytes"] and peak["phase"] == doc["peak_phase"]
    # each sample split by category: the split adds up to the live bytes, and at the peak it is the peak's breakdown
    assert all(sum(x["breakdown"].values()) == x["live_bytes"] for x in timeline)
    assert set(timeline[0]["breakdown"]) == set(doc["breakdown"])
    assert peak["breakdown"] == doc["breakdown"]
    # the estimate's replayed tape: one step in tape order, its highest point the estimate's peak
    tape = doc["estimate"]["timeline"]
    assert all(set(p) == {"event", "phase", "label", "allocated_bytes", "breakdown"} for p in tape)
    assert [p["event"] for p in tape] == sorted(p["event"] for p in tape)
    assert max(p["allocated_bytes"] for p in tape) == doc["estimate"]["peak_allocated_bytes"]
    assert all(sum(p["breakdown"].values()) == p["allocated_bytes"] for p in tape)
    # --html draws both: the measured split as stacked areas, the tape as a line over the last step
    from test_report import check_marks, marks_of

    html = page.read_text()
    assert "Memory over time" in html and 'data-series="estimate (replayed tape)"' in html
    assert 'class="area" data-series="weights"' in html
    marks = marks_of(html).marks
    keys = [m["key"] for m in marks]
    assert any(k.startswith("timeline.") and ".breakdown." in k for k in keys)
    assert any(k.startswith("estimate.timeline.") for k in keys)
    assert check_marks(marks, {"main": doc}) > 0


def test_timeline_split_follows_relabels(tmp_path):
    """Forward's survivors become saved_activations when backward starts and grads become gradients before the
    optimizer: the running split moves their bytes, so every sample still adds up."""
    path = _config(tmp_path)
    spec = load_model_spec(path)
    r = profile(spec, TrainSetup(batch_size=2, seq_len_tokens=64), source=path, steps=2, device="cpu")
    samples = r.memory_timeline
    assert all(sum(s.by_category) == s.live_bytes for s in samples)
    backward = [s.breakdown() for s in samples if s.phase == "backward"]
    optimizer = [s.breakdown() for s in samples if s.phase == "optimizer"]
    assert max(b["saved_activations"] for b in backward) > 0
    assert max(b["gradients"] for b in optimizer) > 0


def _samples(n, phases=("forward", "backward", "optimizer"), per_phase=None):
    from fitune.profile.tracker import Sample

    per_phase = per_phase or n // len(phases)
    return [Sample(0.001 * i, phases[i // per_phase % len(phases)],
                   1000 + (i * 7919) % 5000 + (300_000 if i == n // 3 else 0))  # one peak, a third of the way
            for i in range(n)]


def test_downsample_keeps_the_peak_the_phase_bands_and_the_bound():
    from fitune.profile.tracker import downsample

    samples = _samples(50_000, per_phase=5_000)  # 10 phase runs
    kept = downsample(samples, 500)
    assert len(kept) <= 500 and kept == sorted(kept, key=lambda x: x.t_s)
    assert max(kept, key=lambda x: x.live_bytes) is samples[50_000 // 3]
    starts = [i for i in range(len(samples)) if i == 0 or samples[i].phase != samples[i - 1].phase]
    assert all(samples[i] in kept for i in starts)  # each phase band starts where it did
    assert min(x.live_bytes for x in kept) == min(x.live_bytes for x in samples)
    short = _samples(300)
    assert downsample(short, 500) == short
    # CUDA: the allocator's counters read now and then; its highest reading survives, and the line stays drawn
    from fitune.profile.tracker import Sample

    cuda = [Sample(x.t_s, x.phase, x.live_bytes,
                   *((x.live_bytes + 100, 2 * x.live_bytes) if i % 7 == 0 else (None, None)))
            for i, x in enumerate(samples)]
    cuda[7 * 1000].allocated_bytes = 10**9
    kept = downsample(cuda, 500)
    assert len(kept) <= 500 and cuda[7000] in kept and cuda[50_000 // 3] in kept
    assert sum(1 for x in kept if x.allocated_bytes is not None) > 100
    many_runs = _samples(20_000, per_phase=10)  # 2,000 phase runs: more than the points allowed
    kept = downsample(many_runs, 500)
    assert len(kept) <= 500 and max(kept, key=lambda x: x.live_bytes) is many_runs[20_000 // 3]


def test_cap_turns_an_oom_into_a_post_mortem(tmp_path, capsys):
    path = _config(tmp_path)
    code = main(["profile", path, "--device", "cpu", "--seq-len", "64", "--steps", "2", "--cap", "2.5MiB"])
    captured = capsys.readouterr()
    assert code == 1
    assert "out of memory - post-mortem" in captured.out
    assert "what filled it, by category" in captured.out and "weights" in captured.out
    assert "Traceback" not in captured.out + captured.err


def test_oom_report_context_manager(capsys):
    import fitune

    with pytest.raises(SystemExit) as exit_info:
        with fitune.oom_report(model_spec="llama-3.1-8b", setup=TrainSetup(grad_checkpointing="full"), gpu="rtx4090"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "failed request: 1.96 GiB" in err
    assert "fitune estimate for this setup" in err and "--method qlora" in err


def test_oom_report_lets_other_errors_through():
    import fitune

    with pytest.raises(ValueError):
        with fitune.oom_report():
            raise ValueError("not memory")


def test_tracker_post_mortem_names_categories(tmp_path):
    from fitune.profile.tracker import MemoryTracker
    from fitune.runtime.model import build_model, wrap_lora
    from fitune.runtime.oom import build_report

    spec = load_model_spec(_config(tmp_path))
    model = wrap_lora(build_model(spec, device="cpu", init="random"), 8, ["q_proj", "v_proj"])
    ids = torch.randint(0, 1000, (2, 64))
    tracker = MemoryTracker(model, cap_bytes=2 * 2**20)
    with pytest.raises(torch.OutOfMemoryError) as info:
        with tracker:
            tracker.set_phase("forward")
            model(input_ids=ids, labels=ids).loss.backward()
    rep = build_report(info.value, tracker=tracker, model_spec=spec, setup=TrainSetup(seq_len_tokens=64),
                       gpu=resolve_gpu("2MiB"))
    assert rep.requested_bytes and rep.live_by_category["weights"] > 0
    assert rep.top_sources and rep.phase == "forward"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = _config(tmp_path)
    out = tmp_path / "mem.png"
    assert main(["profile", path, "--device", "cpu", "--seq-len", "32", "--steps", "2", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_report_of_one_process_has_no_several_gpu_rows(tmp_path, capsys):
    """The measured-vs-estimated table of a single-process profile shows no gathered-weights / comm-buffer rows."""
    path = _config(tmp_path)
    assert main(["profile", path, "--device", "cpu", "--seq-len", "32", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "saved activations" in out and "peak allocated" in out
    assert "gathered weights" not in out and "comm buffers" not in out


def test_the_report_says_what_is_in_use_outside_the_allocator(tmp_path):
    """On CUDA the report gives the GPU memory outside PyTorch's allocator after the steps beside what the estimate's
    budget leaves for it (set here by hand: the CPU has neither)."""
    from fitune.cli.profile import format_result

    path = _config(tmp_path)
    spec = load_model_spec(path)
    r = profile(spec, TrainSetup(batch_size=1, seq_len_tokens=32), source=path, steps=1, device="cpu")
    assert "outside the allocator" not in format_result(r)
    r.outside_allocator_bytes, r.estimate_context_bytes = int(1.5 * 2 ** 30), 718_077_952
    # in the report's unit (the tiny model's peak is MiBs)
    assert "outside the allocator: 1536.00 MiB (CUDA context, kernels loaded, libraries; the estimate's budget " \
           "leaves 684.81 MiB for it on this GPU)" in format_result(r)
    assert r.to_json()["outside_allocator_bytes"] == int(1.5 * 2 ** 30)
    assert r.to_json()["estimate"]["cuda_context_bytes"] == 718_077_952
