"""The decode loop: one loop over a batch of sequences, for every mode and drafter family.
A single `generate` is a batch of one.

A step: the proposer drafts for every row (runtime/proposers.py: none, n-gram lookup,
DFlash blocks with or without n-gram assist, PARD / EAGLE-3 chains, EAGLE-3 trees); the
target verifies every row in one pass (rows of [last token, *drafts], or each row's tree
under its mask); each row's sampler keeps the longest acceptable prefix plus the target's
own next token (greedy: its argmax; sampling: rejection sampling, lossless); the caches
roll back to what was committed; the step is recorded. Each sequence keeps its own
length (so its own N and beta), sampler, stop tokens, budget and draft policy; sequences
join between steps (prefilled alone, then a row) and leave when done.

How many drafts to verify and whether the drafter runs at all are one policy object per
sequence (DraftPolicy: a no-op; MeasuredPolicy: from the engine's measured step costs).
It reads the context and past steps' outcomes, never the verdict on the step it shapes,
so decoding stays lossless.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from contextlib import contextmanager
from typing import Callable

import torch

from runtime.backends.roles import TokenRows
from runtime.metrics import Generation
from runtime.request import OnTokens, Request  # noqa: F401 -- the loop's requests
from runtime.sampling import Sampler, greedy_choice, greedy_verify, token_logprobs
from runtime.step_costs import AcceptanceRecord, HybridChoice, StepCosts, choose_draft_count


class DraftPolicy:
    """The no-op policy: verify every draft offered, run the drafter every step."""

    def lookup_drafts(self, offered: int, strong: bool, context: int) -> int:
        return offered

    def use_drafter(self, context: int) -> bool:
        return True

    def trim(self, drafts: list[int], logits: torch.Tensor, probs, sampler: Sampler,
             context: int) -> list[int]:
        return drafts

    def update(self, kind: "DraftKind", strong: bool, offered: int, verified: int,
               accepted: int, context: int) -> None:
        pass


class MeasuredPolicy(DraftPolicy):
    """Choices priced by the step costs measured at build time (runtime/step_costs.py):
    the drafter's drafts are cut where their confidence, scaled by how often drafts were
    accepted so far (AcceptanceRecord), no longer pays for a wider verify; the drafter
    sits a step out where it does not beat a plain decode step, and a lookup's drafts
    are cut by their own record (HybridChoice)."""

    def __init__(self, costs: StepCosts):
        self.costs = costs
        self.record = AcceptanceRecord()
        self.choice = HybridChoice(costs)
        self.confidence: list[float] = []  # of the drafts this step's drafter offered

    def lookup_drafts(self, offered: int, strong: bool, context: int) -> int:
        return self.choice.lookup_drafts(offered, strong, context)

    def use_drafter(self, context: int) -> bool:
        return self.choice.use_drafter(context)

    def trim(self, drafts, logits, probs, sampler, context):
        self.confidence = sampler.confidence(logits[:len(drafts)], probs)
        return drafts[:choose_draft_count(self.record.calibrate(self.confidence), context, self.costs)]

    def update(self, kind, strong, offered, verified, accepted, context):
        if kind.from_drafter:
            self.record.update(self.confidence, verified, accepted)
        self.choice.update(kind.from_drafter, strong, offered, verified, accepted, context)


def policy_for(costs: StepCosts | None) -> Callable[[], DraftPolicy]:
    return (lambda: MeasuredPolicy(costs)) if costs is not None else DraftPolicy


class DraftKind(enum.Enum):
    """What a proposal's drafts are, which says how they are verified (vLLM's rejection
    sampler reads the same from whether draft probabilities came with the drafts)."""

    NONE = "none"  # no drafts of a row: a tree (Proposal.tree), or a plain step nobody drafted
    GREEDY = "greedy"  # the drafter's argmax: kept while they equal the target's
    SAMPLED = "sampled"  # drawn from the drafter's q (Proposal.q): rejection sampling
    ONE_HOT = "one-hot"  # chosen without a distribution (n-gram lookup; maybe none, when the
    #                      drafter sat the step out): accept d with probability p(d)

    @property
    def from_drafter(self) -> bool:
        return self in (DraftKind.GREEDY, DraftKind.SAMPLED)

    @classmethod
    def drawn(cls, q) -> "DraftKind":
        """The kind of drafts a drafter proposed (Sampler.propose): q None means greedy."""
        return cls.GREEDY if q is None else cls.SAMPLED


@dataclasses.dataclass
class Proposal:
    """One row's drafts for a step: `kind` says what they are (DraftKind); `q`: the
    distribution of each SAMPLED draft; `visible` and `beta`: N of the drafter's first
    row and the beta its attention ran under there, for the metrics; `tree`: drafts as a
    tree (EAGLE-3)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    kind: DraftKind = DraftKind.NONE
    q: torch.Tensor | None = None
    strong: bool = False  # a lookup after a 2+-token match
    offered: int = 0  # lookup drafts found, before the policy cut them
    visible: int | None = None
    beta: float = 1.0
    tree: object = None


