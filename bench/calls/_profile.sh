# Sourced by the call scripts that profile fitune's plan-1 steps (issue32_window.sh, issue32_gaps.sh):
#   profile NAME WORKLOAD [bench/step_profile.py flags ...]
# runs bench/step_profile.py (8 steps, the profiler over steps 5-7) while BUDGET seconds since T0 leave at least 60,
# appends its record to OUT/step_profile.jsonl, and with KEEP_TRACES=1 copies its Chrome trace to OUT.
# Needs OUT, T0, BUDGET, PY and WORK set.
profile() {
  local name=$1 workload=$2 l; shift 2
  l=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$l" -lt 60 ]; then echo "[$name] skipped: ${l}s left"; return; fi
  timeout -k 10 "$l" "$PY" bench/step_profile.py --out "$WORK/prof_$name" --workload "$workload" --steps 8 \
    --profile-from 4 --profile-steps 3 "$@" > "$WORK/prof_$name.log" 2>&1
  echo "[$name] rc=$? $(grep '^{' "$WORK/prof_$name.log" | tail -1 | cut -c1-400)"
  cat "$WORK/prof_$name/step_profile.jsonl" >> "$OUT/step_profile.jsonl" 2>/dev/null || tail -8 "$WORK/prof_$name.log"
  if [ "${KEEP_TRACES:-0}" = 1 ]; then cp "$WORK/prof_$name"/trace.*.json.gz "$OUT/" 2>/dev/null; fi
}
