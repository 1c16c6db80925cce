"""bench/step_profile.py's reading of a profiler trace: kinds of kernels, and the GPU's busy time as the union of
overlapping kernels (CPU: a trace written here)."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.step_profile import kind_of, summarize  # noqa: E402


def test_kernel_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "kernel") == "matmul"
    assert kind_of("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "kernel") == "matmul"
    assert kind_of("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "kernel") == "attention"
    assert kind_of("triton_poi_fused_add_mul_silu_0", "kernel") == "compiled"
    assert kind_of("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "kernel") == "loss"
    assert kind_of("void at::native::multi_tensor_apply_kernel<...>", "kernel") == "optimizer"
    assert kind_of("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy") == "copy_fill"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4>", "kernel") == "other"


def test_busy_time_is_the_union_of_kernels(tmp_path):
    events = [  # 0-100 us and 50-150 us overlap (two streams): 150 us busy; then 200-250 us: 200 us in all
        {"cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "triton_poi_b", "ts": 50, "dur": 100},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 200, "dur": 50},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not a GPU event
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(str(path), wall_s=400e-6, steps=1)
    assert abs(s["gpu_busy_s"] - 200e-6) < 1e-12
    assert abs(s["gpu_span_s"] - 250e-6) < 1e-12
    assert abs(s["gpu_idle_fraction"] - 0.5) < 1e-9
    assert s["kernels"] == 3
    assert s["kernel_s_per_kind"] == {"matmul": 100e-6, "compiled": 100e-6, "copy_fill": 50e-6}
    assert s["top_kernels"][0]["kind"] in ("matmul", "compiled")


def test_idle_gaps_by_length_and_the_host_operations_running_in_them(tmp_path):
    events = [  # kernels 0-100, 105-200 (a 5 us gap), 700-800 (a 500 us gap), 2000-2100 (a 1200 us gap)
        {"cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "nvjet_b", "ts": 105, "dur": 95},
        {"cat": "kernel", "name": "triton_poi_c", "ts": 700, "dur": 100},
        {"cat": "kernel", "name": "nvjet_d", "ts": 2000, "dur": 100},
        {"cat": "cpu_op", "name": "TorchDynamo Cache Lookup", "ts": 250, "dur": 400},  # 400 us of the 500 us gap
        {"cat": "cpu_op", "name": "aten::item", "ts": 900, "dur": 1000},  # 1000 us of the 1200 us gap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 101, "dur": 3},  # only in the 5 us gap: not counted
        {"cat": "cpu_op", "name": "ProfilerStep#5", "ts": 0, "dur": 2100},  # the profiler's own span: left out
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(str(path), wall_s=2100e-6, steps=1)
    assert s["idle_s_by_gap_us"] == {"<10": 5e-6, "<1000": 500e-6, ">=1000": 1200e-6}
    assert s["host_ops_in_gaps"] == [{"name": "aten::item", "s": 0.001, "gaps": 1},
                                     {"name": "TorchDynamo Cache Lookup", "s": 0.0004, "gaps": 1}]
