"""What a decoding step costs on this machine, measured when an engine is built and kept
in engine.json: one target pass over n new tokens with `context` tokens cached, and one
drafter step. Two things read it:

- `--backend auto` picks the backend whose one-token decode step is fastest (measured,
  not assumed);
- adaptive draft length (`choose_draft_count`): each step verifies only as many drafts as
  the drafter's confidence and the measured verify cost make worthwhile.

It also keeps which row counts the torch backend's linear layers run as weight @ x.T
(`choose_transposed_rows`, timed first, so the table is timed with them): the faster BLAS
kernel for a step's few rows differs by CPU.

A verify pass is priced from the table of what was measured (VerifyTable): at the measured
sizes and contexts exactly, linearly between them and past the last. A smooth fit, t = a +
b*n + c*context + d*n*context, is kept beside it (engines built before the table have only
the fit) but no longer prices a step: on the torch backend a 1-token pass runs on a faster
kernel than a 2-token one (SmolLM2-135M at 4,096 tokens, 2 cores: 1 token 76 ms, 2 tokens
113 ms, 3 tokens 137 ms, 4 tokens 109 ms), a step no line through the grid can follow.
Priced by the fit, a frozen drafter accepting 0.22 drafts a step looked as fast as a plain
decode step; measured, it ran at 0.84x (make demo, 4,096 tokens of context).
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import time

import numpy as np
import torch

from runtime import families
from runtime.backends.roles import TokenRows

CONTEXTS = (512, 4096)  # also the contexts --backend auto compares: measured, not extrapolated
# verify widths timed (those below the engine's widest pass, then that one): every small
# one, since a CPU kernel may change between any two, then a few on the way up
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
# A drafter step is timed as decoding runs it: right after a target pass (this many
# tokens), which streams the target's weights through the caches the drafter's weights
# were in, and reading the features of two committed tokens (a step that accepted one
# draft). Timed back to back instead, with its weights warm, the default engine's
# drafter step measured 2.9 / 5.2 ms at 512 / 4,096 tokens of context where decoding
# spent 6.2-6.7 / 11.0 ms in it (drafter.draft timed inside generate_block on an
# evaluation document, same session), and the adaptive rule ran drafter steps that did
# not pay.
DRAFTER_AFTER_VERIFY = 3
DRAFTER_ROWS = 2


def _segment(points: tuple[int, ...], x: float) -> tuple[int, float]:
    """The segment of sorted `points` that prices x (beyond either end: the end segment
    extended) and where x falls along it (0: its start, 1: its end)."""
    i = max(0, min(bisect.bisect_right(points, x) - 1, len(points) - 2))
    return i, (x - points[i]) / (points[i + 1] - points[i])


@dataclasses.dataclass(frozen=True)
class VerifyTable:
    """One verify pass's measured seconds, seconds[i][j] at contexts[i] tokens cached and
    sizes[j] tokens verified (both sorted ascending, each of at least one point)."""
    contexts: tuple[int, ...]
    sizes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def price(self, tokens: int, context: int) -> float:
        def along_sizes(row):
            if len(self.sizes) == 1:
                return row[0]
            j, f = _segment(self.sizes, tokens)
            return row[j] + f * (row[j + 1] - row[j])

        if len(self.contexts) == 1:
            return along_sizes(self.seconds[0])
        i, g = _segment(self.contexts, context)
        low, high = along_sizes(self.seconds[i]), along_sizes(self.seconds[i + 1])
        return low + g * (high - low)

    def to_dict(self) -> dict:
        return {"contexts": list(self.contexts), "sizes": list(self.sizes),
                "seconds": [list(row) for row in self.seconds]}

    @classmethod
    def from_dict(cls, data: dict) -> "VerifyTable":
        return cls(tuple(int(c) for c in data["contexts"]), tuple(int(n) for n in data["sizes"]),
                   tuple(tuple(float(t) for t in row) for row in data["seconds"]))


@dataclasses.dataclass(frozen=True)
class StepCosts:
    verify: tuple[float, float, float, float]  # a, b (per token), c (per cached key), d
    draft: tuple[float, float] | None  # a + b*context; None: no drafter model
    table: VerifyTable | None = None  # what was measured; None: priced by the fit
    # the row counts the torch backend's linear layers compute as weight @ x.T, faster
    # here (choose_transposed_rows; layers.few_rows_linear): the table was timed with them
    transposed_rows: tuple[int, ...] = ()

    def verify_seconds(self, tokens: int, context: int) -> float:
        if self.table is not None:
            return max(self.table.price(tokens, context), 1e-6)
        a, b, c, d = self.verify
        return max(a + b * tokens + c * context + d * tokens * context, 1e-6)

    def draft_seconds(self, context: int) -> float:
        return 0.0 if self.draft is None else max(self.draft[0] + self.draft[1] * context, 0.0)

    def to_dict(self) -> dict:
        out = {"verify": list(self.verify), "draft": None if self.draft is None else list(self.draft)}
        if self.table is not None:
            out["verify_table"] = self.table.to_dict()
        if self.transposed_rows:
            out["transposed_rows"] = list(self.transposed_rows)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "StepCosts":
        table = data.get("verify_table")
        return cls(tuple(float(x) for x in data["verify"]),
                   None if data.get("draft") is None else tuple(float(x) for x in data["draft"]),
                   None if table is None else VerifyTable.from_dict(table),
                   tuple(int(n) for n in data.get("transposed_rows", ())))


def fixed_costs(has_drafter_model: bool) -> StepCosts:
    """Costs recorded instead of measured (build_engine.py --step-costs fixed): a free
    drafter and a verify pass that costs the same at any width, so adaptive draft length
    verifies every drafter step's whole block. Builds whose output must not depend on
    this machine's timing (tests, reproducible engines) use them."""
    return StepCosts((1e-3, 0.0, 0.0, 0.0), (1e-6, 0.0) if has_drafter_model else None)


