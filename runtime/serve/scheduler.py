"""In-flight batching for a served engine: requests queue up, join the running batch at a
step boundary (up to max_batch sequences), stream their tokens as each step commits them,
and leave when done, cancelled or failed -- alone, the others run on.

One thread owns the engine and runs the loop; the Triton model (model.py) only submits
jobs and sends what the callbacks hand it. Pure Python, so it is tested without a server.
Every mode batches (runtime/decode.py), each in its own decoder; on a backend that cannot
batch (tensorrt) requests run one at a time on the same thread.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

from runtime.decode import Request


class QueueFull(RuntimeError):
    """More requests waiting than the configured queue holds; the client may retry."""


class Cancelled(Exception):
    """The client went away; the sequence leaves the batch."""


@dataclasses.dataclass
class Job:
    ids: list[int]
    max_new_tokens: int
    mode: str
    sampling: object
    on_tokens: Callable[[list[int]], None]  # raise Cancelled to leave the batch
    on_done: Callable[[object], None]  # the finished Generation
    on_error: Callable[[BaseException], None]


class StepScheduler:
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.decoders: dict[str, object] = {}  # mode -> its Decoder
        self.jobs: dict[int, Job] = {}  # id(Sequence) -> its job
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="step-scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.wake:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue "
                                f"{self.max_queue}); retry later")
            self.waiting.append(job)
            self.wake.notify()

    def close(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    @property
    def running(self) -> int:
        # None: a backend that runs one request at a time (tensorrt)
        return sum(len(d.active) for d in self.decoders.values() if d is not None)

    def _decoder(self, mode: str):
        if mode not in self.decoders:
            try:
                self.decoders[mode] = self.engine.batch_decoder(mode)
            except Exception:  # this mode or backend runs one request at a time
                self.decoders[mode] = None
        return self.decoders[mode]

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.waiting and not self.running:
                    self.wake.wait()
                if self.stopping:
                    return
                admitted = []
                while self.waiting and self.running + len(admitted) < self.max_batch:
                    admitted.append(self.waiting.popleft())
            for job in admitted:
                self._admit(job)
            for decoder in list(self.decoders.values()):
                if decoder is not None and decoder.active:
                    self._step(decoder)

    def _admit(self, job: Job) -> None:
        decoder = self._decoder(job.mode)
        try:
            if decoder is None:  # one at a time, here and now
                job.on_done(self.engine.generate(job.ids, job.max_new_tokens, job.mode, job.sampling,
                                                 on_tokens=job.on_tokens))
                return
            seq = decoder.add(Request(job.ids, job.max_new_tokens, job.sampling,
                                      self.engine.stop_ids, job.on_tokens))
        except Exception as exc:  # bad input, a cancelled stream, a bug: this request alone
            job.on_error(exc)
            return
        self._finish(seq, job)

    def _step(self, decoder) -> None:
        batch = list(decoder.active)
        try:
            decoder.step()
        except Exception as exc:  # the step itself failed: every sequence in it fails
            for seq in batch:
                self.jobs.pop(id(seq)).on_error(exc)
            decoder.active.clear()
            self.decoders = {m: d for m, d in self.decoders.items() if d is not decoder}
            return
        for seq in batch:
            self._finish(seq, self.jobs.pop(id(seq)))

    def _finish(self, seq, job: Job) -> None:
        if not seq.done:
            self.jobs[id(seq)] = job
        elif seq.failure is not None:
            job.on_error(seq.failure)
        else:
            job.on_done(seq.gen)
