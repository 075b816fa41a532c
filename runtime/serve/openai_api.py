"""An OpenAI-compatible HTTP endpoint (/v1/models, /v1/completions, /v1/chat/completions)
in front of the served streaming model: each request becomes one gRPC stream to the
decoupled `-stream` model, so it joins the same in-flight batch as every other client,
and a client that goes away cancels its Triton request (its batch row is freed at the
next step). aiohttp (already a dependency of tritonclient[http]) carries HTTP and SSE.

Triton's own OpenAI frontend is not used: it needs the in-process `tritonserver` /
`tritonfrontend` wheels, published for Python 3.12 on glibc >= 2.39 only (docs/serving.md).

What OpenAI fields mean here: `max_tokens` -> max_new_tokens (refused above the server's
limit, never clamped), `temperature` (OpenAI's default 1.0), `top_p`, `seed`, `stop`
(matched on the text here; the stream is cut and the Triton request cancelled), `n` = 1
only. vLLM's extensions, as vLLM's clients send them (guidellm, AIPerf, lm-eval):
`ignore_eos`, `min_tokens`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
`frequency_penalty` (runtime/sampling.py applies them to draft and target alike, so
speculation stays lossless); `logprobs` (completions: k; chat: `logprobs` and
`top_logprobs`), from the target's distribution at each committed token; `stream_options`
`include_usage` and `continuous_usage_stats` (every chunk carries the running usage).
GET /metrics shows vLLM's metrics under vLLM's names (runtime/serve/vllm_metrics.py).
SharpDraft's own settings travel as `"sharpdraft": {"mode": NAME}`, which other
clients never send; responses carry a `sharpdraft` object (token ids, mode statistics)
that OpenAI clients ignore.

Each endpoint checks its body against one pydantic schema (_request_schema: OpenAI's
fields, vLLM's extensions, `sharpdraft`; unknown fields refused by name and shape), then
builds from it, once, the request object the Triton door builds too
(runtime/serve/protocol.py: Params), whose construction checks what the server limits (the
token limit, the modes it serves, an empty prompt) at both doors alike; the Triton call
sends Params.arrays(). What only shapes the HTTP answer (stream, usage, echo) is a Reply.

A hostile client gets a 4xx, never a 500 or a stall: a JSON body only (415 otherwise),
UTF-8 only, parsed off the event loop with every malformed kind (invalid Unicode, numbers
past Python's digit limit, nesting past its recursion limit) a 400; a prompt longer in
bytes than the context can hold is refused before anything tokenizes it (the model
tokenizes each prompt once and reports the count for `usage`); errors quote input cut
short. With an API key, every /v1 route wants `Authorization: Bearer KEY` (401). Every
response carries `X-Content-Type-Options: nosniff`, every 503 a `Retry-After`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import sys
import threading
import time
import uuid

from runtime.serve.protocol import (INPUTS, MAX_LOGPROBS, QUOTE, SAMPLING_EXTENSIONS, Door, Params,
                                    RequestError, quote)

# The scheduler's QueueFull text (runtime/serve/scheduler.py): a gRPC stream response
# carries only a message, no status code, so the refusal is recognised by it.
QUEUE_FULL_MARK = "requests are already waiting"
INTERNAL_MARK = "internal error (id"  # protocol.internal_error's reply
MAX_STOP = 4  # OpenAI's own limit on stop sequences
RETRY_AFTER = "2"  # seconds, on every 503: a full queue, or a model coming back
# What the model's errors say when its instance is gone (the Python backend's stub died):
# the server's fault, and retryable once serve has brought the model back.
UNHEALTHY_MARKS = ("is not healthy", "Stub process", "failed to connect", "Socket closed")
# Chat roles the OpenAI API defines; the chat template decides what it accepts of them.
ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields OpenAI clients send with neutral values (LangChain and the `openai` package fill
# some in): None, any value is taken and ignored; else the values taken, any other refused
# as not supported. Anything else unknown is refused by name, so a misspelt field is not
# ignored.
NEUTRAL = {"user": None,
           "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
           "parallel_tool_calls": None, "metadata": None, "store": (None, False), "service_tier": None}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, one-line message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@functools.cache  # built once per endpoint, on its first request
def _request_schema(chat: bool):
    """THE schema of a request body, one per endpoint (pydantic, as vLLM and SGLang check
    theirs): NEUTRAL fields, OpenAI's own, `sharpdraft`, vLLM's extensions and logprobs,
    then the prompt or the messages. Strict types (a number is never a bool or a string),
    OpenAI's and vLLM's ranges, null means not sent, unknown fields refused. What depends on
    the server (the model's name, the limit, the modes) is checked after: Api.parse."""
    from typing import Annotated, Any, Literal, Optional

    from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                          StrictInt, StrictStr, ValidationError, WrapValidator, create_model)
    from pydantic_core import PydanticCustomError

    def integer(**bounds):  # a JSON integer in bounds, or null
        return Optional[Annotated[StrictInt, Field(**bounds)]]

    def number(**bounds):  # StrictFloat takes integers too, never bools or strings
        return Optional[Annotated[StrictFloat, Field(**bounds)]]

    def one_message(message: str):
        """A union's failure as one message (pydantic would report each member's)."""
        def check(value, handler):
            try:
                return handler(value)
            except ValidationError:
                raise PydanticCustomError("refused", message) from None
        return WrapValidator(check)

    def neutral(values):
        def check(value):
            if value is not None and not any(type(value) is type(v) and value == v for v in values):
                raise PydanticCustomError("refused", "is not supported by this server")
            return value
        return Annotated[Any, AfterValidator(check)]

    class Closed(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class StreamOptions(Closed):
        include_usage: Optional[StrictBool] = None
        continuous_usage_stats: Optional[StrictBool] = None

    class SharpDraft(Closed):
        mode: Optional[StrictStr] = None  # a mode this server runs: Params checks it

    class TextPart(BaseModel):
        type: Literal["text"]
        text: StrictStr

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")  # other message keys (`name`, ...) pass
        role: Literal[ROLES]
        content: StrictStr | list[TextPart]

    Stop = Annotated[StrictStr, Field(min_length=1)]
    Neutral = create_model("Neutral", __base__=Closed, **{
        name: (Any if values is None else neutral(values), None) for name, values in NEUTRAL.items()})

    class Body(Neutral):  # in the order a request's problems are reported
        model: StrictStr
        n: integer(ge=1) = None  # 1 only: Api._checked
        max_tokens: integer(ge=0) = None  # 0 only with echo, at most the limit: Params
        max_completion_tokens: integer(ge=0) = None  # max_tokens' newer name
        temperature: number(ge=0, le=2) = None
        top_p: number(gt=0, le=1) = None
        seed: integer(ge=-2**63, le=2**63 - 1) = None
        stop: Optional[Annotated[Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)], one_message(
            f"must be a non-empty string or a list of up to {MAX_STOP} of them")]] = None
        stream: Optional[StrictBool] = None
        sharpdraft: Optional[SharpDraft] = None
        ignore_eos: Optional[StrictBool] = None  # vLLM's extensions, with vLLM's ranges
        min_tokens: integer(ge=0) = None
        top_k: integer(ge=-1) = None  # -1 and 0: every token
        min_p: number(ge=0, le=1) = None
        repetition_penalty: number(gt=0) = None
        presence_penalty: number(ge=-2, le=2) = None
        frequency_penalty: number(ge=-2, le=2) = None
        stream_options: Optional[StreamOptions] = None

    class Completion(Body):
        logprobs: integer(ge=0, le=MAX_LOGPROBS) = None
        echo: Optional[StrictBool] = None  # the prompt and its log-probabilities first
        prompt: Annotated[StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)], one_message(
            "must be one string (token-id and batched prompts are not served)")]

    class Chat(Body):
        logprobs: Optional[StrictBool] = None
        top_logprobs: integer(ge=0, le=MAX_LOGPROBS) = None  # needs logprobs: Api._checked
        messages: Annotated[list[Message], Field(min_length=1)]

    return Chat if chat else Completion