def choose_draft_count(confidence: list[float], context: int, costs: StepCosts) -> int:
    """How many of the drafts to verify: the k maximising expected committed tokens per
    second, (1 + sum_{i<=k} prod_{j<=i} confidence_j) / (draft + verify(k + 1 tokens)),
    reading confidence_i as the chance draft i is accepted given the ones before it were.
    Depends on the drafter alone, never on the target, so decoding stays lossless."""
    draft = costs.draft_seconds(context)
    best, best_rate = 0, 1.0 / (draft + costs.verify_seconds(1, context))
    expected, survive = 1.0, 1.0
    for k, c in enumerate(confidence, start=1):
        survive *= c
        expected += survive
        rate = expected / (draft + costs.verify_seconds(k + 1, context))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class AcceptanceRecord:
    """What the target accepted against what the drafter's confidence predicted, per draft
    position, over one generation. The raw confidence (the largest probability of a
    position's draft distribution) is far from the acceptance rate where the drafter is
    confidently wrong -- a frozen drafter at 4,096 tokens of context verified whole blocks
    of rejected drafts -- so choose_draft_count reads it scaled, per position, by accepted
    over predicted so far (with `prior` pseudo-counts, so the first steps trust it).
    Counts fade by `forget` each step, so a drafter written off (no drafts verified, so
    nothing learned) is trusted again after a while and retested as the context moves on.
    Only past steps' outcomes enter, never the step being verified: lossless."""

    def __init__(self, prior: float = 2.0, forget: float = 0.9):
        self.prior, self.forget = prior, forget
        self.predicted: list[float] = []  # sum of confidence over the drafts tested at i
        self.accepted: list[float] = []  # how many of them the target accepted

    def calibrate(self, confidence: list[float]) -> list[float]:
        out = []
        for i, c in enumerate(confidence):
            predicted = self.predicted[i] if i < len(self.predicted) else 0.0
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            out.append(min(1.0, c * (accepted + self.prior) / (predicted + self.prior)))
        return out

    def update(self, confidence: list[float], verified: int, accepted: int) -> None:
        """A step verified `verified` drafts and accepted the first `accepted`: draft i was
        tested only if every draft before it was accepted (confidence reads as that
        conditional chance). Call it every step, including steps that verified none."""
        self.predicted = [x * self.forget for x in self.predicted]
        self.accepted = [x * self.forget for x in self.accepted]
        for i in range(min(verified, accepted + 1)):
            if i == len(self.predicted):
                self.predicted.append(0.0)
                self.accepted.append(0.0)
            self.predicted[i] += confidence[i]
            self.accepted[i] += float(i < accepted)


