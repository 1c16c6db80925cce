#!/usr/bin/env bash
# Issue 14: the peers' single GPU call. Llama-3.1-8B-shaped random model, LoRA r8 alpha 16 on q_proj,v_proj, bf16,
# sdpa, 2 x 2048 tokens per optimizer step, AdamW, allocator capped to an RTX 4090's budget; each stack's
# candidates (checkpointing, micro-batch 2 or 1 x 2 accumulation), each in its own process under `timeout`.
#
#   bash bench/peers/wheels.sh                              # here, once: ./.peers_site (< 60 MiB, git-ignored)
#   # on the GPU (carry .peers_site):
#   export PYTHONPATH=.:$PWD/.peers_site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
#   bash bench/peers/run.sh $OUT            # every candidate, 12 steps (about 8 minutes)
#   bash bench/peers/run.sh $OUT --quick    # smoke test: 2-layer model, one candidate per stack, 6 steps
#   PEERS_PASSES=1 bash bench/peers/run.sh $OUT   # pass 1 only: each stack's likeliest best
#   PEERS_ONLY=hf_loop_liger.none.m1x2,unsloth.unsloth.m2 bash bench/peers/run.sh $OUT   # these cases only
#
# Results: $OUT/peers.jsonl (one JSON line per candidate), $OUT/logs_tail.txt (the end of each case's log, kept
# in $PEERS_LOGS), $OUT/env.txt.
# The model folder (16 GB) goes to $PEERS_WORK (default /tmp/fitune_peers), not under $OUT: it must not travel back.
# Pass 1 runs each stack's likeliest-best candidate, pass 2 the rest (likely OOMs last); no case starts once
# fewer than 45 s are left of PEERS_BUDGET_S (default 540 s from the start), and none runs past it.
set -u
OUT=${1:?usage: run.sh OUT [--quick]}
QUICK=0
[ "${2:-}" = "--quick" ] && QUICK=1
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-540}
CASE_LIMIT=${PEERS_CASE_TIMEOUT_S:-150}
. bench/peers/common.sh  # the environment (offline, unbuffered), WORK, and the helpers below
LOGS=${PEERS_LOGS:-$WORK/logs}  # one log per case; the device returns few files, so $OUT gets logs_tail.txt
mkdir -p "$OUT" "$LOGS" "$WORK"
RES=$OUT/peers.jsonl
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}   # cpu + PEERS_MAKE_ARGS="--hidden 64 ..." only to test this script without a GPU

write_env "quick=$QUICK budget=${BUDGET}s case_timeout=${CASE_LIMIT}s"

if [ $QUICK = 1 ]; then
  MODEL=$WORK/llama8b_l2; STEPS=6; MAKE_ARGS=(--layers 2)
else
  MODEL=$WORK/llama8b; STEPS=12; MAKE_ARGS=()
fi
if [ -n "${PEERS_MAKE_ARGS:-}" ]; then
  read -r -a extra <<< "$PEERS_MAKE_ARGS"; MAKE_ARGS+=("${extra[@]}"); MODEL=$MODEL.custom
fi
make_model_once "$MODEL" "${MAKE_ARGS[@]}"

