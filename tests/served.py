"""A real `python -m runtime serve --start --json` on free loopback ports, for the serving
test modules (test_serving.py, test_openai.py), which ask it with different limits: it
is started in its own session, waited for (its JSON line), then stopped with SIGTERM by
PID, and must exit 0, release every request (a request Triton never released holds its
model at unload until exit_timeout) and leave nothing running."""

import contextlib
from pathlib import Path

import pytest

from runtime.serve import server as serve_server
from runtime.serve.launch import NotReady, ServeProcess, free_ports  # noqa: F401  (free_ports: test_openai)

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 240  # two cores shared with other work: stubs import torch one by one


@contextlib.contextmanager
def serve(engine_dir, work: Path, *flags):
    """Yields serve's JSON line (endpoints, models, pid) plus http_port and grpc_port."""
    try:
        serve_server.find_tritonserver()
    except serve_server.ServerError as exc:  # a missing install fails, not skips: CI must see it
        pytest.fail(str(exc))
    server_log, cli_err = work / "tritonserver.log", work / "serve.stderr"
    with open(cli_err, "w") as err:
        # one torch thread: the tiny engine's steps are small, and make test's other
        # worker shares the cores
        server = ServeProcess(engine_dir, work / "repo", "--threads", "1", *flags,
                              "--ready-timeout", str(READY_TIMEOUT),
                              "--server-log", str(server_log), stderr=err)

    def logs():
        return (f"\n--- serve stderr ---\n{cli_err.read_text()[-2000:]}"
                f"\n--- tritonserver log ---\n{server_log.read_text(errors='replace')[-3000:]}"
                if server_log.exists() else f"\n--- serve stderr ---\n{cli_err.read_text()[-3000:]}")

    try:
        try:
            info = server.wait_ready(READY_TIMEOUT + 30)
        except NotReady as exc:
            pytest.fail((f"serve exited with {exc.code} before ready" if exc.code is not None
                         else f"server not ready after {READY_TIMEOUT + 30} s") + logs())
    except BaseException:
        server.kill()
        raise
    try:
        yield info | {"http_port": server.http_port, "grpc_port": server.grpc_port}
    finally:
        code, stray = server.stop(90)
    assert code == 0, f"serve exited with {code} on SIGTERM{logs()}"
    assert "Exit timeout expired" not in server_log.read_text(errors="replace"), \
        f"a request was never released{logs()}"
    assert not stray, f"processes left running in process groups {stray}"
