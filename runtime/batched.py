"""In-flight (continuous) batching of block speculation: the single-sequence loop of
runtime/speculative.py, stepped for B sequences at once on the batched roles.

A step is one drafter call and one target verify pass for the whole batch; each sequence
keeps its own length (so its own beta per row), sampler (its own seeded generator, so its
tokens do not depend on the batch), acceptance, stop tokens and budget. Sequences join
between steps (prefilled alone, then a row of the batch) and leave when done. With no
drafter every step is a one-token decode step for each sequence (target-only).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from runtime.backends import BatchBlockDrafter, BatchTarget
from runtime.metrics import Generation
from runtime.sampling import Sampler, Sampling
from runtime.speculative import _budget, _commit
from runtime.step_costs import AcceptanceRecord, HybridChoice, StepCosts, choose_draft_count


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: frozenset = frozenset()
    on_tokens: Callable[[list[int]], None] | None = None


@dataclasses.dataclass
class Sequence:
    """A request in the batch: what the single-sequence loop keeps in local variables."""
    request: Request
    budget: int
    sampler: Sampler
    gen: Generation
    committed: int  # tokens in the target's cache; gen.tokens[-1] is not yet
    context: torch.Tensor | None = None  # target features the drafter has not seen yet
    done: bool = False
    error: str | None = None
    failure: BaseException | None = None  # what its on_tokens raised (a cancelled stream)
    record: AcceptanceRecord = dataclasses.field(default_factory=AcceptanceRecord)
    confidence: list[float] = dataclasses.field(default_factory=list)  # this step's drafts
    choice: HybridChoice | None = None  # with measured costs: does its drafter pay?


class BatchedDecoder:
    def __init__(self, target: BatchTarget, drafter: BatchBlockDrafter | None = None,
                 costs: StepCosts | None = None):
        self.target, self.drafter, self.costs = target, drafter, costs
        self.active: list[Sequence] = []

    def add(self, request: Request) -> Sequence:
        """Prefill a request and make it a row of the batch (from the next step on). Bad
        input (empty or over-long prompt, bad budget) raises ValueError for it alone."""
        budget = _budget(self.target, request.prompt, request.max_new_tokens)
        prompt = request.prompt
        seq = Sequence(request, budget, Sampler(request.sampling), Generation(len(prompt)),
                       len(prompt))
        if self.costs is not None and self.drafter is not None:
            seq.choice = HybridChoice(self.costs)
        slack = self.drafter.block_size if self.drafter else 1  # a padded verify row's scratch
        with seq.gen.timed("total"), seq.gen.timed("prefill"):
            logits, features = self.target.add(prompt, len(prompt) + budget + slack)
            if self.drafter is not None:  # it reads the prompt's features now, so a step's
                try:                      # context is one block at most
                    self.drafter.add(len(prompt) + budget, features)
                except Exception:
                    self.target.remove(len(self.active))  # the row the target just added
                    raise
                seq.context = features[:0]
            self.active.append(seq)
        seq.done = self._commit(seq, [seq.sampler.pick(logits)])
        self._leave_finished()
        return seq

    def _commit(self, seq: Sequence, new: list[int]) -> bool:
        req = seq.request
        try:
            done = _commit(seq.gen, new, req.stop_ids, req.on_tokens)
        except Exception as exc:  # its stream failed or was cancelled: it leaves, alone
            seq.failure, seq.error = exc, str(exc) or type(exc).__name__
            return True
        return done or len(seq.gen.tokens) >= seq.budget

    def _leave_finished(self) -> None:
        for row in reversed(range(len(self.active))):
            if self.active[row].done:
                self.active.pop(row)
                self.target.remove(row)
                if self.drafter is not None:
                    self.drafter.remove(row)

    def step(self) -> list[Sequence]:
        """One draft + verify step of every active sequence; returns those that finished."""
        batch = self.active
        if not batch:
            return []
        drafts, draft_probs, visible = [[] for _ in batch], [None] * len(batch), None
        # as generate_block decides: a sequence whose drafter does not pay takes a plain
        # step; the batch's drafter pass still stores its context (shared, one pass)
        drafting = [self.drafter is not None and (s.choice is None or s.choice.use_drafter(s.committed))
                    for s in batch]
        if self.drafter is not None:
            contexts = [s.context for s in batch]
            draft_logits, visible = self.drafter.draft(contexts, [s.gen.tokens[-1] for s in batch])
            for i, s in enumerate(batch):
                if not drafting[i]:
                    continue
                room = s.budget - len(s.gen.tokens) - 1
                drafts[i], draft_probs[i] = s.sampler.propose(draft_logits[i, :room], self.drafter.vocab)
                if self.costs is not None:
                    s.confidence = s.sampler.confidence(draft_logits[i, :len(drafts[i])], draft_probs[i])
                    k = choose_draft_count(s.record.calibrate(s.confidence), s.committed, self.costs)
                    drafts[i] = drafts[i][:k]
        logits, features = self.target.verify([[s.gen.tokens[-1]] + d for s, d in zip(batch, drafts)])
        for i, s in enumerate(batch):
            n = len(drafts[i])
            accepted, following = s.sampler.verify(drafts[i], logits[i, :n + 1], draft_probs[i])
            if self.costs is not None and drafting[i]:
                s.record.update(s.confidence, n, accepted)
            if s.choice is not None:
                s.choice.update("drafter" if drafting[i] else "lookup", verified=n, accepted=accepted)
            s.committed += accepted + 1
            if features is not None:
                s.context = features[i, :accepted + 1]
            s.gen.step(verified=n, committed=accepted + 1)
            if self.drafter is not None and not drafting[i]:
                s.gen.ngram_steps += 1  # a step without the drafter's drafts
            elif visible is not None:
                n_keys = int(visible[i])
                s.gen.visible_per_step.append(n_keys)
                scaling = self.drafter.scaling
                s.gen.beta_per_step.append(scaling.beta(n_keys) if scaling else 1.0)
            s.done = self._commit(s, drafts[i][:accepted] + [following])
        self.target.rollback([s.committed for s in batch])
        finished = [s for s in batch if s.done]
        self._leave_finished()
        return finished

    def run(self, requests: list[Request], max_batch: int | None = None,
            join_at: list[int] | None = None) -> list[Sequence]:
        """Decode every request: each joins at step join_at[i] (default 0) once a row is
        free (max_batch), and leaves when done. A request whose input is refused gets
        its error and no tokens; the others run on."""
        join_at = join_at or [0] * len(requests)
        waiting = sorted(range(len(requests)), key=lambda i: join_at[i])
        out: list[Sequence | None] = [None] * len(requests)
        step = 0
        while waiting or self.active:
            while waiting and join_at[waiting[0]] <= step and (
                    max_batch is None or len(self.active) < max_batch):
                i = waiting.pop(0)
                try:
                    out[i] = self.add(requests[i])
                except ValueError as exc:
                    out[i] = Sequence(requests[i], 0, None, Generation(len(requests[i].prompt)),
                                      0, done=True, error=str(exc))
            self.step()
            step += 1
        return out


def generate_batch(target: BatchTarget, drafter: BatchBlockDrafter | None,
                   requests: list[Request], costs: StepCosts | None = None,
                   max_batch: int | None = None, join_at: list[int] | None = None) -> list[Sequence]:
    return BatchedDecoder(target, drafter, costs).run(requests, max_batch, join_at)
