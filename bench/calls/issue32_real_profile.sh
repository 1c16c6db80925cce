#!/usr/bin/env bash
# Issue 32: where fitune's real-length step goes. The real-length workload (bench/peers/real_length.py: 2,000
# instruction-like examples, lognormal lengths) trained by fitune as planned (`fitune plan --data`, then `fitune
# train`, RL_STEPS steps), then that run's own plan.yaml trained again under PyTorch's profiler
# (bench/step_profile.py --config, steps 5-7), with recompilations logged (TORCH_LOGS=recompiles). Beside it, the
# seeds' workload (rows of exactly 2,048 tokens, the same LoRA and setup but unpacked) profiled the same way: what
# packing with varlen attention costs per token.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_real_profile.sh $OUT
# Results: $OUT/real/ (real_length.jsonl, env.txt), $OUT/step_profile.jsonl, $OUT/recompiles.txt.
set -u
OUT=${1:?usage: issue32_real_profile.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-560}
PY=${PYTHON:-python3}
WORK=${PEERS_WORK:-/tmp/fitune_peers}
mkdir -p "$OUT" "$WORK"
RL_ONLY=fitune RL_STEPS=${RL_STEPS:-20} PEERS_BUDGET_S=${REAL_BUDGET_S:-240} bash bench/calls/issue32_real.sh "$OUT/real"
profile() {  # profile NAME [step_profile.py flags ...]
  local name=$1 l; shift
  l=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$l" -lt 60 ]; then echo "[$name] skipped: ${l}s left"; return; fi
  TORCH_LOGS=recompiles timeout -k 10 "$l" "$PY" bench/step_profile.py --out "$WORK/prof_$name" --steps 10 \
    --profile-from 5 --profile-steps 3 "$@" > "$WORK/prof_$name.log" 2>&1
  echo "[$name] rc=$? $(grep '^{' "$WORK/prof_$name.log" | tail -1 | cut -c1-900)"
  { echo "==== $name"; grep -i "recompil" "$WORK/prof_$name.log" | head -40; } >> "$OUT/recompiles.txt"
  cat "$WORK/prof_$name/step_profile.jsonl" >> "$OUT/step_profile.jsonl" 2>/dev/null || tail -8 "$WORK/prof_$name.log"
}
profile real --config "$WORK/real_length/fitune/plan.yaml"
profile seeds --workload seeds
echo "### done at $(( $(date +%s) - T0 ))s"
