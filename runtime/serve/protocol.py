"""The served model's contract: its input and output tensors (config.pbtxt is written
from these tables), how a request's tensors become one `generate` call, and how a
finished generation becomes response tensors. Pure Python + numpy, so it is tested
without a server; the Python-backend model (model.py) only moves tensors in and out."""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
import uuid

import numpy as np

from runtime import modes

# Refuse, never clamp, a request above this: a huge max_new_tokens would otherwise hold an
# instance for as long as the context allows. Per model in config.pbtxt
# (parameter max_new_tokens_limit); `serve --max-new-tokens-limit` sets it.
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    triton_type: str  # config.pbtxt data_type
    numpy_type: type
    dims: tuple[int, ...] = (1,)
    optional: bool = False


INPUTS = (
    Tensor("prompt", "TYPE_STRING", np.object_),
    Tensor("max_new_tokens", "TYPE_INT32", np.int32),
    Tensor("temperature", "TYPE_FP32", np.float32, optional=True),
    Tensor("top_p", "TYPE_FP32", np.float32, optional=True),
    Tensor("seed", "TYPE_INT64", np.int64, optional=True),
    Tensor("sharpdraft", "TYPE_BOOL", np.bool_, optional=True),
    Tensor("mode", "TYPE_STRING", np.object_, optional=True),  # a name of runtime/modes.py
    # vLLM's sampling extensions (runtime/sampling.py: Sampling), each off when absent
    Tensor("top_k", "TYPE_INT32", np.int32, optional=True),
    Tensor("min_p", "TYPE_FP64", np.float64, optional=True),
    Tensor("repetition_penalty", "TYPE_FP64", np.float64, optional=True),
    Tensor("presence_penalty", "TYPE_FP64", np.float64, optional=True),
    Tensor("frequency_penalty", "TYPE_FP64", np.float64, optional=True),
    Tensor("min_tokens", "TYPE_INT32", np.int32, optional=True),
    Tensor("ignore_eos", "TYPE_BOOL", np.bool_, optional=True),  # decode past the stop tokens
    # the target's log-probabilities of each committed token and its `logprobs` likeliest
    Tensor("logprobs", "TYPE_INT32", np.int32, optional=True),
    # the prompt's own log-probabilities (OpenAI's echo with logprobs): with it,
    # max_new_tokens may be 0 (score the prompt, generate nothing)
    Tensor("prompt_logprobs", "TYPE_BOOL", np.bool_, optional=True),
)

