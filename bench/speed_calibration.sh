#!/usr/bin/env bash
# Issue 12: run bench/speed_calibration.py for each MODEL:GROUP given, one process each, under a time limit,
# appending to OUT/speed.jsonl. On the GPU machine, from the repo root, after installing .whl/ (bitsandbytes, liger):
#   bash bench/speed_calibration.sh $OUT llama-3.2-1b:lora llama-3.2-1b:lora_liger llama-3.2-1b:full
set -u
out=$1; shift
mkdir -p "$out"
for pair in "$@"; do
  model=${pair%%:*}; group=${pair#*:}
  echo "### $model $group $(date +%T)"
  timeout "${CASE_TIMEOUT:-150}" python3 bench/speed_calibration.py --model "$model" --group "$group" \
    --steps "${STEPS:-6}" --out "$out/speed.jsonl" 2>&1 | grep --line-buffered -v "could not be imported\|Backend impl\|Install it with"
done
