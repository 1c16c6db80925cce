#!/usr/bin/env bash
# Issue 32, the real-length workload (bench/peers/real_length.py: 2,000 records of lognormal lengths, LoRA r8 q,v,
# 23.4 GiB cap, RL_STEPS optimizer steps, default 80) after the chunked loss's head began to run only at the trained
# positions (fitune/runtime/techniques/chunked_loss.py `trained_rows`): fitune as planned (`fitune plan --data`,
# then `fitune train`), TRL's strongest setup of bench/results/issue32/real (packed SFTTrainer, no checkpointing,
# Liger, micro-batch 1 x 2), fitune with FITUNE_TRAINED_ROWS=0 (the head over every position, the path before), and
# fitune again, in that order, in one call.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_trained_rows.sh $OUT
set -u
OUT=${1:?usage: issue32_trained_rows.sh OUT}
cd "$(dirname "$0")/../.."
RL_ONLY=fitune,trl_nogc_liger_m1a2,fitune_all_rows,fitune_again RL_STEPS=${RL_STEPS:-80} \
  PEERS_BUDGET_S=${PEERS_BUDGET_S:-540} bash bench/calls/issue32_real.sh "$OUT/real"
