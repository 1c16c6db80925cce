#!/usr/bin/env bash
# Issue 33 / 34: the long-context rows on today's code, fitune beside Unsloth in one call (bench/peers/context_lanes.sh),
# the lanes chosen by the GPU's memory (each lane's processes capped at their card's budget; the caps of the lanes
# running at once stay under the GPU's memory). fitune's plans hold to 64 GiB of host RAM.
#   FITUNE_COMMIT=... bash bench/calls/issue33_context.sh $OUT/context
set -u
OUT=${1:?usage: issue33_context.sh OUT}
cd "$(dirname "$0")/../.."
TOTAL_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1/1024)}')
H64=host_ram=64GiB
if [ "${TOTAL_GIB:-0}" -ge 100 ]; then  # H200: 23.4 x 3 + 11.4 = 81.6 GiB at once
  LANES=("fitune@23.4GiB:140288:$H64" "unsloth@23.4GiB:87381,81920"
         "fitune@23.4GiB:60416:$H64+method=lora fitune@11.4GiB:plan:$H64"
         "unsloth@11.4GiB:30720 fitune@7.4GiB:plan:$H64 unsloth@7.4GiB:10922")
else  # H100 80 GB: 23.4 x 2 + 11.4 x 2 = 69.6 GiB at once
  LANES=("fitune@23.4GiB:140288:$H64" "unsloth@23.4GiB:87381,81920"
         "fitune@11.4GiB:plan:$H64 fitune@7.4GiB:plan:$H64" "unsloth@11.4GiB:30720 unsloth@7.4GiB:10922")
fi
mkdir -p "$OUT"
echo "GPU ${TOTAL_GIB} GiB; lanes: ${LANES[*]}" | tee "$OUT/lanes.txt"
PEERS_BUDGET_S=${PEERS_BUDGET_S:-530} bash bench/peers/context_lanes.sh "$OUT" "${LANES[@]}"
