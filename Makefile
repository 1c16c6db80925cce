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
	$(PIP) install -q $(STACK_PINS) pytest pyyaml matplotlib

test: install-test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
