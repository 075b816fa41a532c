"""The served engine under failure and behind its front door, against a real tritonserver
(`serve --start --openai-port --api-key`, tests/served.py): a killed model instance fails
its in-flight requests with a retryable error and comes back; the API key guards the
OpenAI endpoint and Triton's inference over HTTP and gRPC; Triton's admin endpoints are
closed. Slow (a server of its own, restarted once): the fast tier covers the supervisor's
rule and the key in process (test_serving_supervisor.py)."""

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from served import free_ports, serve

pytestmark = pytest.mark.slow

KEY = "sk-hostile-0123456789"
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def guarded(tiny_engine, tmp_path_factory):
    port, = free_ports(1)
    work = tmp_path_factory.mktemp("hostile")
    with serve(tiny_engine, work, "--instances", "1", "--max-batch", "2", "--openai-port", str(port),
               "--api-key", KEY) as info:
        yield info | {"work": work}


@pytest.fixture(scope="module")
def engine(tiny_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(tiny_engine))


def _client(info, key=KEY):
    return openai.OpenAI(base_url=info["openai"], api_key=key, max_retries=0, timeout=120)


def _tensors(module, prompt, n):
    tensors = [module.InferInput("prompt", [1], "BYTES"), module.InferInput("max_new_tokens", [1], "INT32")]
    tensors[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    tensors[1].set_data_from_numpy(np.array([n], dtype=np.int32))
    return tensors


def _status(url, data=None, headers=None):
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_key_guards_the_openai_endpoint_and_tritons_inference(guarded, engine):
    model = guarded["models"][0]
    with pytest.raises(openai.AuthenticationError):
        _client(guarded, "wrong-key-000").completions.create(model=model, prompt=PROMPT, max_tokens=2)
    reply = _client(guarded).completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert reply.model_extra["sharpdraft"]["token_ids"] == engine.generate(engine.encode(PROMPT), 4).tokens
    http = httpclient.InferenceServerClient(guarded["http"][len("http://"):])
    grpc = grpcclient.InferenceServerClient(guarded["grpc"])
    try:
        for client, module, header in ((http, httpclient, "authorization"),
                                       (grpc, grpcclient, "triton-grpc-protocol-authorization")):
            with pytest.raises(InferenceServerException, match="restricted"):
                client.infer(model, _tensors(module, PROMPT, 2))
            out = client.infer(model, _tensors(module, PROMPT, 4), headers={header: f"Bearer {KEY}"})
            assert out.as_numpy("token_ids").tolist() == reply.model_extra["sharpdraft"]["token_ids"]
    finally:
        http.close()
        grpc.close()
    # health stays open (load balancers, serve's own probes); the admin endpoints are closed
    assert _status(guarded["http"] + "/v2/health/ready") == 200
    assert _status(guarded["http"] + "/v2/logging", b"{}") == 403
    assert _status(guarded["http"] + "/v2/repository/index", b"{}") == 403
    assert _status(guarded["http"] + "/v2/systemsharedmemory/status") == 403


def test_loadtest_carries_the_api_key_and_says_when_it_lacks_it(guarded, tiny_engine, capsys,
                                                                 monkeypatch):
    """loadtest against a keyed server: with --api-key (or $SHARPDRAFT_API_KEY) over HTTP
    and gRPC every request is served, with the tokens of the engine run in-process;
    without it, one line naming the missing key and exit 1."""
    from runtime.__main__ import main as runtime_main
    from runtime.cli import run

    monkeypatch.delenv("SHARPDRAFT_API_KEY", raising=False)
    model = guarded["models"][0]
    prompts = guarded["work"] / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    argv = ["loadtest", "--model", model, "--concurrency", "1", "--requests", "2",
            "--max-new-tokens", "4", "--prompts-file", str(prompts), "--json"]
    for url in (guarded["http"], "grpc://" + guarded["grpc"]):
        code = run(runtime_main, argv + ["--url", url, "--api-key", KEY, "--engine-dir", str(tiny_engine)])
        out = capsys.readouterr()
        assert code == 0, out.err
        report = json.loads(out.out)
        assert report["levels"][0]["ok"] == 2 and report["token_mismatches"] == 0
    monkeypatch.setenv("SHARPDRAFT_API_KEY", KEY)
    assert run(runtime_main, argv + ["--url", guarded["http"]]) == 0
    capsys.readouterr()
    monkeypatch.delenv("SHARPDRAFT_API_KEY")
    assert run(runtime_main, argv + ["--url", guarded["http"]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--api-key" in err[0]


def _stubs(server_pid: int) -> dict[int, bytes]:
    found = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
                if int(fields[1]) == server_pid and fields[0] != "Z":
                    found[int(stat)] = open(f"/proc/{stat}/cmdline", "rb").read()
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_a_killed_instance_fails_its_requests_retryably_and_the_model_comes_back(guarded, engine):
    """SIGKILL the streaming model's stub during a streamed and an unstreamed OpenAI request
    and a Triton gRPC request to the plain model: each ends in an error within 30 s (a
    503 with Retry-After, an SSE error event, a gRPC error), not a hang; /health says
    not ready meanwhile; the model serves again within 60 s; serve says so in one line
    each. (Before: both OpenAI clients hung to their timeout, new requests got 400.)"""
    model, client = guarded["models"][0], _client(guarded)
    ref = engine.generate(engine.encode(PROMPT), 400)
    stub = next(pid for pid, argv in _stubs(guarded["pid"]).items() if b"-stream/1/model.py" in argv)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)  # the stream is running

    def unstreamed():
        try:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0)
        except openai.APIStatusError as exc:
            return exc

    def triton_plain():
        grpc = grpcclient.InferenceServerClient(guarded["grpc"])
        try:
            return grpc.infer(model, _tensors(grpcclient, PROMPT, 400),
                              headers={"triton-grpc-protocol-authorization": f"Bearer {KEY}"})
        except InferenceServerException as exc:
            return exc
        finally:
            grpc.close()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain, direct = pool.submit(unstreamed), pool.submit(triton_plain)
        # both on their way (one that arrives after the kill gets the same 503); kept short:
        # the 400 tokens take ~1.2 s of the server's CPU, and a make test-all run once
        # starved this thread long enough that the stream had ended before the kill
        time.sleep(0.05)
        killed = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        with pytest.raises(openai.APIError) as streamed_error:
            for _ in chunks:
                pass
        plain, direct = plain.result(timeout=30), direct.result(timeout=30)
    assert time.monotonic() - killed < 30
    assert "unavailable" in str(streamed_error.value).lower()
    assert isinstance(plain, openai.APIStatusError) and plain.status_code == 503, plain
    assert plain.response.headers["Retry-After"] and plain.body["code"] == "backend_unavailable"
    # the gRPC request went to the plain model, whose stub was not killed: the restart
    # either cuts it (an error response, never INVALID_ARGUMENT, a client fault) or it finished
    # first, whole and with the target's tokens -- never a hang (both waited <= 30 s above)
    if isinstance(direct, InferenceServerException):
        assert "INVALID_ARGUMENT" not in str(direct.status()), direct
    else:
        assert direct.as_numpy("token_ids").tolist() == ref.tokens, "a request that finished was cut short"
    saw_not_ready, reply = False, None
    while time.monotonic() - killed < 60:
        if _status(guarded["openai"][:-len("/v1")] + "/health") == 503:
            saw_not_ready = True
            continue
        try:
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.response.headers["Retry-After"]
            time.sleep(0.5)
    assert reply is not None, "the model did not serve again within 60 s"
    assert reply.model_extra["sharpdraft"]["token_ids"] == ref.tokens[:8]
    assert saw_not_ready
    log = (guarded["work"] / "serve.stderr").read_text()
    # one line when it went (the stub, or tritonserver itself where the stub's death
    # brought it down), one when it is back
    assert log.count(": restarting tritonserver") == 1 and log.count("tritonserver back") == 1, log


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory, long_target, long_drafter):
    """A torch engine over the 4096-token tiny pair: prompts long enough that prefilling
    three of them costs seconds."""
    import build_engine

    out = tmp_path_factory.mktemp("long-engine") / "long"
    assert build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target", str(long_target),
                              "--drafter-checkpoint", str(long_drafter), "--ref-keys", "64", "--top-k", "8",
                              "--backend", "torch", "--step-costs", "fixed", "--output", str(out)]) == 0
    return out


