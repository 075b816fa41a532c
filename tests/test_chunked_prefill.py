"""Chunked prefill (runtime/serve/scheduler.py, Decoder.join): a joining prompt prefills a
chunk at a time between steps of the running rows, and decoding stays lossless -- the
tokens are those of a whole prefill and of `generate` alone, on the torch and ONNX
Runtime backends."""

import threading

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling import Sampling
from runtime.serve.scheduler import StepScheduler
from test_scheduler import Outcome, prompts

CHUNK = 32


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def engine(request):
    # tiny_engine: the torch backend (512-token context); native_engine: ONNX Runtime's
    # default graphs (4096 tokens)
    name = {"torch": "tiny_engine", "onnxruntime": "native_engine"}[request.param]
    return Engine(request.getfixturevalue(name))


def _events(engine, mode, scheduler_kwargs, jobs):
    """Run `jobs` [(ids, n, mode, sampling, delay_steps)] through a scheduler; returns the
    outcomes and the log of ("step", rows) and ("prefill", tokens) events in order."""
    log, lock = [], threading.Lock()
    decoder_type = type(engine.batch_decoder(mode))
    single_type = type(engine.batch_decoder(mode).target.single)
    step, prefill, more = decoder_type.step, single_type.prefill, getattr(single_type, "prefill_more", None)

    def logged_step(decoder, *aside):
        if decoder.active:
            with lock:
                log.append(("step", len(decoder.active)))
        return step(decoder, *aside)

    inside = []  # an ONNX prefill runs its loop through prefill_more: log the outer call

    def logged_prefill(self, ids, capacity):
        log.append(("prefill", len(ids)))
        inside.append(1)
        try:
            return prefill(self, ids, capacity)
        finally:
            inside.pop()

    def logged_more(self, ids):
        if not inside:
            log.append(("prefill", len(ids)))
        return more(self, ids)

    outcomes = [Outcome() for _ in jobs]
    scheduler = StepScheduler(engine, **scheduler_kwargs)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(decoder_type, "step", logged_step)
            m.setattr(single_type, "prefill", logged_prefill)
            if more is not None:
                m.setattr(single_type, "prefill_more", logged_more)
            for outcome, (ids, n, job_mode, sampling, after_steps) in zip(outcomes, jobs):
                while sum(e[0] == "step" for e in log) < after_steps:
                    threading.Event().wait(0.005)
                scheduler.submit(outcome.job(ids, n, job_mode, sampling))
            assert all(o.finished.wait(300) for o in outcomes)
    finally:
        scheduler.close()
    return outcomes, log


@pytest.mark.parametrize("mode", ["sharpdraft", "target"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill_and_of_generate(engine, mode):
    short, long_ = prompts([9, 300])
    jobs = [(short, 40, mode, Sampling(), 0),
            (long_, 12, mode, Sampling(), 2),  # joins while the first one decodes
            (prompts([70])[0], 10, mode, Sampling(0.8, 1.0, seed=3), 3)]
    chunked, _ = _events(engine, mode, {"max_batch": 4, "prefill_chunk": CHUNK}, jobs)
    whole, _ = _events(engine, mode, {"max_batch": 4, "prefill_chunk": 0}, jobs)
    for (ids, n, job_mode, sampling, _), a, b in zip(jobs, chunked, whole):
        assert a.error is None and b.error is None
        alone = engine.generate(ids, n, job_mode, sampling)
        assert a.gen.tokens == b.gen.tokens == alone.tokens == sum(a.streamed, [])
        assert a.gen.verify_steps == alone.verify_steps


def test_a_long_prompt_joins_a_chunk_at_a_time_between_steps(engine):
    """While a row decodes, a 300-token prompt never prefills more than one chunk between
    two of its steps (the old scheduler prefilled it whole: 300 tokens at once)."""
    short, long_ = prompts([9, 300])
    outcomes, log = _events(engine, "sharpdraft", {"max_batch": 4, "prefill_chunk": CHUNK},
                            [(short, 60, "sharpdraft", Sampling(), 0),
                             (long_, 6, "sharpdraft", Sampling(), 2)])
    assert all(o.error is None for o in outcomes)
    first = next(i for i, e in enumerate(log) if e == ("prefill", CHUNK))
    chunks = [e for e in log[first:] if e[0] == "prefill"]
    assert sum(n for _, n in chunks) == 300 and max(n for _, n in chunks) <= CHUNK
    # between two steps of the running row, at most one chunk of the joining prompt
    since_step = 0
    for kind, value in log[first:]:
        if kind == "step":
            since_step = 0
        else:
            since_step += value
            assert since_step <= CHUNK, log
    assert ("step", 2) in log  # and it did join the running row


def test_a_bad_request_fails_alone_while_another_prefills_in_chunks(engine):
    short, long_ = prompts([9, 300])
    jobs = [(short, 30, "sharpdraft", Sampling(), 0), (long_, 8, "sharpdraft", Sampling(), 1),
            ([7] * (engine.context_limit + 5), 4, "sharpdraft", Sampling(), 1),
            ([], 4, "sharpdraft", Sampling(), 2)]
    outcomes, _ = _events(engine, "sharpdraft", {"max_batch": 4, "prefill_chunk": CHUNK}, jobs)
    assert isinstance(outcomes[2].error, ValueError) and isinstance(outcomes[3].error, ValueError)
    for (ids, n, mode, sampling, _), o in zip(jobs[:2], outcomes[:2]):
        assert o.error is None and o.gen.tokens == engine.generate(ids, n, mode, sampling).tokens
