"""In-flight batching for a served engine: requests queue up, join the running batch at a
step boundary (up to max_batch sequences), stream their tokens as each step commits them,
and leave when done, cancelled or failed -- alone, the others run on.

One thread owns the engine and runs the loop; the Triton model (model.py) only submits
jobs and sends what the callbacks hand it. Pure Python, so it is tested without a server.
Every mode batches (runtime/decode.py), each in its own decoder; on a backend that cannot
batch (the engine's spec says which: EngineSpec.batches, tensorrt) requests run one at a
time on the same thread. A decoder that fails to build is that request's error, never a
silent fallback to one at a time.

A request whose client has gone (Request.cancelled) costs nothing more at any stage: it is dropped
from the queue when it reaches the head (or when a full queue is swept before refusing a
newcomer), between two chunks of its prefill, and from the batch at its next commit
(on_tokens raises Cancelled). Each ends in on_error(Cancelled(stage)), so the model counts
cancellations per stage (CANCEL_STAGES).

Chunked prefill (prefill_chunk tokens, 0: off): a joining prompt prefills at most
prefill_chunk tokens between two steps of the running rows (Decoder.join: the target's
chunk, then the drafter's read of it), and its last part (the rows join, the first
token) takes a turn of its own, so a long prompt delays the others by a chunk per step
instead of its whole prefill. With no row running there is nobody to
delay, and joining prompts prefill whole.

A job that names no mode joins the default batch: the batch of the mode the last
default job took, while it has rows (one batch serves the load; two half batches would
each pay a whole step); else the engine's default for the load it joins (running,
joining and waiting requests, itself included, up to max_batch: EngineSpec.default_mode_at,
the one rule in runtime/modes.py over the batch sizes the build measured). Each step of
the default batch follows the load it runs at: where the default at that batch size
drafts with no drafter model (target-only, n-gram lookup), the step sets the drafter's
drafts aside (Decoder.step's `aside`: a plain decode step for those rows, lossless), so a
mode that stops paying under load steps aside within its running requests. A job that
names the default batch's mode shares that batch, and so its steps aside.

Every turn of the loop that makes the running rows wait is timed (TURNS: a step, a chunk
of a joining prompt, a chunked join's last part, a prefill with no budget) and handed to
`on_turn(kind, seconds)`. A running stream's gap between two responses is one prefill
turn and one step, so the longest chunk and step bound what chunked prefill promises,
measured under the server's own load (the Triton model exports them:
runtime/serve/model.py).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from runtime.backends.bf16_prefill import chunk_problem
from runtime.decode import DraftKind
from runtime.metrics import Generation
from runtime.modes import LOOKUP, Mode
from runtime.request import Request
from runtime.serve.repository import DEFAULT_PREFILL_CHUNK


# What a turn of the loop did: a decode step of a batch; a chunk of a joining prompt, or a
# chunked join's last part (the rows join, the first token), while rows were running; a
# prefill with no budget (chunking off, or no row running: then nobody waits on it).
TURNS = ("step", "chunk", "join", "prefill")


class QueueFull(RuntimeError):
    """More requests waiting than the configured queue holds; the client may retry."""


# Where a cancelled job left: waiting in the queue, between chunks of its prefill, or the
# running batch (at a commit: on_tokens raised Cancelled).
CANCEL_STAGES = ("queue", "prefill", "decode")


class Cancelled(Exception):
    """The client went away; the sequence leaves the batch. `stage`: CANCEL_STAGES."""

    def __init__(self, stage: str = "decode"):
        super().__init__(f"the request was cancelled ({stage})")
        self.stage = stage


@dataclasses.dataclass
class Joining:
    """A job whose prompt is prefilling (Decoder.join's generator), `left` tokens to go."""
    job: Request
    decoder: object
    steps: object
    left: int


class StepScheduler:
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 on_turn: Callable[[str, float], None] | None = None):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 0:
            raise ValueError(f"max_batch must be >= 1, max_queue and prefill_chunk >= 0, got "
                             f"{max_batch}, {max_queue}, {prefill_chunk}")
        if problem := chunk_problem(prefill_chunk, getattr(engine, "prefill_grid", None)):
            raise ValueError(problem)
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.prefill_chunk = prefill_chunk
        self.on_turn = on_turn
        self.joining: collections.deque[Joining] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.decoders: dict[str, object] = {}  # mode -> its Decoder
        self.default: str | None = None  # the mode of the default batch (jobs naming none)
        self.jobs: dict[int, Request] = {}  # id(Sequence) -> its job
        self.scorer = None  # the target-only decoder that scores prompts (_score)
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="step-scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Request) -> None:
        with self.wake:
            # A request that finds a free row is not queued for long: the queue's bound
            # counts only what waits beyond the batch's free rows (else two requests that
            # arrive together at an idle server could refuse each other, before the
            # scheduler thread has taken the first into the batch).
            if len(self.waiting) >= self.max_queue + self._free_rows():
                self._sweep()  # hung-up clients hold no place in a full queue
            if len(self.waiting) >= self.max_queue + self._free_rows():
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue "
                                f"{self.max_queue}); retry later")
            self.waiting.append(job)
            self.wake.notify()

    def _sweep(self) -> None:
        """Drop the waiting jobs whose clients have gone (called with self.wake held)."""
        gone = [job for job in self.waiting if _gone(job)]
        for job in gone:
            self.waiting.remove(job)
            job.on_error(Cancelled("queue"))

    def close(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def _free_rows(self) -> int:
        # read from the submitting thread: a snapshot of the decoders (the scheduler thread
        # may add one), lengths read whole
        rows = sum(len(d.active) for d in list(self.decoders.values()) if d is not None)
        return max(0, self.max_batch - rows - len(self.joining))

    @property
    def running(self) -> int:
        # None: a backend that runs one request at a time (tensorrt)
        return sum(len(d.active) for d in self.decoders.values() if d is not None)

    def _decoder(self, mode: str):
        """The mode's batch decoder, or None where the modes table says the engine's
        backend cannot batch (then requests run one at a time). A decoder that fails to
        build raises: that request's error, and the next request of the mode tries again."""
        if mode not in self.decoders:
            if not self.engine.spec.batches:
                self.decoders[mode] = None
            else:
                self.decoders[mode] = self.engine.decoder(mode)
        return self.decoders[mode]

    def _loop(self) -> None:
        while True:
            with self.wake:
                while (not self.stopping and not self.waiting and not self.running
                       and not self.joining):
                    self.wake.wait()
                if self.stopping:
                    return
                admitted = []
                while self.waiting and (self.running + len(self.joining) + len(admitted)
                                        < self.max_batch):
                    admitted.append(self.waiting.popleft())
                # the default follows the load: the rows these jobs will decode with
                load = min(self.running + len(self.joining) + len(admitted) + len(self.waiting),
                           self.max_batch)
            for job in admitted:
                self._admit(job, load)
            self._prefill()
            for decoder in list(self.decoders.values()):
                if decoder is not None and decoder.active:
                    self._step(decoder)

    def _admit(self, job: Request, load: int = 1) -> None:
        if _gone(job):  # hung up while it waited: no prefill, no row
            job.on_error(Cancelled("queue"))
            return
        try:
            if job.on_prompt is not None:
                job.on_prompt(self._score(job))
                if job.max_new_tokens == 0:  # scored by the target alone: that is the mode it ran
                    job.mode = job.mode or str(Mode.TARGET)
                    job.on_done(Generation(len(job.prompt)), job.mode)
                    return
            if job.mode is None:
                job.mode = self._default_batch() or self.engine.spec.default_mode_at(load)
                self.default = job.mode
            decoder = self._decoder(job.mode)
            if decoder is None:  # one at a time, here and now
                if job.logprobs is not None:
                    raise ValueError("logprobs are computed by the batch loop; this backend runs "
                                     "one request at a time without it")
                job.on_done(self.engine.decoder(job.mode).generate(job), job.mode)
                return
        except Exception as exc:  # bad input, a cancelled stream, a bug: this request alone
            job.on_error(exc)
            return
        steps = decoder.join(job, self.prefill_chunk or None)
        self.joining.append(Joining(job, decoder, steps, len(job.prompt)))

    def _score(self, job: Request) -> list:
        """The prompt's log-probabilities, on a target-only decoder of its own that no
        request decodes on (its verify pass would step their rows)."""
        if self.scorer is None:
            self.scorer = self.engine.decoder(Mode.TARGET)
        return self.scorer.score(job.prompt, job.logprobs or 0)

    def _prefill(self) -> None:
        """Prefill joining prompts: at most prefill_chunk tokens while rows are running,
        everything when none is (or chunking is off). A join's last part (the rows
        joining and the first token) counts no tokens but takes a turn of its own
        between two steps, not the last chunk's: so the running rows wait at most one
        chunk's prefill, or the last part, per step."""
        budget = self.prefill_chunk if self.prefill_chunk and self.running else None
        while self.joining:
            if budget is None and self.prefill_chunk and self.running:
                budget = self.prefill_chunk  # a prompt just joined: it is running now
            head = self.joining[0]
            if _gone(head.job):  # hung up mid-prefill: its remaining chunks never run
                self.joining.popleft()
                head.steps.close()  # the held prefill is dropped; the next join starts a new one
                head.job.on_error(Cancelled("prefill"))
                continue
            cost = min(head.left, self.prefill_chunk or head.left)
            last_part = budget is not None and not cost  # a chunked join's: a turn alone
            if budget is not None and (cost > budget or last_part and budget < self.prefill_chunk):
                return
            if budget is not None:
                budget = 0 if last_part else budget - cost
            head.left -= cost
            kind = "prefill" if budget is None else "chunk" if cost else "join"
            start = time.perf_counter()
            try:
                next(head.steps)
                self._turn(kind, start)
                continue  # a chunk done; the prompt joins later
            except StopIteration as joined:
                seq = joined.value
            except Exception as exc:  # bad input, a cancelled stream, a bug: this request alone
                self.joining.popleft()
                head.job.on_error(exc)
                continue
            self._turn(kind, start)
            self.joining.popleft()
            self._finish(seq, head.job)

    def _turn(self, kind: str, start: float) -> None:
        if self.on_turn is not None:
            self.on_turn(kind, time.perf_counter() - start)

    def _default_batch(self) -> str | None:
        """The default batch's mode while it has rows (decoding or joining), else None."""
        decoder = self.decoders.get(self.default)
        if decoder is None:
            return None
        joining = any(j.decoder is decoder for j in self.joining)
        return self.default if decoder.active or joining else None

    def _aside(self, decoder) -> frozenset:
        """The DraftKinds the default batch sets aside this step: at its size, a default
        with no drafter model (target: every draft; ngram: the drafter's, lookups stay)."""
        if decoder is not self.decoders.get(self.default):
            return frozenset()
        at = Mode(self.engine.spec.default_mode_at(len(decoder.active)))
        if at.uses_drafter_model:
            return frozenset()
        drafter = frozenset({DraftKind.GREEDY, DraftKind.SAMPLED})
        return drafter if at.draft_source == LOOKUP else drafter | {DraftKind.ONE_HOT}

    def _step(self, decoder) -> None:
        batch, start = list(decoder.active), time.perf_counter()
        try:
            decoder.step(self._aside(decoder))
            self._turn("step", start)
        except Exception as exc:  # the step itself failed: every sequence in it fails
            for seq in batch:
                self.jobs.pop(id(seq)).on_error(exc)
            decoder.active.clear()
            self.decoders = {m: d for m, d in self.decoders.items() if d is not decoder}
            for entry in [j for j in self.joining if j.decoder is decoder]:
                self.joining.remove(entry)  # it would join a decoder no longer stepped
                entry.job.on_error(exc)
            return
        for seq in batch:
            self._finish(seq, self.jobs.pop(id(seq)))

    def _finish(self, seq, job: Request) -> None:
        if not seq.done:
            self.jobs[id(seq)] = job
        elif seq.failure is not None:
            job.on_error(seq.failure)
        else:
            job.on_done(seq.gen, job.mode)


def _gone(job: Request) -> bool:
    """Whether the job's client has gone; a check that itself fails counts as not gone
    (the job then runs, and its commit's on_tokens reports what is wrong)."""
    try:
        return bool(job.cancelled())
    except Exception:
        return False
