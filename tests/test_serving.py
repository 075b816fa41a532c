"""The Triton deployment end to end: one real tritonserver per module, started by
`python -m runtime serve --start` on free loopback ports over the tiny engine
(tests/served.py), and asked over HTTP, gRPC, the generate endpoint and a gRPC stream.
The finalizer stops it with SIGTERM by PID and checks that nothing it started is left
running.

The full tier's (make test-all): its server runs four model instances (two, and the
streaming model's two), about 25 s of make test's time. The fast tier serves the same
engine once, through tests/test_openai.py: the OpenAI endpoint token for token against
in-process generate, Triton's own HTTP endpoint refusing past a full queue while the
others finish, and its gRPC stream timed by scripts/ttft_paths.py."""

import json
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from runtime.__main__ import main
from runtime.cli import run
from served import REPO, serve

pytestmark = pytest.mark.slow

PROMPTS = ["def fib(n):", "import os\n\n\ndef main():", "class Stack:\n    def __init__(self):"]
# Long enough that the drafter sees more than the tiny engine's ref_keys (64): beta > 1.
LONG_PROMPT = "def area(r):\n    return 3.14159 * r * r\n\n\n" * 6 + "def volume(r):"


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    with serve(tiny_engine, tmp_path_factory.mktemp("serving"), "--instances", "2", "--streaming",
               "--max-new-tokens-limit", "256") as info:
        info["model"], info["stream_model"] = info["models"]
        yield info


