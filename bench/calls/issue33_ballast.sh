#!/usr/bin/env bash
# Issue 33's no-retries goal on a simulated card that behaves as the card does: `fitune plan --host-ram 64GiB`'s
# longest QLoRA r32 all-linear context at BALLAST_CAP (default 23.4 GiB: 141,312 tokens, retries [0, 22] under
# PyTorch's memory fraction in bench/results/issue33/noretry; 15.4 GiB: 77,824 tokens, [30, 32] in
# bench/results/issue33/retries), two steps, alone on the GPU, capped with FITUNE_CAP_MODE=ballast (the memory
# beyond the budget taken by one cudaMalloc outside PyTorch's allocator: fitune/runtime/device.py `limit_allocator`).
# BALLAST_LENGTHS: the lengths to probe instead of the plan's longest, comma-separated, each `fitune plan --seq-len N`'s
# plan 1 (131,072 is 1.50x Unsloth's out-of-memory length at 23.4 GiB; bench/results/issue33/ballast ran the plan's
# 141,312: 20 and 31 retries). Each step line carries `outside_allocator_bytes` since commit 5d1a58c.
# BALLAST_PLAN_GPU: plan for this GPU instead of the cap (room under the cap for the 902 MiB a training process holds
# outside PyTorch's allocator, bench/results/issue33/ballast_131k); the run is still capped at BALLAST_CAP.
# BALLAST_PLAN_GPU=rtx4090 plans as a 4090's user does: the card's 23.4 GiB less the kernel images a run loads after
# cuBLAS is up (fitune/specs/gpu.py `kernel_images_bytes`), which the ballast, sized after a first matmul, charges too.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_ballast.sh $OUT
#   BALLAST_LENGTHS=131072,122880 PEERS_BUDGET_S=540 bash bench/calls/issue33_ballast.sh $OUT
# BALLAST_STEPS: steps per probe (default 2; 3 gives two steady-state steps after the first).
# BALLAST_PLAN_OPTIMIZER: `fitune plan --optimizer` (e.g. adamw8bit): plan 1 of the plans with that optimizer.
# (BALLAST_PLAN_GPU reached the probes only from the commit that added BALLAST_PLAN_OPTIMIZER: the records before it
# planned for BALLAST_CAP, `--gpu 23.4GiB`.)
# BALLAST_PEER: an item run after fitune's in the same lane, under the same ballast cap (e.g. unsloth@23.4GiB:87381).
set -u
OUT=${1:?usage: issue33_ballast.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT/lanes"
FITUNE_CAP_MODE=ballast PEERS_STEPS=${BALLAST_STEPS:-2} PEERS_BUDGET_S=${PEERS_BUDGET_S:-300} bash bench/peers/context_lanes.sh \
  "$OUT/lanes" "fitune@${BALLAST_CAP:-23.4GiB}:${BALLAST_LENGTHS:-plan}:host_ram=64GiB${BALLAST_PLAN_GPU:++plan_gpu=$BALLAST_PLAN_GPU}${BALLAST_PLAN_OPTIMIZER:++plan_optimizer=$BALLAST_PLAN_OPTIMIZER}${BALLAST_PEER:+ $BALLAST_PEER}" > "$OUT/lanes/log.txt" 2>&1
grep '^\[' "$OUT/lanes/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/lanes/max_context.jsonl"
