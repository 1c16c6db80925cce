#!/usr/bin/env bash
# Issue 33's allocator retries and issue 34's 16 GB row, in one call, after the offload fix (restored checkpoints
# allocated on the compute stream: fitune/runtime/techniques/offload.py `prefetch`): (1) the GPU test of offloaded
# checkpoints while the GPU lags the host (tests/test_offload.py), alone; (2) context lanes
# (bench/peers/context_lanes.sh): `fitune plan --host-ram 64GiB`'s 140,288-token QLoRA r32 all-linear plan at the
# 24 GB cap (31-32 retries a step before the fix), `fitune plan --host-ram 32GiB`'s longest (118,784 since the plan
# holds the save), then Unsloth at the 16 GB cap (its call-1 lengths); fitune's longest at the 16 GB cap (15.4 GiB).
# The records say the retries of every step (alloc_retries_per_step).
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_retries.sh $OUT
set -u
OUT=${1:?usage: issue33_retries.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT/lanes"
if python3 -c 'import pytest' 2>/dev/null; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_offload.py > "$OUT/pytest_offload.log" 2>&1
  echo "tests/test_offload.py rc=$?"; tail -3 "$OUT/pytest_offload.log"
fi
H32=host_ram=32GiB H64=host_ram=64GiB
# ISSUE33_LANES: other lanes (bench/calls/issue33_noretry.sh), as words with $H32 / $H64 expanded
if [ -n "${ISSUE33_LANES:-}" ]; then
  IFS='|' read -r -a LANES <<< "${ISSUE33_LANES//\$H32/$H32}"
  LANES=("${LANES[@]//\$H64/$H64}")
else
  LANES=("fitune@23.4GiB:140288:$H64" "fitune@23.4GiB:plan:$H32 unsloth@15.4GiB:51882,47786" "fitune@15.4GiB:plan:$H64")
fi
PEERS_BUDGET_S=${PEERS_BUDGET_S:-520} bash bench/peers/context_lanes.sh "$OUT/lanes" "${LANES[@]}" \
  > "$OUT/lanes/log.txt" 2>&1
grep '^\[' "$OUT/lanes/log.txt" | cut -c1-300
python3 bench/peers/probe_lines.py "$OUT/lanes/max_context.jsonl"
