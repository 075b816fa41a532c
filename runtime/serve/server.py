"""Finding and running `tritonserver` for a generated model repository: bound to
127.0.0.1 (or `host`), ready when every model is, stopped with SIGTERM (SIGKILL after a
grace period), watched for dead model instances (stubs) and restarted whole when one
dies (Supervisor). Triton's admin endpoints (logging, model repository, shared memory,
trace) are always behind a header only this process knows; with an API key, inference
and the model repository API too, behind `authorization: Bearer KEY`. On CPU machines the server is the one inside the nvidia-pytriton wheel that
`make setup` installs into .cache/pytriton; on GPU hosts, a system tritonserver.

The Python backend's stub is an embedded interpreter started in isolated mode: it
ignores PYTHONPATH and finds its `sys.prefix` by looking up `python3` on PATH. So the
launcher gives it a small environment of its own -- a `python3` link to this interpreter
beside a pyvenv.cfg, and a .pth file listing this checkout, this environment's
site-packages and (for the wheel) a numpy 1.x folder -- and puts it first on PATH.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime.serve.repository import REPO_ROOT

PYTRITON = REPO_ROOT / ".cache" / "pytriton"
WHEEL = PYTRITON / "wheel"  # pip install --no-deps --target: nvidia-pytriton
# The wheel's backend stubs were built with a pybind11 that reads numpy 1.x array
# descriptors: under numpy 2 a BYTES input arrives as garbage. The stub alone sees numpy 1.
STUB_SITE = PYTRITON / "stub-site"
SETUP_HINT = "run `make setup` (installs the nvidia-pytriton wheel into .cache/pytriton)"


class ServerError(RuntimeError):
    """The server could not be found, started, or made ready; one line for the user."""


@dataclasses.dataclass(frozen=True)
class Installation:
    binary: Path
    backends: Path  # holds python/libtriton_python.so
    kind: str  # "wheel" or "system"
    libs: tuple[Path, ...] = ()  # extra LD_LIBRARY_PATH entries
    stub: Path | None = None  # the wheel ships one stub per Python minor version
    stub_site: Path | None = None


def _wheel() -> Installation | None:
    root = WHEEL / "pytriton" / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the nvidia-pytriton wheel in {WHEEL} has no Python backend stub for "
                          f"Python {version}")
    if not (STUB_SITE / "numpy").is_dir():
        raise ServerError(f"{STUB_SITE} lacks numpy 1.x for the backend stub — {SETUP_HINT}")
    return Installation(binary=binary, backends=root / "backends", kind="wheel",
                        libs=(WHEEL / "nvidia_pytriton.libs",), stub=stub, stub_site=STUB_SITE)


def _system(binary: Path) -> Installation:
    binary = binary.resolve()
    # The layout of the NGC containers: /opt/tritonserver/{bin,backends}.
    backends = binary.parent.parent / "backends"
    if not (backends / "python").is_dir():
        raise ServerError(f"{binary} has no Python backend beside it ({backends / 'python'} "
                          "is missing)")
    return Installation(binary=binary, backends=backends, kind="system")


def find_tritonserver(explicit: str | Path | None = None) -> Installation:
    """--tritonserver PATH, else `tritonserver` on PATH (GPU hosts), else the wheel's."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ServerError(f"--tritonserver {path} is not an executable file")
        return _system(path)
    on_path = shutil.which("tritonserver")
    if on_path:
        return _system(Path(on_path))
    wheel = _wheel()
    if wheel is None:
        raise ServerError("no tritonserver found: none on PATH, no --tritonserver, and no "
                          f"nvidia-pytriton wheel in {WHEEL} — {SETUP_HINT}")
    return wheel


def _site_packages() -> list[str]:
    paths = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths()[key]
        if p not in paths:
            paths.append(p)
    return paths


