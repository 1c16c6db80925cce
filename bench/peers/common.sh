# Shared by bench/peers/run.sh, run_more.sh and context_lanes.sh (sourced from the repo root, not run): the environment every peer
# runs in (offline, unbuffered), the work folder, the machine's description and the model folder.
# The functions expect PY, OUT, LOGS, DEVICE and T0 to be set.

export PYTHONPATH=${PYTHONPATH:-.:$PWD/.peers_site}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_TELEMETRY=1
WORK=${PEERS_WORK:-/tmp/fitune_peers}
export UNSLOTH_COMPILE_LOCATION=$WORK/unsloth_compiled_cache HF_HOME=$WORK/hf_home

# write_env "settings line": $OUT/env.txt (the machine, the library versions, this call's settings), also printed
write_env() {
  {
    date -u; nvidia-smi -L 2>&1; df -h "$WORK" 2>&1 | tail -1; free -g 2>&1 | head -2
    "$PY" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "cuda", torch.cuda.is_available())' 2>&1
    echo "PYTHONPATH=$PYTHONPATH $1"
  } > "$OUT/env.txt"
  cat "$OUT/env.txt"
}

# make_model_once MODEL [make_model.py args...]: the random-weight model folder, made unless it is already there
make_model_once() {
  local model=$1; shift
  if [ ! -f "$model/peers_meta.json" ]; then
    echo "### make_model -> $model"
    if ! timeout 300 "$PY" bench/peers/make_model.py --out "$model" --device "$DEVICE" "$@" > "$LOGS/make_model.log" 2>&1; then
      echo "make_model failed:"; tail -20 "$LOGS/make_model.log"; exit 1
    fi
    tail -1 "$LOGS/make_model.log"
  fi
  echo "### model ready at $(( $(date +%s) - T0 ))s"
}

# probe_setup: the llama8b model folder (made once; PEERS_MAKE_ARGS: a custom one, to test without a GPU) in MODEL,
# and the probes' --fake-threshold (PEERS_FAKE_THRESHOLD, tests only) in FAKE: what run_more.sh and
# context_lanes.sh share
probe_setup() {
  MODEL=$WORK/llama8b
  local make_args=()
  if [ -n "${PEERS_MAKE_ARGS:-}" ]; then
    read -r -a make_args <<< "$PEERS_MAKE_ARGS"; MODEL=$MODEL.custom
  fi
  FAKE=()
  [ -n "${PEERS_FAKE_THRESHOLD:-}" ] && FAKE=(--fake-threshold "$PEERS_FAKE_THRESHOLD")
  make_model_once "$MODEL" "${make_args[@]}"
}

# search_summary LABEL STACK CAP RC LOG START [MODE]: after one unsloth_max_context.py run, print its SUMMARY line
# (with the exit code and seconds since START); with none, append a summary line saying why to $MC and show the
# log's end
search_summary() {
  local label=$1 stack=$2 cap=$3 rc=$4 log=$5 t=$6 mode=${7:-} line
  line=$(grep -o 'SUMMARY {.*' "$log" | tail -1)
  echo "[$label] rc=$rc $(( $(date +%s) - t ))s ${line#SUMMARY }" | cut -c1-400
  if [ -z "$line" ]; then
    printf '{"stack": "%s", "summary": true, "cap": "%s",%s "longest_tokens": null, "complete": false, "stopped": "no summary: exit code %s"}\n' \
      "$stack" "$cap" "${mode:+ \"mode\": \"$mode\",}" "$rc" >> "$MC"
    tail -8 "$log"
  fi
}
