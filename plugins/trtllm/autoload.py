"""The hook in every Python process of an environment, TensorRT-LLM's workers included.

TensorRT-LLM's LLM API runs the model in worker processes it spawns through mpi4py
(`MPIPoolExecutor(max_workers=n, path=sys.path, env=only TRTLLM*/TLLM* variables)`,
tensorrt_llm/llmapi/mpi_session.py, see pins.SOURCES["mpi_session"]), not in the process
that called LLM() or trtllm-serve; an `install()` there never reaches them. A `.pth` file
in site-packages runs in every interpreter that starts, workers included, whatever their
environment. So `python -m plugins.trtllm autoload install` writes one line there that
runs this file when either

- the *activation folder* beside it (sharpdraft_trtllm.d/) holds a launch's file
  (<nonce>.json, written by our launchers for the duration of a launch: the QueryScaling,
  the launch's proof directory, the launcher's pid and start time, a per-launch nonce); or
- SHARPDRAFT_TRTLLM holds a QueryScaling as JSON (for launches of your own where the
  environment does reach the workers).

A launch's file counts only while its launcher lives (pid and kernel start time, so a
recycled pid does not revive it): a file left by a crashed or killed launch is removed by
the first process that sees it, with one line on stderr, and scales nothing. Our launchers
also put the nonce in TRTLLM_SHARPDRAFT_LAUNCH (TRTLLM_-prefixed: MpiPoolSession forwards
it to its workers): a process that has it takes that launch's file and no other, and a
frozen or target-only launch sets it to "off", so its workers ignore every file. A process
without the variable takes the one live launch; with several live launches on one host
(Triton instances, ranks under mpirun) it cannot tell which is its own and stays unhooked
(its launcher's proof check then refuses, in one line).

It makes this checkout importable, installs the hook and points its proof records at the
launch's proof directory (plugins/trtllm/proof.py). It never raises: a broken file or
variable is reported on stderr and recorded, and the process goes on without the hook.

Trade-offs (docs/trtllm.md): every Python process of that environment pays one
os.environ lookup and one stat; while a launch is active each one also lists the folder,
reads /proc for the launcher, imports torch (through plugins.scaling) and appends this
checkout to sys.path (top-level names `plugins`, `runtime`, `build`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "SHARPDRAFT_TRTLLM"
NONCE_ENV = "TRTLLM_SHARPDRAFT_LAUNCH"  # TRTLLM_-prefixed: MpiPoolSession forwards it to workers
OFF = "off"  # NONCE_ENV of a frozen / target-only launch: ignore every activation
CHECKOUT = Path(__file__).resolve().parents[2]
PTH_NAME = "sharpdraft_trtllm.pth"
ACTIVATION_NAME = "sharpdraft_trtllm.d"  # one file per live launch


def env_value(scaling) -> str:
    """What to put in SHARPDRAFT_TRTLLM for this QueryScaling."""
    return json.dumps(scaling.to_dict(), sort_keys=True)


def pth_line(site: Path) -> str:
    # .pth lines that start with `import` are executed by site.py; one line, no newlines.
    activation = str(Path(site).resolve() / ACTIVATION_NAME)
    return (f"import os; (os.environ.get({ENV!r}) or (os.path.isdir({activation!r}) and "
            f"os.listdir({activation!r}))) and "
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
    """The activation folder of an environment."""
    return Path(site) / ACTIVATION_NAME


def read_activation(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (jiffies since boot, /proc/<pid>/stat field 22), or
    None where it cannot be read: with the pid it names one process incarnation."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
        return stat.rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError, ValueError):
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


def launcher_alive(data: dict) -> bool:
    """The launch that wrote `data` is still running (its pid lives and, where recorded,
    with the same start time: a recycled pid does not count)."""
    try:
        pid = int(data.get("launcher", 0))
    except (TypeError, ValueError):
        return False
    if not _pid_alive(pid):
        return False
    started = data.get("started")
    return started is None or process_start(pid) in (None, started)


def _entries(folder: Path) -> list[tuple[Path, dict | None]]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    entries = []
    for path in sorted(folder.glob("*.json")):
        try:
            entries.append((path, read_activation(path)))
        except ValueError:
            entries.append((path, None))  # half-written or broken: a dead launch's
    return entries


def live_launches(folder: Path, clear_stale: bool = True) -> list[tuple[Path, dict]]:
    """The activation files of running launches; those of dead launches (or broken ones)
    are removed, each with one line on stderr."""
    live = []
    for path, data in _entries(folder):
        if data is not None and launcher_alive(data):
            live.append((path, data))
        elif clear_stale:
            try:
                path.unlink()
                who = f"launcher pid {data.get('launcher')} is gone" if data else "unreadable"
                sys.stderr.write(f"sharpdraft: removed a stale activation file {path} ({who}); "
                                 "nothing scaled from it\n")
            except OSError:
                pass
    return live


def activate(site: Path, scaling, proof_dir: Path) -> Path:
    """Write this launch's activation file (several live launches may share an environment:
    each has its own file and nonce). Returns the file; its nonce is what the launcher puts
    in NONCE_ENV."""
    import secrets

    folder = activation_path(site)
    folder.mkdir(parents=True, exist_ok=True)
    live_launches(folder)  # clear what dead launches left
    nonce = secrets.token_hex(8)
    path = folder / f"{nonce}.json"
    temporary = folder / f".{nonce}.tmp"
    temporary.write_text(json.dumps({"scaling": scaling.to_dict(), "proof": str(proof_dir),
                                     "launcher": os.getpid(), "started": process_start(os.getpid()),
                                     "nonce": nonce}, sort_keys=True))
    temporary.replace(path)  # readers never see half a file
    return path


def deactivate(path: Path | None) -> None:
    """Remove a launch's activation file (and the folder once empty)."""
    if path is None:
        return
    path = Path(path)
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass


def _settings(activation) -> tuple[dict | None, str | None]:
    """(QueryScaling as a dict, proof directory) from the variable or this process's live
    launch; (None, None) when there is none it can call its own."""
    value = os.environ.get(ENV)
    if value:
        return json.loads(value), os.environ.get("SHARPDRAFT_TRTLLM_PROOF")
    if not activation:
        return None, None
    live = live_launches(Path(activation))
    nonce = os.environ.get(NONCE_ENV)
    if nonce:  # this process belongs to a launch of ours: that launch's file, or nothing
        live = [(p, d) for p, d in live if d.get("nonce") == nonce]
    elif len(live) > 1:
        sys.stderr.write(f"sharpdraft: {len(live)} SharpDraft launches are live in this environment and "
                         f"pid {os.getpid()} carries no {NONCE_ENV}: hook not installed here\n")
        return None, None
    if not live:
        return None, None
    data = live[0][1]
    return data["scaling"], data.get("proof")


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
