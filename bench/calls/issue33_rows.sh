#!/usr/bin/env bash
# Issue 33's host-RAM rows and issue 32's kernel check, in one call: (1) context lanes (bench/peers/context_lanes.sh):
# `fitune plan`'s longest QLoRA r32 all-linear context at 23.4 GiB with 32 GiB of host RAM, bf16 LoRA r32 all-linear's
# with 32 GiB (the plan's longest is the same length with 64: the card is its limit), and the 140,288-token QLoRA
# plan again (its allocator retries per step, which the first
# call did not record); (2) beside them, tests/test_varlen_kernel.py (its GPU test: the varlen kernel against the
# segment loop) and bench/packed_attention.py's exactness (its timings share the GPU with the lanes: not speed).
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_rows.sh $OUT
# ROWS_SHORT=1: without the 140,288-token run (a short call).
set -u
OUT=${1:?usage: issue33_rows.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT/lanes" "$OUT/kernel"
H32=host_ram=32GiB H64=host_ram=64GiB
LANES=("fitune@23.4GiB:plan:$H32" "fitune@23.4GiB:140288:$H64" "fitune@23.4GiB:plan:$H32+method=lora")
[ "${ROWS_SHORT:-0}" = 1 ] && LANES=("fitune@23.4GiB:plan:$H32" "fitune@23.4GiB:plan:$H32+method=lora")  # no 140,288
(PEERS_BUDGET_S=${PEERS_BUDGET_S:-470} bash bench/peers/context_lanes.sh "$OUT/lanes" "${LANES[@]}" \
   > "$OUT/lanes/log.txt" 2>&1) &
LANES_PID=$!
sleep 60  # the lanes' model folder first (the GPU's memory is theirs to probe)
if python3 -c 'import pytest' 2>/dev/null; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_kernel.py > "$OUT/kernel/pytest_varlen.log" 2>&1
  echo "tests/test_varlen_kernel.py rc=$?"; tail -4 "$OUT/kernel/pytest_varlen.log"
else
  echo "no pytest on this machine"
fi
timeout 120 python3 bench/packed_attention.py --out "$OUT/kernel/packed_attention_shared_gpu.jsonl" > "$OUT/kernel/pa.log" 2>&1
echo "packed_attention rc=$?"; tail -3 "$OUT/kernel/pa.log" | cut -c1-400
wait $LANES_PID
grep '^\[' "$OUT/lanes/log.txt" | cut -c1-300