def _inputs(module, prompt, max_new_tokens, **optional):
    kinds = {"temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
             "seed": ("INT64", np.int64), "sharpdraft": ("BOOL", np.bool_), "mode": ("BYTES", np.object_)}
    tensors = [module.InferInput("prompt", [1], "BYTES"),
               module.InferInput("max_new_tokens", [1], "INT32")]
    tensors[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    tensors[1].set_data_from_numpy(np.array([max_new_tokens], dtype=np.int32))
    for name, value in optional.items():
        datatype, dtype = kinds.get(name, ("INT32", np.int32))
        tensor = module.InferInput(name, [1], datatype)
        value = value.encode() if isinstance(value, str) else value
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        tensors.append(tensor)
    return tensors


def _client(kind, served):
    if kind == "http":
        return httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{served['http_port']}")
    return grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{served['grpc_port']}")


def _reference(engine_dir, prompt, max_new_tokens, capsys):
    """What `python -m runtime generate --json` prints for this prompt (greedy)."""
    capsys.readouterr()
    assert main(["generate", "--engine-dir", str(engine_dir), "--prompt", prompt,
                 "--max-new-tokens", str(max_new_tokens), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_responses_are_token_identical_to_generate(served, tiny_engine, capsys, kind):
    module, client = _client(kind, served)
    for prompt, n in [(p, 12) for p in PROMPTS] + [(LONG_PROMPT, 8)]:
        ref = _reference(tiny_engine, prompt, n, capsys)
        result = client.infer(served["model"], _inputs(module, prompt, n))
        assert result.as_numpy("token_ids").tolist() == ref["tokens"]
        assert result.as_numpy("text")[0].decode() == ref["text"]
        assert result.as_numpy("verify_steps")[0] == ref["verify_steps"]
        assert result.as_numpy("mean_accepted_length")[0] == pytest.approx(
            ref["mean_accepted_length"], abs=1e-4)
        assert result.as_numpy("beta")[0] == pytest.approx(ref["beta"]["last"], rel=1e-6)
    assert result.as_numpy("beta")[0] > 1.0  # the long prompt: SharpDraft is scaling


def test_generate_endpoint_matches_the_generate_command_line(served, tiny_engine):
    # Both user-facing ends as a user runs them: `python -m runtime generate` in its own
    # process, and a curl-style POST to the generate endpoint.
    cli = subprocess.run([sys.executable, "-m", "runtime", "generate", "--engine-dir",
                          str(tiny_engine), "--prompt", PROMPTS[0], "--max-new-tokens", "10",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    ref = json.loads(cli.stdout)
    url = f"http://127.0.0.1:{served['http_port']}/v2/models/{served['model']}/generate"
    body = json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 10}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        reply = json.loads(response.read())
    assert reply["token_ids"] == ref["tokens"] and reply["text"] == ref["text"]
    assert reply["verify_steps"] == ref["verify_steps"]
    assert reply["finish_reason"] == ("stop" if ref["stopped_by"] == "stop_token" else "length")


def test_concurrent_clients_each_get_their_own_output(served, tiny_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(tiny_engine))
    clients, per_client = 16, 8
    # Every client asks its own prompt and length, so a crossed response cannot pass.
    work = {c: (f"{PROMPTS[c % 3]}\n    # client {c}", 4 + c % 5) for c in range(clients)}
    expected = {c: engine.generate(engine.encode(p), n).tokens for c, (p, n) in work.items()}
    got, failures = {c: [] for c in range(clients)}, []
    start = threading.Barrier(clients)

    def run(c):
        module, client = _client("http" if c % 2 else "grpc", served)
        prompt, n = work[c]
        start.wait()
        for _ in range(per_client):
            try:
                got[c].append(client.infer(served["model"], _inputs(module, prompt, n))
                              .as_numpy("token_ids").tolist())
            except Exception as exc:
                failures.append((c, str(exc)))
        client.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures
    for c in range(clients):
        assert got[c] == [expected[c]] * per_client, f"client {c}"


BAD_REQUESTS = [
    ("empty prompt", dict(prompt="   "), "prompt is empty"),
    ("no tokens", dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    ("too many tokens", dict(max_new_tokens=10**9), "exceeds this server's limit of 256"),
    ("prompt beyond context", dict(prompt="x = 1\n" * 400), "the target's context holds 512"),
    ("wrong dtype", dict(seed=("FP32", 1.5)), "'seed' data-type is 'FP32'"),
    ("unknown field", dict(colour=3), "unexpected inference input 'colour'"),
    ("bad temperature", dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    ("mode it cannot run", dict(mode="window"), "cannot run mode 'window'"),
]


@pytest.mark.parametrize("kind", ["http", "grpc"])
@pytest.mark.parametrize("case, change, message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_an_error_and_the_server_stays_ready(served, kind, case, change, message):
    module, client = _client(kind, served)
    args = {"prompt": PROMPTS[0], "max_new_tokens": 4} | change
    prompt, n = args.pop("prompt"), args.pop("max_new_tokens")
    if "seed" in args:  # deliberately the wrong type
        datatype, value = args.pop("seed")
        tensors = _inputs(module, prompt, n, **args)
        wrong = module.InferInput("seed", [1], datatype)
        wrong.set_data_from_numpy(np.array([value], dtype=np.float32))
        tensors.append(wrong)
    else:
        tensors = _inputs(module, prompt, n, **args)
    with pytest.raises(Exception) as refused:
        client.infer(served["model"], tensors)
    assert message in str(refused.value)
    assert client.is_server_ready() and client.is_model_ready(served["model"])
    good = client.infer(served["model"], _inputs(module, PROMPTS[1], 4))
    assert len(good.as_numpy("token_ids")) >= 1


def test_generate_endpoint_refuses_an_unknown_field_by_name(served):
    url = f"http://127.0.0.1:{served['http_port']}/v2/models/{served['model']}/generate"
    body = json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 4, "max_tokens": 4}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60)
    assert refused.value.code == 400 and "'max_tokens'" in refused.value.read().decode()


def test_streaming_sends_one_response_per_verify_step(served, tiny_engine, capsys):
    ref = _reference(tiny_engine, LONG_PROMPT, 10, capsys)
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['grpc_port']}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(served["stream_model"], _inputs(grpcclient, LONG_PROMPT, 10))
    steps, final = [], None
    while final is None:
        result, error = responses.get(timeout=120)
        assert error is None, str(error)
        if result.get_response().parameters["triton_final_response"].bool_param:
            final = result
        else:
            steps.append(result)
    client.stop_stream()
    client.close()
    # The prefill commits the first token; then one response per verify step.
    assert len(steps) == ref["verify_steps"] + 1
    assert sum((s.as_numpy("token_ids").tolist() for s in steps), []) == ref["tokens"]
    text = "".join(r.as_numpy("text")[0].decode() for r in steps + [final])
    assert text == ref["text"]
    assert final.as_numpy("verify_steps")[0] == ref["verify_steps"]
    assert final.as_numpy("beta")[0] == pytest.approx(ref["beta"]["last"], rel=1e-6)


def test_loadtest_reports_and_matches_in_process(served, tiny_engine, capsys):
    capsys.readouterr()
    code = main(["loadtest", "--url", f"grpc://127.0.0.1:{served['grpc_port']}",
                 "--concurrency", "1", "4", "--requests", "12", "--max-new-tokens", "8",
                 "--engine-dir", str(tiny_engine), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    # the streaming model (in-flight batching) is preferred, found by itself
    assert report["model"] == served["stream_model"] and report["streaming"]
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["ok"] == 12 and level["errors"] == 0
        latency, first = level["latency_ms"], level["ttft_ms"]
        assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
        assert 0 < first["p50"] <= first["p95"] and first["p50"] <= latency["p50"]
        assert level["mean_accepted_length"] >= 1.0 and level["tokens_per_second"] > 0
    assert report["token_mismatches"] == 0
    assert report["in_process"]["ok"] == 12


def test_loadtest_mode_names_the_mode_of_every_request(served, tiny_engine, capsys):
    capsys.readouterr()
    code = main(["loadtest", "--url", f"grpc://127.0.0.1:{served['grpc_port']}",
                 "--concurrency", "2", "--requests", "4", "--max-new-tokens", "8", "--mode",
                 "frozen-hybrid", "--engine-dir", str(tiny_engine), "--backend", "torch", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mode"] == "frozen-hybrid" and report["levels"][0]["ok"] == 4
    assert report["token_mismatches"] == 0  # against in-process frozen-hybrid decoding
    # the in-process engine loads as the server's does (--backend, --prefill-dtype): one
    # this engine cannot be is refused in one line, before any request is sent
    code = run(main, ["loadtest", "--url", f"grpc://127.0.0.1:{served['grpc_port']}", "--requests",
                      "1", "--engine-dir", str(tiny_engine), "--backend", "onnxruntime", "--json"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 1 and captured.out == "" and len(err) == 1
    assert err[0].startswith("error: ") and "holds no ONNX graphs" in err[0]
    code = main(["loadtest", "--url", f"grpc://127.0.0.1:{served['grpc_port']}",
                 "--concurrency", "1", "--requests", "1", "--mode", "window", "--json"])
    report = json.loads(capsys.readouterr().out)  # the server refuses what the engine lacks
    assert code == 1 and report["levels"][0]["errors"] == 1


def test_loadtest_runs_the_plain_model_when_asked(served, capsys):
    capsys.readouterr()
    code = main(["loadtest", "--url", f"http://127.0.0.1:{served['http_port']}", "--model",
                 served["model"], "--concurrency", "2", "--requests", "4", "--max-new-tokens", "4",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and not report["streaming"] and report["levels"][0]["ok"] == 4


def _stream(served, prompt, n, responses, cancel_after=None, **optional):
    """One gRPC stream: (token ids, final response or None, error or None)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['grpc_port']}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(served["stream_model"], _inputs(grpcclient, prompt, n, **optional))
    ids = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return ids, None, str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ids, result, None
            ids += result.as_numpy("token_ids").tolist()
            if cancel_after is not None and len(ids) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return ids, None, "cancelled"
    finally:
        client.stop_stream()
        client.close()


def test_concurrent_streams_batch_in_flight_and_a_bad_or_cancelled_one_fails_alone(served,
                                                                                  tiny_engine):
    """Eight streams at once share one instance's decoding steps (and join as others
    leave); each gets exactly its own `generate` output and statistics, while an
    over-long prompt is refused and a cancelled stream leaves, alone."""
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(tiny_engine))
    work = [(f"{PROMPTS[c % 3]}\n    # stream {c}" + (LONG_PROMPT if c % 4 == 0 else ""), 4 + c % 7)
            for c in range(8)]
    expected = [engine.generate(engine.encode(p), n) for p, n in work]
    results, start = {}, threading.Barrier(len(work) + 2)

    def run(key, prompt, n, cancel_after=None):
        start.wait()
        results[key] = _stream(served, prompt, n, queue.Queue(), cancel_after)

    threads = [threading.Thread(target=run, args=(c, *work[c])) for c in range(len(work))]
    threads.append(threading.Thread(target=run, args=("long", "x = 1\n" * 400, 4)))
    threads.append(threading.Thread(target=run, args=("cancelled", LONG_PROMPT, 200, 2)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert "the target's context holds 512" in results["long"][2]
    assert results["cancelled"][2] == "cancelled"
    for c, want in enumerate(expected):
        ids, final, error = results[c]
        assert error is None and ids == want.tokens, f"stream {c}"
        assert final.as_numpy("verify_steps")[0] == want.verify_steps
        assert final.as_numpy("beta")[0] == pytest.approx(
            want.beta_per_step[-1] if want.beta_per_step else 1.0, rel=1e-6)
    # the server is still serving after the refusal and the cancellation
    ids, final, error = _stream(served, PROMPTS[0], 6, queue.Queue())
    assert error is None and ids == engine.generate(engine.encode(PROMPTS[0]), 6).tokens


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_request_names_its_mode_and_gets_what_generate_mode_gives(served, tiny_engine, capsys, kind):
    # n-gram-assisted modes run one request at a time inside the scheduler's loop, on the
    # plain model as on the streaming one: both equal the command line's tokens
    module, client = _client(kind, served)
    prompt = PROMPTS[0] + "\n" + PROMPTS[0]  # repeats itself: the lookup finds drafts
    for mode in ("hybrid", "frozen-hybrid", "target"):
        capsys.readouterr()
        assert main(["generate", "--engine-dir", str(tiny_engine), "--prompt", prompt,
                     "--max-new-tokens", "12", "--json", "--mode", mode]) == 0
        ref = json.loads(capsys.readouterr().out)
        result = client.infer(served["model"], _inputs(module, prompt, 12, mode=mode))
        assert result.as_numpy("token_ids").tolist() == ref["tokens"], mode
        assert result.as_numpy("verify_steps")[0] == ref["verify_steps"], mode
    url = f"http://127.0.0.1:{served['http_port']}/v2/models/{served['stream_model']}/generate_stream"
    body = json.dumps({"prompt": prompt, "max_new_tokens": 12, "mode": "frozen-hybrid"}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        events = [json.loads(line[5:]) for line in response.read().decode().splitlines()
                  if line.startswith("data:")]
    capsys.readouterr()
    assert main(["generate", "--engine-dir", str(tiny_engine), "--prompt", prompt,
                 "--max-new-tokens", "12", "--json", "--mode", "frozen-hybrid"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert sum((e["token_ids"] if isinstance(e["token_ids"], list) else [e["token_ids"]]
                for e in events), []) == ref["tokens"]


def _scrape(served, read=None) -> dict:
    from runtime.metrics import read_speculation

    with urllib.request.urlopen(served["metrics"], timeout=30) as response:
        return (read or read_speculation)(response.read().decode())


def test_speculation_metrics_count_what_the_responses_report(served, tiny_engine):
    """Triton's real metrics endpoint, scraped before and after real requests (plain and
    streaming, three modes, two instances): per model and mode, the sharpdraft_spec_*
    counters grew by exactly the steps, drafts, accepted tokens and drafter steps the
    responses' own `sharpdraft` objects report -- and those objects equal what the
    same prompts record in-process."""
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.metrics import context_bucket

    engine = Engine(open_spec(tiny_engine))
    repeated = PROMPTS[0] + "\n" + PROMPTS[0]  # the lookup finds drafts: the drafter sits out
    work = [(served["model"], LONG_PROMPT, 10, "sharpdraft"), (served["model"], repeated, 12, "hybrid"),
            (served["stream_model"], PROMPTS[1], 9, "sharpdraft"), (served["model"], PROMPTS[2], 7, "target"),
            (served["stream_model"], LONG_PROMPT + "\n", 11, "frozen")]
    from runtime.metrics import read_turns

    before, turns_before = _scrape(served), _scrape(served, read_turns)
    objects = []
    for model, prompt, n, mode in work:
        if model == served["stream_model"]:
            ids, final, error = _stream(served, prompt, n, queue.Queue(), mode=mode)
            assert error is None
        else:
            module, client = _client("http", served)
            final = client.infer(model, _inputs(module, prompt, n, mode=mode))
        spec = json.loads(final.as_numpy("speculation")[0])
        gen = engine.generate(engine.encode(prompt), n, mode)
        # the response's own figures are the step records of the same decode in-process
        assert spec["mode"] == mode and spec["verify_steps"] == gen.verify_steps
        assert spec["accepted_per_step"] == [c - 1 for c in gen.committed_per_step]
        assert spec["draft_tokens"] == sum(gen.verified_per_step)
        assert spec["drafter_steps"] == len(gen.beta_per_step)
        if gen.beta_per_step:
            assert spec["mean_beta"] == pytest.approx(sum(gen.beta_per_step) / len(gen.beta_per_step))
            assert spec["visible_keys"] == gen.visible_per_step[-1]
        objects.append((model, mode, spec, gen))
    after, turns_after = _scrape(served), _scrape(served, read_turns)

    assert any(s["mean_beta"] > 1.0 for _, _, s, _ in objects)  # SharpDraft scaled somewhere
    assert any(s["drafter_steps"] < s["verify_steps"] for _, m, s, _ in objects if m == "hybrid")
    for model, mode in {(m, mode) for m, mode, _, _ in objects}:
        mine = [(s, g) for m, md, s, g in objects if (m, md) == (model, mode)]
        keys = [k for k in after if k[:2] == (model, mode)]
        assert keys and all(k[2] == context_bucket(len(engine.encode(LONG_PROMPT))) for k in keys)

        def grew(field):
            return sum(after[k][field] - before.get(k, {}).get(field, 0.0) for k in keys)

        assert grew("requests") == len(mine)
        assert grew("steps") == sum(s["verify_steps"] for s, _ in mine), (model, mode)
        assert grew("accepted_tokens") == sum(sum(s["accepted_per_step"]) for s, _ in mine)
        assert grew("draft_tokens") == sum(s["draft_tokens"] for s, _ in mine)
        assert grew("beta_count") == sum(s["drafter_steps"] for s, _ in mine)
        assert grew("beta_sum") == pytest.approx(sum(s["mean_beta"] * s["drafter_steps"] for s, _ in mine),
                                                 rel=1e-5)
        uses_drafter = mode != "target"
        assert grew("drafter_sitouts") == (sum(s["verify_steps"] - s["drafter_steps"] for s, _ in mine)
                                           if uses_drafter else 0)
        # position p counts the steps that accepted at least p drafts
        for p in range(1, 1 + max(max(s["accepted_per_step"], default=0) for s, _ in mine)):
            got = sum(after[k]["accepted_per_position"].get(p, 0)
                      - before.get(k, {}).get("accepted_per_position", {}).get(p, 0) for k in keys)
            assert got == sum(a >= p for s, _ in mine for a in s["accepted_per_step"])

    # the scheduler's turns (sharpdraft_turn_*): the requests ran one after another, so
    # the steps taken are the steps they verified, and no prompt joined while a row ran
    def turns(kind):
        return (turns_after.get(kind, {}).get("count", 0)
                - turns_before.get(kind, {}).get("count", 0))

    assert turns("step") == sum(s["verify_steps"] for _, _, s, _ in objects)
    assert turns("chunk") == turns("join") == 0 and turns("prefill") >= len(work)
    assert turns_after["step"]["longest"] > 0 and turns_after["prefill"]["longest"] > 0
