"""The serving scheduler (runtime/serve/scheduler.py) without a server: concurrent jobs
share decoding steps, each gets exactly its own `generate` output, and a bad, cancelled
or refused job fails alone."""

import threading

import pytest
import torch

from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.sampling import Sampling
from runtime.request import Request
from runtime.serve.scheduler import Cancelled, QueueFull, StepScheduler


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return Engine(open_spec(tiny_engine))


class Outcome:
    def __init__(self, cancel_after=None):
        self.streamed, self.gen, self.error = [], None, None
        self.cancel_after, self.finished = cancel_after, threading.Event()

    def job(self, ids, n, mode="sharpdraft", sampling=Sampling(), stop_ids=frozenset()):
        def on_tokens(new):
            if self.cancel_after is not None and len(self.streamed) >= self.cancel_after:
                raise Cancelled()
            self.streamed.append(list(new))

        def on_done(gen, mode):
            self.gen = gen
            self.finished.set()

        def on_error(exc):
            self.error = exc
            self.finished.set()

        return Request(prompt=ids, max_new_tokens=n, mode=mode, sampling=sampling, stop_ids=stop_ids,
                       on_tokens=on_tokens, on_done=on_done, on_error=on_error)


def prompts(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 300, (n,), generator=g).tolist() for n in lengths]


def test_concurrent_jobs_share_steps_and_each_gets_its_own_generate(engine):
    scheduler = StepScheduler(engine, max_batch=4)
    seen = []
    step = type(engine.decoder("sharpdraft")).step

    def counting_step(decoder, *aside):
        seen.append(len(decoder.active))
        return step(decoder, *aside)

    jobs = [(ids, n, "sharpdraft" if i % 3 else "frozen", Sampling(0.7, 1.0, seed=i) if i == 4 else Sampling())
            for i, (ids, n) in enumerate(zip(prompts([5, 80, 20, 150, 9, 33]), [20, 8, 30, 12, 16, 1]))]
    outcomes = [Outcome() for _ in jobs]
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(type(engine.decoder("sharpdraft")), "step", counting_step)
            for outcome, (ids, n, mode, sampling) in zip(outcomes, jobs):
                scheduler.submit(outcome.job(ids, n, mode, sampling, stop_ids=engine.stop_ids))
            assert all(o.finished.wait(120) for o in outcomes)
    finally:
        scheduler.close()
    assert max(seen) > 1  # steps were shared
    for outcome, (ids, n, mode, sampling) in zip(outcomes, jobs):
        assert outcome.error is None
        alone = engine.generate(ids, n, mode, sampling)
        assert outcome.gen.tokens == alone.tokens == sum(outcome.streamed, [])
        assert outcome.gen.mean_accepted_length >= 1 or n == 1


def test_a_bad_or_cancelled_job_fails_alone(engine):
    scheduler = StepScheduler(engine, max_batch=4)
    good, long_, cancelled, empty = Outcome(), Outcome(), Outcome(cancel_after=2), Outcome()
    try:
        scheduler.submit(good.job(prompts([12])[0], 24, stop_ids=engine.stop_ids))
        scheduler.submit(cancelled.job(prompts([40])[0], 24, stop_ids=engine.stop_ids))
        scheduler.submit(empty.job([], 5, stop_ids=engine.stop_ids))
        scheduler.submit(long_.job([7] * (engine.context_limit + 5), 5, stop_ids=engine.stop_ids))
        assert all(o.finished.wait(120) for o in (good, long_, cancelled, empty))
    finally:
        scheduler.close()
    assert isinstance(cancelled.error, Cancelled) and len(cancelled.streamed) == 2
    assert isinstance(empty.error, ValueError) and isinstance(long_.error, ValueError)
    assert good.error is None
    assert good.gen.tokens == engine.generate(prompts([12])[0], 24).tokens


def test_a_full_queue_refuses_the_request(engine):
    """The queue bounds what waits beyond the batch's free rows: with one row and no queue,
    the first request takes the row and the next, sent while it decodes, is refused."""
    scheduler = StepScheduler(engine, max_batch=1, max_queue=0)
    first = Outcome()
    try:
        scheduler.submit(first.job([1, 2], 48, stop_ids=engine.stop_ids))
        with pytest.raises(QueueFull, match="max_queue 0"):
            scheduler.submit(Outcome().job([1, 2], 4, stop_ids=engine.stop_ids))
        assert first.finished.wait(60)
    finally:
        scheduler.close()
    assert first.error is None and len(first.gen.tokens) > 1


@pytest.fixture(scope="module", params=["pard", "eagle3"])
def chain_or_tree_engine(request, tmp_path_factory, tiny_target):
    """A PARD chain engine and an EAGLE-3 tree engine."""
    import build_engine
    import tiny

    folder = tmp_path_factory.mktemp(request.param)
    make = {"pard": tiny.make_pard, "eagle3": tiny.make_eagle3}[request.param]
    out = folder / "engine"
    assert build_engine.main(["--drafter", request.param, "--sharpdraft", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(make(folder / "ckpt", tiny_target)),
                              "--ref-keys", "64", "--top-k", "8", "--backend", "torch",
                              "--step-costs", "fixed", "--output", str(out)]) == 0
    return Engine(open_spec(out))