class HybridChoice:
    """The decisions of a hybrid step (SharpDraft assisted by n-gram lookup) with measured
    step costs, each the one that commits more tokens per second by the costs priced at
    this context against what was accepted so far in this generation:

    - whether a step whose context ends in no 2+-token n-gram seen before runs the
      drafter (use_drafter): only when its step (draft pass + a wider verify) beats a
      plain one-token decode step. Far past the drafter's training length it stops
      paying; such steps then do what n-gram drafting does: verify a 1-token match's
      drafts, or decode one token;
    - how many of a lookup's drafts to verify (lookup_drafts), from a record of accepted
      lookup drafts per position (AcceptanceRecord, confidence 1 for a one-hot draft),
      kept apart for 2+-token and 1-token matches.

    Weighing the drafter against the 1-token lookup's record instead of a plain step was
    tried and dropped (commit d89ff26): on the evaluation documents it took the lookup
    nearly everywhere, so hybrid's MAL fell to about n-gram drafting's (2.305 / 1.929 at
    512 / 4,096 tokens against 2.520 / 2.011 with the drafter on every unmatched step,
    `bench --lengths 512 4096 7680 --new-tokens 64 --repeats 1 --max-docs 3 --modes ngram
    hybrid` on the drafter of that commit).

    Without a proposer (plain block speculation) only the first decision is made: a step
    whose drafter does not pay is a plain decode step.

    The drafter's counts fade by `forget` each step toward `prior` pseudo-steps that
    verified `hope` drafts and accepted them all (so a fresh drafter is tried first), the
    lookup records as AcceptanceRecord's do, so a way written off is
    retried after a while (the context moves on; nothing is learned about a way not
    taken). A retry costs more than the drafter's step it prices: the drafter first reads
    the context it skipped. With counts fading by 0.97 a step, the demo's drafters
    (frozen, and SharpDraft at 4,096 tokens on the torch backend, both short of a plain
    step there) were retried 6 times in 64 tokens, about 28 ms of drafting and 40 ms of
    wider verify each for 0.3-0.4 more tokens; at 0.99, 3 times. Only past steps'
    outcomes enter, never the step being verified: lossless."""

    def __init__(self, costs: StepCosts, prior: float = 1.0, forget: float = 0.99,
                 hope: float = 1.0):
        self.costs, self.prior, self.forget, self.hope = costs, prior, forget, hope
        self.lookup_costs = dataclasses.replace(costs, draft=None)  # a lookup costs nothing
        self.lookups = {True: AcceptanceRecord(), False: AcceptanceRecord()}  # by 2+-token match
        # the drafter's steps, the drafts they accepted and what they cost, in plain decode
        # steps at their context (each priced as it ran), faded
        self.steps = self.accepted = self.cost = 0.0

    def lookup_drafts(self, offered: int, strong: bool, context: int) -> int:
        """How many of the `offered` drafts of a lookup (a 2+-token match when `strong`)
        are worth verifying."""
        if not offered:
            return 0
        return choose_draft_count(self._lookup_confidence(strong, offered), context,
                                  self.lookup_costs)

    def _lookup_confidence(self, strong: bool, drafts: int) -> list[float]:
        """The chance each lookup draft lands given the ones before it did: its record's
        rate, and for positions never tested yet the last tested one's (a one-hot draft
        has no confidence of its own to fall back on, unlike the drafter's)."""
        record = self.lookups[strong]
        confidence = record.calibrate([1.0] * drafts)
        tested = len(record.predicted)
        if 0 < tested < drafts:
            confidence[tested:] = [confidence[tested - 1]] * (drafts - tested)
        return confidence

    def step_cost(self, verified: float, context: int) -> float:
        """A drafter step that verifies `verified` drafts at `context`, in plain decode steps."""
        return ((self.costs.draft_seconds(context) + self.costs.verify_seconds(1 + verified, context))
                / self.costs.verify_seconds(1, context))

    def use_drafter(self, context: int) -> bool:
        """Does a drafter step at `context` committed tokens beat a plain decode step? Its
        tokens per step over its cost per step, each a mean over the steps it ran: each
        step priced at the width it verified, not the mean width priced once, since a
        verify's cost need not be linear in its width (VerifyTable)."""
        accepted = (self.accepted + self.prior * self.hope) / (self.steps + self.prior)
        cost = ((self.cost + self.prior * self.step_cost(self.hope, context))
                / (self.steps + self.prior))
        return 1 + accepted >= cost

    def update(self, drafter: bool, strong: bool = False, offered: int = 0, verified: int = 0,
               accepted: int = 0, context: int | None = None) -> None:
        """Call once a step: the drafter's drafts (`drafter`, at `context` committed tokens)
        or a lookup's (a 2+-token match when `strong`; none: a plain step) verified
        `verified` of the `offered` drafts and accepted `accepted`."""
        if drafter and context is None:
            raise ValueError("a drafter step is priced at its context: pass context")
        self.steps, self.accepted, self.cost = (
            x * self.forget for x in (self.steps, self.accepted, self.cost))
        if drafter:
            self.steps, self.accepted, self.cost = (
                self.steps + 1, self.accepted + accepted,
                self.cost + self.step_cost(verified, context))
        for kind, record in self.lookups.items():  # fade both; learn from the one tested
            tested = not drafter and kind == strong
            record.update([1.0] * offered if tested else [], verified if tested else 0, accepted)


