#!/usr/bin/env bash
# Issue 12's measured cases: every option the planner can choose, each one `fitune profile` run on the GPU
# machine (random weights, 4 steps, uncapped H200), appended as one JSON line to $OUT/options.jsonl as it ends.
#
#   bash bench/options.sh [FIRST [LAST]]     # from the repository root; runs cases FIRST..LAST (1-based)
#
# Each line is `fitune profile ... --json`'s object plus `case` (its number), `model_arg` (what was passed as
# MODEL, reloadable by `fitune estimate`) and `argv`. fitune/profile/accuracy.py (`compare_profiles`) and
# tests/test_estimator_accuracy.py read them.
set -u
OUT=${OUT:-out}
CASEDIR=${CASEDIR:-$OUT}  # where each case's own JSON goes (the device returns only a few files)
mkdir -p "$OUT" "$CASEDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
FIRST=${1:-1}
LAST=${2:-999}

C="--seq-len 2048 --batch-size 2 --grad-checkpointing full"
L=llama-3.2-1b
Q=qwen2.5-1.5b
CASES=(
  # full fine-tuning and freeze, as a plain transformers script does them (--stack hf)
  "$L --method full --optimizer adamw $C"
  "$L --method full --optimizer adamw8bit $C"
  "$L --method full --optimizer paged_adamw8bit $C"
  "$L --method full --optimizer adafactor $C"
  "$L --method full --optimizer sgd $C"
  "$L --method full --optimizer adamw --seq-len 512 --batch-size 2 --grad-checkpointing none"
  "$L --method freeze --freeze-trainable-layers 4 --optimizer adamw $C"
  "$Q --method full --optimizer adamw $C"
  "$Q --method full --optimizer adamw8bit $C"
  "$Q --method full --optimizer adafactor $C"
  "$Q --method freeze --freeze-trainable-layers 4 --optimizer adamw $C"
  # the same methods on fitune's runner (what `fitune plan` writes)
  "$L --method full --optimizer adamw --stack fitune --loss chunked $C --lean-norm --expandable-segments"
  "$L --method full --optimizer adafactor --stack fitune --loss chunked $C --lean-norm --expandable-segments"
  "$Q --method full --optimizer adamw8bit --stack fitune --loss chunked $C --lean-norm --expandable-segments"
  "$Q --method freeze --freeze-trainable-layers 4 --stack fitune --loss chunked $C --lean-norm --expandable-segments"
  # LoRA with the 8-bit / paged optimizers and fp16
  "$L --method lora --lora-targets all-linear --lora-rank 16 --optimizer adamw8bit $C"
  "$L --method lora --lora-targets all-linear --lora-rank 16 --optimizer paged_adamw8bit $C"
  "$L --method lora --lora-targets all-linear --lora-rank 16 --dtype fp16 $C"
  "$L --method full --dtype fp16 --optimizer adamw $C"
  # fitune's runner with each technique, and Liger's kernels
  "$L --method lora --lora-targets all-linear --lora-rank 16 --stack fitune --loss chunked --lean-lora --kernels liger $C --expandable-segments"
  "$Q --method lora --stack fitune --loss chunked --lean-lora --kernels liger --seq-len 4096 --batch-size 2 --grad-checkpointing none --expandable-segments"
  "$L --method lora --stack fitune --loss chunked --lean-lora --lean-norm --tiled-mlp --seq-len 16384 --batch-size 1 --grad-checkpointing offload --expandable-segments"
  "$Q --method qlora --lora-targets all-linear --lora-rank 32 --stack fitune --loss chunked --lean-lora --lean-norm --seq-len 8192 --batch-size 1 --grad-checkpointing full --expandable-segments"
  # other architectures: Gemma-3, Phi-3, two mixture-of-experts models (fewer layers than the full ones)
  "gemma-3-1b --method lora $C"
  "gemma-3-4b --method lora --lora-targets all-linear --lora-rank 16 --seq-len 4096 --batch-size 1 --grad-checkpointing full"
  "phi-3-mini --method lora --lora-targets all-linear --lora-rank 16 $C"
  "phi-3-mini --method qlora --lora-targets all-linear --lora-rank 16 $C"
  "bench/configs/qwen3-30b-a3b-8layers.json --method lora $C"
  "bench/configs/mixtral-8x7b-4layers.json --method lora $C"
  "bench/configs/qwen3-30b-a3b-8layers.json --method lora --stack fitune --loss chunked --lean-lora $C --lean-norm --expandable-segments"
  # the loop people write: the model output kept alive through backward
  "llama-3.1-8b --method lora --keep-outputs $C"
  # the seeds' case as `fitune plan llama-3.1-8b --gpu rtx4090 --seq-len 2048 --batch-size 2` writes it (plans 1, 2)
  "llama-3.1-8b --method lora --stack fitune --loss chunked --lean-lora --lean-norm --expandable-segments $C"
  "llama-3.1-8b --method lora --stack fitune --lean-lora --lean-norm --expandable-segments $C"
)
echo "# bench/options.sh $FIRST $LAST ($(date -u +%FT%TZ))" >> "$OUT/options_log.txt"
for i in "${!CASES[@]}"; do
  n=$((i + 1))
  [ "$n" -lt "$FIRST" ] || [ "$n" -gt "$LAST" ] && continue
  args=${CASES[$i]}
  echo "### case $n: fitune profile $args --steps 4 --gpu h200 --json" | tee -a "$OUT/options_log.txt"
  # shellcheck disable=SC2086
  timeout 150 python3 -m fitune profile $args --steps 4 --gpu h200 --json > "$CASEDIR/case_$n.json" 2>> "$OUT/options_log.txt"
  rc=$?
  echo "exit status $rc" | tee -a "$OUT/options_log.txt"
  python3 - "$CASEDIR/case_$n.json" "$n" "$args" "$rc" >> "$OUT/options.jsonl" <<'EOF'
import json, sys
path, n, args, rc = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
try:
    doc = json.load(open(path))
except ValueError:
    doc = {"ok": False, "error": open(path).read()[-500:]}
doc.pop("timeline", None)  # the memory over time: kept in the case file, not in the summary line
doc.setdefault("ok", rc == 0 and not doc.get("oom"))
doc.update(case=n, model_arg=args.split()[0], argv=args, exit_status=rc)
print(json.dumps(doc))
EOF
  tail -c 300 "$OUT/options_log.txt" | grep -i "error\|Traceback" | tail -2
done
