"""The hook in every Python process of an environment, TensorRT-LLM's workers included.

TensorRT-LLM's LLM API runs the model in worker processes it spawns through mpi4py
(`MPIPoolExecutor(max_workers=n, path=sys.path[, env=only TRTLLM*/TLLM* variables])`,
tensorrt_llm/llmapi/mpi_session.py, see pins.SOURCES["mpi_session"]), not in the process
that called LLM() or trtllm-serve; an `install()` there never reaches them, and a variable
of ours is not forwarded by that spawn. A `.pth` file in site-packages runs in every
interpreter that starts, workers included, whatever their environment. So
`python -m plugins.trtllm autoload install` writes one line there that runs this file when
either

- the *activation file* beside it (sharpdraft_trtllm.json, written by our launchers for
  the duration of a launch: the QueryScaling and the launch's proof directory) exists —
  the mechanism that does not depend on environment inheritance; or
- SHARPDRAFT_TRTLLM holds a QueryScaling as JSON (for launches of your own where the
  environment does reach the workers).

It makes this checkout importable, installs the hook and points its proof records at the
launch's proof directory (plugins/trtllm/proof.py). It never raises: a broken file or
variable is reported on stderr and recorded, and the process goes on without the hook.

Trade-offs (docs/trtllm.md): every Python process of that environment pays one
os.environ lookup and one stat; while a launch is active each one also imports torch
(through plugins.scaling) and appends this checkout to sys.path (top-level names
`plugins`, `runtime`, `build`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "SHARPDRAFT_TRTLLM"
CHECKOUT = Path(__file__).resolve().parents[2]
PTH_NAME = "sharpdraft_trtllm.pth"
ACTIVATION_NAME = "sharpdraft_trtllm.json"


def env_value(scaling) -> str:
    """What to put in SHARPDRAFT_TRTLLM for this QueryScaling."""
    return json.dumps(scaling.to_dict(), sort_keys=True)


def pth_line(site: Path) -> str:
    # .pth lines that start with `import` are executed by site.py; one line, no newlines.
    activation = str(Path(site).resolve() / ACTIVATION_NAME)
    return (f"import os; (os.environ.get({ENV!r}) or os.path.exists({activation!r})) and "
            f"__import__('runpy').run_path({str(Path(__file__).resolve())!r}, "
            f"init_globals={{'ACTIVATION': {activation!r}}})\n")


def find_site() -> Path | None:
    """The site-packages folder of this environment that holds our .pth (None: the
    autoloader is not installed)."""
    import sysconfig

    candidates = [sysconfig.get_paths()["purelib"], *[p for p in sys.path if p.endswith("-packages")]]
    for folder in dict.fromkeys(candidates):
        if (Path(folder) / PTH_NAME).is_file():
            return Path(folder)
    return None


def activation_path(site: Path) -> Path:
    return Path(site) / ACTIVATION_NAME


def read_activation(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # 0 would signal our own process group: not a launcher
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def activate(site: Path, scaling, proof_dir: Path) -> Path:
    """Write the activation file for this launch (one launch per environment at a time:
    another live launcher's file is refused in one line rather than overwritten)."""
    path = activation_path(site)
    current = None
    try:
        current = read_activation(path)
    except ValueError:
        current = None  # a broken file from a crashed launch: replace it
    if current and current.get("launcher") != os.getpid() and _pid_alive(int(current.get("launcher", 0))):
        raise RuntimeError(f"another SharpDraft launch (pid {current['launcher']}) is active in this "
                           f"environment ({path}); one launch per environment at a time")
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"scaling": scaling.to_dict(), "proof": str(proof_dir),
                                     "launcher": os.getpid()}, sort_keys=True))
    temporary.replace(path)
    return path


def deactivate(site: Path) -> None:
    path = activation_path(site)
    try:
        current = read_activation(path)
    except ValueError:
        current = None
    if current is not None and current.get("launcher") in (None, os.getpid()):
        path.unlink(missing_ok=True)


def _settings(activation) -> tuple[dict | None, str | None]:
    """(QueryScaling as a dict, proof directory) from the variable or the activation file."""
    value = os.environ.get(ENV)
    if value:
        return json.loads(value), os.environ.get("SHARPDRAFT_TRTLLM_PROOF")
    data = read_activation(Path(activation)) if activation else None
    if data:
        return data["scaling"], data.get("proof")
    return None, None


def install_from_settings(activation=None) -> bool:
    """install() with the QueryScaling from the variable or the activation file; False when
    neither is there."""
    scaling, proof_dir = _settings(activation)
    if not scaling:
        return False
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))  # appended: never shadows the environment's packages
    from plugins.scaling import QueryScaling
    from plugins.trtllm import install, proof

    if proof_dir:
        proof.set_directory(proof_dir)
    install(QueryScaling.from_dict(scaling))
    return True


install_from_env = install_from_settings  # the name earlier releases of this file exported


if __name__ == "<run_path>":  # run from the .pth line
    try:
        install_from_settings(globals().get("ACTIVATION"))
    except Exception as exc:  # a broken variable or file must not break every Python process
        sys.stderr.write(f"sharpdraft: hook not installed in pid {os.getpid()}: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}\n")
        try:
            from plugins.trtllm import proof
            proof.record("disabled", drafter=None, reason=f"autoload failed: {exc}")
        except Exception:
            pass