def prepare_workspace(install: Installation, workspace: Path) -> tuple[Path, dict]:
    """Backend directory and environment for the server process."""
    env = dict(os.environ)
    backends = install.backends
    if install.kind == "wheel":
        # The backend looks for its stub beside libtriton_python.so; the wheel keeps one
        # stub per Python version elsewhere, so assemble the directory from links.
        backends = workspace / "backends"
        python_dir = backends / "python"
        python_dir.mkdir(parents=True)
        for item in (install.backends / "python").iterdir():
            if item.is_file():
                (python_dir / item.name).symlink_to(item)
        (python_dir / "triton_python_backend_stub").symlink_to(install.stub)

    # The stub's interpreter: a venv-like prefix whose site-packages .pth lists our paths.
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    prefix = workspace / "stub-env"
    site = prefix / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    (prefix / "bin").mkdir()
    real_python = Path(os.path.realpath(sys.executable))
    (prefix / "bin" / "python3").symlink_to(real_python)
    (prefix / "pyvenv.cfg").write_text(f"home = {real_python.parent}\n"
                                       "include-system-site-packages = false\n")
    paths = ([str(install.stub_site)] if install.stub_site else []) + [str(REPO_ROOT)] + _site_packages()
    (site / "sharpdraft.pth").write_text("\n".join(paths) + "\n")
    env["PATH"] = f"{prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    libs = []
    # The wheel's stub links libpython3.x.so.1.0 by soname; the system's copy may be another
    # patch release than this interpreter (and its stdlib): load this interpreter's first.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and (Path(libdir) / f"lib{version}.so.1.0").exists():
        libs.append(libdir)
    libs += [str(p) for p in install.libs]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return backends, env


WORKSPACE_PREFIX = "sharpdraft-triton-"


