"""serve's front door and supervision without a tritonserver (the real server's cases are
in test_serving_hostile.py, slow): the supervisor's restart and give-up rule over a
stand-in server, Triton's restricted-API flags, the API key and readiness on the OpenAI
endpoint running in process, and serve's refusal of a weak key."""

import json
import urllib.error
import urllib.request

import pytest

from runtime.serve import server
from runtime.serve.launch import free_ports


class FakeProcess:
    pid = 4242

    def poll(self):
        return None


class FakeServer:
    """What Supervisor reads of a Server: its stubs, readiness, kill/start/wait_ready."""

    models = ["m", "m-stream"]

    def __init__(self):
        self.process, self.alive, self.calls, self.next_pid = FakeProcess(), {10: "m", 11: "m-stream"}, [], 12

    def stubs(self):
        return dict(self.alive)

    def model_ready(self, model):
        return True

    def kill(self):
        self.calls.append("kill")
        self.alive = {}

    def start(self):
        self.calls.append("start")
        self.alive = {self.next_pid: "m", self.next_pid + 1: "m-stream"}
        self.next_pid += 2
        return 99

    def wait_ready(self, timeout, cancel=None):
        self.calls.append("ready")
        return True

    def log_hint(self):
        return ""


def test_a_dead_instance_restarts_the_server_and_one_that_keeps_dying_is_given_up_on():
    srv, lines, events = FakeServer(), [], []
    watch = server.Supervisor(srv, 60, lines.append, on_down=lambda: events.append("down"),
                              on_up=lambda: events.append("up"), restarts=2, window=600)
    assert watch.check() is False and srv.calls == [] and lines == []  # all well: nothing done
    for round_ in (1, 2):
        srv.alive.pop(min(srv.alive))  # the plain model's stub dies
        assert watch.check() is True
        assert srv.calls[-3:] == ["kill", "start", "ready"] and events[-2:] == ["down", "up"]
        assert "died" in lines[-2] and f"restart {round_} of at most 2" in lines[-2]
        assert "back (pid 99)" in lines[-1]
    assert len(lines) == 4  # one line when it dies, one when it is back
    srv.alive.pop(min(srv.alive))
    with pytest.raises(server.ServerError, match="3 times in 600 s — giving up"):
        watch.check()


def test_a_model_that_stays_not_ready_is_brought_back_but_one_slow_probe_is_not():
    srv, lines, ready = FakeServer(), [], {"now": True}
    srv.model_ready = lambda model: ready["now"]
    watch = server.Supervisor(srv, 60, lines.append)
    results = []
    for now in [False, True] + [False] * server.Supervisor.NOT_READY_POLLS:
        ready["now"] = now
        results.append(watch.check())
    assert not any(results[:2])  # one slow probe: nothing
    results = results[2:]
    assert results[-1] is True and not any(results[:-1]) and "is not ready" in lines[0]


def test_tritons_admin_apis_are_always_restricted_and_inference_only_with_a_key():
    flags = server.restricted_api_flags(None, "TOKEN")
    assert flags == ["--http-restricted-api=logging,shared-memory,trace:sharpdraft-admin=TOKEN",
                     "--grpc-restricted-protocol=logging,shared-memory,trace:sharpdraft-admin=TOKEN"]
    keyed = server.restricted_api_flags("k" * 12, "TOKEN")
    assert f"--http-restricted-api=inference,model-repository:authorization=Bearer {'k' * 12}" in keyed
    assert f"--grpc-restricted-protocol=inference,model-repository:authorization=Bearer {'k' * 12}" in keyed


