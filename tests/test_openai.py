"""The OpenAI-compatible endpoint end to end, with the real `openai` client: one real
tritonserver + endpoint for the module (`python -m runtime serve --start --openai-port`)
on the tiny engine, small enough (one instance, 2 batch rows, 1 queue slot, 8-token
prefill chunks) that a full queue, a freed row and a chunked join are observable -- on the endpoint and on the plain Triton
model beside it, which batches through the same scheduler."""

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from served import free_ports, serve

MAX_BATCH, MAX_QUEUE = 2, 1
PROMPTS = ["def fib(n):", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def endpoint(tiny_engine, tmp_path_factory):
    port, = free_ports(1)
    with serve(tiny_engine, tmp_path_factory.mktemp("openai"), "--instances", "1",
               "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
               "--max-new-tokens-limit", "256", "--openai-port", str(port),
               # chunked prefill on these short prompts: a request joining a running one
               # prefills 8 tokens per step, and every token check below covers it
               "--prefill-chunk", "8") as info:
        assert info["openai"] == f"http://127.0.0.1:{port}/v1"
        yield info


@pytest.fixture(scope="module")
def engine(tiny_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(tiny_engine))


def _client(endpoint):
    # No retries: a 503 must reach the test, not be retried away by the client.
    return openai.OpenAI(base_url=endpoint["openai"], api_key="unused", max_retries=0, timeout=120)


def _chat_prompt(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _greedy(engine, prompt, n):
    return engine.generate(engine.encode(prompt), n)


def test_models_lists_the_served_model_and_its_modes(endpoint, engine):
    models = _client(endpoint).models.list().data
    assert [m.id for m in models] == [endpoint["models"][0]]
    # every mode the loaded engine runs (the modes table), read by the endpoint from engine.json
    assert models[0].model_extra["sharpdraft"]["modes"] == [str(m) for m in engine.spec.modes]
    assert "hybrid" in models[0].model_extra["sharpdraft"]["modes"]
    # what a request naming no mode runs: the tiny engine records no measured default
    assert models[0].model_extra["sharpdraft"]["default_mode"] == engine.spec.default_mode == "sharpdraft"


def test_completion_and_chat_equal_in_process_generate_token_for_token(endpoint, engine):
    client, model = _client(endpoint), endpoint["models"][0]
    for prompt in PROMPTS:
        ref = _greedy(engine, prompt, 12)
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert reply.model_extra["sharpdraft"]["token_ids"] == ref.tokens
        assert reply.model_extra["sharpdraft"]["mode"] == "sharpdraft"  # the default, named
        assert reply.choices[0].text == engine.decode(ref.tokens)
        assert reply.choices[0].finish_reason == ("stop" if ref.stopped_by == "stop_token" else "length")
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            len(engine.encode(prompt)), len(ref.tokens))
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that reverses a list."}]
    ref = _greedy(engine, _chat_prompt(engine, messages), 10)
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"sharpdraft": {"mode": "sharpdraft"}})
    assert reply.model_extra["sharpdraft"]["token_ids"] == ref.tokens
    assert reply.choices[0].message.content == engine.decode(ref.tokens)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == len(ref.tokens)
    # Every other mode the engine runs is the same text under greedy decoding (lossless),
    # reached by name: n-gram assisted ones included.
    for mode in engine.spec.modes:
        other = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"sharpdraft": {"mode": str(mode)}})
        assert other.model_extra["sharpdraft"]["token_ids"] == ref.tokens, mode
        if mode == "frozen":
            assert other.model_extra["sharpdraft"]["beta"] == 1.0


def test_the_sharpdraft_object_reports_the_requests_own_speculation(endpoint, engine):
    """Beside `usage`, streamed or not: the mode that ran, MAL, the drafts accepted at
    each step, the mean beta and the visible keys of the last drafter step -- those of
    the same decode in-process."""
    client, model = _client(endpoint), endpoint["models"][0]
    prompt = "def area(r):\n    return 3.14159 * r * r\n\n\n" * 6 + "def volume(r):"  # beta > 1
    gen = engine.generate(engine.encode(prompt), 14, "sharpdraft")
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=14, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=14, temperature=0,
                                            stream=True))
    streamed = next(c.model_extra["sharpdraft"] for c in chunks if c.model_extra.get("sharpdraft"))
    for spec in (reply.model_extra["sharpdraft"], streamed):
        assert spec["mode"] == "sharpdraft" and spec["token_ids"] == gen.tokens
        assert spec["accepted_per_step"] == [c - 1 for c in gen.committed_per_step]
        assert spec["mean_accepted_length"] == pytest.approx(gen.mean_accepted_length)
        assert spec["mean_beta"] == pytest.approx(sum(gen.beta_per_step) / len(gen.beta_per_step))
        assert spec["mean_beta"] > 1.0
        assert spec["visible_keys"] == gen.visible_per_step[-1]