def _remove_orphaned_workspaces() -> None:
    """Workspaces of launchers that were killed outright (no chance to clean up)."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORKSPACE_PREFIX}*-*"):
        pid = path.name[len(WORKSPACE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def _die_with_parent():  # runs in the child between fork and exec
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclasses.dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    def check(self) -> None:
        values = dataclasses.astuple(self)
        for name, value in dataclasses.asdict(self).items():
            if not 1 <= value <= 65535:
                raise ValueError(f"--{name}-port must be in 1..65535, got {value}")
        if len(set(values)) != len(values):
            raise ValueError(f"the HTTP, gRPC and metrics ports must differ, got {values}")


# Triton's writable admin APIs, which no client of ours needs: restricted always (Triton
# has no switch to turn them off), behind a header whose value is a secret this process
# makes and never shows. The model repository API lists the models (`loadtest` finds them
# there) and cannot load or unload any in the default model control mode: behind the API
# key with inference when there is one, else open like inference.
ADMIN_APIS = ("logging", "shared-memory", "trace")
KEYED_APIS = ("inference", "model-repository")
ADMIN_HEADER = "sharpdraft-admin"
STUB = "triton_python_backend_stub"


def restricted_api_flags(api_key: str | None, admin_token: str) -> list[str]:
    """tritonserver's --http-restricted-api / --grpc-restricted-protocol arguments:
    `APIS:KEY=VALUE`, one group per header (an API may sit in one group only). A gRPC
    client sends the header KEY as `triton-grpc-protocol-KEY`."""
    groups = [(",".join(ADMIN_APIS), f"{ADMIN_HEADER}={admin_token}")]
    if api_key is not None:
        groups.append((",".join(KEYED_APIS), f"authorization=Bearer {api_key}"))
    return [f"--{flag}={apis}:{header}" for apis, header in groups
            for flag in ("http-restricted-api", "grpc-restricted-protocol")]


def loopback_for(host: str) -> str:
    """Where this process reaches a server bound to `host` (a wildcard: the loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


class Server:
    """One tritonserver process serving `repository` on 127.0.0.1 (or `host`)."""

    HOST = "127.0.0.1"

    def __init__(self, repository: str | Path, models: list[str], ports: Ports = Ports(),
                 install: Installation | None = None, log=None, exit_timeout: int = 30,
                 host: str = HOST, api_key: str | None = None, http_max_input: int | None = None):
        ports.check()
        self.http_max_input = http_max_input  # bytes; None: Triton's own default
        self._accepted: frozenset | None = None
        self.bind = host
        self.HOST = loopback_for(host)  # what our own probes and the endpoints we print use
        self.api_key = api_key
        self.admin_token = secrets.token_urlsafe(24)
        self.repository = Path(repository).resolve()
        self.models, self.ports = list(models), ports
        self.install = install or find_tritonserver()
        self.log = log  # file object for the server's output; None: our stderr
        self.exit_timeout = exit_timeout
        self.process: subprocess.Popen | None = None
        self.workspace: Path | None = None

    @property
    def http_url(self) -> str:
        host = f"[{self.HOST}]" if ":" in self.HOST else self.HOST
        return f"http://{host}:{self.ports.http}"

    def endpoints(self) -> dict:
        return {"http": self.http_url, "grpc": f"{self.HOST}:{self.ports.grpc}",
                "metrics": f"http://{self.HOST}:{self.ports.metrics}/metrics",
                "models": self.models,
                "generate": [f"{self.http_url}/v2/models/{m}/generate" for m in self.models]}

    def command(self, backends: Path, accepted: frozenset = frozenset()) -> list[str]:
        """The server's argv; `accepted`: the optional flags this binary takes (accepts)."""
        size = ([f"--http-max-input-size={self.http_max_input}"]
                if self.http_max_input and "--http-max-input-size" in accepted else [])
        return [str(self.install.binary), f"--model-repository={self.repository}", *size,
                f"--backend-directory={backends}",
                f"--http-address={self.bind}", f"--http-port={self.ports.http}",
                f"--grpc-address={self.bind}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-address={self.bind}", f"--metrics-port={self.ports.metrics}",
                "--exit-on-error=true", "--strict-readiness=true",
                f"--exit-timeout-secs={self.exit_timeout}",
                *restricted_api_flags(self.api_key, self.admin_token)]

    def start(self) -> int:
        _remove_orphaned_workspaces()
        self.workspace = Path(tempfile.mkdtemp(prefix=f"{WORKSPACE_PREFIX}{os.getpid()}-"))
        backends, env = prepare_workspace(self.install, self.workspace)
        self.process = subprocess.Popen(
            self.command(backends, self.accepts(env)), env=env, stdin=subprocess.DEVNULL,
            stdout=self.log or sys.stderr, stderr=subprocess.STDOUT,
            # Its own session: a terminal's Ctrl-C reaches only us, and we stop the server
            # exactly once; PDEATHSIG stops it should we be killed outright.
            start_new_session=True, preexec_fn=_die_with_parent)
        return self.process.pid

    def accepts(self, env: dict) -> frozenset:
        """Which of the flags newer tritonservers added this one takes (its --help says):
        --http-max-input-size came after 2.51, the wheel's."""
        if self._accepted is None:
            try:
                out = subprocess.run([str(self.install.binary), "--help"], env=env, capture_output=True,
                                     text=True, timeout=60)
                help_text = out.stdout + out.stderr
            except (OSError, subprocess.TimeoutExpired):
                help_text = ""
            self._accepted = frozenset(f for f in ("--http-max-input-size",) if f in help_text)
        return self._accepted

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def model_ready(self, model: str) -> bool:
        return self._ok(f"/v2/models/{model}/ready")

    def ready(self) -> bool:
        return self._ok("/v2/health/ready") and all(self.model_ready(m) for m in self.models)

    def wait_ready(self, timeout: float = 300.0, cancel=None) -> bool:
        """True once the server and every model are ready; False if `cancel` (an Event)
        was set first; ServerError if the server exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                return False
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"tritonserver exited with code {code} before its models were "
                                  f"ready{self.log_hint()}")
            if self.ready():
                return True
            time.sleep(0.5)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s{self.log_hint()}")

    def log_hint(self) -> str:
        name = getattr(self.log, "name", None)
        if isinstance(name, str) and os.path.isfile(name):
            # The model's own error (a failed import, a bad engine) is the useful line.
            self.log.flush()
            errors = [line.strip() for line in Path(name).read_text(errors="replace").splitlines()
                      if line.startswith("E") or "error" in line.lower()]
            return f" — {errors[-1][:300]}" if errors else f" — see {name}"
        return " — see its log above"

    def stubs(self) -> dict[int, str]:
        """pid -> model name of the Python-backend stubs (one per model instance) this
        server runs; a zombie counts as gone."""
        found = {}
        if self.process is None:
            return found
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z" or int(fields[1]) != self.process.pid:
                    continue
                argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if not argv or not argv[0].endswith(STUB.encode()):
                continue
            # the stub's first argument is the model's file: <repository>/<model>/1/model.py
            path = argv[1].decode(errors="replace") if len(argv) > 1 else ""
            model = next((m for m in self.models if f"/{m}/" in path), path)
            found[int(stat.parent.name)] = model
        return found

    def kill(self) -> None:
        """SIGKILL to the server and its stubs (its process group), at once: for a restart,
        where Triton's own shutdown would wait out exit_timeout on the dead stub's requests."""
        if self.process is not None:
            # the whole group even where the server has exited (crashed): its other stubs
            # outlive it otherwise
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None

    def stop(self) -> int | None:
        """SIGTERM (Triton finishes in-flight requests, unloads the models, stops the
        stubs), SIGKILL to the whole process group after the grace period."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(self.exit_timeout + 15)
                except subprocess.TimeoutExpired:
                    # The group (server + backend stubs) still exists, so its id is not reused.
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
            code = self.process.returncode
            try:  # a server that crashed leaves its stubs running in its group
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None
        return code

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class Supervisor:
    """Keeps a ready Server's models serving. A model instance whose stub dies stays dead
    in Triton (its Python backend never restarts a stub; its readiness still says 200;
    its requests hang), so the supervisor watches the stubs' processes and each model's
    readiness; when one dies (or tritonserver itself exits) it kills the server at once
    (every in-flight request then fails at its client: a retryable error, not a hang)
    and starts it again, one log line each. `restarts` within `window` seconds and no
    more: a model that keeps dying is given up on, loudly (ServerError)."""

    POLL_S = 0.5
    NOT_READY_POLLS = 6  # readiness can be slow to answer under load: ~3 s of no's, not one

    def __init__(self, srv: Server, ready_timeout: float, log, on_down=None, on_up=None,
                 restarts: int = 3, window: float = 600.0, cancel=None):
        self.srv, self.ready_timeout, self.log, self.cancel = srv, ready_timeout, log, cancel
        self.on_down, self.on_up = on_down or (lambda: None), on_up or (lambda: None)
        self.restarts, self.window = restarts, window
        self.history: list[float] = []
        self.not_ready = 0
        self.known = self._baseline()

    def _baseline(self) -> dict[int, str]:
        stubs = self.srv.stubs()
        if not stubs:
            self.log("cannot see the model instances' processes (not the Python backend's "
                     "stubs?): watching readiness only")
        return stubs

    def _failure(self) -> str | None:
        """What has died, in words, or None while all is well."""
        code = self.srv.process.poll()
        if code is not None:
            return f"tritonserver (pid {self.srv.process.pid}) exited with code {code}"
        alive = self.srv.stubs()
        for pid, model in self.known.items():
            if pid not in alive:
                return f"model {model}'s instance (stub pid {pid}) died"
        down = [m for m in self.srv.models if not self.srv.model_ready(m)]
        self.not_ready = self.not_ready + 1 if down else 0
        if self.not_ready >= self.NOT_READY_POLLS:
            return f"model {down[0]} is not ready"
        return None

    def check(self) -> bool:
        """One look; brings the server back if something died. False when all was well."""
        what = self._failure()
        if what is None:
            return False
        now = time.monotonic()
        self.history = [t for t in self.history if now - t < self.window] + [now]
        if len(self.history) > self.restarts:
            raise ServerError(f"{what}; it died {len(self.history)} times in "
                              f"{self.window:.0f} s — giving up{self.srv.log_hint()}")
        self.log(f"{what}: restarting tritonserver (restart {len(self.history)} of at most "
                 f"{self.restarts} in {self.window:.0f} s); in-flight requests fail, retryable")
        self.on_down()
        start = time.monotonic()
        self.srv.kill()
        pid = self.srv.start()
        if not self.srv.wait_ready(self.ready_timeout, self.cancel):
            return True  # stopped while it came back
        self.known, self.not_ready = self._baseline(), 0
        self.log(f"tritonserver back (pid {pid}): {', '.join(self.srv.models)} ready after "
                 f"{time.monotonic() - start:.1f} s")
        self.on_up()
        return True


def describe(endpoints: dict) -> str:
    lines = [f"tritonserver ready: HTTP {endpoints['http']}  gRPC {endpoints['grpc']}  "
             f"metrics {endpoints['metrics']}"]
    for url in endpoints["generate"]:
        lines.append(f"  generate: {url}")
    first = endpoints["generate"][0]
    lines.append(f"try: curl -s -X POST {first} "
                 + "-d '" + json.dumps({"prompt": "def fib(n):", "max_new_tokens": 32}) + "'")
    return "\n".join(lines)
