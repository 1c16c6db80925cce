"""The estimator per rank (fitune/memory/parallel.py) and the planner's strategy x GPU-count axis.

Exact expectations from the named formulas on catalog models; no GPU. None of these numbers is measured on several
GPUs yet: they check that the estimator does what its formulas (FSDP2 / DeepSpeed docs, ZeRO paper) say.
"""

from __future__ import annotations

import pytest

from fitune.memory import estimate
from fitune.memory import parallel as par
from fitune.memory.adapters import trainable_param_bytes, trainable_param_count
from fitune.memory.weights import weight_bytes
from fitune.plan import PlanRequest, plan
from fitune.plan import throughput
from fitune.setup import TrainSetup
from fitune.specs.gpu import resolve_gpu
from fitune.specs.model import load_model_spec

FULL = TrainSetup(method="full", grad_checkpointing="full", batch_size=1, seq_len_tokens=2048)


@pytest.fixture(scope="module")
def llama8b():
    return load_model_spec("llama-3.1-8b")


@pytest.fixture(scope="module")
def a100():
    return resolve_gpu("a100-80gb")


def test_one_gpu_ddp_is_the_single_gpu_estimate(llama8b, a100):
    plain = estimate(llama8b, FULL, a100)
    explicit = estimate(llama8b, FULL.replace(num_gpus=1, strategy="ddp"), a100)
    assert not par.is_parallel(FULL)
    assert plain == explicit
    assert set(plain.breakdown).isdisjoint(par.PARALLEL_CATEGORIES)  # the single-GPU categories only
    assert plain.gpu.allocator_budget_bytes == a100.allocator_budget_bytes