@dataclasses.dataclass
class Sequence:
    """A request in the batch."""
    request: Request
    budget: int
    sampler: Sampler
    gen: Generation
    committed: int  # tokens in the target's cache; gen.tokens[-1] is not yet
    policy: DraftPolicy = dataclasses.field(default_factory=DraftPolicy)
    row: object = None  # the proposer's state for this row
    done: bool = False
    error: str | None = None
    failure: BaseException | None = None  # what its on_tokens raised (a cancelled stream)
    started: float = 0.0
    prefilled: int = 0  # prompt tokens the target has prefilled so far (a chunked join)

    @property
    def room(self) -> int:
        """Drafts this step may add: the step also commits the target's own token."""
        return self.budget - len(self.gen.tokens) - 1

    @property
    def tokens(self) -> list[int]:
        """The whole context: prompt and what was committed."""
        return self.request.prompt + self.gen.tokens


def check_budget(context_limit: int, prompt: list[int], max_new_tokens: int) -> int:
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    room = context_limit - len(prompt)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the target's context holds "
                         f"{context_limit}")
    return min(max_new_tokens, room)


class Decoder:
    """target: a batch target (runtime/backends/roles.py: BatchTarget); proposer: how
    rows draft (runtime/proposers.py); policy: makes each sequence's DraftPolicy; slack:
    cache room past a sequence's budget, for the scratch keys of a verify row padded to
    the batch's longest (batched targets)."""

    def __init__(self, target, proposer, policy: Callable[[], DraftPolicy] = DraftPolicy,
                 slack: int = 0):
        self.target, self.proposer, self.policy, self.slack = target, proposer, policy, slack
        self.active: list[Sequence] = []

    def add(self, request: Request) -> Sequence:
        """Prefill a request and make it a row of the batch (from the next step on). Bad
        input (empty or over-long prompt, bad budget, a mode that cannot sample) raises
        ValueError for it alone."""
        joining = self.join(request)
        while True:
            try:
                next(joining)
            except StopIteration as joined:
                return joined.value

    def join(self, request: Request, chunk: int | None = None):
        """add() as a generator: with `chunk`, the prompt prefills `chunk` tokens at a
        time, the target's chunk and then the drafter's read of its features
        (Proposer.prefill / prefill_more), yielding after each, so the batch can step
        between them while a long prompt joins (chunked prefill); the last part (the rows
        join, the first token) is what must happen once. Returns the Sequence. Without
        `chunk`, or on a target that cannot continue a prefill (one without
        join_prefilled), the whole prompt in one go. One chunked join at a time per
        decoder: the prompt prefills held aside by the target and the drafter (their
        prefill / prefill_more) until its rows join."""
        prompt = request.prompt
        budget = check_budget(self.target.context_limit, prompt, request.max_new_tokens)
        sampler = request.sampler or Sampler(request.sampling)
        self.proposer.check(sampler)
        seq = Sequence(request, budget, sampler, Generation(len(prompt)), len(prompt),
                       policy=self.policy(), started=time.perf_counter())
        sampler.bind(prompt, seq.gen.tokens, request.stop_ids)  # what its processors read
        capacity = len(prompt) + budget + self.slack
        chunked = bool(chunk) and len(prompt) > chunk and hasattr(self.target, "join_prefilled")
        if chunked:  # the prompt prefills outside the batch's rows, then joins them
            for begin in range(0, len(prompt), chunk):
                if begin:
                    yield
                with seq.gen.timed("prefill"):
                    part = prompt[begin:begin + chunk]
                    seq.prefilled = begin + len(part)
                    if begin:
                        logits, features = self.target.prefill_more(part)
                        self.proposer.prefill_more(seq, features)
                    else:
                        logits, features = self.target.prefill(part, capacity)
                        self.proposer.prefill(seq, features)
            yield
        with seq.gen.timed("prefill"):
            if chunked:
                self.target.join_prefilled()
            else:
                logits, features = self.target.add(prompt, capacity)
            try:
                if chunked:
                    self.proposer.join(seq)
                else:
                    self.proposer.add(seq, features)
            except Exception:
                self.target.remove(len(self.active))  # the row the target just added
                raise
            self.active.append(seq)
        seq.done = self._commit(seq, [seq.sampler.pick(logits)], logits[None])
        self._leave_finished()
        return seq

    def step(self, aside: frozenset = frozenset()) -> list[Sequence]:
        """One draft + verify step of every active sequence; returns those that finished.
        `aside`: the DraftKinds whose drafts this step drops (the serving scheduler steps a
        mode that stops paying under load aside for target-only or n-gram lookup): those
        rows verify no drafts, a plain decode step, as if every draft were rejected --
        lossless, and the proposer's state (a drafter's cache, its unread features) moves
        on as after a rejection. The proposer is told, so it need not draft what will be
        dropped (Block: its drafter does not run while its drafts are set aside). Trees
        are never set aside."""
        batch = self.active
        if not batch:
            return []
        with self._timed(batch, "draft"):
            proposals = self.proposer.propose(batch, aside)
        if aside and not self.proposer.drafts_trees:
            proposals = [Proposal() if p.kind in aside else p for p in proposals]
        with self._timed(batch, "verify"):
            if self.proposer.drafts_trees:
                outcomes = self._verify_trees(batch, proposals)
            else:
                outcomes = self._verify_rows(batch, proposals)
        for s, p, (new, features, rows) in zip(batch, proposals, outcomes):
            if p.kind is not DraftKind.NONE:
                s.policy.update(p.kind, p.strong, p.offered, len(p.tokens), len(new) - 1,
                                s.committed)
            s.committed += len(new)
            self.proposer.accept(s, p, new, features)
            s.gen.step(verified=len(p.tree) - 1 if p.tree is not None else len(p.tokens),
                       committed=len(new))
            if p.kind is DraftKind.ONE_HOT:
                s.gen.ngram_steps += 1
            if p.visible is not None:
                s.gen.visible_per_step.append(p.visible)
                s.gen.beta_per_step.append(p.beta)
            s.done = self._commit(s, new, rows)
        finished = [s for s in batch if s.done]
        self._leave_finished()
        return finished

    def _verify_rows(self, batch, proposals):
        """[last token, *drafts] per row in one pass -> (committed tokens, their features,
        the target's logits at them). The rows of plain greedy samplers (no processor
        that can move the argmax) get their verdicts in one batched comparison
        (sampling.greedy_verify); a plain decode step among them is the argmax after the
        bonus, as Sampler.pick gives it."""
        rows = TokenRows.of([[s.gen.tokens[-1]] + p.tokens for s, p in zip(batch, proposals)])
        logits, features = self.target.verify(rows)
        verdicts = [None] * len(batch)
        plain = [i for i, s in enumerate(batch)
                 if s.sampler.sampling.greedy and not s.sampler.processing]
        if plain:
            picked = logits if len(plain) == len(batch) else logits[plain]
            accepted, following = greedy_verify(rows.padded(plain)[:, 1:].numpy(),
                                                rows.lengths[plain].numpy() - 1,
                                                greedy_choice(picked))
            for i, a, f in zip(plain, accepted.tolist(), following.tolist()):
                verdicts[i] = a, f
        outcomes = []
        for i, (s, p) in enumerate(zip(batch, proposals)):
            n = len(p.tokens)
            # Rows that sample, or whose processors read the drafts before each position,
            # are verified one by one: each row draws from its own seeded generator (as
            # vLLM's rejection sampler draws per-request generators row by row), so one
            # batched draw would change what a seeded request commits.
            if verdicts[i] is not None:
                accepted, following = verdicts[i]
            elif not n:  # a plain decode step
                accepted, following = 0, s.sampler.pick(logits[i, 0])
            elif p.kind is DraftKind.ONE_HOT:
                accepted, following = s.sampler.verify_deterministic(p.tokens, logits[i, :n + 1])
            else:
                accepted, following = s.sampler.verify(p.tokens, logits[i, :n + 1], p.q)
            kept = None if features is None else features[i, :accepted + 1]
            outcomes.append((p.tokens[:accepted] + [following], kept, logits[i, :accepted + 1]))
        self.target.rollback([s.committed + len(new) for s, (new, _, _) in zip(batch, outcomes)])
        return outcomes

    def _verify_trees(self, batch, proposals):
        """Every node of each row's tree in one pass; the longest path of the target's own
        argmax is kept, plus its next token (greedy: trees verify greedily)."""
        results = self.target.verify_trees([p.tree for p in proposals])
        outcomes, paths = [], []
        for p, (logits, features) in zip(proposals, results):
            path, token = p.tree.greedy_path(greedy_choice(logits).tolist())
            paths.append(path)
            outcomes.append(([p.tree.tokens[i] for i in path[1:]] + [token], features[path],
                             logits[path]))
        self.target.keep_paths(TokenRows.of(paths))
        return outcomes

    @contextmanager
    def _timed(self, batch: list[Sequence], phase: str):
        """A phase of the batch's step, charged to every sequence in it (its latency)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            for s in batch:
                s.gen.seconds[phase] += elapsed

    def _commit(self, seq: Sequence, new: list[int], logits: torch.Tensor) -> bool:
        """Append committed tokens, cutting at a stop token; True when the sequence ends.
        logits: the target's at each of `new` (their log-probabilities, when asked)."""
        req, gen = seq.request, seq.gen
        for i, token in enumerate(new):
            if token in req.stop_ids:
                new = new[: i + 1]
                gen.stopped_by = "stop_token"
                break
        entries = None
        if req.logprobs is not None:
            entries = token_logprobs(logits[:len(new)], new, req.logprobs)
            gen.logprobs.extend(entries)
        gen.tokens.extend(new)
        try:
            if req.on_tokens:
                req.on_tokens(new) if entries is None else req.on_tokens(new, entries)
        except Exception as exc:  # its stream failed or was cancelled: it leaves, alone
            seq.failure, seq.error = exc, str(exc) or type(exc).__name__
            return True
        return gen.stopped_by == "stop_token" or len(gen.tokens) >= seq.budget

    def _leave_finished(self) -> None:
        now = time.perf_counter()
        for row in reversed(range(len(self.active))):
            seq = self.active[row]
            if seq.done:
                seq.gen.seconds["total"] = now - seq.started
                self.active.pop(row)
                self.target.remove(row)
                self.proposer.remove(row)

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

    def score(self, prompt: list[int], top: int) -> list[tuple]:
        """The target's log-probability of each prompt token after the ones before it (the
        first has none: None), with its `top` likeliest (sampling.token_logprobs): a row of its
        own, prefilled with the first token, then one pass over the rest, then removed. On
        a decoder with no rows (a verify pass steps every row)."""
        if self.active:
            raise RuntimeError("score() needs a decoder with no rows")
        check_budget(self.target.context_limit, prompt, 1)
        logits, _ = self.target.add(prompt[:1], len(prompt) + 1)
        try:
            rows = [logits[None]]
            if len(prompt) > 2:  # the last prompt token's own prediction is not needed
                more, _ = self.target.verify(TokenRows.of([prompt[1:-1]]))
                rows.append(more[0, :len(prompt) - 2])
        finally:
            self.target.remove(0)
        return [(prompt[0], None, [])] + token_logprobs(torch.cat(rows)[:len(prompt) - 1], prompt[1:], top)

    def generate(self, request: Request) -> Generation:
        """One request alone (a batch of one): its Generation, or what it raised."""
        seq = self.add(request)
        while not seq.done:
            self.step()
        if seq.failure is not None:
            raise seq.failure
        return seq.gen
