"""The served model's contract: its input and output tensors (config.pbtxt is written
from these tables), what a client asks of one generation (Params), and how a finished
generation becomes response tensors. Pure Python + numpy, so it is tested without a
server; the Python-backend model (model.py) only moves tensors in and out.

Params is the one request object of both front doors. The Triton door builds it from the
model's input tensors (parse); the OpenAI door (runtime/serve/openai_api.py) from its
pydantic-checked body, and sends it to Triton as Params.arrays(), which parse reads back
into an equal Params. Each door builds it once, and its construction is where every limit
is checked: the prompt not empty, max_new_tokens at least 1 (0 where the prompt is only
scored) and at most the server's limit, finite sampling values that runtime/sampling.py
takes, logprobs in range, a mode name of the table (and, where the door knows them, one
the server runs). A refusal is a RequestError naming the field as the door's client
wrote it (a Door). The served model then builds the loop's runtime/request.py Request from
it, with keywords only, once the prompt's ids are known."""

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

    @property
    def wire_type(self) -> str:
        """Its datatype as a Triton client names it (InferInput): BYTES, INT32, ..."""
        return "BYTES" if self.triton_type == "TYPE_STRING" else self.triton_type.removeprefix("TYPE_")


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
    """A request the model refuses; the message goes back to the client as is. `field`:
    the field it refuses as the client named it (the OpenAI door's `param`); `code`: a
    machine-readable reason, where there is one."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


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


@dataclasses.dataclass(frozen=True)
class Door:
    """How a front door's client names Params' fields, for refusals: `names` maps a field
    to the client's name (the OpenAI door: max_new_tokens is 'max_tokens'), written in
    quotes where `quoted`; `limit_hint` ends the refusal of too many tokens (where the
    limit is set); `served`: the modes this server runs, checked at construction (None:
    Params.mode checks them against the engine)."""

    names: dict = dataclasses.field(default_factory=dict)
    quoted: bool = False
    limit_hint: str = ""
    served: tuple | None = None

    def param(self, field: str) -> str:
        return self.names.get(field, field)

    def name(self, field: str) -> str:
        return f"'{self.param(field)}'" if self.quoted else self.param(field)


# the Triton model's own door: its input names, bare
TRITON = Door(names={"text": "prompt", "asked_mode": "mode"},
              limit_hint=" (max_new_tokens_limit in config.pbtxt)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
    """What a client asks of one generation: the prompt's text, the tokens to generate and
    how to sample them, the mode, the log-probabilities, the stop strings. Built once per
    request by either front door, and refused at construction (RequestError) unless it is
    a request this server takes: `limit` is the server's max_new_tokens limit, `door` how
    the client names the fields. `sampling` is the runtime/sampling.py Sampling it asks for.
    The served model builds the one runtime/request.py Request from it once the prompt's
    ids are known."""

    text: str
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    sharpdraft: bool | None = None  # None: not sent
    asked_mode: str | None = None  # the request's `mode`, a name of the modes table
    extensions: tuple = ()  # (name, value) of SAMPLING_EXTENSIONS sent
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False  # with it, max_new_tokens may be 0: the prompt scored alone
    # matched on the text by the OpenAI door (runtime/serve/openai_api.py StopMatcher); the
    # Triton model has no such input, so arrays() does not carry them
    stop: tuple = ()
    limit: dataclasses.InitVar[int] = DEFAULT_MAX_NEW_TOKENS_LIMIT
    door: dataclasses.InitVar[Door] = TRITON
    sampling: object = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self, limit: int, door: Door):
        """THE check of what a client may ask, at both front doors."""
        def refuse(field: str, message: str, code: str | None = None):
            raise RequestError(message, field=door.param(field), code=code)

        if not self.text.strip():
            refuse("text", "the prompt is empty")
        least = 0 if self.prompt_logprobs else 1  # 0: score the prompt, generate nothing
        if self.max_new_tokens < least:
            refuse("max_new_tokens", f"{door.name('max_new_tokens')} must be >= {least}, got "
                                     f"{self.max_new_tokens}")
        if self.max_new_tokens > limit:
            refuse("max_new_tokens", f"{door.name('max_new_tokens')} {self.max_new_tokens} exceeds "
                                     f"this server's limit of {limit}{door.limit_hint}")
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p),
                            *((n, v) for n, v in self.extensions if isinstance(v, float))):
            if not math.isfinite(value):
                refuse(name, f"{door.name(name)} must be a finite number, got {value}")
        if self.asked_mode is not None:
            mode = self.asked_mode
            if self.sharpdraft is not None:
                refuse("asked_mode", f"send mode or sharpdraft, not both (mode "
                                     f"'{modes.Mode.FROZEN}' is sharpdraft false)")
            if door.served is not None and mode not in door.served:
                refuse("asked_mode", f"mode {quote(mode)} is not served by this engine; served "
                                     f"modes: {', '.join(door.served)}", code="unsupported_mode")
            try:
                modes.parse(mode)
            except ValueError:
                refuse("asked_mode", f"no decoding mode {quote(mode)} (modes: {', '.join(modes.Mode)})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            refuse("logprobs", f"{door.name('logprobs')} must be in [0, {MAX_LOGPROBS}], got "
                               f"{self.logprobs}")
        from runtime.sampling import Sampling

        try:
            sampling = Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                **dict(self.extensions))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        object.__setattr__(self, "sampling", sampling)

    def arrays(self) -> dict:
        """The Triton model's inputs that carry this request (name -> numpy array; what
        is off or not sent is left out): parse reads them back into an equal Params."""
        values = {"prompt": self.text, "max_new_tokens": self.max_new_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                  "sharpdraft": self.sharpdraft, "mode": self.asked_mode, **dict(self.extensions),
                  "ignore_eos": self.ignore_eos or None, "logprobs": self.logprobs,
                  "prompt_logprobs": self.prompt_logprobs or None}
        specs = {t.name: t for t in INPUTS}
        return {name: (text_array(value) if specs[name].numpy_type is np.object_
                       else np.array([value], dtype=specs[name].numpy_type))
                for name, value in values.items() if value is not None}

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
                               f"{', '.join(engine.spec.modes)})", field="mode")
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
    """The Triton door: input name -> numpy array (None or absent for an omitted optional
    input), plus the request's parameters, of which this model takes none, as the one
    Params (checked as it is built)."""
    unknown = sorted(set(arrays) - {t.name for t in INPUTS}) + sorted(parameters or {})
    if unknown:  # Triton itself refuses unknown tensors; unknown parameters reach us
        raise RequestError(f"unknown field(s) {', '.join(quote(u) for u in unknown[:4])}; this model "
                           f"takes {', '.join(t.name for t in INPUTS)}")
    specs = {t.name: t for t in INPUTS}

    temperature = _scalar(arrays, specs["temperature"])
    top_p = _scalar(arrays, specs["top_p"])
    seed = _scalar(arrays, specs["seed"])
    sharpdraft = _scalar(arrays, specs["sharpdraft"])
    logprobs = _scalar(arrays, specs["logprobs"])
    extensions = tuple((name, type(neutral)(value)) for name, neutral in SAMPLING_EXTENSIONS.items()
                       if (value := _scalar(arrays, specs[name])) is not None)
    return Params(text=_text(arrays, specs["prompt"]),
                  max_new_tokens=int(_scalar(arrays, specs["max_new_tokens"])),
                  temperature=0.0 if temperature is None else float(temperature),
                  top_p=1.0 if top_p is None else float(top_p),
                  seed=None if seed is None else int(seed),
                  sharpdraft=None if sharpdraft is None else bool(sharpdraft),
                  asked_mode=_text(arrays, specs["mode"]), extensions=extensions,
                  ignore_eos=bool(_scalar(arrays, specs["ignore_eos"])),
                  logprobs=None if logprobs is None else int(logprobs),
                  prompt_logprobs=bool(_scalar(arrays, specs["prompt_logprobs"])),
                  limit=max_new_tokens_limit, door=TRITON)


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