# pydantic's error types as the phrase a message gives (the bounds from its context)
PHRASES = {"missing": "is required", "int_type": "must be an integer", "float_type": "must be a number",
           "bool_type": "must be true or false", "string_type": "must be a string",
           "model_type": "must be an object", "list_type": "must be a list",
           "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
           "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
           "literal_error": "must be {expected}", "string_too_short": "must not be empty",
           "too_short": "must hold at least {min_length} item(s)", "too_long": "must hold at most {max_length} item(s)"}
UNION_TAGS = ("str", "list[TextPart]")  # the names pydantic gives a message content's two forms


def _where(loc: tuple) -> str:
    """A field's path as a client writes it: stream_options.include_usage, messages[0].role."""
    parts = [p for p in loc if p not in UNION_TAGS]
    return str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:])


def validation_error(exc) -> ApiError:
    """THE one mapping of a request schema's pydantic ValidationError to the client's 400:
    every unknown field by name (as a misspelling is found), else the first wrong field in
    the schema's order at its deepest problem (the part of a chat message that is wrong),
    one line naming it; the input quoted only as a number or a bool, cut short (quote), for a
    wrong type or range."""
    errors = exc.errors(include_url=False)
    unknown = sorted(_where(e["loc"]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        named = ", ".join(map(quote, unknown[:4])) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        return ApiError(400, f"unknown field(s) {named}", param=unknown[0][:QUOTE])
    if not errors[0]["loc"]:
        return ApiError(400, "the body must be a JSON object")
    field = errors[0]["loc"][0]
    first = max((e for e in errors if e["loc"][:1] == (field,)), key=lambda e: len(e["loc"]))
    where = _where(first["loc"])[:QUOTE]
    context = {k: int(v) if isinstance(v, float) and v.is_integer() else v
               for k, v in (first.get("ctx") or {}).items()}
    if first["type"] == "refused":  # the schema's own phrase (PydanticCustomError)
        phrase = first["msg"]
    elif first["type"] in PHRASES:
        phrase = PHRASES[first["type"]].format(**context)
    else:
        phrase = f"is not valid: {first['msg'][:200]}"
    value = first.get("input")
    got = (f", got {quote(value)}" if isinstance(value, (int, float)) and first["type"] in PHRASES
           and first["type"] != "missing" else "")
    return ApiError(400, f"'{where}' {phrase}{got}", param=where)


def check_media_type(content_type: str, charset: str | None) -> None:
    """Before the body is read: 415 unless it says it is JSON (a browser's cross-site
    form post cannot), 400 for a charset other than UTF-8."""
    if content_type != "application/json":
        raise ApiError(415, f"the body must be JSON sent as Content-Type: application/json, got "
                            f"{quote(content_type)}", code="unsupported_media_type")
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise ApiError(400, f"the body's charset must be utf-8, got {quote(charset)}")


def decode_body(raw: bytes):
    """The request body as JSON: 400 for anything that is not UTF-8 JSON a Python program
    can hold (invalid bytes, a lone surrogate escape, a number past the digit limit,
    nesting past the recursion limit)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ApiError(400, "the body nests JSON too deeply") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc.msg} at character {exc.pos})") from None
    except ValueError:  # int("9" * 5000): past Python's limit on digits
        raise ApiError(400, "the body holds a number with too many digits") from None
    try:  # a lone surrogate (\ud800) decodes to a str no encoder or tokenizer takes
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"the body holds invalid Unicode ({exc.reason})") from None
    except RecursionError:
        raise ApiError(400, "the body nests JSON too deeply") from None
    return body


class StopMatcher:
    """Cuts generated text at the first stop sequence. Text that could still begin a stop
    sequence is held back, so a stream never shows what the full answer would not."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held, self.stopped = self.held[:cut], "", True
            return out
        keep = 0  # the longest tail of held that is a proper prefix of some stop
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:k]):
                    keep = k
                    break
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """How the HTTP answer to one request is shaped, which the model never sees: streamed
    or whole, with usage on the last chunk or every chunk, the prompt echoed first."""

    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False


