"""Moved to the torch backend's folder: runtime/backends/pytorch/compiled.py (the compiled
steps) and runtime/backends/pytorch/placement.py (devices, dtypes, loading). Kept, one way
and defining nothing, only for the callers merged beside this move (scripts/gpu_e2e.py,
scripts/gpu_steps.py, tests/test_gpu_e2e.py); delete it once they import the new paths."""

from runtime.backends.pytorch.compiled import *  # noqa: F401,F403
from runtime.backends.pytorch.compiled import (  # noqa: F401 -- what those callers import
    BufferPool, CompiledBatchDFlash, CompiledBatchTarget, CompiledDFlash, CompiledPARD,
    CompiledTarget, EngineSteps, compile_step)
from runtime.backends.pytorch.placement import (  # noqa: F401
    load_dflash, load_target, place, resolve_device, resolve_dtype)