def _turns(metrics_url: str, kinds) -> float:
    """Scheduler turns of these kinds so far (sharpdraft_turn_seconds_count{kind})."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sharpdraft_turn_seconds_count{")
               and any(f'kind="{kind}"' in line for kind in kinds))


def _cancelled(metrics_url: str, stage: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sharpdraft_cancelled_requests_total{") and f'stage="{stage}"' in line)


HUNG_UP = 4


def test_clients_that_hang_up_during_prefill_cost_the_next_request_nothing(long_engine, tmp_path):
    """Four streamed ~3,900-token prompts cut once their prefill is under way, then a
    4-token request: it is answered within 5 s (their prefills stop between two chunks;
    before, every chunk ran and the next request waited for them all: 14.2 s on 2 shared
    cores, against 0.12 s now), and the metrics count the cancellations."""
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(long_engine))
    prompt = "x = [i * i for i in range(10)]\n"
    prompt *= 3900 // len(engine.encode(prompt))
    assert 3500 < len(engine.encode(prompt)) < 4000
    port, = free_ports(1)
    with serve(long_engine, tmp_path, "--instances", "1", "--max-batch", "4", "--prefill-chunk", "8",
               "--openai-port", str(port)) as info:
        model = info["models"][0]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "stream": True}).encode()
        openai_port = int(info["openai"].rsplit(":", 1)[1].split("/")[0])
        clients = []
        for _ in range(HUNG_UP):
            conn = http.client.HTTPConnection("127.0.0.1", openai_port, timeout=30)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            clients.append(conn)
        deadline = time.monotonic() + 30
        while _turns(info["metrics"], ("prefill", "chunk")) < 10:  # the prefill is under way
            assert time.monotonic() < deadline, "the prompts never started prefilling"
            time.sleep(0.05)
        for conn in clients:  # the clients hang up mid-prefill
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        start = time.monotonic()
        reply = _client(info, "unused").completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        answered = time.monotonic() - start
        assert reply.model_extra["sharpdraft"]["token_ids"] == engine.generate(engine.encode(PROMPT), 4).tokens
        print(f"the next request was answered in {answered:.2f} s")
        assert answered < 5, f"the next request waited {answered:.1f} s"
        stages = {stage: _cancelled(info["metrics"], stage) for stage in ("queue", "prefill", "decode")}
        assert stages["prefill"] + stages["queue"] == HUNG_UP, stages