def test_streaming_deltas_concatenate_to_the_same_text(endpoint, engine):
    client, model = _client(endpoint), endpoint["models"][0]
    prompt = PROMPTS[0] + "\n    # iterative"
    ref = _greedy(engine, prompt, 20)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == engine.decode(ref.tokens)
    assert chunks[-1].usage.completion_tokens == len(ref.tokens) and not chunks[-1].choices
    messages = [{"role": "user", "content": "def fib(n):"}]
    ref = _greedy(engine, _chat_prompt(engine, messages), 16)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == engine.decode(ref.tokens)


def test_a_stop_sequence_cuts_the_text_streamed_or_not(endpoint, engine):
    """A stop string ends the request before the model's final response: the text is cut
    there, finish_reason is "stop", the usage still counts the prompt, and vLLM's
    request_success counts it under finished_reason "stop"."""
    client, model = _client(endpoint), endpoint["models"][0]
    front = endpoint["openai"].removesuffix("/v1") + "/metrics"
    full = engine.decode(_greedy(engine, PROMPTS[1], 24).tokens)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    prompt_tokens = len(engine.encode(PROMPTS[1]))
    before = _scrape(front)
    reply = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (want, "stop")
    assert reply.usage.prompt_tokens == prompt_tokens
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                              stop=stop, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
    assert streamed[-1].usage.prompt_tokens == prompt_tokens
    after = _scrape(front)
    success = {reason: after[("vllm:request_success_total", (("finished_reason", reason), ("model_name", model)))]
               - before[("vllm:request_success_total", (("finished_reason", reason), ("model_name", model)))]
               for reason in ("stop", "length")}
    assert success == {"stop": 2, "length": 0}


BAD = [
    ("n>1", dict(n=2), "'n' must be 1"),
    ("negative temperature", dict(temperature=-1), "'temperature' must be >= 0"),
    ("over the limit", dict(max_tokens=10**6), "exceeds this server's limit of 256"),
    ("unknown mode", dict(extra_body={"sharpdraft": {"mode": "warp"}}),
     "mode 'warp' is not served by this engine; served modes: target, ngram, frozen"),
    ("unknown field", dict(extra_body={"max_new_tokens": 3}), "unknown field(s) 'max_new_tokens'"),
    ("prompt beyond the context", dict(prompt="x = 1\n" * 400), "the target's context holds 512"),
]


@pytest.mark.parametrize("change, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_request_gets_an_openai_shaped_400_with_one_line(endpoint, change, message):
    client = _client(endpoint)
    args = {"model": endpoint["models"][0], "prompt": PROMPTS[0], "max_tokens": 4} | change
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**args)
    error = refused.value
    assert error.status_code == 400 and message in error.message and "\n" not in error.body["message"]
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.body["type"] == "invalid_request_error"


def test_a_wrong_model_is_404_and_bad_json_is_400_in_openai_shape(endpoint):
    with pytest.raises(openai.NotFoundError) as missing:
        _client(endpoint).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    request = urllib.request.Request(endpoint["openai"] + "/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    body = json.loads(refused.value.read())
    assert refused.value.code == 400 and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def long_prompt(engine):
    """A prompt whose greedy continuation runs the whole 250 tokens (no early stop), and
    that continuation (decoded once for the module)."""
    for prompt in ["def area(r):\n    return 3.14159 * r * r\n\n\n", "import os\n", PROMPTS[0]]:
        ref = _greedy(engine, prompt, 250)
        if len(ref.tokens) == 250:
            return prompt, ref
    pytest.fail("no candidate prompt decodes 250 tokens without a stop token")


def test_a_disconnect_mid_stream_frees_the_request(endpoint, engine, long_prompt):
    """Hung-up streams are cancelled in Triton (their rows leave the batch at the next
    step) and the next requests are served; the fixture's teardown then checks that
    Triton released every request (else its shutdown waits out exit_timeout)."""
    client, model = _client(endpoint), endpoint["models"][0]
    prompt, _ = long_prompt
    streams = [client.completions.create(model=model, prompt=prompt, max_tokens=250, temperature=0, stream=True)
               for _ in range(MAX_BATCH)]
    for s in streams:
        next(iter(s))
    for s in streams:
        s.close()
    for p in PROMPTS:
        reply = client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0)
        assert reply.model_extra["sharpdraft"]["token_ids"] == _greedy(engine, p, 6).tokens