# The extensions' inputs, with what each is when absent, in Sampling's own names.
SAMPLING_EXTENSIONS = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "min_tokens": 0}
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (vLLM's default)

OUTPUTS = (
    Tensor("text", "TYPE_STRING", np.object_),
    Tensor("token_ids", "TYPE_INT64", np.int64, dims=(-1,)),
    Tensor("mean_accepted_length", "TYPE_FP32", np.float32),
    Tensor("verify_steps", "TYPE_INT32", np.int32),
    Tensor("beta", "TYPE_FP32", np.float32),  # at the last drafter step
    Tensor("finish_reason", "TYPE_STRING", np.object_),  # "stop" or "length"
    # JSON: the mode that ran and what its speculation did (Generation.speculation)
    Tensor("speculation", "TYPE_STRING", np.object_),
    # the prompt's tokens as the model counted them (the OpenAI endpoint's `usage` reads
    # it, so a prompt is tokenized once, in the model)
    Tensor("prompt_tokens", "TYPE_INT32", np.int32),
    # JSON, when asked: [[token, log-probability, [[id, log-probability], ...]], ...] of
    # the tokens this response carries
    Tensor("logprob_entries", "TYPE_STRING", np.object_),
    Tensor("prompt_logprob_entries", "TYPE_STRING", np.object_),  # as logprob_entries; the first: null
)


class RequestError(ValueError):
    """A request the model refuses; the message goes back to the client as is."""


QUOTE = 60  # the most characters of a client's input an error message quotes


def quote(value) -> str:
    """A client's value for an error message, cut to QUOTE characters: an error never
    echoes a megabyte back."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit
        return "an integer too long to show"
    return text if len(text) <= QUOTE else text[:QUOTE - 3] + "..."


def internal_error(exc: BaseException) -> tuple[str, str]:
    """(reply, log entry) for an unexpected failure: the client gets a short message with
    an id to quote; the server log gets the same id with the exception and traceback."""
    incident = uuid.uuid4().hex[:12]
    trace = "".join(traceback.format_exception(exc)).rstrip()
    return (f"internal error (id {incident}); the server log has the details",
            f"generate failed (id {incident}): {type(exc).__name__}: {exc}\n{trace}")


def check_max_new_tokens(value: int, limit: int, scoring: bool = False,
                         name: str = "max_new_tokens", hint: str = "") -> None:
    """The one check of how many tokens a client may ask for, at both front doors (the
    OpenAI endpoint names its own field, `name`; the Triton model, max_new_tokens): at
    least 1 (0 where the prompt is only scored) and at most the server's limit. The
    context's room is the loop's to check (runtime/decode.py check_budget)."""
    least = 0 if scoring else 1
    if value < least:
        raise RequestError(f"{name} must be >= {least}, got {value}")
    if value > limit:
        raise RequestError(f"{name} {value} exceeds this server's limit of {limit}{hint}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
    """What a client asked, as the Triton model's inputs carry it (parse): the prompt's
    text, the tokens to generate and how to sample them, the mode. The served model builds
    the one runtime/request.py Request from it once the prompt's ids are known."""

    text: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    sharpdraft: bool | None  # None: not sent
    asked_mode: str | None = None  # the request's `mode`, checked against the table
    extensions: tuple = ()  # (name, value) of SAMPLING_EXTENSIONS sent
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def sampling(self):
        from runtime.sampling import Sampling

        try:
            return Sampling(self.temperature, self.top_p, self.seed, **dict(self.extensions))
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def mode(self, engine) -> str:
        """The mode this request runs on `engine`: the one it names, which must be among the
        engine's modes; with `sharpdraft` true or false, SharpDraft or the drafter frozen
        (the table's rule); with neither, the engine's default, the fastest mode its build
        measured (EngineSpec.default_mode)."""
        if self.asked_mode is None:
            if self.sharpdraft is None:
                return engine.spec.default_mode
            return engine.spec.rule_default(self.sharpdraft)
        mode = modes.Mode(self.asked_mode)
        if mode not in engine.spec.modes:
            why = engine.spec.refusal(mode) or "it is a study, run by bench"
            raise RequestError(f"this model cannot run mode '{mode}': {why} (it runs "
                               f"{', '.join(engine.spec.modes)})")
        return mode


def _scalar(arrays: dict, spec: Tensor):
    value = arrays.get(spec.name)
    if value is None:
        if spec.optional:
            return None
        raise RequestError(f"input '{spec.name}' is required")
    value = np.asarray(value)
    if value.size != 1:
        raise RequestError(f"input '{spec.name}' must hold exactly one value, got shape "
                           f"{list(value.shape)}")
    return value.reshape(-1)[0]


def _text(arrays: dict, spec: Tensor) -> str | None:
    value = _scalar(arrays, spec)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{spec.name} is not valid UTF-8 ({exc.reason} at byte "
                               f"{exc.start})") from None
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{spec.name} must be text, got {type(value).__name__}")
    return value


def parse(arrays: dict, max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
          parameters: dict | None = None) -> Params:
    """Input name -> numpy array (None or absent for an omitted optional input), plus the
    request's parameters, of which this model takes none."""
    unknown = sorted(set(arrays) - {t.name for t in INPUTS}) + sorted(parameters or {})
    if unknown:  # Triton itself refuses unknown tensors; unknown parameters reach us
        raise RequestError(f"unknown field(s) {', '.join(quote(u) for u in unknown[:4])}; this model "
                           f"takes {', '.join(t.name for t in INPUTS)}")
    specs = {t.name: t for t in INPUTS}

    raw = _text(arrays, specs["prompt"])
    if not raw.strip():
        raise RequestError("prompt is empty")

    max_new = int(_scalar(arrays, specs["max_new_tokens"]))
    prompt_logprobs = bool(_scalar(arrays, specs["prompt_logprobs"]))
    # 0 with prompt_logprobs: score the prompt, generate nothing
    check_max_new_tokens(max_new, max_new_tokens_limit, scoring=prompt_logprobs,
                         hint=" (max_new_tokens_limit in config.pbtxt)")

    temperature = _scalar(arrays, specs["temperature"])
    top_p = _scalar(arrays, specs["top_p"])
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and not math.isfinite(float(value)):
            raise RequestError(f"{name} must be a finite number, got {float(value)}")
    seed = _scalar(arrays, specs["seed"])
    sharpdraft = _scalar(arrays, specs["sharpdraft"])
    mode = _text(arrays, specs["mode"])
    if mode is not None:
        if sharpdraft is not None:
            raise RequestError(f"send mode or sharpdraft, not both (mode '{modes.Mode.FROZEN}' is "
                               "sharpdraft false)")
        try:
            modes.parse(mode)
        except ValueError:
            raise RequestError(f"no decoding mode {quote(mode)} (modes: {', '.join(modes.Mode)})") from None
    extensions = []
    for name, neutral in SAMPLING_EXTENSIONS.items():
        value = _scalar(arrays, specs[name])
        if value is not None:
            value = type(neutral)(value)
            if isinstance(value, float) and not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value}")
            extensions.append((name, value))
    ignore_eos = _scalar(arrays, specs["ignore_eos"])
    logprobs = _scalar(arrays, specs["logprobs"])
    if logprobs is not None and not 0 <= int(logprobs) <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {int(logprobs)}")
    request = Params(text=raw, max_new_tokens=max_new,
                      temperature=0.0 if temperature is None else float(temperature),
                      top_p=1.0 if top_p is None else float(top_p),
                      seed=None if seed is None else int(seed),
                      sharpdraft=None if sharpdraft is None else bool(sharpdraft), asked_mode=mode,
                      extensions=tuple(extensions), ignore_eos=bool(ignore_eos),
                      logprobs=None if logprobs is None else int(logprobs),
                      prompt_logprobs=prompt_logprobs)
    request.sampling()  # refuse bad temperature / top_p now, before any work
    return request


