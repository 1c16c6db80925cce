#!/usr/bin/env bash
# Issue 14, the second peers' GPU call(s): "context per card size" (Unsloth and fitune, Llama-3.1-8B-shaped, QLoRA
# r32 all-linear, batch 1, AdamW, the longest sequence under five allocator caps: bench/peers/unsloth_max_context.py)
# and "real-length data" (HF Trainer, TRL packing, fitune on one instruction-like length distribution:
# bench/peers/real_length.py). Every search / case in its own process(es) under `timeout`.
#
#   bash bench/peers/wheels.sh                                  # here, once: ./.peers_site (git-ignored)
#   # on the GPU (carry .peers_site):
#   export PYTHONPATH=.:$PWD/.peers_site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
#   bash bench/peers/run_more.sh $OUT                     # every part, in priority order, as far as the budget goes
#   bash bench/peers/run_more.sh $OUT fitune@23.4GiB 11.4GiB real_length:hf_trainer     # chosen parts
#
# Parts (default, in this order): 23.4GiB 11.4GiB 7.4GiB 15.4GiB 47.4GiB real_length. A cap runs both stacks'
# searches (unsloth, then fitune); STACK@CAP one of them; real_length the three stacks (hf_trainer, trl_packing,
# fitune; hf_trainer again at micro-batch 2 x 2 accumulation when 4 does not fit), real_length:STACK one.
# Budget: PEERS_BUDGET_S (default 560 s from the start, model folder included); a part that would start with less
# than it needs left (a search 150 s, a real-length case 90 s) is skipped with a JSON line saying so; searches get
# --budget-s = what is left, so none runs past it. Resolution and probe limit per cap: 7.4GiB 1024 / 240 s,
# 11.4GiB 2048 / 300 s, 15.4GiB 2048 / 360 s, 23.4GiB 4096 / 420 s, 47.4GiB 8192 / 540 s and one step per probe
# instead of two (a step near 200k tokens takes minutes; Adam's states, 0.63 GiB, are 1.3 % of that budget).
#
# Results: $OUT/max_context.jsonl (a line per probe, a summary line per search), $OUT/real_length.jsonl,
# $OUT/logs_tail.txt (the end of every log of this call, kept in $PEERS_LOGS), $OUT/env.txt. The 16 GB model folder goes to
# $PEERS_WORK (default /tmp/fitune_peers; made once, reused while the machine stays warm), never under $OUT.
# Without a GPU (to test this script): PEERS_DEVICE=cpu PEERS_MAKE_ARGS="--hidden 64 ..." PEERS_FAKE_THRESHOLD=N.
set -u
OUT=${1:?usage: run_more.sh OUT [PART ...]}
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(23.4GiB 11.4GiB 7.4GiB 15.4GiB 47.4GiB real_length)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-560}
. bench/peers/common.sh  # the environment (offline, unbuffered), WORK, and the helpers below
LOGS=${PEERS_LOGS:-$WORK/logs_more/$(date -u +%Y%m%d-%H%M%S)}  # this call's logs only
mkdir -p "$LOGS" "$WORK" "$OUT"
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}
MC=$OUT/max_context.jsonl
RL=$OUT/real_length.jsonl
RL_STEPS=${PEERS_RL_STEPS:-20}

write_env "budget=${BUDGET}s parts=${PARTS[*]} device=$DEVICE"
probe_setup

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

search() {  # search STACK CAP: one longest-context search (its probes in their own processes)
  local stack=$1 cap=$2 res limit steps=2 l
  case $cap in
    7.4GiB) res=1024; limit=240 ;; 11.4GiB) res=2048; limit=300 ;; 15.4GiB) res=2048; limit=360 ;;
    23.4GiB) res=4096; limit=420 ;; *) res=8192; limit=540; steps=1 ;;
  esac
  l=$(left)
  if [ "$l" -lt 150 ]; then
    echo "[$stack@$cap] skipped: ${l}s left of the ${BUDGET}s budget"
    printf '{"stack": "%s", "summary": true, "cap": "%s", "longest_tokens": null, "complete": false, "stopped": "skipped: %ss left of the call budget"}\n' "$stack" "$cap" "$l" >> "$MC"
    return
  fi
  local log=$LOGS/search_${stack}_$cap.log t=$(date +%s)
  timeout -k 30 "$l" "$PY" bench/peers/unsloth_max_context.py --stack "$stack" --cap "$cap" --model-dir "$MODEL" \
    --out "$MC" --resolution "$res" --probe-timeout "$limit" --steps "$steps" --budget-s $(( l - 20 )) --log-dir "$LOGS" \
    --work "$WORK/max_context" --device "$DEVICE" "${FAKE[@]}" > "$log" 2>&1
  search_summary "$stack@$cap" "$stack" "$cap" $? "$log" "$t"
}

