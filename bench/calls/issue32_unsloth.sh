#!/usr/bin/env bash
# Issue 32, fitune against Unsloth's strongest setups, in one call on a card capped at the 24 GB card's 23.4 GiB:
# Llama-3.1-8B-shaped random weights, 2 x 2048 tokens per optimizer step, 12 steps (tokens/s: the median of steps 3
# and later). Two workloads: (a) the seeds' LoRA r8 alpha 16 on q_proj,v_proj, bf16; (b) QLoRA r16 (Unsloth: alpha
# 32) on every linear layer, 4-bit NF4 base. fitune runs along the user's path (bench/rank_check.py: `fitune plan
# --write --pick 1`, then `fitune train`, plan 1 only); Unsloth (bench/peers/unsloth_run.py) with its model driven by
# a plain PyTorch loop (`--loop plain`) and by its SFTTrainer. Most important first; a case not started for want of
# budget, or killed before it wrote its line, is a record saying so (with fits null); one that does not fit is a
# record with fits false.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue32_unsloth.sh $OUT
#   U32_ONLY=unsloth_plain_lora_nogc_m1a2,fitune_seeds bash bench/calls/issue32_unsloth.sh $OUT   # these cases only
# Results: $OUT/rank_check.jsonl (fitune), $OUT/peers.jsonl (Unsloth), $OUT/logs_tail.txt, $OUT/env.txt. The model
# folder (16 GB) and fitune's run folders stay in $PEERS_WORK (default /tmp/fitune_peers): they must not travel back.
set -u
OUT=${1:?usage: issue32_unsloth.sh OUT}
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-560}
CASE_LIMIT=${U32_CASE_S:-180}  # seconds one case may take (loading the 8B folder, quantizing it for QLoRA, 12 steps)
MIN_LEFT=${U32_MIN_S:-60}      # a case is not started with less than this left
STEPS=${U32_STEPS:-12}
. bench/peers/common.sh
LOGS=${PEERS_LOGS:-$WORK/logs_issue32_unsloth}
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}   # cpu + PEERS_MAKE_ARGS="--layers 2 --hidden 64 ..." only to test this script
CAP=${PEERS_CAP-rtx4090}
mkdir -p "$OUT" "$LOGS" "$WORK"
write_env "budget=${BUDGET}s case_limit=${CASE_LIMIT}s steps=$STEPS cap=$CAP issue32_unsloth"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
probe_setup
PEERS=$OUT/peers.jsonl
FITUNE=$OUT/rank_check.jsonl
QLORA=(--qlora --lora-rank 16 --lora-targets all-linear)

note() {  # note FILE NAME STACK WHY: the record of a case that wrote none (through write_record: provenance)
  "$PY" - "$@" <<'PYEOF'
import sys

from bench.common import training_facts, write_record

path, name, stack, why = sys.argv[1:5]
write_record(path, {"case": name, "stack": stack, "fits": None, "error": why},
             training=training_facts([], None, why_none=why))
PYEOF
}

start() {  # start NAME FILE STACK: prints the case's time limit; nothing (and a record) when it is not run
  local l; l=$(left)
  if [ -n "${U32_ONLY:-}" ] && [[ ",$U32_ONLY," != *",$1,"* ]]; then return; fi
  if [ "$l" -lt "$MIN_LEFT" ]; then
    echo "[$1] skipped: ${l}s left of the ${BUDGET}s budget" >&2
    note "$2" "$1" "$3" "skipped: ${l}s left of the ${BUDGET}s budget (a case needs ${MIN_LEFT}s)" >&2
    return
  fi
  echo $(( l < CASE_LIMIT ? l : CASE_LIMIT ))
}