class Settings:
    """What every request needs: the served names, the tokenizer (the chat template, the
    longest token for the prompts' byte bound), the limit, the modes, the API key, and
    where Triton listens."""

    def __init__(self, spec, model: str, stream_model: str, grpc_url: str,
                 max_new_tokens_limit: int, api_key: str | None = None):
        """spec: the engine spec serve opened (runtime/spec.py: open_spec, on the backend
        and with the options it serves with): the modes a request may name and the one it
        runs when it names none, as the served model's own spec answers them."""
        from runtime.engine import load_tokenizer

        self.tokenizer = load_tokenizer(spec.manifest.target_dir)
        self.modes = tuple(str(m) for m in spec.modes)
        self.default_mode = str(spec.default_mode)
        self.model, self.stream_model, self.grpc_url = model, stream_model, grpc_url
        self.limit = max_new_tokens_limit
        from runtime.serve.protocol import prompt_byte_limit

        self.context = spec.context
        self.prompt_bytes = None if self.context is None else prompt_byte_limit(self.tokenizer, self.context)
        self.api_key = api_key  # None: open; else every /v1 route wants it as a Bearer token
        # Triton's gRPC restricted protocols read the header KEY as `triton-grpc-protocol-KEY`
        self.triton_headers = ({} if api_key is None else
                               {"triton-grpc-protocol-authorization": f"Bearer {api_key}"})