def load_engine(spec):
    """The engine `spec` describes (opened by the served model, where it enters), loaded on
    a thread that ends with the load (runtime/openmp.py), so the scheduler's thread, which
    decodes, holds the process's one OpenMP pool."""
    from runtime.engine import Engine
    from runtime.openmp import in_own_thread

    return in_own_thread(Engine, spec)


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text that one token covers: its vocabulary's
    longest entry as UTF-8 (byte-level BPE writes each byte as one character of at most
    two UTF-8 bytes, SentencePiece a space as three, so the bound errs on the long side)."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=1)


def prompt_byte_limit(tokenizer, context_limit: int) -> int:
    """The most UTF-8 bytes a prompt that fits `context_limit` tokens can have: every
    token covers at most longest_token_bytes, so a longer prompt is refused by its length
    alone, before a tokenizer spends seconds on megabytes that cannot fit."""
    return context_limit * longest_token_bytes(tokenizer)


def encode_prompt(engine, request: Params, byte_limit: int | None = None) -> list[int]:
    """The prompt's ids, refused first by its length in bytes (`byte_limit`, default
    prompt_byte_limit of the engine: the model computes it once), then in tokens."""
    limit = byte_limit or prompt_byte_limit(engine.tokenizer, engine.context_limit)
    size = len(request.text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise RequestError(f"prompt is {size} bytes, more than {engine.context_limit} tokens can "
                           f"hold ({limit} bytes); the target's context holds {engine.context_limit}")
    ids = engine.encode(request.text)
    if not ids:
        raise RequestError("prompt encodes to no tokens")
    if len(ids) >= engine.context_limit:
        raise RequestError(f"prompt has {len(ids)} tokens; the target's context holds "
                           f"{engine.context_limit}")
    return ids


def text_array(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def ids_array(ids: list[int]) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def count_array(n: int) -> np.ndarray:
    return np.array([n], dtype=np.int32)


def logprobs_array(entries) -> np.ndarray:
    """Log-probability entries (runtime.sampling.token_logprobs) as the `logprobs` output."""
    return text_array(json.dumps([[t, lp, [list(a) for a in top]] for t, lp, top in entries],
                                 separators=(",", ":")))


def outputs(text: str, token_ids: list[int], gen, finish: str, mode, logprobs=None) -> dict:
    """Response tensors for a finished generation (runtime.metrics.Generation) of `mode`;
    `logprobs`: the entries this response carries, if the request asked."""
    # No drafter step ran (one token asked for, or a stop at once): the query was unscaled.
    beta = gen.beta_per_step[-1] if gen.beta_per_step else 1.0
    return ({} if logprobs is None else {"logprob_entries": logprobs_array(logprobs)}) | {
        "text": text_array(text),
        "token_ids": ids_array(token_ids),
        "mean_accepted_length": np.array([gen.mean_accepted_length], dtype=np.float32),
        "verify_steps": np.array([gen.verify_steps], dtype=np.int32),
        "beta": np.array([beta], dtype=np.float32),
        "finish_reason": text_array(finish),
        "speculation": text_array(json.dumps(gen.speculation(mode), separators=(",", ":"))),
        "prompt_tokens": np.array([gen.prompt_tokens], dtype=np.int32),
    }


def finish_reason(gen) -> str:
    return "stop" if gen.stopped_by == "stop_token" else "length"
