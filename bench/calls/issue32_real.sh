#!/usr/bin/env bash
# Issue 32, the real-length workload (bench/peers/real_length.py) with each peer at its strongest setup, in one call:
# fitune as planned (no FITUNE_VARLEN_KERNEL set here: the kernel path is to be fitune's default; the record says what
# the environment had), TRL's packed SFTTrainer without gradient checkpointing and with Liger (micro-batch 1 x
# grad-accum 2, which fits a 24 GB cap, and micro-batch 2), TRL's defaults plus Liger, Unsloth's packed SFTTrainer
# with its own checkpointing and without, then fitune again (noise: about +-8 %). Most important first: what the
# budget cannot reach is skipped, and a run that does not fit is a record with fits false.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_real.sh $OUT/real
#   RL_ONLY=fitune,trl_nogc_liger_m1a2 RL_STEPS=80 bash bench/calls/issue32_real.sh $OUT/real   # these runs, 80 steps
set -u
OUT=${1:?usage: issue32_real.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-560}
RUN_LIMIT=${RL_LIMIT_S:-200}  # seconds one run may take (loading the 8B folder, preparing the data, 14 steps)
MIN_LEFT=${RL_MIN_S:-90}      # a run is not started with less than this left
. bench/peers/common.sh
LOGS=${PEERS_LOGS:-$WORK/logs_real}
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}
mkdir -p "$OUT" "$LOGS" "$WORK"
write_env "budget=${BUDGET}s run_limit=${RUN_LIMIT}s issue32_real FITUNE_VARLEN_KERNEL=${FITUNE_VARLEN_KERNEL-unset}"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
probe_setup
RL=$OUT/real_length.jsonl
rl() {  # rl NAME STACK [real_length.py flags ...]
  local name=$1 stack=$2; shift 2
  local l; l=$(left)
  if [ -n "${RL_ONLY:-}" ] && [[ ",$RL_ONLY," != *",$name,"* ]]; then return; fi
  if [ -z "${RL_ONLY:-}" ] && [ "$name" = fitune_all_rows ]; then return; fi
  if [ "$l" -lt "$MIN_LEFT" ]; then echo "[$name] skipped: ${l}s left"; return; fi
  local limit=$(( l < RUN_LIMIT ? l : RUN_LIMIT )) t=$(date +%s)
  timeout -k 20 "$limit" "$PY" bench/peers/real_length.py --stack "$stack" --model-dir "$MODEL" --out "$RL" \
    --steps "${RL_STEPS:-14}" --cap "${PEERS_CAP-rtx4090}" --device "$DEVICE" --work "$WORK/real_length" \
    --timeout $(( limit - 20 )) "$@" > "$LOGS/rl_$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $(( $(date +%s) - t ))s $(grep -o 'RESULT {.*' "$LOGS/rl_$name.log" | tail -1 | cut -c1-300)"
  if [ "$rc" -ne 0 ]; then tail -5 "$LOGS/rl_$name.log"; fi
}
rl fitune fitune
rl trl_nogc_liger_m1a2 trl_packing --grad-checkpointing off --liger --micro-batch 1 --grad-accum 2
rl unsloth_gc_m2 unsloth_packing --grad-checkpointing unsloth --micro-batch 2
rl trl_gc_liger_m2 trl_packing --grad-checkpointing on --liger --micro-batch 2
rl unsloth_nogc_m1a2 unsloth_packing --grad-checkpointing off --micro-batch 1 --grad-accum 2
rl trl_nogc_liger_m2 trl_packing --grad-checkpointing off --liger --micro-batch 2
FITUNE_TRAINED_ROWS=0 rl fitune_all_rows fitune  # the loss's head over every position: only with RL_ONLY naming it
rl fitune_again fitune
echo "### done at $(( $(date +%s) - T0 ))s"
