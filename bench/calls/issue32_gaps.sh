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
profile() {  # profile NAME WORKLOAD [step_profile.py flags ...]
  local name=$1 workload=$2 l; shift 2
  l=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$l" -lt 60 ]; then echo "[$name] skipped: ${l}s left"; return; fi
  timeout -k 10 "$l" "$PY" bench/step_profile.py --out "$WORK/prof_$name" --workload "$workload" --steps 8 \
    --profile-from 4 --profile-steps 3 "$@" > "$WORK/prof_$name.log" 2>&1
  echo "[$name] rc=$? $(grep '^{' "$WORK/prof_$name.log" | tail -1 | cut -c1-400)"
  cat "$WORK/prof_$name/step_profile.jsonl" >> "$OUT/step_profile.jsonl" 2>/dev/null || tail -8 "$WORK/prof_$name.log"
  cp "$WORK/prof_$name"/trace.*.json.gz "$OUT/" 2>/dev/null
}
profile qlora_plan1 qlora_seeds
profile seeds_plan1 seeds
echo "### done at $(( $(date +%s) - T0 ))s"
