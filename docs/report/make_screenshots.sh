#!/usr/bin/env bash
# Re-makes the screenshots of docs/report.md from real fitune output (CPU only, ~30 s):
#   bash docs/report/make_screenshots.sh        (from the repository root, after `make test` set up .venv)
# Needs /usr/bin/chromium and the playwright package (both installed by `make test`).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.venv/bin
OUT=docs/report
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

$BIN/fitune estimate llama-3.1-8b --gpu rtx4090 --json > "$WORK/estimate.json"
$BIN/fitune report estimate "$WORK/estimate.json" -o "$WORK/estimate.html"
$BIN/fitune estimate llama-3.1-8b --grad-checkpointing full --gpu rtx4090 --json > "$WORK/estimate_ckpt.json"
$BIN/fitune report estimate "$WORK/estimate_ckpt.json" --measured bench/results/profile/seeds_ckpt_uncapped.json \
    -o "$WORK/estimate_measured.html"
$BIN/fitune plan llama-3.1-8b --gpu rtx4090 --json > "$WORK/plan.json"
$BIN/fitune report plan "$WORK/plan.json" -o "$WORK/plan.html"
$BIN/fitune report profile bench/results/profile/seeds_ckpt_uncapped.json -o "$WORK/profile.html"
$BIN/fitune report profile bench/results/profile/llama-3.2-1b_ckpt_timeline_cuda.json -o "$WORK/profile_timeline.html"
script=tests/fixtures/doctor/scripts/checkpoint-reentrant.py
$BIN/fitune doctor "$script" --json > "$WORK/doctor.json" || true   # exit 1: it has an error-severity finding
$BIN/fitune report doctor "$WORK/doctor.json" --script "$script" -o "$WORK/doctor.html"

# a tiny CPU run of fitune train, and a CPU profile with its memory timeline (through the Python API here;
# `fitune profile --json` prints the same timeline)
$BIN/python - "$WORK" <<'PY'
import json, os, sys
sys.path.insert(0, "tests")
from tiny import make_chat_data, make_model_folder, write_config
work = sys.argv[1]
model = make_model_folder(f"{work}/model")
make_chat_data(f"{work}/train.jsonl", n=96)
make_chat_data(f"{work}/eval.jsonl", n=8, seed=1)
write_config(f"{work}/run.yaml", model=model, data={"path": f"{work}/train.jsonl", "format": "chat",
             "eval_path": f"{work}/eval.jsonl"}, method="lora", lora={"rank": 8, "alpha": 16,
             "targets": ["q_proj", "v_proj"]}, seq_len=32, batch_size=4, max_steps=40, lr=5e-3,
             output_dir=f"{work}/run", dtype="fp32", schedule="cosine", warmup_steps=4, eval_every=10, seed=3)
os.makedirs(f"{work}/tiny", exist_ok=True)
with open(f"{work}/tiny/config.json", "w") as f:
    json.dump({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
               "max_position_embeddings": 512}, f)
from fitune.profile.run import profile
from fitune.report import write_html
from fitune.setup import TrainSetup
from fitune.specs.model import load_model_spec
spec = load_model_spec(f"{work}/tiny/config.json")
r = profile(spec, TrainSetup(batch_size=2, seq_len_tokens=64), source=f"{work}/tiny/config.json", steps=3, device="cpu")
doc = r.to_json()
write_html("profile", doc, f"{work}/profile_cpu.html")
PY
$BIN/fitune train "$WORK/run.yaml" --no-progress > /dev/null 2>&1
$BIN/fitune report train "$WORK/run" -o "$WORK/train.html"

$BIN/python - "$WORK" "$OUT" <<'PY'
import sys
from playwright.sync_api import sync_playwright
work, out = sys.argv[1:]
flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    for name in ("estimate", "estimate_measured", "plan", "profile", "profile_cpu", "train", "doctor"):
        page.goto(f"file://{work}/{name}.html")
        page.screenshot(path=f"{out}/{name}.png", full_page=True)
    # the H200 profile's memory over time: by category, the allocator's counters, the estimate's tape
    page.goto(f"file://{work}/profile_timeline.html")
    page.locator('figure.chart[data-chart="memory over time"]').screenshot(path=f"{out}/profile_timeline.png")
    # plan #3 clicked: its row selected, its breakdown open
    page.goto(f"file://{work}/plan.html")
    page.locator('.plan-row[data-plan="2"] button').click()
    page.screenshot(path=f"{out}/plan_clicked.png", full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": 1150})
    # hovering a bar segment: its bytes and what the term is
    page.goto(f"file://{work}/estimate.html")
    page.locator('rect[data-category="logits_and_loss"]').first.hover()
    page.screenshot(path=f"{out}/estimate_hover.png", clip={"x": 0, "y": 150, "width": 1280, "height": 420})
    browser.close()
PY
ls -la "$OUT"/*.png