fitune_case() {  # fitune_case NAME WORKLOAD [--set KEY=VALUE ...]: bench/rank_check.py's plan 1 of WORKLOAD (with
  # the keys changed, a variant of it); its line to $FITUNE
  local name=$1 workload=$2 limit t rc dir=$WORK/rc_$1
  shift 2
  limit=$(start "$name" "$FITUNE" fitune); [ -z "$limit" ] && return
  t=$(date +%s); rm -rf "$dir"
  timeout -k 10 "$limit" "$PY" bench/rank_check.py --out "$dir" --workload "$workload" --steps "$STEPS" --plans 1 \
    --cap "$CAP" --timeout $(( limit > 60 ? limit - 30 : limit / 2 )) --case "$name" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "[$name] rc=$rc $(( $(date +%s) - t ))s $(grep '^{' "$LOGS/$name.log" | tail -1 | cut -c1-400)"
  if [ -s "$dir/rank_check.jsonl" ]; then
    cat "$dir/rank_check.jsonl" >> "$FITUNE"
  else
    note "$FITUNE" "$name" fitune "no record: exit code $rc (limit ${limit}s)"; tail -8 "$LOGS/$name.log"
  fi
  rm -rf "$dir/work"  # the run's folder (adapter, tokenizer, data): not results
}

hf_loop_case() {  # hf_loop_case NAME [hf_loop.py flags ...]: transformers + PEFT in a plain loop; its line to $PEERS
  local name=$1 limit t rc line; shift
  limit=$(start "$name" "$PEERS" hf_loop); [ -z "$limit" ] && return
  t=$(date +%s)
  timeout -k 10 "$limit" "$PY" bench/peers/hf_loop.py --model-dir "$MODEL" --out "$PEERS" --steps "$STEPS" \
    --cap "$CAP" --device "$DEVICE" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  line=$(grep -o 'RESULT {.*' "$LOGS/$name.log" | tail -1)
  echo "[$name] rc=$rc $(( $(date +%s) - t ))s ${line#RESULT }"
  if [ -z "$line" ]; then
    note "$PEERS" "$name" hf_loop "no record: exit code $rc (limit ${limit}s)"; tail -8 "$LOGS/$name.log"
  fi
}

unsloth_case() {  # unsloth_case NAME [unsloth_run.py flags ...]: one candidate in its own process; its line to $PEERS
  local name=$1 limit t rc line; shift
  limit=$(start "$name" "$PEERS" unsloth); [ -z "$limit" ] && return
  t=$(date +%s)
  timeout -k 10 "$limit" "$PY" bench/peers/unsloth_run.py --model-dir "$MODEL" --out "$PEERS" --steps "$STEPS" \
    --cap "$CAP" --device "$DEVICE" --case "$name" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  line=$(grep -o 'RESULT {.*' "$LOGS/$name.log" | tail -1)  # a progress bar's carriage return may precede it
  echo "[$name] rc=$rc $(( $(date +%s) - t ))s ${line#RESULT }"
  if [ -z "$line" ]; then  # killed before it could write its line (SIGKILL, a crash in C): record that
    note "$PEERS" "$name" unsloth "no record: exit code $rc (limit ${limit}s)"; tail -8 "$LOGS/$name.log"
  fi
}

run_named() {  # run_named NAME[-rN]: the case NAME (-rN: its N-th run in this call, a record of its own)
  local name=$1 base=${1%-r[0-9]*} k
  case $base in
    fitune_seeds)                  fitune_case "$name" seeds ;;
    fitune_qlora_seeds)            fitune_case "$name" qlora_seeds ;;
    fitune_seeds_eager)            fitune_case "$name" seeds_eager --plans 2 ;;  # plans 1 and 2, uncompiled
    # variants of QLoRA plan 1: micro-batch 2 with 8-bit AdamW and checkpointing on the first K layers only;
    # micro-batch 1 x 2 without checkpointing (where the OOM guard took the tight plan of commit 58459bd)
    fitune_qlora_sel[0-9]*)        k=${base#fitune_qlora_sel}
                                   fitune_case "$name" qlora_seeds --set batch_size=2 --set grad_accum=1 \
                                     --set grad_checkpointing=selective:$k --set optimizer=adamw8bit ;;
    fitune_qlora_m1a2)             fitune_case "$name" qlora_seeds --set batch_size=1 --set grad_accum=2 \
                                     --set grad_checkpointing=none --set optimizer=adamw8bit ;;
    unsloth_plain_lora_nogc_m1a2)  unsloth_case "$name" --loop plain --grad-checkpointing none --micro-batch 1 \
                                     --grad-accum 2 ;;
    unsloth_sft_qlora_gc_m2)       unsloth_case "$name" --loop sfttrainer "${QLORA[@]}" --grad-checkpointing unsloth \
                                     --micro-batch 2 ;;
    unsloth_plain_qlora_nogc_m1a2) unsloth_case "$name" --loop plain "${QLORA[@]}" --grad-checkpointing none \
                                     --micro-batch 1 --grad-accum 2 ;;
    unsloth_plain_qlora_gc_m2)     unsloth_case "$name" --loop plain "${QLORA[@]}" --grad-checkpointing unsloth \
                                     --micro-batch 2 ;;
    unsloth_plain_lora_nogc_m2)    unsloth_case "$name" --loop plain --grad-checkpointing none --micro-batch 2 ;;
    hf_loop_liger_m1a2)            hf_loop_case "$name" --liger --grad-checkpointing none --micro-batch 1 \
                                     --grad-accum 2 ;;
    *) echo "[$name] not a case of this script" >&2 ;;
  esac
}

