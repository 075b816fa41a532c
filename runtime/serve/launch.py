"""`python -m runtime serve --start --json` as a child process on free loopback ports, for
what drives a real server from outside: the serving tests (tests/served.py) and the
A/B scripts (scripts/chunked_prefill_ab.py; scripts/served_ab.py, whose arms are other
checkouts). The child runs in its own session,
so its process group can be signalled by its PID; ready is serve's JSON line (endpoints,
models, the server's pid); stop is SIGTERM to that group, SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime.serve.repository import REPO_ROOT


def free_ports(n: int) -> list[int]:
    """n loopback TCP ports free at the time of asking."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes in process group pgid."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class NotReady(RuntimeError):
    """serve printed no JSON line: `code` is its exit status where it exited first, None
    where the wait ran out."""

    def __init__(self, code: int | None):
        super().__init__(f"serve exited with {code} before ready" if code is not None else "serve not ready")
        self.code = code


class ServeProcess:
    """`python -m runtime serve --engine-dir ENGINE --model-repository REPOSITORY --start
    --json FLAGS...` on three free loopback ports (http_port, grpc_port, metrics_port),
    started in its own session from the repository root; its stdout is read for the JSON
    line, its stderr goes to `stderr` (a file; None: this process's). `root` and `python`:
    another checkout and its interpreter (an A/B's arm), else this one's."""

    def __init__(self, engine_dir, repository, *flags: str, stderr=None, root: Path = REPO_ROOT,
                 python: str = sys.executable):
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        cmd = [python, "-m", "runtime", "serve", "--engine-dir", str(engine_dir),
               "--model-repository", str(repository), "--start", "--json", *flags,
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     start_new_session=True)
        self.info: dict = {}
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        """Every stdout line to the queue, then None at its end (serve exited or closed it)."""
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float | None = None) -> dict:
        """serve's JSON line, once printed (lines that are not JSON are passed over).
        Raises NotReady where serve exits first or `timeout` seconds pass (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.info:
            if self.proc.poll() is not None:
                raise NotReady(self.proc.returncode)
            if deadline is not None and time.monotonic() > deadline:
                raise NotReady(None)
            try:
                line = self._lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:  # stdout ended before the JSON line: serve is exiting, not polled a second later
                raise NotReady(self.proc.wait())
            try:
                self.info = json.loads(line)
            except json.JSONDecodeError:
                continue
        return self.info

    def kill(self) -> None:
        """SIGKILL to serve's process group and the server's (where it said its pid); reaped."""
        kill_group(self.proc.pid)
        if self.info.get("pid"):
            kill_group(self.info["pid"])
        self.proc.wait()

    def stop(self, grace: float) -> tuple[int | None, list[int]]:
        """SIGTERM to serve's process group and `grace` seconds to exit, then SIGKILL to
        whatever is left in its group and the server's. Returns serve's exit status (None:
        it had not exited within the grace) and the process groups that still had members."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        stray = [g for g in (self.proc.pid, self.info.get("pid")) if g and group_members(g)]
        for pgid in stray:
            kill_group(pgid)
        if code is None:
            self.proc.wait()
        return code, stray
