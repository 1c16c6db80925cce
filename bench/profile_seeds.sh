#!/usr/bin/env bash
# Issue 3's GPU record: the seeds' case under `fitune profile`, capped to an RTX 4090's budget and uncapped.
# Run on the GPU machine from the repository root; writes into $OUT (default ./out).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
SEEDS="llama-3.1-8b --method lora --lora-rank 8 --lora-targets q_proj,v_proj --seq-len 2048 --batch-size 2"
run() {  # name, args...
  local name=$1; shift
  echo "### fitune profile $*" | tee -a "$OUT/profile_log.txt"
  timeout 240 python3 -m fitune profile "$@" --json > "$OUT/$name.json" 2>> "$OUT/profile_log.txt"
  echo "exit status $?" | tee -a "$OUT/profile_log.txt"
}
run seeds_ckpt_capped_rtx4090 $SEEDS --grad-checkpointing full --cap rtx4090 --gpu h200
run seeds_nockpt_capped_rtx4090 $SEEDS --grad-checkpointing none --cap rtx4090 --gpu h200
python3 -m fitune profile $SEEDS --grad-checkpointing full --gpu h200 --plot "$OUT/seeds_ckpt_uncapped.png" \
  > "$OUT/seeds_ckpt_uncapped.txt" 2>> "$OUT/profile_log.txt"
run seeds_ckpt_uncapped $SEEDS --grad-checkpointing full --gpu h200
