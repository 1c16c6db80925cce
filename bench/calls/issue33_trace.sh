#!/usr/bin/env bash
# Issue 33: the allocator history of offloaded QLoRA steps that need retries, to replay off the GPU through
# fitune/memory/allocator.py's expandable-segments model. `fitune plan --host-ram 64GiB`'s longest QLoRA r32
# all-linear context on the 16 GB card (77,824 tokens; 30-32 retries a step in bench/results/issue33/retries), two
# steps under the 15.4 GiB cap, and beside it the same plan with the cap raised to 78 GiB (no retries: the reserved
# peak the allocator reaches when nothing stops it; 15.83 GiB in bench/results/issue33/retry_cost against 15.38
# estimated). Each run under bench/_with_memory_history.py (FITUNE_MEMORY_HISTORY_DIR): OUT/history/*.trace.json.gz.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_trace.sh $OUT
set -u
OUT=${1:?usage: issue33_trace.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT/lanes" "$OUT/history"
H64=host_ram=64GiB
FITUNE_MEMORY_HISTORY_DIR=$OUT/history PEERS_STEPS=2 PEERS_BUDGET_S=${PEERS_BUDGET_S:-300} \
  bash bench/peers/context_lanes.sh "$OUT/lanes" "fitune@15.4GiB:77824:$H64" "fitune@15.4GiB:77824:$H64+cap=78GiB" \
  > "$OUT/lanes/log.txt" 2>&1
grep '^\[' "$OUT/lanes/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/lanes/max_context.jsonl"
ls -la "$OUT/history"