class Api:
    def __init__(self, settings: Settings):
        from runtime.serve.vllm_metrics import FrontMetrics

        self.s = settings
        self.metrics = FrontMetrics(settings.model)

    # --- request parsing ---------------------------------------------------------------

    def parse(self, raw: bytes, chat: bool) -> tuple[Params, Reply]:
        """The body to the one request object (protocol.Params, built once) and how to
        shape the answer; run off the event loop, so a big body or a slow chat template
        never holds up other clients."""
        body = decode_body(raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        checked = self._checked(body, chat)
        prompt = self._chat_prompt(checked) if chat else self._completion_prompt(checked)
        return self._params(checked, prompt, chat), self._reply(checked, chat)

    def _checked(self, body: dict, chat: bool):
        """The body checked against its endpoint's schema (validation_error: the 400), then
        what depends on this server's name or joins two fields the model never sees."""
        from pydantic import ValidationError

        try:
            checked = _request_schema(chat).model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if checked.model != self.s.model:
            raise ApiError(404, f"model {quote(checked.model)} is not served here; served: {self.s.model!r}",
                           param="model", code="model_not_found")
        if checked.n not in (None, 1):
            raise ApiError(400, f"'n' must be 1 (one choice per request), got {checked.n}", param="n")
        if not chat and checked.echo and checked.stream:
            raise ApiError(400, "'echo' is served without streaming", param="echo")
        if chat and checked.top_logprobs and not checked.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return checked

    def _params(self, checked, prompt: str, chat: bool) -> Params:
        """THE request object, as the Triton door builds it (protocol.Params), from the
        checked body: OpenAI's names and defaults, and its construction's refusal (the
        server's limit, the modes it serves, an empty prompt) as a 400 naming the field as
        the client wrote it."""
        name = "max_tokens" if checked.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = getattr(checked, name)
        if max_tokens is None:
            max_tokens = self.s.limit if chat else 16
        if chat:
            logprobs = (checked.top_logprobs or 0) if checked.logprobs else None
        else:
            logprobs = checked.logprobs
        # vLLM's extensions in the model's own types; top_k -1 (vLLM's "every token") is 0
        extensions = tuple((n, type(neutral)(0 if n == "top_k" and value == -1 else value))
                           for n, neutral in SAMPLING_EXTENSIONS.items()
                           if (value := getattr(checked, n)) is not None)
        stop = [checked.stop] if isinstance(checked.stop, str) else checked.stop or []
        door = Door(names={"max_new_tokens": name, "text": "prompt", "asked_mode": "sharpdraft.mode",
                           "logprobs": "top_logprobs" if chat else "logprobs"},
                    quoted=True, served=self.s.modes)
        try:
            return Params(text=prompt, max_new_tokens=max_tokens,
                          temperature=1.0 if checked.temperature is None else float(checked.temperature),
                          top_p=1.0 if checked.top_p is None else float(checked.top_p),
                          seed=checked.seed, asked_mode=checked.sharpdraft.mode if checked.sharpdraft else None,
                          extensions=extensions, ignore_eos=bool(checked.ignore_eos), logprobs=logprobs,
                          # echo with max_tokens 0: the prompt scored, nothing generated
                          # (lm-eval's loglikelihood)
                          prompt_logprobs=not chat and bool(checked.echo), stop=tuple(stop),
                          limit=self.s.limit, door=door)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.field, code=exc.code) from None

    @staticmethod
    def _reply(checked, chat: bool) -> Reply:
        options = checked.stream_options
        include = bool(options and options.include_usage)
        return Reply(stream=bool(checked.stream), include_usage=include,
                     continuous_usage=include and bool(options.continuous_usage_stats),
                     echo=not chat and bool(checked.echo))

    def _completion_prompt(self, checked) -> str:
        prompt = checked.prompt if isinstance(checked.prompt, str) else checked.prompt[0]
        self._check_size(len(prompt.encode("utf-8")))
        return prompt

    def _check_size(self, size: int) -> None:
        """Refuse a prompt by its bytes alone where no tokenization could fit it in the
        context (protocol.prompt_byte_limit); the model counts its tokens exactly."""
        if self.s.prompt_bytes is not None and size > self.s.prompt_bytes:
            raise ApiError(400, f"the prompt is {size} bytes, more than the target's context "
                                f"({self.s.context} tokens, at most {self.s.prompt_bytes} bytes) can hold",
                           param="prompt", code="context_length_exceeded")

    def _chat_prompt(self, checked) -> str:
        plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(part.text for part in m.content)} for m in checked.messages]
        self._check_size(sum(len(m["content"].encode("utf-8")) for m in plain))
        if not getattr(self.s.tokenizer, "chat_template", None):
            raise ApiError(400, f"model {self.s.model!r} has no chat template; use /v1/completions",
                           param="messages")
        try:
            return self.s.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (roles out of order, ...)
            raise ApiError(400, f"the chat template refused the messages: {str(exc).splitlines()[0][:200]}",
                           param="messages") from None

    # --- the Triton call ---------------------------------------------------------------

    @staticmethod
    def _inputs(params: Params) -> list:
        """The request's Triton inputs: Params.arrays(), as gRPC InferInputs."""
        import tritonclient.grpc as grpcclient

        types = {t.name: t.wire_type for t in INPUTS}
        tensors = []
        for name, array in params.arrays().items():
            t = grpcclient.InferInput(name, list(array.shape), types[name])
            t.set_data_from_numpy(array)
            tensors.append(t)
        return tensors

    async def generate(self, params: Params):
        """Yields ("text", delta, (ids, info)) per commit (info: the prompt's tokens and,
        when asked, the ids' log-probability entries), then ("done", finish_reason, stats).
        Closing the generator early (a stop sequence, a client gone) cancels the request."""
        finished = asyncio.Event()
        request = {"model_name": self.s.stream_model, "inputs": self._inputs(params),
                   "request_id": uuid.uuid4().hex}

        async def requests():
            yield request
            await finished.wait()  # keep the stream open until the final response

        import tritonclient.grpc.aio as grpcaio

        # One channel per request, closed at the end, and a finished stream ended by a
        # half-close, not cancelled: otherwise Triton 2.51 never releases the request (the
        # model cannot unload and shutdown waits out exit_timeout; the tests check it).
        client = grpcaio.InferenceServerClient(self.s.grpc_url)
        call = client.stream_infer(requests(), headers=self.s.triton_headers)
        complete = False  # Triton sent the request's last response (or its error)
        try:
            async for result, error in call:
                if error is not None:
                    complete = True
                    raise _backend_error(str(error))
                response = result.get_response()
                text = result.as_numpy("text")
                text = bytes(text.reshape(-1)[0]).decode("utf-8", "replace") if text is not None else ""
                ids = result.as_numpy("token_ids")
                ids = [] if ids is None else ids.reshape(-1).tolist()
                if result.as_numpy("prompt_logprob_entries") is not None:  # echo: ahead of any token
                    yield "prompt", json.loads(bytes(result.as_numpy("prompt_logprob_entries").reshape(-1)[0])), None
                if text or ids:
                    info = {}
                    if result.as_numpy("prompt_tokens") is not None:
                        info["prompt_tokens"] = int(result.as_numpy("prompt_tokens").reshape(-1)[0])
                    if result.as_numpy("logprob_entries") is not None:
                        info["logprobs"] = json.loads(bytes(result.as_numpy("logprob_entries").reshape(-1)[0]))
                    yield "text", text, (ids, info)
                if response.parameters["triton_final_response"].bool_param:
                    stats = {k: float(result.as_numpy(k).reshape(-1)[0])
                             for k in ("mean_accepted_length", "beta") if result.as_numpy(k) is not None}
                    for name in ("verify_steps", "prompt_tokens"):
                        if result.as_numpy(name) is not None:
                            stats[name] = int(result.as_numpy(name).reshape(-1)[0])
                    speculation = result.as_numpy("speculation")
                    if speculation is not None:  # the mode that ran and its speculation
                        stats |= json.loads(bytes(speculation.reshape(-1)[0]))
                    reason = result.as_numpy("finish_reason")
                    reason = bytes(reason.reshape(-1)[0]).decode() if reason is not None else "length"
                    complete = True
                    yield "done", reason, stats
                    return
        except ApiError:
            raise
        except Exception as exc:  # the gRPC stream itself failed: Triton down, restarting
            details = getattr(exc, "details", None)  # grpc.aio's AioRpcError: its one line
            line = (details() if callable(details) else None) or str(exc).splitlines()[0]
            raise ApiError(503, f"the Triton model is unavailable: {line[:200]}",
                           "server_error", code="backend_unavailable") from None
        finally:
            if complete:  # end the stream the ordinary way: half-close, let Triton finish it
                finished.set()
                try:
                    await asyncio.wait_for(_drain(call), 10)
                except Exception:  # a stream that will not end is cut, never waited on forever
                    call.cancel()
            else:  # the client left or a stop sequence matched: Triton cancels the request
                call.cancel()
                finished.set()
            await client.close()

    # --- HTTP handlers -----------------------------------------------------------------

    async def prometheus(self, request):
        """GET /metrics: vLLM's families, Prometheus text (as vLLM's API server serves them)."""
        from aiohttp import web

        return web.Response(body=self.metrics.text(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.s.model, "object": "model", "created": 0, "owned_by": "sharpdraft",
             "sharpdraft": {"modes": list(self.s.modes), "default_mode": self.s.default_mode}}]})

    async def completions(self, request):
        return await self._serve(request, chat=False)

    async def chat(self, request):
        return await self._serve(request, chat=True)

    async def _serve(self, http, chat: bool):
        from aiohttp import web

        try:
            check_media_type(http.content_type, http.charset)
            raw = await http.read()
            params, reply = await asyncio.to_thread(self.parse, raw, chat)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.s.model}
        stops = StopMatcher(list(params.stop))
        run = self.generate(params)
        clock = self.metrics.arrived()
        mode = params.asked_mode or self.s.default_mode  # until the model says which ran
        if reply.stream:
            return await self._stream(http, chat, head, run, stops, params, reply, mode, clock)
        text, ids, entries, reason, stats, prompt_tokens = [], [], [], "length", None, 0
        try:
            async for kind, value, extra in run:
                if kind == "prompt":
                    entries = value + entries
                elif kind == "text":
                    self.metrics.tokens(clock)
                    text.append(stops.push(value))
                    ids += extra[0]
                    entries += extra[1].get("logprobs", [])
                    prompt_tokens = extra[1].get("prompt_tokens", prompt_tokens)
                    if stops.stopped:
                        reason = "stop"
                        break
                else:
                    reason, stats = value, extra
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        finally:
            await run.aclose()
            finished, stats = _ended(stats, stops, reason, prompt_tokens)
            self.metrics.left(clock, finished, stats, len(ids))
        text.append(stops.flush())
        content = ("".join(text) if not reply.echo else params.text + "".join(text))
        logprobs = None if params.logprobs is None else self._logprobs(entries, chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason})
        head["object"] = "chat.completion" if chat else "text_completion"
        return web.json_response(head | {"choices": [choice], "usage": _usage(stats, len(ids)),
                                         "sharpdraft": _extension(mode, ids, stats)})

    def _logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict:
        """Log-probability entries ([token, logprob, [[id, logprob], ...]]) in OpenAI's
        shape: chat's `content` list, or completions' four parallel lists."""
        piece = self.s.tokenizer.decode
        if chat:
            def one(token, lp):
                text = piece([token])
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [one(t, lp) | {"top_logprobs": [one(i, v) for i, v in top]}
                                for t, lp, top in entries]}
        tokens = [piece([t]) for t, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for _, lp, top in entries:  # alternatives that decode alike: the likeliest keeps the key
            tops.append(None if lp is None else {})  # an echoed prompt's first token: none
            for i, v in top:
                tops[-1].setdefault(piece([i]), v)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops, "text_offset": offsets}

    async def _stream(self, http, chat, head, run, stops, params: Params, reply: Reply, mode: str, clock):
        from aiohttp import web

        head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}
        ids, entries, reason, stats, prompt_tokens, sent = [], [], "length", None, [0], [0]

        def chunk(delta: str | None, reason=None, role=False):
            # the log-probabilities of the tokens since the last chunk (text may lag them)
            logprobs = None
            if params.logprobs is not None and not role and entries:
                logprobs = self._logprobs(entries, chat, sent[0])
                sent[0] += sum(len(t) for t in logprobs.get("tokens", []))
                entries.clear()
            if chat:
                d = ({"role": "assistant", "content": ""} if role else
                     {} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
            out = head | {"choices": [choice]}
            if reply.continuous_usage:  # the running usage, on every chunk
                out["usage"] = _usage({"prompt_tokens": prompt_tokens[0]}, len(ids))
            return out

        response = None
        try:
            async for kind, value, extra in run:
                if kind == "text":
                    self.metrics.tokens(clock)
                    ids += extra[0]
                    entries += extra[1].get("logprobs", [])
                    prompt_tokens[0] = extra[1].get("prompt_tokens", prompt_tokens[0])
                if response is None:  # the first reply from Triton: errors until now are plain HTTP
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(http)
                    if chat:
                        await _send(response, chunk(None, role=True))
                if kind == "text":
                    out = stops.push(value)
                    if out:
                        await _send(response, chunk(out))
                    if stops.stopped:
                        reason = "stop"
                        break
                else:
                    reason, stats = value, extra
            tail = stops.flush()
            if tail:
                await _send(response, chunk(tail))
            prompt_tokens[0] = (stats or {}).get("prompt_tokens", prompt_tokens[0])
            last = chunk(None, reason)
            if not reply.include_usage:
                last["usage"] = None
            await _send(response, last | {"sharpdraft": _extension(mode, ids, stats or {})})
            if reply.include_usage:
                await _send(response, head | {"choices": [], "usage": _usage(
                    stats or {"prompt_tokens": prompt_tokens[0]}, len(ids))})
            await response.write(b"data: [DONE]\n\n")
        except ApiError as exc:
            if response is None:
                return web.json_response(exc.body(), status=exc.status)
            await _send(response, exc.body())  # the `openai` client raises on an error event
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client left; finally cancels the Triton request
        finally:
            await run.aclose()
            self.metrics.left(clock, *_ended(stats, stops, reason, prompt_tokens[0]), len(ids))
        await response.write_eof()
        return response


async def _drain(call) -> None:
    async for _ in call:
        pass


def _ended(stats: dict | None, stops, reason: str, prompt_tokens: int) -> tuple[str | None, dict]:
    """How a request ended: its finish_reason (None: it failed or was cut) and what the
    model's responses said of it. A stop string ends it before the final response, whose
    stats never come; the prompt's size came with every token response."""
    finished = stats is not None or stops.stopped
    return (reason if finished else None), (stats or {"prompt_tokens": prompt_tokens})


def _usage(stats: dict, completion_tokens: int) -> dict:
    prompt_tokens = stats.get("prompt_tokens", 0)  # as the model counted them
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _extension(mode: str, ids: list[int], stats: dict) -> dict:
    return {"mode": mode, "token_ids": ids} | {k: v for k, v in stats.items() if k != "prompt_tokens"}


async def _send(response, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def _backend_error(message: str) -> ApiError:
    """A Triton error response as an OpenAI error: the model's refusal of the request's
    input is the client's fault (400), a full queue is 503 (retry), a bug is 500."""
    line = message.strip().splitlines()[0] if message.strip() else "the model failed"
    if line.startswith("[StatusCode."):  # tritonclient prefixes some messages with the code
        line = line.split("] ", 1)[-1]
    if QUEUE_FULL_MARK in line:
        return ApiError(503, f"the server is at capacity: {line}", "server_error", code="queue_full")
    if any(mark in line for mark in UNHEALTHY_MARKS):  # the model's instance is gone
        return ApiError(503, f"the model is recovering: {line[:200]}", "server_error",
                        code="backend_unavailable")
    if INTERNAL_MARK in line:
        return ApiError(500, line, "server_error", code="internal_error")
    return ApiError(400, line)


class OpenAIServer:
    """The endpoint on its own thread and event loop, next to the `serve` command's wait
    loop; started once Triton is ready, stopped before Triton is."""

    def __init__(self, settings: Settings, port: int, host: str = "127.0.0.1"):
        self.settings, self.host, self.port = settings, host, port
        # cleared by serve while the Triton model is being brought back: GET /health says
        # 503 then (requests meanwhile fail as Triton does: 503, retryable)
        self.ready = threading.Event()
        self.ready.set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="openai-endpoint", daemon=True)
        self.runner = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def _start(self):
        from aiohttp import web

        api = Api(self.settings)
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_get("/v1/models", api.models)
        app.router.add_post("/v1/completions", api.completions)
        app.router.add_post("/v1/chat/completions", api.chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", api.prometheus)
        app.middlewares.append(_error_middleware())
        if self.settings.api_key is not None:
            app.middlewares.append(_key_middleware(self.settings.api_key))
        app.on_response_prepare.append(_safe_headers)
        # handler_cancellation: a client that disconnects cancels its handler, whose
        # `finally` cancels the Triton request (else a non-streaming one runs to the end).
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()

    async def _health(self, request):
        from aiohttp import web

        if self.ready.is_set():
            return web.json_response({"status": "ready"})
        return web.json_response(ApiError(503, "the model is being brought back", "server_error",
                                          code="backend_unavailable").body(), status=503)

    def start(self) -> None:
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        except OSError as exc:
            self.stop()
            raise RuntimeError(f"the OpenAI endpoint cannot listen on {self.host}:{self.port}: "
                               f"{exc.strerror or exc}") from None

    def stop(self) -> None:
        async def close():
            if self.runner is not None:
                await self.runner.cleanup()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


async def _safe_headers(request, response) -> None:
    """On every response, streamed or not, errors too: no content sniffing by browsers,
    and a 503 always says when to retry."""
    response.headers["X-Content-Type-Options"] = "nosniff"
    if response.status == 503:
        response.headers.setdefault("Retry-After", RETRY_AFTER)


def _key_middleware(key: str):
    """`Authorization: Bearer KEY` on every /v1 route (as vLLM's --api-key); 401 otherwise.
    /health stays open for a load balancer's probes."""
    from aiohttp import web

    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request, handler):
        if request.path.startswith("/v1") and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected):
            return web.json_response(ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                              code="invalid_api_key").body(), status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def _error_middleware():
    from aiohttp import web

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:  # 404 / 405 from the router, in OpenAI's shape
            if exc.status < 400:
                raise
            return web.json_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                              code="not_found" if exc.status == 404 else None).body(),
                                     status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # a bug: one line to the client, the details to the log
            from runtime.serve.protocol import internal_error

            reply, log = internal_error(exc)
            sys.stderr.write(log + "\n")
            return web.json_response(ApiError(500, reply, "server_error").body(), status=500)

    return errors

