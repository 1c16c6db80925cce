#!/usr/bin/env bash
# Issue 32, two questions in one call on the 24 GB card's 23.4 GiB cap:
# (1) the real-length workload over a longer window: fitune (`fitune plan --data`, then `fitune train`), TRL's
#     strongest setup of bench/results/issue32/real (packing, no checkpointing, Liger, micro-batch 1 x 2), fitune
#     again; RL_STEPS optimizer steps each (default 80; 14 in issue32/real, whose trained-token rate moved with the
#     share of completion tokens its few steps happened to hold: TRL 72.5 %, fitune 69.8 %, the whole file 69.4 %).
# (2) where fitune's QLoRA r16 all-linear step goes (bench/step_profile.py, the workload qlora_seeds, PyTorch's
#     profiler over steps 5-7): plan 1 as written, with the cap raised to 78 GiB (plan 1, micro-batch 2 without
#     checkpointing, ran out of memory under the cap in bench/results/issue32/unsloth and was re-planned to 1 x 2:
#     its real peak, and its speed); then micro-batch 1 x 2 under the cap (Unsloth's fastest QLoRA setup's shape).
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_window.sh $OUT
# Results: $OUT/real/ (real_length.jsonl, env.txt), $OUT/step_profile.jsonl; the profiler traces stay in $PEERS_WORK.
set -u
OUT=${1:?usage: issue32_window.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-570}
PY=${PYTHON:-python3}
WORK=${PEERS_WORK:-/tmp/fitune_peers}
mkdir -p "$OUT" "$WORK"
RL_ONLY=${RL_ONLY:-fitune,trl_nogc_liger_m1a2,fitune_again} RL_STEPS=${RL_STEPS:-80} \
  PEERS_BUDGET_S=${WINDOW_BUDGET_S:-390} bash bench/calls/issue32_real.sh "$OUT/real"
. bench/calls/_profile.sh
profile qlora_plan1_uncapped qlora_seeds --set cap=78GiB
profile qlora_m1a2 qlora_seeds --set batch_size=1 --set grad_accum=2
echo "### done at $(( $(date +%s) - T0 ))s"
