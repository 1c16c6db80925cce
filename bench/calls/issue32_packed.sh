#!/usr/bin/env bash
# Issue 32, packed rows on the GPU: (1) bench/packed_attention.py, the varlen kernel against fitune's segment loop and
# transformers' block-diagonal mask (exactness: the largest difference of output and gradients; speed; eager and
# compiled); (2) the real-length workload (bench/peers/real_length.py) in one call: TRL's packed SFTTrainer, fitune
# with FITUNE_VARLEN_KERNEL=1 (the kernel path) planned with --compile layers and without, fitune as planned
# (segment loop); before them the kernel's GPU test (tests/test_varlen_kernel.py); the first again last with PACKED_REPEAT=1 (noise about +-8 %). The kernel's GPU test: bench/calls/issue33_rows.sh.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_packed.sh $OUT/packed
set -u
OUT=${1:?usage: issue32_packed.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-540}
. bench/peers/common.sh
LOGS=${PEERS_LOGS:-$WORK/logs_packed}
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}
mkdir -p "$OUT" "$LOGS" "$WORK"
write_env "budget=${BUDGET}s issue32_packed"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if "$PY" -c 'import pytest' 2>/dev/null; then  # the kernel's GPU test (tests/test_varlen_kernel.py) first, alone
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_varlen_kernel.py > "$OUT/pytest_varlen.log" 2>&1
  echo "tests/test_varlen_kernel.py rc=$?"; tail -4 "$OUT/pytest_varlen.log"
fi
timeout 90 "$PY" bench/packed_attention.py --device "$DEVICE" --out "$OUT/packed_attention.jsonl" > "$LOGS/pa.log" 2>&1; echo "packed_attention rc=$?"; tail -3 "$LOGS/pa.log"
timeout 120 "$PY" bench/packed_attention.py --device "$DEVICE" --out "$OUT/packed_attention.jsonl" --compile > "$LOGS/pa_c.log" 2>&1; echo "packed_attention --compile rc=$?"; tail -3 "$LOGS/pa_c.log"
probe_setup
RL=$OUT/real_length.jsonl
rl() {  # rl NAME STACK PLAN_ARGS [ENV=VALUE ...]
  local name=$1 stack=$2 plan_args=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt 100 ]; then echo "[$name] skipped: ${l}s left"; return; fi
  local limit=$(( l < 240 ? l : 240 )) t=$(date +%s)
  env "$@" timeout -k 20 "$limit" "$PY" bench/peers/real_length.py --stack "$stack" --model-dir "$MODEL" --out "$RL" \
    --steps "${RL_STEPS:-14}" --cap "${PEERS_CAP-rtx4090}" --device "$DEVICE" --work "$WORK/real_length" \
    --timeout $(( limit - 20 )) --plan-args="$plan_args" > "$LOGS/rl_$name.log" 2>&1
  echo "[$name] rc=$? $(( $(date +%s) - t ))s $(grep -o 'RESULT {.*' "$LOGS/rl_$name.log" | tail -1 | cut -c1-300)"
}
rl fitune_kernel_compiled fitune "--compile layers" FITUNE_VARLEN_KERNEL=1
rl trl_packing trl_packing ""
rl fitune_kernel fitune "" FITUNE_VARLEN_KERNEL=1
rl fitune_loop fitune "" FITUNE_VARLEN_KERNEL=
[ "${PACKED_REPEAT:-0}" = 1 ] && rl fitune_kernel_compiled2 fitune "--compile layers" FITUNE_VARLEN_KERNEL=1
echo "### done at $(( $(date +%s) - T0 ))s"