def _fastest_seconds(step, repeats: int, before=None) -> float:
    # The fastest run is the least disturbed by whatever else the machine does (another
    # process's threads on 2 cores can slow a step many times over, not a few percent).
    # `before` runs untimed ahead of each step, to leave the machine as decoding does.
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def _fit(rows: list[tuple[float, ...]], times: list[float]) -> tuple[float, ...]:
    solution, *_ = np.linalg.lstsq(np.asarray(rows, dtype=np.float64),
                                   np.asarray(times, dtype=np.float64), rcond=None)
    return tuple(round(float(x), 9) for x in solution)


def measure(engine, contexts=CONTEXTS, sizes=SIZES, repeats: int = 5, progress=None) -> StepCosts:
    """Time the engine's target (and drafter) on random tokens: content does not change
    the work. Contexts beyond the engine's limit are clipped to it."""
    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    # up to the widest pass a step makes: a drafter's block, or a lookup's drafts + 1
    widest = max(engine.manifest.block_size, engine.spec.ngram_settings["num_draft_tokens"] + 1)
    sizes = [n for n in sizes if n < widest] + [widest]
    width = max(*sizes, DRAFTER_AFTER_VERIFY)  # the most tokens a step below writes
    limit = engine.context_limit - width - 1
    contexts = sorted({min(c, limit) for c in contexts})
    rows, times, draft_rows, draft_times = [], [], [], []
    target = engine.loaded.batch_target()  # a batch of one, as a request alone runs
    transposed = choose_transposed_rows(engine, target, vocab, contexts[0], 3, progress)
    for context in contexts:
        ids = torch.randint(0, vocab, (context + width,), generator=gen).tolist()
        _, features = target.add(ids[:context], context + width)
        for n in sizes:
            def verify(n=n):
                target.verify(TokenRows.of([ids[context:context + n]]))
                target.rollback([context])
            verify()  # warm-up: first calls at a new shape pay one-off costs
            rows.append((1.0, n, context, n * context))
            times.append(_fastest_seconds(verify, repeats))
        if engine.style is not None:
            def target_pass():  # what runs between two drafter steps in decoding
                target.verify(TokenRows.of([ids[context:context + DRAFTER_AFTER_VERIFY]]))
                target.rollback([context])
            draft_rows.append((1.0, context))
            draft_times.append(_fastest_seconds(_drafter_step(engine, ids, features, context,
                                                              repeats), repeats, target_pass))
        target.remove(0)
        if progress:
            progress(f"      step costs at {context} tokens: verify "
                     + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(sizes, times[-len(sizes):]))
                     + (f"; draft {draft_times[-1] * 1e3:.1f} ms" if draft_times else ""))
    draft_fit = None
    if len(draft_rows) > 1:
        draft_fit = _fit(draft_rows, draft_times)
    elif draft_rows:  # one context measured (a short engine): a flat cost
        draft_fit = (round(draft_times[0], 9), 0.0)
    table = VerifyTable(tuple(contexts), tuple(sizes),
                        tuple(tuple(round(t, 9) for t in times[i * len(sizes):(i + 1) * len(sizes)])
                              for i in range(len(contexts))))
    return StepCosts(_fit(rows, times), draft_fit, table, transposed)


# A row count runs transposed only when that beats F.linear by this much: below it, the
# two are even and timing noise would pick at random.
TRANSPOSED_MARGIN = 0.05