def test_ddp_is_the_single_gpu_step_plus_a_full_copy_of_the_gradients_in_buckets(llama8b, a100):
    one = estimate(llama8b, FULL, a100)
    four = estimate(llama8b, FULL.replace(num_gpus=4), a100)
    grads = trainable_param_bytes(llama8b, FULL)
    assert par.ddp_bucket_bytes(grads) == grads == 2 * trainable_param_count(llama8b, FULL)  # bf16 gradients
    assert four.resident_bytes[par.COMM] == grads
    assert sum(par.ddp_bucket_sizes(grads)) == grads and par.ddp_bucket_sizes(grads)[0] == par.DDP_FIRST_BUCKET_BYTES
    # the step itself is unchanged: every phase peaks exactly the buckets higher
    for phase in ("forward", "backward", "optimizer"):
        assert four.phases[phase].peak_allocated_bytes == one.phases[phase].peak_allocated_bytes + grads
    # NCCL's memory outside the allocator (a named guess) comes off the budget
    assert four.gpu.allocator_budget_bytes == a100.allocator_budget_bytes - par.NCCL_OUTSIDE_ALLOCATOR_BYTES


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_memory_falls_with_the_gpus_as_the_formulas_say(llama8b, a100, strategy):
    W = weight_bytes(llama8b, "full", "bf16")
    n_params = trainable_param_count(llama8b, FULL)
    peaks = []
    for n in (1, 2, 4, 8):
        e = estimate(llama8b, FULL.replace(num_gpus=n, strategy=strategy), a100)
        assert e.resident_bytes["weights"] == -(-W // n)
        if strategy == "fsdp":  # torch AdamW on bf16 DTensor shards: 2 bf16 moments, divided N ways
            assert e.resident_bytes["optimizer_states"] == -(-(2 * 2 * n_params) // n)
        else:  # ZeRO: fp32 master + 2 fp32 moments = K 12 bytes per parameter, one flat partition per rank
            assert e.resident_bytes["optimizer_states"] == 12 * -(-n_params // n)
            assert e.resident_bytes["gradients"] == -(-(2 * n_params) // n)
        peaks.append(e.peak_allocated_bytes)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0] / 3


def test_fsdp_gathers_the_root_and_two_layers_at_most(llama8b, a100):
    s = FULL.replace(num_gpus=4, strategy="fsdp")
    e = estimate(llama8b, s, a100)
    W = weight_bytes(llama8b, "full", "bf16")
    root = par.fsdp_root_gathered_bytes(llama8b, 2)
    layer = (W - root) // llama8b.num_layers
    assert root == 2 * (2 * 128256 * 4096 + 4096)  # embeddings + untied lm_head + final norm, bf16
    for ph in e.phases.values():
        assert ph.breakdown[par.GATHERED] <= root + par.fsdp_gathered_layers() * layer
    assert e.phases["backward"].breakdown[par.GATHERED] >= root  # the root stays unsharded through backward


def test_zero_on_one_gpu_divides_nothing_but_has_its_copies_and_buckets(llama8b, a100):
    lora = TrainSetup(method="lora", batch_size=1, seq_len_tokens=2048)
    single = estimate(llama8b, lora, a100)
    z2 = estimate(llama8b, lora.replace(strategy="zero2"), a100)
    n = trainable_param_count(llama8b, lora)
    assert z2.resident_bytes["weights"] == single.resident_bytes["weights"]
    assert z2.resident_bytes["optimizer_states"] == par.zero_optimizer_state_bytes("adamw", n, 1) == 12 * n
    # DeepSpeed casts the adapters to bf16: half the single-GPU fp32 adapter bytes
    assert z2.resident_bytes["adapter_weights"] == single.resident_bytes["adapter_weights"] // 2
    # stage 2's reduce buckets: 5e8 elements of the bf16 gradients, two buffers (fitune sets overlap_comm), made at
    # the first gradient - after the loss's backward, where this LoRA step peaks (measured: bench/results/zero/)
    assert par.zero_reduce_bucket_bytes("zero2", 2) == 2_000_000_000
    assert z2.phases["backward"].breakdown[par.COMM] == 0
    assert abs(z2.peak_allocated_bytes - single.peak_allocated_bytes) < 0.01 * single.peak_allocated_bytes
    # one request per buffer (`buf_0`, `buf_1`)
    assert [ev.nbytes for ev in z2.tape if ev.label == "zero reduce bucket" and ev.nbytes > 0] == [1_000_000_000] * 2
    # stage 3 keeps one bucket from initialisation on, and its gradient partitions; on one GPU it gathers nothing
    z3 = estimate(llama8b, lora.replace(strategy="zero3"), a100)
    assert z3.resident_bytes[par.COMM] == par.zero_reduce_bucket_bytes("zero3", 2) == 1_000_000_000
    assert z3.resident_bytes["gradients"] == 2 * n
    assert z3.phases["backward"].breakdown.get(par.GATHERED, 0) == 0
    assert z2.gpu.allocator_budget_bytes == a100.allocator_budget_bytes - par.DEEPSPEED_OUTSIDE_ALLOCATOR_BYTES


def test_zero3_optimizer_steps_one_sub_group_at_a_time():
    assert par.zero3_sub_group_elements([600_000_000, 500_000_000, 300_000_000], 1) == 1_100_000_000
    assert par.zero3_sub_group_elements([600_000_000, 500_000_000, 300_000_000], 4) == 350_000_000
    assert par.zero3_sub_group_elements([10, 20], 1) == 30


def test_zero3_offload_puts_parameters_and_optimizer_state_on_the_host(llama8b, a100):
    s = FULL.replace(num_gpus=4, strategy="zero3_offload")
    e = estimate(llama8b, s, a100)
    W = weight_bytes(llama8b, "full", "bf16")
    n = trainable_param_count(llama8b, FULL)
    assert e.resident_bytes["weights"] == e.resident_bytes["optimizer_states"] == 0
    assert e.host_breakdown == {"weights": -(-W // 4), "optimizer_states": 12 * -(-n // 4),
                                "gradients": 4 * -(-n // 4)}
    assert e.host_bytes == sum(e.host_breakdown.values())
    assert e.peak_allocated_bytes < estimate(llama8b, FULL.replace(num_gpus=4, strategy="zero3"), a100).peak_allocated_bytes


def test_grad_accumulation_replays_the_rank_step_consistently(llama8b, a100):
    for strategy in ("fsdp", "zero2", "zero3"):
        s = FULL.replace(num_gpus=4, strategy=strategy)
        one, two = estimate(llama8b, s, a100), estimate(llama8b, s.replace(grad_accum=2), a100)
        # nothing freed twice: every category stays non-negative and the second micro-batch adds no residents
        assert all(v >= 0 for ph in two.phases.values() for v in ph.breakdown.values())
        assert two.peak_allocated_bytes >= one.peak_allocated_bytes


def test_communication_terms(llama8b, a100):
    s = FULL.replace(num_gpus=4)
    G = trainable_param_bytes(llama8b, FULL)
    W = weight_bytes(llama8b, "full", "bf16")
    c = throughput.communication_bytes(llama8b, s)
    assert c.per_step_backward == pytest.approx(2 * 3 / 4 * G)  # ring all-reduce
    f = throughput.communication_bytes(llama8b, s.replace(strategy="fsdp"))
    assert f.per_micro == pytest.approx(2 * 3 / 4 * W + 3 / 4 * G)  # all-gather fwd + bwd, reduce-scatter
    assert throughput.predict(llama8b, FULL, a100).communication_s == 0.0
    slow = resolve_gpu("rtx4090")
    assert slow.link_gb_s == 25 and a100.link_gb_s == 300 and "assumed" in a100.link_source
    fast_comm = throughput.communication_s(llama8b, s.replace(strategy="zero2"), a100, 0.0)
    slow_comm = throughput.communication_s(llama8b, s.replace(strategy="zero2"), slow, 0.0)
    assert slow_comm == pytest.approx(fast_comm * 300 / 25)


def test_planner_shards_a_70b_lora_that_ddp_cannot_hold():
    from fitune.cli.plan import plan_to_json

    model, gpu = load_model_spec("llama-3.1-70b"), resolve_gpu("a100-80gb")
    req = PlanRequest(model, gpu, seq_len_tokens=4096, batch_size=8, num_gpus=8, methods=("lora",))
    result = plan(req)
    assert result.plans
    best = result.plans[0]
    assert best.setup.strategy in ("fsdp", "zero3", "zero3_offload") and best.setup.num_gpus == 8
    ddp = estimate(model, best.setup.replace(strategy="ddp", grad_checkpointing="offload", tiled_mlp=True), gpu)
    assert not ddp.fits  # 131 GiB of bf16 weights on each GPU
    doc = plan_to_json(best, 1)
    assert doc["strategy"] == best.setup.strategy and doc["num_gpus"] == 8
    assert doc["setup"]["num_gpus"] == 8 and doc["setup"]["strategy"] == best.setup.strategy
    assert doc["unvalidated"] is True and doc["unvalidated_reasons"]
    assert all(p.setup.batch_size * p.setup.grad_accum * p.setup.num_gpus == 8 for p in result.plans)


def test_one_gpu_plans_stay_single_gpu_ddp(llama8b):
    result = plan(PlanRequest(llama8b, resolve_gpu("rtx4090"), seq_len_tokens=2048, batch_size=2))
    from fitune.plan.search import unvalidated_reasons

    assert all(p.setup.num_gpus == 1 and p.setup.strategy == "ddp" for p in result.plans)
    assert all(not unvalidated_reasons(p.setup) for p in result.plans)  # nothing multi-GPU to mark


def test_estimate_cli_says_per_gpu_and_reports_host_bytes(capsys):
    import json

    from fitune.cli.main import main

    assert main(["estimate", "llama-3.1-8b", "--method", "full", "--gpus", "4", "--strategy", "zero3_offload",
                 "--gpu", "a100-80gb", "--grad-checkpointing", "full"]) == 0
    out = capsys.readouterr().out
    assert "per GPU" in out and "pinned host memory per GPU" in out
    assert main(["estimate", "llama-3.1-8b", "--gpus", "2", "--strategy", "fsdp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["per_gpu"] is True and doc["setup"]["num_gpus"] == 2 and doc["setup"]["strategy"] == "fsdp"
    assert "gathered_weights" in doc["breakdown"] and "host_breakdown" in doc
