"""The hook in every Python process, workers included, when SHARPDRAFT_TRTLLM is set.

TensorRT-LLM's LLM API runs the model in MPI worker processes (mpi4py), not in the
process that called LLM() or trtllm-serve; an `install()` there never reaches them. A
`.pth` file in site-packages runs in every interpreter that starts, workers included,
and inherits the environment, so `python -m plugins.trtllm autoload install` writes one
line there that, only when SHARPDRAFT_TRTLLM holds a QueryScaling as JSON, runs this
file: it makes this checkout importable and calls install().

Trade-offs (docs/trtllm.md): every Python process in that environment pays one
os.environ lookup; with the variable set, each one also imports torch (through
plugins.scaling) and adds this checkout to sys.path (top-level names `plugins`,
`runtime`, `build`), so set the variable only for TensorRT-LLM's processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "SHARPDRAFT_TRTLLM"
CHECKOUT = Path(__file__).resolve().parents[2]
PTH_NAME = "sharpdraft_trtllm.pth"


def env_value(scaling) -> str:
    """What to put in SHARPDRAFT_TRTLLM for this QueryScaling."""
    return json.dumps(scaling.to_dict(), sort_keys=True)


def pth_line() -> str:
    # .pth lines that start with `import` are executed by site.py; one line, no newlines.
    return (f"import os; os.environ.get({ENV!r}) and "
            f"__import__('runpy').run_path({str(Path(__file__).resolve())!r})\n")


def install_from_env() -> bool:
    """install() with the QueryScaling in SHARPDRAFT_TRTLLM; False when it is unset."""
    value = os.environ.get(ENV)
    if not value:
        return False
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))  # appended: never shadows the environment's packages
    from plugins.scaling import QueryScaling
    from plugins.trtllm import install

    try:
        scaling = QueryScaling.from_dict(json.loads(value))
    except ValueError as exc:
        raise ValueError(f"{ENV} must hold a QueryScaling as JSON ({exc})") from None
    install(scaling)
    return True


if __name__ == "<run_path>":  # run from the .pth line
    try:
        install_from_env()
    except Exception as exc:  # a broken variable must not break every Python process
        sys.stderr.write(f"sharpdraft: {ENV} ignored: {str(exc).splitlines()[0]}\n")