def choose_transposed_rows(engine, target, vocab: int, context: int, repeats: int,
                           progress=None) -> tuple[int, ...]:
    """The row counts (1..layers.FEW_ROWS) whose verify pass runs faster with the torch
    models' linear layers computing weight @ x.T than with F.linear, timed interleaved on
    this machine at `context` tokens cached, and applied to the engine's models. The
    BLAS kernel behind each shape differs by CPU, so this is measured, never assumed.
    Backends without torch models (ONNX Runtime), and models that would not take the
    path (not float32 on CPU), keep F.linear: ()."""
    from runtime.models import layers

    models = [m for m in (engine.model, engine.drafter_model) if m is not None]
    weight = next(models[0].parameters()) if models else None
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return ()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (context + layers.FEW_ROWS,), generator=gen).tolist()
    target.add(ids[:context], context + layers.FEW_ROWS)
    chosen, seen = [], []
    for n in range(1, layers.FEW_ROWS + 1):
        def verify(n=n):
            target.verify(TokenRows.of([ids[context:context + n]]))
            target.rollback([context])

        best = {(): float("inf"), (n,): float("inf")}
        for sweep in range(repeats + 1):  # the two ways interleaved: a slow spell hits both
            for rows in best:
                for model in models:
                    layers.transpose_rows(model, rows)
                if sweep == 0:
                    verify()  # warm-up: first calls at a new shape pay one-off costs
                else:
                    best[rows] = min(best[rows], _fastest_seconds(verify, 1))
        if best[(n,)] < (1 - TRANSPOSED_MARGIN) * best[()]:
            chosen.append(n)
        seen.append(f"{n}: {best[()] * 1e3:.1f} / {best[(n,)] * 1e3:.1f} ms")
    target.remove(0)
    if progress:
        progress(f"      linear layers at {context} tokens, verify with F.linear / weight @ x.T: "
                 + ", ".join(seen) + f"; weight @ x.T for rows {chosen or 'none'}")
    for model in models:
        layers.transpose_rows(model, chosen)
    return tuple(chosen)


def _drafter_step(engine, ids: list[int], features, context: int, repeats: int, batch: int = 1):
    """A drafter step with ~context tokens in the drafter's cache, for `batch` rows alike
    (the build's costs: a batch of one), their caches filled and one warm-up step run: a
    block step (DRAFTER_ROWS context features + bonus), a chain step (one new token, the
    engine's draft count) or a tree step (one new token, the whole tree). Each step
    commits its new rows, so the cache grows by a few tokens over the repeats."""
    from runtime.sampling import Sampler

    drafter = engine.drafter(scaled=False)
    capacity = context + repeats + 2
    rows = range(batch)
    if families.drafts_trees(engine.style):  # EAGLE-3: one context row, then the tree's levels
        shape = engine.tree_shape
        for _ in rows:  # the prompt's entries, as a joining row reads them
            drafter.add(capacity, ids[:context], features[:-1])

        def step():
            drafter.draft_trees(TokenRows.of([ids[context:context + 1]] * batch), [features[-1:]] * batch,
                                [shape] * batch)
    elif families.drafts_chains(engine.style):
        k, sampler = engine.spec.drafting.max_drafts, Sampler()
        for _ in rows:
            drafter.add(capacity, [], None)
        # fill its rows to context tokens
        drafter.draft(TokenRows.of([ids[:context]] * batch), [features] * batch, [k] * batch,
                      [sampler] * batch)
        # the newest token's features (a drafter that reads features reads one row per token)
        newest = None if features is None else features[-1:]

        def step():
            drafter.draft(TokenRows.of([ids[context:context + 1]] * batch), [newest] * batch, [k] * batch,
                          [sampler] * batch)
    else:
        width = DRAFTER_ROWS
        helds = [drafter.add(context + width * (repeats + 2), features[:-width], ids[0])
                 for _ in rows]
        # the first step reads what its prefill held back (a drafter run one row at a time)
        drafter.draft([torch.cat([held, features[-width:]]) for held in helds], [ids[1]] * batch)

        def step():
            drafter.draft([features[-width:]] * batch, [ids[1]] * batch)
    step()  # warm-up
    return step


def decode_seconds(costs: StepCosts, limit: int) -> float:
    """One-token decode cost averaged over the measured contexts (clipped to the engine's
    limit): what `--backend auto` compares. Extrapolating the fit past them picked the
    slower backend once (torch over ONNX Runtime, which then decoded 1.6-1.75x faster at
    512 and 4,096 tokens), so the choice rests on measured points only."""
    contexts = sorted({min(c, limit) for c in CONTEXTS})
    return statistics.fmean(costs.verify_seconds(1, c) for c in contexts)