def test_serve_refuses_a_key_triton_cannot_carry(tiny_engine, tmp_path, capsys, monkeypatch):
    from runtime.__main__ import main
    from runtime.cli import run

    serve = ["serve", "--engine-dir", str(tiny_engine), "--model-repository", str(tmp_path / "r")]
    for key in ("short", "has space inside", "a:b=c,d-long-enough"):
        code = run(main, serve + ["--start", "--api-key", key])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: --api-key") and err.count("\n") == 1
    monkeypatch.setenv("SHARPDRAFT_API_KEY", "short")  # the key from the environment, checked alike
    assert run(main, serve + ["--start"]) == 2
    assert capsys.readouterr().err.startswith("error: --api-key (or $SHARPDRAFT_API_KEY)")
    monkeypatch.delenv("SHARPDRAFT_API_KEY")
    for flags in (["--host", "0.0.0.0"], ["--api-key", "long-enough-key"]):  # a server's options
        assert run(main, serve + flags) == 2
        assert "add --start" in capsys.readouterr().err


def _get(url, headers=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def test_the_openai_endpoint_wants_the_key_and_says_when_it_is_not_ready(tiny_engine):
    """The endpoint in process (no Triton behind it: nothing here reaches it)."""
    from runtime.serve.openai_api import OpenAIServer, Settings
    from runtime.spec import open_spec

    key = "sk-test-0123456789"
    port, dead = free_ports(2)
    frontend = OpenAIServer(Settings(open_spec(tiny_engine), "m", "m-stream", f"127.0.0.1:{dead}", 64, api_key=key), port)
    frontend.start()
    try:
        base = f"http://127.0.0.1:{port}"
        for headers in ({}, {"Authorization": "Bearer wrong-key-000"}, {"Authorization": key}):
            code, h, body = _get(base + "/v1/models", headers)
            assert code == 401 and body["error"]["code"] == "invalid_api_key", headers
            assert h["X-Content-Type-Options"] == "nosniff"
        code, _, body = _get(base + "/v1/models", {"Authorization": f"Bearer {key}"})
        assert code == 200 and body["data"][0]["id"] == "m"
        assert _get(base + "/health")[0] == 200  # a load balancer's probe needs no key
        frontend.ready.clear()  # serve is bringing the model back
        code, h, body = _get(base + "/health")
        assert code == 503 and h["Retry-After"] and body["error"]["code"] == "backend_unavailable"
    finally:
        frontend.stop()


def test_tritons_http_body_is_capped_to_what_the_model_can_take_where_the_binary_can(tiny_engine, tmp_path):
    """--http-max-input-size (newer tritonservers; 2.51, the wheel's, has none, and serve
    says so): the longest prompt the context holds, JSON-escaped at worst, plus room."""
    from runtime.commands.serve import _http_max_input
    from runtime.engine import load_tokenizer
    from runtime.manifest import read_manifest
    from runtime.serve.protocol import longest_token_bytes
    from runtime.spec import open_spec

    manifest = read_manifest(tiny_engine, verify="skip")
    cap = _http_max_input(open_spec(tiny_engine))
    assert cap == 6 * 512 * longest_token_bytes(load_tokenizer(manifest.target_dir)) + 2**16
    install = server.Installation(binary=tmp_path / "tritonserver", backends=tmp_path, kind="system")
    srv = server.Server(tmp_path, ["m"], install=install, http_max_input=cap)
    assert f"--http-max-input-size={cap}" in srv.command(tmp_path, frozenset({"--http-max-input-size"}))
    assert not any(a.startswith("--http-max-input-size") for a in srv.command(tmp_path, frozenset()))


def test_host_binds_every_port_and_our_probes_use_the_loopback(tmp_path):
    install = server.Installation(binary=tmp_path / "tritonserver", backends=tmp_path, kind="system")
    srv = server.Server(tmp_path, ["m"], install=install, host="0.0.0.0")
    argv = srv.command(tmp_path)
    for flag in ("http", "grpc", "metrics"):
        assert f"--{flag}-address=0.0.0.0" in argv
    assert srv.http_url.startswith("http://127.0.0.1:")
    assert "--http-address=127.0.0.1" in server.Server(tmp_path, ["m"], install=install).command(tmp_path)
