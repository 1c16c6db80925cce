#!/usr/bin/env bash
# Issue 32: where the GPU waits in fitune's plan-1 steps on the 24 GB card's 23.4 GiB cap (bench/step_profile.py,
# PyTorch's profiler over steps 5-7 of 8; its `idle_s_by_gap_us` and `host_ops_in_gaps`): the QLoRA r16 all-linear
# workload (qlora_seeds: plan 1, micro-batch 2 with selective:4 checkpointing; 12.5 % of its profiled time idle in
# bench/results/issue32/window, without checkpointing), then the forum workload (seeds: plan 1, 1 x 2). The traces
# are copied to OUT (a few MiB each) to be read again off the GPU.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_gaps.sh $OUT
set -u
OUT=${1:?usage: issue32_gaps.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-400}
PY=${PYTHON:-python3}
WORK=${PEERS_WORK:-/tmp/fitune_peers}
mkdir -p "$OUT" "$WORK"
. bench/calls/_profile.sh
KEEP_TRACES=1
profile qlora_plan1 qlora_seeds
profile seeds_plan1 seeds
echo "### done at $(( $(date +%s) - T0 ))s"
