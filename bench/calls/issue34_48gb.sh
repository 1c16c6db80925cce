#!/usr/bin/env bash
# Issue 34, the 48 GB row of the per-card table on today's code: Llama-3.1-8B-shaped, QLoRA r32 on all linear layers,
# batch 1, the allocator capped at 47.4 GiB, `fitune plan --seq-len 196608 --host-ram 64GiB --write`, plan 1, then
# `fitune train`, two optimizer steps (bench/peers/context_lanes.sh, one lane: the GPU and the host are this probe's
# alone). 196,608 tokens is the length both stacks trained in bench/results/peers/context_48gb (Unsloth ran out of
# memory at 245,760 there); `fitune plan --host-ram 64GiB` accepts up to 249,856, but a step there takes over 200 s,
# two of them more than one call's 10 minutes.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue34_48gb.sh $OUT
set -u
OUT=${1:?usage: issue34_48gb.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
PEERS_BUDGET_S=${PEERS_BUDGET_S:-540} bash bench/peers/context_lanes.sh "$OUT" "fitune@47.4GiB:196608:host_ram=64GiB" \
  > "$OUT/log.txt" 2>&1
grep '^\[' "$OUT/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/max_context.jsonl"
