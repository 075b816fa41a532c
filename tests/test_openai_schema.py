"""The OpenAI endpoint's request schema in process (no Triton, no model: Api.parse on a
stand-in for the settings): one pydantic model per endpoint, every malformed body a 400
with one line naming its field in `param`, the server's own limits checked after it.
(tests/test_openai.py sends the same kinds of body to a real server.)"""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.serve import protocol
from runtime.serve.openai_api import Api, ApiError, Reply, _request_schema
from runtime.serve.protocol import QUOTE, Params


class _Template:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


@pytest.fixture(scope="module")
def api():
    return Api(SimpleNamespace(model="m", limit=256, modes=("target", "ngram", "sharpdraft"),
                               default_mode="sharpdraft", prompt_bytes=10_000, context=512,
                               tokenizer=_Template()))


COMPLETION = {"model": "m", "prompt": "def f():", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "def f():"}], "max_tokens": 4}


def _refusal(api, body: dict, chat: bool) -> ApiError:
    with pytest.raises(ApiError) as refused:
        api.parse(json.dumps(body).encode(), chat)
    return refused.value


# (change to a valid body, param, what the message says); both endpoints unless marked
MALFORMED = [
    ({"model": 5}, "model", "'model' must be a string"),
    ({"model": None}, "model", "'model' must be a string"),
    ({"n": 2}, "n", "'n' must be 1 (one choice per request), got 2"),
    ({"n": 0}, "n", "'n' must be >= 1, got 0"),
    ({"n": True}, "n", "'n' must be an integer, got True"),
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1, got 0"),
    ({"max_tokens": -1}, "max_tokens", "'max_tokens' must be >= 0, got -1"),
    ({"max_tokens": 1.5}, "max_tokens", "'max_tokens' must be an integer, got 1.5"),
    ({"max_tokens": "4"}, "max_tokens", "'max_tokens' must be an integer"),
    ({"max_tokens": 10**6}, "max_tokens", "'max_tokens' 1000000 exceeds this server's limit of 256"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "'max_completion_tokens' must be >= 1, got 0"),
    ({"max_completion_tokens": 300}, "max_completion_tokens", "exceeds this server's limit of 256"),
    ({"temperature": -1}, "temperature", "'temperature' must be >= 0, got -1"),
    ({"temperature": 3}, "temperature", "'temperature' must be <= 2, got 3"),
    ({"temperature": "hot"}, "temperature", "'temperature' must be a number"),
    ({"temperature": True}, "temperature", "'temperature' must be a number, got True"),
    ({"top_p": 0}, "top_p", "'top_p' must be > 0, got 0"),
    ({"top_p": 1.5}, "top_p", "'top_p' must be <= 1, got 1.5"),
    ({"seed": 1.5}, "seed", "'seed' must be an integer, got 1.5"),
    ({"seed": 2**63}, "seed", "'seed' must be <= 9223372036854775807"),
    ({"stop": ""}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"stop": [""]}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"stop": ["a"] * 5}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"stop": ["a", 3]}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"stream": "yes"}, "stream", "'stream' must be true or false"),
    ({"stream": 1}, "stream", "'stream' must be true or false, got 1"),
    ({"sharpdraft": {"mode": "warp"}}, "sharpdraft.mode",
     "mode 'warp' is not served by this engine; served modes: target, ngram, sharpdraft"),
    ({"sharpdraft": {"mode": 5}}, "sharpdraft.mode", "'sharpdraft.mode' must be a string, got 5"),
    ({"sharpdraft": {"bogus": 1}}, "sharpdraft.bogus", "unknown field(s) 'sharpdraft.bogus'"),
    ({"sharpdraft": "x"}, "sharpdraft", "'sharpdraft' must be an object"),
    ({"best_of": 2}, "best_of", "'best_of' is not supported by this server"),
    ({"best_of": True}, "best_of", "'best_of' is not supported by this server"),
    ({"logit_bias": {"1": 2}}, "logit_bias", "'logit_bias' is not supported by this server"),
    ({"suffix": "x"}, "suffix", "'suffix' is not supported by this server"),
    ({"store": True}, "store", "'store' is not supported by this server"),
    ({"max_new_tokens": 3}, "max_new_tokens", "unknown field(s) 'max_new_tokens'"),
    ({"zz": 1, "aa": 2, "bb": 3, "cc": 4, "dd": 5, "ee": 6}, "aa",
     "unknown field(s) 'aa', 'bb', 'cc', 'dd' and 2 more"),
    ({"bogus": 1, "temperature": -1}, "bogus", "unknown field(s) 'bogus'"),  # unknown fields first
    ({"ignore_eos": "yes"}, "ignore_eos", "'ignore_eos' must be true or false"),
    ({"top_k": 1.5}, "top_k", "'top_k' must be an integer, got 1.5"),
    ({"top_k": -2}, "top_k", "'top_k' must be >= -1, got -2"),
    ({"min_p": 2}, "min_p", "'min_p' must be <= 1, got 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must be > 0, got 0"),
    ({"presence_penalty": 3}, "presence_penalty", "'presence_penalty' must be <= 2, got 3"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "'frequency_penalty' must be a number"),
    ({"min_tokens": -1}, "min_tokens", "'min_tokens' must be >= 0, got -1"),
    ({"stream_options": {"bogus": True}}, "stream_options.bogus", "unknown field(s) 'stream_options.bogus'"),
    ({"stream_options": "x"}, "stream_options", "'stream_options' must be an object"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "'stream_options.include_usage' must be true or false, got 1"),
]
COMPLETION_ONLY = [
    ({"prompt": ["a", "b"]}, "prompt", "'prompt' must be one string (token-id and batched prompts are not served)"),
    ({"prompt": [1, 2]}, "prompt", "'prompt' must be one string"),
    ({"prompt": 5}, "prompt", "'prompt' must be one string"),
    ({"prompt": "  "}, "prompt", "the prompt is empty"),
    ({"logprobs": 21}, "logprobs", "'logprobs' must be <= 20, got 21"),
    ({"logprobs": True}, "logprobs", "'logprobs' must be an integer, got True"),
    ({"echo": "yes"}, "echo", "'echo' must be true or false"),
    ({"echo": True, "stream": True}, "echo", "'echo' is served without streaming"),
    ({"top_logprobs": 2}, "top_logprobs", "unknown field(s) 'top_logprobs'"),
    ({"messages": []}, "messages", "unknown field(s) 'messages'"),
]
CHAT_ONLY = [
    ({"logprobs": 3}, "logprobs", "'logprobs' must be true or false, got 3"),
    ({"top_logprobs": 2}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs' must be <= 20, got 21"),
    ({"echo": True}, "echo", "unknown field(s) 'echo'"),
    ({"prompt": "x"}, "prompt", "unknown field(s) 'prompt'"),
    ({"messages": []}, "messages", "'messages' must hold at least 1 item(s)"),
    ({"messages": "x"}, "messages", "'messages' must be a list"),
    ({"messages": [5]}, "messages[0]", "'messages[0]' must be an object"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role",
     "'messages[0].role' must be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "'messages[0].content[0].type' must be 'text'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, "messages[1].content",
     "'messages[1].content' is required"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("change, param, message", MALFORMED, ids=[f"{m[1]}{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_body_is_a_400_naming_its_field(api, chat, change, param, message):
    error = _refusal(api, (CHAT if chat else COMPLETION) | change, chat)
    assert (error.status, error.param) == (400, param), error.message
    assert message in error.message and "\n" not in error.message


@pytest.mark.parametrize("chat, change, param, message",
                         [(False, *m) for m in COMPLETION_ONLY] + [(True, *m) for m in CHAT_ONLY],
                         ids=[f"completions-{m[1]}{i}" for i, m in enumerate(COMPLETION_ONLY)]
                         + [f"chat-{m[1]}{i}" for i, m in enumerate(CHAT_ONLY)])
def test_each_endpoints_own_fields_are_checked_by_its_schema(api, chat, change, param, message):
    error = _refusal(api, (CHAT if chat else COMPLETION) | change, chat)
    assert (error.status, error.param) == (400, param), error.message
    assert message in error.message


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_missing_fields_and_a_model_not_served(api, chat):
    base = CHAT if chat else COMPLETION
    for name in ("model", "messages" if chat else "prompt"):
        error = _refusal(api, {k: v for k, v in base.items() if k != name}, chat)
        assert (error.status, error.param, error.message) == (400, name, f"'{name}' is required")
    error = _refusal(api, base | {"model": "gpt-4"}, chat)
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    huge = _refusal(api, base | {"model": "m" * 2**20}, chat)
    assert huge.status == 404 and len(huge.message) < 200
    for raw in (b"[1]", b"null", b'"x"'):
        error = pytest.raises(ApiError, api.parse, raw, chat).value
        assert (error.status, error.message) == (400, "the body must be a JSON object")


def test_errors_quote_only_a_short_number_never_a_string(api):
    for value in ("hot" * 100_000, 10**1000, float("inf")):
        error = _refusal(api, COMPLETION | {"temperature": value}, False)
        assert error.status == 400 and error.param == "temperature" and len(error.message) < 120
        assert "hothot" not in error.message
    error = _refusal(api, COMPLETION | {"x" * 10_000: 1}, False)
    assert len(error.param) <= QUOTE and len(error.message) < 120


def test_well_formed_bodies_become_the_request_fields(api):
    params, reply = api.parse(json.dumps(COMPLETION | {
        "prompt": ["def g():"], "temperature": 0, "top_p": 0.5, "seed": -2**63, "stop": "x", "stream": None,
        "sharpdraft": {"mode": "ngram"}, "user": "me", "best_of": 1, "logit_bias": {}, "store": False,
        "top_k": -1, "min_p": 0, "ignore_eos": True, "logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode(), False)
    assert isinstance(params, Params) and params.text == "def g():"
    assert params == Params(text="def g():", max_new_tokens=4, temperature=0.0, top_p=0.5, seed=-2**63,
                            asked_mode="ngram", extensions=(("top_k", 0), ("min_p", 0.0)), ignore_eos=True,
                            logprobs=2, stop=("x",))
    assert reply == Reply(stream=False, include_usage=True, continuous_usage=True, echo=False)
    # the Triton inputs it becomes: the mode by name, the extensions in the model's types
    arrays = params.arrays()
    assert arrays["mode"].tolist() == [b"ngram"] and arrays["top_k"].dtype == np.int32
    assert "prompt_logprobs" not in arrays and arrays["ignore_eos"].tolist() == [True]
    # echo with max_tokens 0 (lm-eval's loglikelihood), the prompt's log-probabilities asked
    params, reply = api.parse(json.dumps(COMPLETION | {"echo": True, "max_tokens": 0, "logprobs": 1}).encode(), False)
    assert (params.max_new_tokens, reply.echo, params.prompt_logprobs) == (0, True, True)
    # chat: text parts joined, max_completion_tokens over max_tokens, the limit by default
    params, reply = api.parse(json.dumps({"model": "m", "max_completion_tokens": 9, "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"}],
        "logprobs": True, "top_logprobs": 3}).encode(), True)
    assert (params.text, params.max_new_tokens, params.logprobs, params.asked_mode) == ("ab", 9, 3, None)
    params, _ = api.parse(json.dumps({"model": "m", "messages": CHAT["messages"]}).encode(), True)
    assert (params.max_new_tokens, params.temperature, params.top_p, params.stop) == (256, 1.0, 1.0, ())


def test_the_openai_door_sends_what_the_triton_door_reads_back(api):
    """One request object at both doors: the OpenAI door's Params, sent as its arrays, is
    the Params the Triton model parses from them (stop strings are the endpoint's own)."""
    params, _ = api.parse(json.dumps(COMPLETION | {
        "temperature": 0.5, "seed": 7, "sharpdraft": {"mode": "ngram"}, "top_k": 3, "min_p": 0.25,
        "repetition_penalty": 1.5, "min_tokens": 2, "ignore_eos": True, "logprobs": 2, "echo": True,
        "stop": ["x"]}).encode(), False)
    assert protocol.parse(params.arrays(), max_new_tokens_limit=256) == dataclasses.replace(params, stop=())
    # the one limit check, at both doors, each naming the field as its client wrote it
    with pytest.raises(protocol.RequestError, match="max_new_tokens 4 exceeds this server's limit of 3 "):
        protocol.parse(params.arrays(), max_new_tokens_limit=3)
    error = _refusal(api, COMPLETION | {"max_tokens": 300}, False)
    assert (error.param, error.message) == ("max_tokens", "'max_tokens' 300 exceeds this server's limit of 256")


def test_one_schema_per_endpoint_built_once():
    assert _request_schema(False) is _request_schema(False) is not _request_schema(True)
    for chat, own in ((False, {"prompt", "echo"}), (True, {"messages", "top_logprobs"})):
        fields = set(_request_schema(chat).model_fields)
        assert own <= fields and {"model", "temperature", "stop", "sharpdraft", "top_k", "user"} <= fields
        assert _request_schema(chat).model_config["extra"] == "forbid"