def _try(client, model, prompt, n, stream=False):
    try:
        if stream:
            return list(client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True))
        return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    except openai.APIStatusError as exc:
        return exc


def test_a_full_queue_refuses_with_503_and_the_others_finish(endpoint, engine, long_prompt):
    client, model = _client(endpoint), endpoint["models"][0]
    prompt, ref = long_prompt
    clients = MAX_BATCH + MAX_QUEUE + 3
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda _: _try(client, model, prompt, 250, stream=True), range(clients)))
    refused = [r for r in replies if isinstance(r, Exception)]
    served = [r for r in replies if not isinstance(r, Exception)]
    # How many get in depends on how fast the scheduler admits (the queue holds one), but
    # a full queue refuses, and every admitted request runs to its end, token for token.
    assert refused and served and len(refused) + len(served) == clients
    for r in refused:
        assert r.status_code == 503 and r.body["code"] == "queue_full" and "max_queue 1" in r.body["message"]
    for chunks in served:  # every admitted request ran to its end, token for token
        assert "".join(c.choices[0].text for c in chunks) == engine.decode(ref.tokens)


# --- the plain (non-streaming) Triton model of the same server -------------------------

def _plain(endpoint, kind, prompt, n, ready=None):
    """One request to the plain model over `kind` (http, grpc, generate): token ids, or the
    refusal as (status, message). `ready`: a barrier to wait at once the client is built,
    so that requests released together are sent together."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    model = endpoint["models"][0]
    if kind == "generate":
        body = json.dumps({"prompt": prompt, "max_new_tokens": n}).encode()
        if ready:
            ready.wait()
        try:
            with urllib.request.urlopen(urllib.request.Request(endpoint["generate"][0], data=body),
                                        timeout=120) as response:
                return json.loads(response.read())["token_ids"]
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["error"]
    module = httpclient if kind == "http" else grpcclient
    client = module.InferenceServerClient(endpoint["http"][len("http://"):] if kind == "http"
                                          else endpoint["grpc"])
    tensors = [module.InferInput("prompt", [1], "BYTES"), module.InferInput("max_new_tokens", [1], "INT32")]
    tensors[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    tensors[1].set_data_from_numpy(np.array([n], dtype=np.int32))
    if ready:
        ready.wait()
    try:
        return client.infer(model, tensors).as_numpy("token_ids").tolist()
    except InferenceServerException as exc:
        return exc.status(), exc.message()
    finally:
        client.close()


def _batch_peaks(endpoint) -> dict:
    """sharpdraft_batch_peak_rows per model: the most sequences one step of its batch held."""
    with urllib.request.urlopen(endpoint["metrics"], timeout=30) as response:
        lines = response.read().decode().splitlines()
    peaks = {}
    for line in lines:
        if line.startswith("sharpdraft_batch_peak_rows{"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            peaks[model] = max(peaks.get(model, 0), float(line.rsplit(" ", 1)[1]))
    return peaks


def test_two_concurrent_plain_requests_run_in_one_batch(endpoint, engine, long_prompt):
    """The plain model answers once per request but decodes through the scheduler: two
    requests at once share its steps (its batch peaks at 2 rows), each its own output."""
    prompt, ref = long_prompt
    other = PROMPTS[1]  # decodes 200 tokens too (no stop token): the two overlap for long
    expected = {"http": ref.tokens[:200], "grpc": _greedy(engine, other, 200).tokens}
    assert len(expected["grpc"]) == 200
    assert _batch_peaks(endpoint).get(endpoint["models"][0], 0) < 2  # nothing has batched it yet
    ready = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = dict(zip(("http", "grpc"), pool.map(lambda kind, p: _plain(endpoint, kind, p, 200, ready),
                                                  ("http", "grpc"), (prompt, other))))
    assert got == expected
    assert _batch_peaks(endpoint)[endpoint["models"][0]] == MAX_BATCH


@pytest.mark.parametrize("kind, status", [("http", 503), ("grpc", "StatusCode.UNAVAILABLE"),
                                          # Triton's generate endpoint sends every error as 400
                                          ("generate", 400)])
def test_a_full_queue_refuses_plain_requests_and_the_others_finish(endpoint, long_prompt, kind, status):
    prompt, ref = long_prompt
    n = 120  # long enough that every request arrives while the first ones decode
    clients = MAX_BATCH + MAX_QUEUE + 3
    ready = threading.Barrier(clients)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda _: _plain(endpoint, kind, prompt, n, ready), range(clients)))
    refused = [r for r in replies if isinstance(r, tuple)]
    served = [r for r in replies if not isinstance(r, tuple)]
    assert refused and served and len(refused) + len(served) == clients
    for code, message in refused:
        assert str(code) == str(status) and "max_queue 1" in message and "\n" not in message
    assert served == [ref.tokens[:n]] * len(served)  # every admitted request ran to its end


def test_the_ttft_script_times_every_path_against_this_server(endpoint, tiny_engine, tmp_path):
    """scripts/ttft_paths.py against this module's server: a time to first token per
    request through the OpenAI endpoint, the Triton gRPC stream and in process."""
    import importlib.util
    import statistics
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "ttft_paths.py"
    spec = importlib.util.spec_from_file_location("ttft_paths", script)
    ttft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttft)
    prompts, out = tmp_path / "prompts.txt", tmp_path / "ttft.json"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert ttft.main(["--openai-url", endpoint["openai"], "--grpc-url",
                      f"grpc://127.0.0.1:{endpoint['grpc_port']}", "--engine-dir", str(tiny_engine),
                      "--prompts-file", str(prompts), "--requests", "3", "--new-tokens", "4",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["ttft_s"]) == ["openai", "grpc", "in_process"]
    for name, seconds in result["ttft_s"].items():
        assert len(seconds) == 3 and all(0 < s < 60 for s in seconds)
        assert abs(result["median_s"][name] - statistics.median(seconds)) < 1e-3


# --- a hostile client: every malformed input a 4xx, big prompts refused before work ----

def _raw(endpoint, path, data: bytes, content_type="application/json", method="POST", timeout=30):
    """(status, headers, parsed body) of one raw HTTP request to the endpoint."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    request = urllib.request.Request(endpoint["openai"] + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _body(endpoint, **fields) -> bytes:
    return json.dumps({"model": endpoint["models"][0], "prompt": PROMPTS[0], "max_tokens": 4} | fields).encode()


