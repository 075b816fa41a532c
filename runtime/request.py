"""The one request, from the serving front door to the decode loop (vLLM's `Request`):
built once, with keywords only, by whoever holds the prompt's ids -- the served model
(runtime/serve/model.py), Engine.generate, the commands -- and handed unchanged to the
scheduler (runtime/serve/scheduler.py) and the loop (runtime/decode.py). Its limits keep
one name all the way (max_new_tokens). What a client may ask is checked where it arrives,
once, as the front doors' one request object is built (runtime/serve/protocol.py: Params,
which the OpenAI and the Triton door both build, and from which the served model builds
this Request); the context's room where the loop admits it (decode.check_budget).

Its callbacks are set at construction: on_tokens(new[, entries]) per commit (raise to
leave the batch: a cancelled stream), on_done(generation, mode) and on_error(exception)
once at the end, on_prompt(entries) before any token where the prompt is scored."""

from __future__ import annotations

import dataclasses
from typing import Callable

from runtime.sampling import Sampler, Sampling

OnTokens = Callable[[list[int]], None]


def _never() -> bool:
    return False


@dataclasses.dataclass(kw_only=True)
class Request:
    prompt: list[int]  # token ids
    max_new_tokens: int  # 0 only where on_prompt scores the prompt and nothing is generated
    sampling: Sampling = Sampling()
    sampler: Sampler | None = None  # a seeded sampler of the caller's; default: from sampling
    stop_ids: frozenset = frozenset()  # empty: decode past the engine's stop tokens
    # the target's log-probabilities of each committed token and of its `logprobs` likeliest
    # (None: none computed): into Generation.logprobs, and on_tokens(new, entries)
    logprobs: int | None = None
    # the decoding mode; None: the engine's default for the batch it joins, which the
    # scheduler resolves at admission (the one field set after construction: its state)
    mode: str | None = None
    on_tokens: OnTokens | None = None
    on_done: Callable[[object, str], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    # set: the prompt's log-probabilities (Decoder.score, `logprobs` alternatives) go to
    # on_prompt(entries) before any token; with max_new_tokens 0 that is all it runs
    on_prompt: Callable[[list], None] | None = None
    # whether the client has gone (Triton: request.is_cancelled); asked before work starts
    # on it and between chunks of its prefill
    cancelled: Callable[[], bool] = _never