def test_chain_and_tree_engines_batch_in_flight(chain_or_tree_engine):
    """The one loop batches every family: chains and trees share steps too."""
    engine = chain_or_tree_engine
    scheduler = StepScheduler(engine, max_batch=4)
    seen = []
    step = type(engine.decoder("sharpdraft")).step

    def counting_step(decoder, *aside):
        seen.append(len(decoder.active))
        return step(decoder, *aside)

    jobs = list(zip(prompts([7, 60, 25]), [12, 6, 9], ["sharpdraft", "sharpdraft", "frozen"]))
    outcomes = [Outcome() for _ in jobs]
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(type(engine.decoder("sharpdraft")), "step", counting_step)
            for outcome, (ids, n, mode) in zip(outcomes, jobs):
                scheduler.submit(outcome.job(ids, n, mode, stop_ids=engine.stop_ids))
            assert all(o.finished.wait(120) for o in outcomes)
    finally:
        scheduler.close()
    assert max(seen) > 1  # the two sharpdraft jobs shared steps
    for outcome, (ids, n, mode) in zip(outcomes, jobs):
        assert outcome.error is None
        alone = engine.generate(ids, n, mode)
        assert outcome.gen.tokens == alone.tokens == sum(outcome.streamed, [])
        assert alone.tokens == engine.generate(ids, n, "target").tokens  # lossless


def test_every_mode_runs_beside_the_others(engine):
    """Each mode steps its own batch; n-gram lookup and hybrid beside the drafter modes
    (before the one loop they ran one request at a time, and once the first such request
    stopped the scheduler's thread and every later request hung)."""
    scheduler = StepScheduler(engine, max_batch=4)
    jobs = list(zip(prompts([30, 12, 40, 9]), [10, 6, 8, 5], ["ngram", "sharpdraft", "hybrid", "frozen"]))
    outcomes = [Outcome() for _ in jobs]
    try:
        for outcome, (ids, n, mode) in zip(outcomes, jobs):
            scheduler.submit(outcome.job(ids, n, mode, stop_ids=engine.stop_ids))
        assert all(o.finished.wait(120) for o in outcomes)
    finally:
        scheduler.close()
    for outcome, (ids, n, mode) in zip(outcomes, jobs):
        assert outcome.error is None
        assert outcome.gen.tokens == engine.generate(ids, n, mode).tokens


def test_a_decoder_that_fails_to_build_is_the_requests_error_not_a_fallback(engine):
    """Whether a mode batches is the modes table's to say (modes.batch_refusal): a batch
    decoder that fails to build fails its request, it does not silently serve the mode
    one request at a time."""
    scheduler = StepScheduler(engine, max_batch=2)
    broken, after = Outcome(), Outcome()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(engine, "decoder", lambda mode, *a, **k: (_ for _ in ()).throw(
                RuntimeError("no decoder today")))
            scheduler.submit(broken.job(prompts([9])[0], 4, stop_ids=engine.stop_ids))
            assert broken.finished.wait(60)
        scheduler.submit(after.job(prompts([9])[0], 4, stop_ids=engine.stop_ids))  # the next request builds it again
        assert after.finished.wait(60)
    finally:
        scheduler.close()
    assert isinstance(broken.error, RuntimeError) and broken.gen is None
    assert after.error is None and after.gen.tokens == engine.generate(prompts([9])[0], 4).tokens


def test_a_hung_up_client_costs_no_more_prefill_chunks_nor_its_queue_place(engine):
    """Cancellation at every stage: a job whose client goes mid-prefill stops between two
    chunks; one that goes while it waits never prefills; each ends in Cancelled(stage)
    and the next request is served."""
    gone = threading.Event()
    prefills = []

    def on_turn(kind, seconds):
        if kind in ("prefill", "chunk"):  # a chunk of the long prompt (nothing else runs)
            prefills.append(kind)
            if len(prefills) == 3:
                gone.set()  # the client hangs up during the third chunk

    scheduler = StepScheduler(engine, max_batch=1, max_queue=4, prefill_chunk=8, on_turn=on_turn)
    long_, waiting, after = Outcome(), Outcome(), Outcome()
    long_job = long_.job(prompts([400])[0], 8, stop_ids=engine.stop_ids)
    long_job.cancelled = gone.is_set
    waiting_job = waiting.job(prompts([300])[0], 8, stop_ids=engine.stop_ids)
    waiting_job.cancelled = lambda: True  # went before its turn
    try:
        scheduler.submit(long_job)
        scheduler.submit(waiting_job)
        scheduler.submit(after.job(prompts([5])[0], 4, stop_ids=engine.stop_ids))  # shorter than a chunk: one turn
        assert all(o.finished.wait(60) for o in (long_, waiting, after))
    finally:
        scheduler.close()
    assert isinstance(long_.error, Cancelled) and long_.error.stage == "prefill"
    assert len(prefills) == 3 + 1  # 3 of the long prompt's 50 chunks, then the short one's
    assert isinstance(waiting.error, Cancelled) and waiting.error.stage == "queue"
    assert after.error is None and after.gen.tokens == engine.generate(prompts([5])[0], 4).tokens


def test_a_full_queue_drops_its_hung_up_clients_before_refusing(engine):
    scheduler = StepScheduler(engine, max_batch=1, max_queue=1)
    first, gone, newcomer = Outcome(), Outcome(), Outcome()
    try:
        scheduler.submit(first.job([1, 2], 48, stop_ids=engine.stop_ids))
        gone_job = gone.job([1, 2], 4, stop_ids=engine.stop_ids)
        scheduler.submit(gone_job)
        gone_job.cancelled = lambda: True
        scheduler.submit(newcomer.job([1, 2], 4, stop_ids=engine.stop_ids))  # refused before: the queue held one
        assert all(o.finished.wait(60) for o in (first, gone, newcomer))
    finally:
        scheduler.close()
    assert isinstance(gone.error, Cancelled) and gone.error.stage == "queue"
    assert first.error is None and newcomer.error is None