# U32_ORDER: the cases to run, in this order, repeats named NAME-r2, NAME-r3 ... (medians of one call). Without it:
# (a) LoRA r8 q,v: fitune's plan 1, then Unsloth's strongest seen (its model in a plain loop, no checkpointing,
# micro-batch 1 x 2); (b) QLoRA r16 all-linear: fitune's plan 1, Unsloth's notebook path (SFTTrainer, its own
# checkpointing, micro-batch 2), its plain loop without and with checkpointing; last, LoRA in the plain loop at
# micro-batch 2 without checkpointing (likely out of memory). U32_ONLY filters either list.
ORDER=${U32_ORDER:-fitune_seeds,unsloth_plain_lora_nogc_m1a2,fitune_qlora_seeds,unsloth_sft_qlora_gc_m2,unsloth_plain_qlora_nogc_m1a2,unsloth_plain_qlora_gc_m2,unsloth_plain_lora_nogc_m2,fitune_qlora_sel2,fitune_qlora_sel3,fitune_qlora_sel4,fitune_qlora_m1a2}
[ -z "${U32_ORDER:-}" ] && [ -z "${U32_ONLY:-}" ] && ORDER=${ORDER%%,fitune_qlora_sel2*}  # variants: when named
for c in ${ORDER//,/ }; do run_named "$c"; done

for f in "$LOGS"/*.log; do echo "==== $f"; grep -v "could not be imported\|Install it with" "$f" | tail -25; done \
  > "$OUT/logs_tail.txt" 2>&1
echo "### done at $(( $(date +%s) - T0 ))s"
"$PY" - "$FITUNE" "$PEERS" <<'PYEOF'
import json, os, sys
print(f"{'case':32} {'method':6} {'loop / plan':22} {'ckpt':8} {'mb x acc':8} {'fits':5} {'tok/s':>7} {'alloc GiB':>9}")
for path in sys.argv[1:]:
    for line in open(path) if os.path.exists(path) else []:
        r = json.loads(line)
        g = lambda k: f"{r[k] / 2**30:.2f}" if r.get(k) else "-"
        if "workload" in r and "plan" in r:  # bench/rank_check.py's line: fitune's plan 1
            s = r.get("setup") or {}
            tps = r.get("tokens_per_s_median")
            mb = f"{s.get('batch_size', '?')}x{s.get('grad_accum', '?')}"
            print(f"{'fitune ' + r['workload']:32} {s.get('method', '?'):6} {'plan ' + str(r['plan']):22} "
                  f"{str(s.get('grad_checkpointing')):8} {mb:8} {str(r['exit'] == 0):5} "
                  f"{f'{tps:.0f}' if tps else '-':>7} {g('peak_allocated_bytes'):>9}")
            continue
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        mb = f"{r.get('micro_batch_size', '?')}x{r.get('grad_accum', '?')}"
        print(f"{str(r.get('case') or r.get('stack')):32} {str(r.get('method', '?')):6} {str(r.get('loop', '?')):22} "
              f"{str(r.get('grad_checkpointing', '?')):8} {mb:8} {str(r.get('fits')):5} {tps:>7} "
              f"{g('peak_allocated_bytes'):>9}" + (f"  {r['error'][:60]}" if r.get("error") else ""))
PYEOF
