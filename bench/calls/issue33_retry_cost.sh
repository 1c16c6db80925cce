#!/usr/bin/env bash
# Issue 33: what the allocator retries of offloaded plans cost. One lane, so the GPU is the run's alone (step times
# are speed figures): `fitune plan --host-ram 64GiB`'s longest QLoRA r32 all-linear context at the 16 GB cap
# (77,824 tokens; 30-32 retries a step in bench/results/issue33/retries), three steps under the 15.4 GiB cap, then the
# same plan (planned at 15.4 GiB) trained with the cap raised to 78 GiB (`cap=78GiB` set in the written plan): no
# retries expected there. The records hold step_seconds and alloc_retries_per_step of both.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_retry_cost.sh $OUT
set -u
OUT=${1:?usage: issue33_retry_cost.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
H64=host_ram=64GiB
PEERS_STEPS=${PEERS_STEPS:-3} PEERS_BUDGET_S=${PEERS_BUDGET_S:-540} bash bench/peers/context_lanes.sh "$OUT" \
  "fitune@15.4GiB:77824:$H64 fitune@15.4GiB:77824:$H64+cap=78GiB" > "$OUT/log.txt" 2>&1
grep '^\[' "$OUT/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/max_context.jsonl"