MALFORMED = [  # (name, path, raw body or a function of the endpoint, content type, status)
    ("max_tokens of 5000 digits", "/completions",
     lambda e: _body(e)[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", "application/json", 400),
    ("lone surrogate in a prompt", "/completions",
     lambda e: _body(e, prompt="x").replace(b'"x"', b'"a\\ud800b"'), "application/json", 400),
    ("lone surrogate in chat content", "/chat/completions",
     lambda e: json.dumps({"model": e["models"][0], "max_tokens": 4, "messages": [
         {"role": "user", "content": "x"}]}).encode().replace(b'"x"', b'"\\ud800"'), "application/json", 400),
    ("a bogus charset", "/completions", lambda e: _body(e), "application/json; charset=x-bogus", 400),
    ("JSON nested 100,000 deep", "/completions", lambda e: b"[" * 100_000 + b"]" * 100_000,
     "application/json", 400),
    ("an unknown chat role", "/chat/completions",
     lambda e: json.dumps({"model": e["models"][0], "max_tokens": 4, "messages": [
         {"role": "wizard", "content": "hi"}]}).encode(), "application/json", 400),
    ("a text/plain body", "/completions", lambda e: _body(e), "text/plain", 415),
    ("no content type", "/completions", lambda e: _body(e), None, 415),
]


@pytest.mark.parametrize("path, make, content_type, status", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_input_gets_a_4xx_never_a_500(endpoint, path, make, content_type, status):
    """The five inputs that got 500 (a ValueError, TypeErrors, a LookupError, a
    RecursionError), an unknown chat role that was accepted, and non-JSON bodies: each
    an OpenAI-shaped 4xx with one line, and nosniff on it."""
    code, headers, body = _raw(endpoint, path, make(endpoint), content_type)
    assert code == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and "\n" not in body["error"]["message"]
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_errors_quote_input_cut_short_and_every_response_says_nosniff(endpoint):
    huge = "m" * 2**20  # a 1 MiB model name
    code, headers, body = _raw(endpoint, "/completions", _body(endpoint, model=huge))
    assert code == 404 and len(body["error"]["message"]) < 200
    code, headers, body = _raw(endpoint, "/completions", _body(endpoint, temperature="hot" * 100_000))
    assert code == 400 and len(body["error"]["message"]) < 200
    code, headers, body = _raw(endpoint, "/models", None, None, method="GET")
    assert code == 200 and headers["X-Content-Type-Options"] == "nosniff"
    request = urllib.request.Request(endpoint["openai"] + "/completions", data=_body(endpoint, stream=True),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # a stream's headers too
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.read().endswith(b"data: [DONE]\n\n")


def test_a_15_mb_prompt_is_refused_at_once_and_the_endpoint_stays_responsive(endpoint):
    """Refused by its bytes before any tokenizer sees it (it was tokenized on the event
    loop for 33 s, and /v1/models waited 18 s meanwhile); the Triton model refuses it by
    its bytes too."""
    body = _body(endpoint, prompt="x = 1; " * (15_000_000 // 7))  # under the 16 MiB body cap
    listed = []

    def list_models():
        start = time.perf_counter()
        _raw(endpoint, "/models", None, None, method="GET")
        listed.append(time.perf_counter() - start)

    lister = threading.Thread(target=list_models)
    start = time.perf_counter()
    lister.start()
    code, _, reply = _raw(endpoint, "/completions", body)
    refused = time.perf_counter() - start
    lister.join(30)
    assert code == 400 and "bytes" in reply["error"]["message"]
    assert reply["error"]["code"] == "context_length_exceeded"
    assert refused < 2 and listed and listed[0] < 2, (refused, listed)
    big = json.dumps({"prompt": "x = 1; " * (2_000_000 // 7), "max_new_tokens": 2}).encode()
    start = time.perf_counter()
    with pytest.raises(urllib.error.HTTPError) as triton_refused:
        urllib.request.urlopen(urllib.request.Request(endpoint["generate"][0], data=big), timeout=30)
    assert "bytes" in json.loads(triton_refused.value.read())["error"]
    assert time.perf_counter() - start < 5


def test_chat_messages_are_checked_against_their_schema(endpoint):
    """Roles and content forms (pydantic, as vLLM and SGLang): the first problem is a 400
    naming where it is, without echoing the input."""
    for messages, where in (([{"role": "wizard", "content": "hi"}], "messages[0].role"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                             "messages[0].content[0].type"),
                            ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content"),
                            ([], "messages")):
        code, _, body = _raw(endpoint, "/chat/completions", json.dumps(
            {"model": endpoint["models"][0], "max_tokens": 2, "messages": messages}).encode())
        assert code == 400 and body["error"]["param"] == where, body


# --- what the field's clients send (guidellm, AIPerf, lm-eval), and vLLM's /metrics ----

def _events(endpoint, path, body: dict) -> list[dict]:
    """The parsed data events of one streamed request (the [DONE] mark dropped)."""
    request = urllib.request.Request(endpoint["openai"] + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        lines = response.read().decode().split("\n\n")
    assert lines[-2] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-2]]


def test_guidellm_default_bodies_stream_with_running_usage(endpoint):
    """guidellm 0.8.1's request bodies as it sends them (FACTS.md): ignore_eos, stop null,
    continuous_usage_stats; chat with max_completion_tokens and content parts. Every chunk
    carries the running usage, and ignore_eos holds the output to its length."""
    model = endpoint["models"][0]
    common = {"model": model, "stream": True, "stop": None, "ignore_eos": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, body in (("/completions", {"prompt": PROMPTS[0], "max_tokens": 12}),
                       ("/chat/completions", {"max_completion_tokens": 12, "messages": [
                           {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]})):
        events = _events(endpoint, path, common | body)
        usage = [e["usage"] for e in events]
        assert all(u is not None for u in usage), path
        completion = [u["completion_tokens"] for u in usage]
        assert completion == sorted(completion) and completion[-1] == 12, (path, completion)
        assert len({u["prompt_tokens"] for u in usage}) == 1 and usage[0]["prompt_tokens"] > 0
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usage)
        assert events[-1]["choices"] == []  # include_usage's own last chunk


EXTENSIONS = {"top_k": 3, "min_p": 0.2, "repetition_penalty": 1.5, "presence_penalty": 1.0,
              "frequency_penalty": 0.8, "min_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_each_extension_greedy_equals_target_only_in_process(endpoint, engine, name):
    """Served (the default mode: speculation) with one of vLLM's extensions, greedy: the
    tokens of target-only decoding in-process with the same option."""
    from runtime.sampling import Sampling

    value = EXTENSIONS[name]
    reply = _client(endpoint).completions.create(
        model=endpoint["models"][0], prompt=PROMPTS[1], max_tokens=14, temperature=0,
        extra_body={name: value})
    sampling = Sampling(0.0, **({} if name == "ignore_eos" else {name: value}))
    want = engine.generate(engine.encode(PROMPTS[1]), 14, "target", sampling, stop=name != "ignore_eos")
    assert reply.model_extra["sharpdraft"]["token_ids"] == want.tokens
    if name in ("ignore_eos", "min_tokens"):
        assert reply.usage.completion_tokens >= value


def _target_logprobs(engine, prompt: str, n: int, top: int):
    from runtime.decode import Request
    from runtime.sampling import Sampler

    return engine.decoder("target").generate(Request(prompt=engine.encode(prompt), max_new_tokens=n, stop_ids=engine.stop_ids,
                                                     sampler=Sampler(), logprobs=top))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_equal_target_only_in_process(endpoint, engine, stream):
    """Completions (logprobs=3) and chat (logprobs, top_logprobs=2), streamed or not: each
    token's log-probability and its likeliest alternatives are target-only decoding's."""
    client, model = _client(endpoint), endpoint["models"][0]
    want = _target_logprobs(engine, PROMPTS[0], 10, 3)
    reply = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                      logprobs=3, stream=stream)
    chunks = list(reply) if stream else [reply]
    lp = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    tops = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert len(lp) == len(want.tokens) == 10
    assert max(abs(a - b) for a, (_, b, _) in zip(lp, want.logprobs)) < 1e-4
    for top, (_, _, want_top) in zip(tops, want.logprobs, strict=True):
        # keyed by each token's text: alternatives that decode alike share one key
        assert all(min(abs(v - w) for _, w in want_top) < 1e-4 for v in top.values())
        assert max(top.values()) == pytest.approx(want_top[0][1], abs=1e-4)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = _target_logprobs(engine, _chat_prompt(engine, messages), 8, 2)
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, stream=stream)
    chunks = list(reply) if stream else [reply]
    content = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert len(content) == len(want.tokens)
    for got, (token, value, top) in zip(content, want.logprobs):
        assert got.token == engine.tokenizer.decode([token]) and got.logprob == pytest.approx(value, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)


def _scrape(url: str) -> dict:
    """Prometheus text parsed by prometheus_client: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total")


def test_vllm_metrics_give_the_servers_mal_over_the_steps_that_drafted(endpoint):
    """/metrics on the OpenAI port (and Triton's port) parses with prometheus_client and
    carries vLLM's counters; over a run, 1 + accepted / drafts is the MAL of the steps
    that drafted, as the responses' own step records give it, and the serving families
    count the run's requests and tokens."""
    from runtime.metrics import read_speculation

    front = endpoint["openai"].removesuffix("/v1") + "/metrics"
    before, triton_before = _scrape(front), _scrape(endpoint["metrics"])
    own_before = read_speculation(urllib.request.urlopen(endpoint["metrics"], timeout=30).read().decode())
    assert all((name, (("model_name", endpoint["models"][0]),)) in before for name in SPEC)
    client, model = _client(endpoint), endpoint["models"][0]
    prompt = "def area(r):\n    return 3.14159 * r * r\n\n\ndef volume(r):"
    committed = steps = tokens = 0
    # the default mode, and n-gram lookup, whose drafts the tiny target accepts here
    for stream, mode in ((False, None), (True, "ngram"), (False, "ngram")):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                          stream=stream, extra_body={"sharpdraft": {"mode": mode}} if mode else None)
        spec = next(c.model_extra["sharpdraft"] for c in (list(reply) if stream else [reply])
                    if c.model_extra.get("sharpdraft"))
        drafted = [a for d, a in zip(spec["drafts_per_step"], spec["accepted_per_step"]) if d]
        committed, steps = committed + sum(a + 1 for a in drafted), steps + len(drafted)
        tokens += len(spec["token_ids"])
    after, triton_after = _scrape(front), _scrape(endpoint["metrics"])
    drafts, draft_tokens, accepted = (_total(after, n) - _total(before, n) for n in SPEC)
    assert drafts == steps > 0 and accepted > 0 and draft_tokens >= accepted
    assert 1 + accepted / drafts == pytest.approx(committed / steps)
    assert _total(after, "vllm:generation_tokens_total") - _total(before, "vllm:generation_tokens_total") == tokens
    assert _total(after, "vllm:time_to_first_token_seconds_count") - \
        _total(before, "vllm:time_to_first_token_seconds_count") == 3
    # vLLM's request_success, by finished_reason: both reasons shown from the start
    assert _total(after, "vllm:request_success_total") - _total(before, "vllm:request_success_total") == 3
    assert {dict(labels).get("finished_reason") for name, labels in after
            if name == "vllm:request_success_total"} == {"stop", "length"}
    assert ("vllm:num_requests_running", (("model_name", model),)) in after
    for name in (*SPEC, "vllm:request_success_total"):  # Triton's port: the same requests, counted by the model
        assert _total(triton_after, name) - _total(triton_before, name) == _total(after, name) - _total(before, name)
    assert _total(triton_after, "vllm:e2e_request_latency_seconds_count") > 0
    # the server's own counters (sharpdraft_spec_*, summed over modes and buckets) agree
    own = read_speculation(urllib.request.urlopen(endpoint["metrics"], timeout=30).read().decode())
    grew = {k: sum(e[k] for e in own.values()) - sum(e[k] for e in own_before.values())
            for k in ("drafting_steps", "accepted_tokens")}
    assert (grew["drafting_steps"], grew["accepted_tokens"]) == (drafts, accepted)


MALFORMED_EXTENSIONS = [
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"top_k": 1.5}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"stream_options": {"bogus": True}}, "stream_options.bogus"),
    ({"stream_options": "x"}, "stream_options"), ({"echo": "yes"}, "echo"), ({"echo": True, "stream": True}, "echo"),
]


@pytest.mark.parametrize("field, param", MALFORMED_EXTENSIONS, ids=[m[1] + str(i) for i, m in
                                                                    enumerate(MALFORMED_EXTENSIONS)])
def test_a_malformed_extension_is_a_400_naming_it(endpoint, field, param):
    code, _, body = _raw(endpoint, "/completions", _body(endpoint, **field))
    assert code == 400 and body["error"]["param"] == param, body
    assert "\n" not in body["error"]["message"]
    code, _, body = _raw(endpoint, "/chat/completions", json.dumps(
        {"model": endpoint["models"][0], "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
         "top_logprobs": 2}).encode())
    assert code == 400 and body["error"]["param"] == "top_logprobs"


def test_echo_scores_the_prompt_as_lm_eval_asks(endpoint, engine):
    """lm-eval's loglikelihood request (echo, logprobs 1; max_tokens 0, or 1 as 0.4.x
    sends): the prompt's text and each prompt token's log-probability, the first null,
    as target-only scoring in-process gives them; with max_tokens 1, one more token."""
    from runtime.modes import Mode

    prompt = "import numpy as np"
    ids = engine.encode(prompt)
    want = engine.decoder(Mode.TARGET).score(ids, 1)
    for max_tokens in (0, 1):
        code, _, body = _raw(endpoint, "/completions", _body(endpoint, prompt=prompt, max_tokens=max_tokens,
                                                               echo=True, logprobs=1, temperature=0))
        assert code == 200, body
        choice = body["choices"][0]
        assert choice["text"].startswith(prompt) and body["usage"]["completion_tokens"] == max_tokens
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + max_tokens and got[0] is None
        assert choice["logprobs"]["top_logprobs"][0] is None
        assert got[1:len(ids)] == pytest.approx([lp for _, lp, _ in want[1:]], abs=1e-4)
    # the plain Triton model (one response per request) scores the same through `generate`
    body = json.dumps({"prompt": prompt, "max_new_tokens": 0, "prompt_logprobs": True, "logprobs": 1}).encode()
    with urllib.request.urlopen(urllib.request.Request(endpoint["generate"][0], data=body), timeout=60) as reply:
        entries = json.loads(json.loads(reply.read())["prompt_logprob_entries"])
    assert [e[0] for e in entries] == ids and entries[0][1] is None
    assert [e[1] for e in entries[1:]] == pytest.approx([lp for _, lp, _ in want[1:]], abs=1e-4)