n=0
run_case() {  # run_case NAME SCRIPT ARGS...: one candidate in its own process
  local name=$1 script=$2; shift 2
  if [ -n "${PEERS_ONLY:-}" ] && [[ ",$PEERS_ONLY," != *",$name,"* ]]; then return; fi
  n=$((n + 1))
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ $left -lt 45 ]; then
    echo "[$n $name] skipped: ${left}s left of the ${BUDGET}s budget"
    printf '{"stack": "%s", "grad_checkpointing": "%s", "case": "%s", "fits": null, "error": "skipped: out of the call budget", "steps": %s}\n' \
      "${name%%.*}" "$(echo "$name" | cut -d. -f2)" "$name" "$STEPS" >> "$RES"
    return
  fi
  local limit=$(( left < CASE_LIMIT ? left : CASE_LIMIT ))
  local log=$LOGS/$n-$name.log t=$(date +%s)
  timeout -k 10 $limit "$PY" "bench/peers/$script.py" --model-dir "$MODEL" --out "$RES" --steps $STEPS --device "$DEVICE" "$@" > "$log" 2>&1
  local rc=$? line
  line=$(grep -o 'RESULT {.*' "$log" | tail -1)  # a progress bar's carriage return may precede it on its line
  echo "[$n $name] rc=$rc $(( $(date +%s) - t ))s ${line#RESULT }"
  if [ -z "$line" ]; then  # killed before it could write its line (SIGKILL, a crash in C): record that
    printf '{"stack": "%s", "grad_checkpointing": "%s", "case": "%s", "fits": null, "error": "no record: exit code %s (limit %ss)", "steps": %s}\n' \
      "${name%%.*}" "$(echo "$name" | cut -d. -f2)" "$name" "$rc" "$limit" "$STEPS" >> "$RES"
    tail -8 "$log"
  fi
}

# pass 1: each stack's likeliest best (issue 5: HF fits 2 x 2048 only with full checkpointing, HF + Liger fastest
# at micro-batch 1 x 2 without it; Unsloth's own checkpointing is its default)
run_case hf_trainer.full.m2          hf_trainer --grad-checkpointing full
run_case hf_trainer_liger.none.m1x2  hf_trainer --liger --grad-checkpointing none --micro-batch 1 --grad-accum 2
run_case hf_loop_liger.none.m1x2     hf_loop --liger --grad-checkpointing none --micro-batch 1 --grad-accum 2
run_case unsloth.unsloth.m2          unsloth_run --grad-checkpointing unsloth
if [ $QUICK = 0 ] && [ "${PEERS_PASSES:-2}" = 2 ]; then  # PEERS_PASSES=1: pass 1 only
  # pass 2: the other candidates, likely out-of-memory ones last
  run_case unsloth.none.m1x2         unsloth_run --grad-checkpointing none --micro-batch 1 --grad-accum 2
  run_case hf_trainer_liger.full.m2  hf_trainer --liger --grad-checkpointing full
  run_case hf_loop_liger.full.m2     hf_loop --liger --grad-checkpointing full
  run_case hf_trainer.none.m1x2      hf_trainer --grad-checkpointing none --micro-batch 1 --grad-accum 2
  run_case unsloth.none.m2           unsloth_run --grad-checkpointing none
  run_case hf_trainer_liger.none.m2  hf_trainer --liger --grad-checkpointing none
  run_case hf_loop_liger.none.m2     hf_loop --liger --grad-checkpointing none
  run_case hf_trainer.none.m2        hf_trainer --grad-checkpointing none
fi

for f in "$LOGS"/*.log; do echo "==== $f"; grep -v "could not be imported\|Install it with" "$f" | tail -25; done > "$OUT/logs_tail.txt" 2>&1
echo "### done at $(( $(date +%s) - T0 ))s; $RES:"
"$PY" - "$RES" <<'EOF'
import json, sys
print(f"{'stack':18} {'ckpt':8} {'mb x acc':8} {'fits':5} {'tok/s':>7} {'alloc GiB':>9} {'resv GiB':>8} retries")
for line in open(sys.argv[1]):
    r = json.loads(line)
    g = lambda k: f"{r[k] / 2**30:.2f}" if r.get(k) else "-"
    tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
    mb = f"{r.get('micro_batch_size', '?')}x{r.get('grad_accum', '?')}"
    print(f"{r.get('stack', '?'):18} {str(r.get('grad_checkpointing', r.get('case', '?'))):8} {mb:8} "
          f"{str(r.get('fits')):5} {tps:>7} {g('peak_allocated_bytes'):>9} {g('peak_reserved_bytes'):>8} "
          f"{r.get('num_alloc_retries', '-')}" + (f"  {r['error'][:60]}" if r.get("error") else ""))
EOF
