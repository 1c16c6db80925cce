#!/usr/bin/env bash
# Issue 14, "context per card size", in lanes: a few fixed-length probes per stack and cap (unsloth_max_context.py
# --lengths), lanes run side by side on the one GPU. Only whether a length fits is measured here (each probe's
# allocator is capped on its own, so probes running at the same time do not change each other's answer), never
# speed. Each lane runs its items one after the other; the lanes run at the same time.
#
#   export PYTHONPATH=.:$PWD/.peers_site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
#   bash bench/peers/context_lanes.sh $OUT "fitune@23.4GiB:plan,131072 fitune@15.4GiB:plan" \
#                                          "unsloth@7.4GiB:5461,2972 unsloth@11.4GiB:30720,21848"
#
# An item is STACK@CAP:LENGTHS[:KEY=VALUE] (LENGTHS as --lengths: comma-separated, 'plan' = fitune plan's longest;
# KEY=VALUE: fitune, a setup key set in the written plan, --fitune-set, or plan_at=N, --fitune-plan-at, or
# optimizer=NAME, --fitune-optimizer (fitune's first plan with that optimizer; default any: plan 1), or
# plan_optimizer=NAME, --fitune-plan-optimizer (`fitune plan --optimizer NAME`: plan 1 of the plans with it),
# host_ram=NGiB, --fitune-host-ram (the host RAM fitune plan holds its plans to), plan_gpu=NGiB, --fitune-plan-gpu
# (the budget fitune plan plans for, under the cap), or method=lora|qlora; several
# joined by '+'). Unsloth runs
# with its notebooks' optimizer (--optim adamw_8bit), fitune with its plan 1 (--fitune-optimizer any): each stack
# at its own best. PEERS_BUDGET_S (default 560) bounds the whole call; an item starts only with 90 s left.
# Results: $OUT/max_context.jsonl (a line per probe, a summary per item), $OUT/lanes_tail.txt.
set -u
OUT=${1:?usage: context_lanes.sh OUT "LANE" ["LANE" ...]}
shift
cd "$(dirname "$0")/../.."
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-560}
. bench/peers/common.sh
LOGS=${PEERS_LOGS:-$WORK/logs_lanes/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$LOGS" "$WORK" "$OUT"
PY=${PYTHON:-python3}
DEVICE=${PEERS_DEVICE:-cuda}
MC=$OUT/max_context.jsonl
STEPS=${PEERS_STEPS:-2}
write_env "budget=${BUDGET}s lanes=$* device=$DEVICE steps=$STEPS"
probe_setup

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

item() {  # item STACK@CAP:LENGTHS[:KEY=VALUE[,KEY=VALUE]]
  local spec=$1 stack cap lengths sets=() kv l
  stack=${spec%%@*}; cap=${spec#*@}; lengths=${cap#*:}; cap=${cap%%:*}
  if [[ $lengths == *:* ]]; then
    local IFS=+
    for kv in ${lengths#*:}; do
      case $kv in
        plan_at=*) sets+=(--fitune-plan-at "${kv#plan_at=}") ;;
        plan_gpu=*) sets+=(--fitune-plan-gpu "${kv#plan_gpu=}") ;;
        host_ram=*) sets+=(--fitune-host-ram "${kv#host_ram=}") ;;
        method=*) sets+=(--method "${kv#method=}") ;;
        optimizer=*) sets+=(--fitune-optimizer "${kv#optimizer=}") ;;  # fitune's first plan with this optimizer
        plan_optimizer=*) sets+=(--fitune-plan-optimizer "${kv#plan_optimizer=}") ;;  # fitune plan --optimizer
        *) sets+=(--fitune-set "$kv") ;;
      esac
    done
    unset IFS
    lengths=${lengths%%:*}
  fi
  l=$(left)
  if [ "$l" -lt 90 ]; then
    echo "[$spec] skipped: ${l}s left"
    printf '{"stack": "%s", "summary": true, "cap": "%s", "mode": "lengths", "longest_tokens": null, "complete": false, "stopped": "skipped: %ss left of the call budget"}\n' "$stack" "$cap" "$l" >> "$MC"
    return
  fi
  local log=$LOGS/lane_${stack}_$cap${sets[1]:+_${sets[1]}}.log t=$(date +%s)
  timeout -k 30 "$l" "$PY" bench/peers/unsloth_max_context.py --stack "$stack" --cap "$cap" --model-dir "$MODEL" \
    --out "$MC" --lengths "$lengths" --steps "$STEPS" --probe-timeout "$(( l - 15 ))" --budget-s "$(( l - 10 ))" \
    --min-probe-s 60 --optim adamw_8bit --fitune-optimizer any --log-dir "$LOGS" --work "$WORK/max_context" \
    --device "$DEVICE" "${sets[@]}" "${FAKE[@]}" > "$log" 2>&1
  search_summary "$spec" "$stack" "$cap" $? "$log" "$t" lengths
}

lane() { local spec; for spec in $1; do item "$spec"; done; }

for spec in "$@"; do lane "$spec" & done
wait
for f in "$LOGS"/*.log; do echo "==== $f"; grep -v "could not be imported\|Install it with\|it/s\]\|examples/s\]" "$f" | tail -30; done > "$OUT/lanes_tail.txt" 2>&1
echo "### done at $(( $(date +%s) - T0 ))s"
