#!/usr/bin/env bash
# Issue 33's allocator retries after offloaded checkpoints stopped deferring the free of each layer's input
# (fitune/runtime/techniques/offload.py: the compute stream waits for the transfer instead of `record_stream`), and
# its context goal in one call: (1) the GPU test of offloaded checkpoints while the GPU lags the host
# (tests/test_offload.py), alone; (2) context lanes (bench/peers/context_lanes.sh), each process under its own cap:
# `fitune plan --host-ram 64GiB`'s longest QLoRA r32 all-linear context at the 24 GB cap; Unsloth at the same cap at
# the lengths of bench/results/issue33/context_pool (87,381 out of memory, 81,920 fitted), then fitune's longest at
# the 16 GB cap (15.4 GiB) with 64 GiB; `fitune plan --host-ram 32GiB`'s longest at 24 GB. The records say the
# retries of every step (alloc_retries_per_step): 22-32 a step before the change (bench/results/issue33/retries).
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_noretry.sh $OUT
set -u
OUT=${1:?usage: issue33_noretry.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT/lanes"
if python3 -c 'import pytest' 2>/dev/null; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_offload.py > "$OUT/pytest_offload.log" 2>&1
  echo "tests/test_offload.py rc=$?"; tail -3 "$OUT/pytest_offload.log"
fi
H32=host_ram=32GiB H64=host_ram=64GiB
PEERS_BUDGET_S=${PEERS_BUDGET_S:-520} bash bench/peers/context_lanes.sh "$OUT/lanes" \
  "fitune@23.4GiB:plan:$H64" "unsloth@23.4GiB:87381,81920 fitune@15.4GiB:plan:$H64" "fitune@23.4GiB:plan:$H32" \
  > "$OUT/lanes/log.txt" 2>&1
grep '^\[' "$OUT/lanes/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/lanes/max_context.jsonl"
