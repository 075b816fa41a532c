"""A real `python -m runtime serve --start --json` on free loopback ports, for the serving
test modules (test_serving.py, test_openai.py), which ask it with different limits: it
is started in its own session, waited for (its JSON line), then stopped with SIGTERM by
PID, and must exit 0, release every request (a request Triton never released holds its
model at unload until exit_timeout) and leave nothing running."""

import contextlib
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

import pytest

from runtime.serve import server as serve_server

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 240  # two cores shared with other work: stubs import torch one by one


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def group_members(pgid):
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def serve(engine_dir, work: Path, *flags):
    """Yields serve's JSON line (endpoints, models, pid) plus http_port and grpc_port."""
    try:
        serve_server.find_tritonserver()
    except serve_server.ServerError as exc:  # a missing install fails, not skips: CI must see it
        pytest.fail(str(exc))
    http, grpc, metrics = free_ports(3)
    server_log, cli_err = work / "tritonserver.log", work / "serve.stderr"
    cmd = [sys.executable, "-m", "runtime", "serve", "--engine-dir", str(engine_dir),
           "--model-repository", str(work / "repo"), "--start", "--json", "--threads", "1", *flags,
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--ready-timeout", str(READY_TIMEOUT), "--server-log", str(server_log)]
    with open(cli_err, "w") as err:
        # Own session: the finalizer can signal the CLI's whole group by its PID.
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    info = {}

    def logs():
        return (f"\n--- serve stderr ---\n{cli_err.read_text()[-2000:]}"
                f"\n--- tritonserver log ---\n{server_log.read_text(errors='replace')[-3000:]}"
                if server_log.exists() else f"\n--- serve stderr ---\n{cli_err.read_text()[-3000:]}")

    try:
        deadline = time.monotonic() + READY_TIMEOUT + 30
        while not info:
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode} before ready{logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {READY_TIMEOUT + 30} s{logs()}")
            try:
                info = json.loads(lines.get(timeout=1))
            except (queue.Empty, json.JSONDecodeError):
                continue
    except BaseException:
        kill_group(proc.pid)
        if info.get("pid"):
            kill_group(info["pid"])
        proc.wait()
        raise
    try:
        yield info | {"http_port": http, "grpc_port": grpc}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        code = proc.poll()
        stray = [g for g in (proc.pid, info.get("pid")) if g and group_members(g)]
        for pgid in stray:
            kill_group(pgid)
        if code is None:
            proc.wait()
    assert code == 0, f"serve exited with {code} on SIGTERM{logs()}"
    assert "Exit timeout expired" not in server_log.read_text(errors="replace"), \
        f"a request was never released{logs()}"
    assert not stray, f"processes left running in process groups {stray}"