RL_LAST=""
real_length() {  # real_length STACK [ARGS]: one real-length run
  local stack=$1; shift
  local l name=$stack${1:+.mb$2}
  l=$(left)
  if [ "$l" -lt 90 ]; then
    echo "[real_length $name] skipped: ${l}s left of the ${BUDGET}s budget"
    printf '{"stack": "%s", "workload": "real_length", "fits": null, "error": "skipped: out of the call budget", "steps": %s}\n' "$stack" "$RL_STEPS" >> "$RL"
    RL_LAST=""; return
  fi
  local limit=$(( l < 400 ? l : 400 )) log=$LOGS/real_length_$name.log t=$(date +%s)
  timeout -k 20 "$limit" "$PY" bench/peers/real_length.py --stack "$stack" --model-dir "$MODEL" --out "$RL" \
    --steps "$RL_STEPS" --cap "${PEERS_CAP-rtx4090}" --device "$DEVICE" --work "$WORK/real_length" \
    --timeout $(( limit - 20 )) "$@" > "$log" 2>&1
  local rc=$?
  RL_LAST=$(grep -o 'RESULT {.*' "$log" | tail -1)
  echo "[real_length $name] rc=$rc $(( $(date +%s) - t ))s ${RL_LAST#RESULT }"
  if [ -z "$RL_LAST" ]; then
    printf '{"stack": "%s", "workload": "real_length", "fits": null, "error": "no record: exit code %s (limit %ss)", "steps": %s}\n' "$stack" "$rc" "$limit" "$RL_STEPS" >> "$RL"
    tail -8 "$log"
  fi
}

real_length_part() {  # real_length_part STACK
  real_length "$1"
  if [ "$1" = hf_trainer ] && echo "$RL_LAST" | grep -q '"fits": false'; then
    real_length hf_trainer --micro-batch 2 --grad-accum 2  # what its user does next
  fi
}

for part in "${PARTS[@]}"; do
  case $part in
    real_length) for s in hf_trainer trl_packing fitune; do real_length_part "$s"; done ;;
    real_length:*) real_length_part "${part#real_length:}" ;;
    *@*) search "${part%@*}" "${part#*@}" ;;
    *) search unsloth "$part"; search fitune "$part" ;;
  esac
done

for f in "$LOGS"/*.log; do echo "==== $f"; grep -v "could not be imported\|Install it with\|it/s\]\|examples/s\]" "$f" | tail -30; done > "$OUT/logs_tail.txt" 2>&1
echo "### done at $(( $(date +%s) - T0 ))s"
"$PY" - "$MC" "$RL" <<'EOF'
import json, os, sys
mc, rl = sys.argv[1:3]
if os.path.exists(mc):
    print(f"{'stack':8} {'cap':8} {'longest':>8} {'upper':>8} {'complete':8} probes")
    for line in open(mc):
        r = json.loads(line)
        if r.get("summary"):
            print(f"{r['stack']:8} {r['cap']:8} {str(r.get('longest_tokens')):>8} {str(r.get('upper_bound_tokens')):>8} "
                  f"{str(r.get('complete')):8} {len(r.get('probes') or [])}" + (f"  {r['stopped'][:70]}" if r.get("stopped") else ""))
if os.path.exists(rl):
    print(f"{'stack':12} {'mb x acc':8} {'fits':5} {'trained/s':>9} {'padded/s':>9} {'pad %':>5} {'resv GiB':>8}")
    for line in open(rl):
        r = json.loads(line)
        f = lambda k: f"{r[k]:.0f}" if r.get(k) else "-"
        pad = f"{100 * r['padding_share']:.0f}" if r.get("padding_share") is not None else "-"
        resv = f"{r['peak_reserved_bytes'] / 2**30:.2f}" if r.get("peak_reserved_bytes") else "-"
        print(f"{r.get('stack', '?'):12} {str(r.get('micro_batch_size'))+'x'+str(r.get('grad_accum')):8} {str(r.get('fits')):5} "
              f"{f('trained_tokens_per_s'):>9} {f('padded_tokens_per_s'):>9} {pad:>5} {resv:>8}" + (f"  {r['error'][:60]}" if r.get("error") else ""))
EOF
