"""How the rows of a batch draft, one class per drafting style (runtime/decode.py runs
them all). Each keeps its per-row state on the Sequence (`seq.row`) and answers:

  add(seq, features)        -- the drafter's prefill: the prompt's target features
  prefill(seq, features), prefill_more(seq, features), join(seq)
                            -- add in parts (chunked prefill, Decoder.join): each chunk's
                               features right after the target computed them, then the
                               row joins. Block, Chain and Tree read each part as it
                               comes (chains and trees pair a feature row with the token
                               after it, so each part's newest row waits: PromptRead); by
                               default the parts wait for join, which reads them in one
                               piece (add)
  propose(batch, aside)     -> a Proposal per row; `aside`: the DraftKinds this step
                               drops (Decoder.step), which a proposer need not draft
  accept(seq, proposal, new, features) -- what the step committed (accepted drafts and
                               the target's token) and the target's features of them
  remove(row)               -- a sequence left the batch
  check(sampler)            -- refuse (ValueError) a request it cannot decode
  drafts_trees              -- verified as trees

A Proposal says what its drafts are (DraftKind: greedy, sampled with q, one-hot) and the
N and beta the drafter's attention ran under (beta_used: the drafter's own QueryScaling
at the count its op returned).

Block (DFlash): the drafter reads the target features of every token committed since it
last ran and drafts a block [bonus, d1 .. d(k)] in one pass, for the whole batch in one
call. With n-gram assist (hybrid), a row whose context ends in an n-gram of 2+ tokens
seen before verifies the lookup's drafts instead and skips the drafter; its unread
features wait for the drafter's next step, so the drafter's cache stays exact. While
the step sets the drafter's drafts aside (the served default under load: target-only
or n-gram), the drafter does not run at all; its rows' features wait, and the step
that drafts again reads them first (Block._catch_up).

Chain (PARD; EAGLE-3 with top_k 1): the drafter reads each row's tokens committed since
its last step (and the target's features of them) and proposes up to K drafts per row,
for the whole batch in one call; while its drafts are set aside, one draft per row (the
read is what its cache needs).

Tree (EAGLE-3): the drafter grows a tree of drafts below each row's last committed token,
for the whole batch in one call (one drafter pass per tree level across the rows:
runtime/tree.py); the target verifies each tree under its mask and keeps one path.

Lookup (n-gram): each row looks the context's last tokens up in the context itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from runtime.backends.roles import TokenRows
from runtime.decode import DraftKind, Proposal, Sequence
from runtime.ngram import NGramProposer
from runtime.tree import DraftTree, TreeShape

# Hybrid steps verify the lookup's drafts only when they follow a match of 2+ tokens: a
# 1-token match is a weak guess, and there the drafter does better. Measured on the
# default engine (one document, 64 new tokens, 512 / 4,096 tokens of context, one shared
# 2-core machine): lookup on any match, MAL 1.80 / 1.91 (n-gram alone 1.80 / 1.85); on 2+
# token matches, 2.25 / 1.97 and the fastest of the three. Running the drafter every step
# to weigh its confidence against the lookup cost more than it bought (its step was a
# third of a verify pass there), so the choice reads the lookup alone. Without such a
# match and with measured costs, the drafter runs only where it pays (HybridChoice).
LOOKUP_MIN_MATCH = 2


def beta_used(drafter, visible: int) -> float:
    """The beta `drafter`'s attention applied to a row that saw `visible` keys: its
    QueryScaling's (plugins/scaling.py), 1 when frozen."""
    return drafter.scaling.beta(visible) if drafter.scaling is not None else 1.0


class Proposer:
    """Defaults: no drafter (every step a plain decode step), no per-row state."""

    drafts_trees = False

    def check(self, sampler) -> None:
        pass

    def add(self, seq: Sequence, features) -> None:
        pass

    def prefill(self, seq: Sequence, features) -> None:
        seq.row = [features]  # until join: the parts read so far

    def prefill_more(self, seq: Sequence, features) -> None:
        seq.row.append(features)

    def join(self, seq: Sequence) -> None:
        parts, seq.row = seq.row, None
        self.add(seq, None if parts[0] is None else torch.cat(parts))

    def propose(self, batch: list[Sequence], aside: frozenset = frozenset()) -> list[Proposal]:
        return [Proposal() for _ in batch]

    def accept(self, seq: Sequence, proposal: Proposal, new: list[int], features) -> None:
        pass

    def remove(self, row: int) -> None:
        pass


class NoDrafts(Proposer):
    """Target-only decoding."""


class Lookup(Proposer):
    """N-gram lookup (prompt lookup decoding): one proposer per row indexes its context."""

    def __init__(self, make: Callable[[], NGramProposer]):
        self.make = make

    def add(self, seq, features):
        seq.row = self.make()

    def propose(self, batch, aside=frozenset()):
        proposals = []
        for s in batch:
            drafts = s.row.propose(s.tokens)[:s.room]
            proposals.append(Proposal(drafts, DraftKind.ONE_HOT, offered=len(drafts)))
        return proposals


@dataclasses.dataclass
class BlockRow:
    unread: list  # verified target features the drafter has not read yet
    lookup: NGramProposer | None


class Block(Proposer):
    """DFlash blocks over a batch block drafter (runtime/backends: BatchBlockDrafter),
    assisted by n-gram lookup when `lookup` makes a proposer per row."""

    def __init__(self, drafter, lookup: Callable[[], NGramProposer] | None = None):
        self.drafter, self.lookup = drafter, lookup

    def add(self, seq, features):
        # the drafter's own prefill, as serving engines run the draft model's prefill with
        # the target's: otherwise the first step pays for the whole prompt
        self.prefill(seq, features)
        self.join(seq)

    def prefill(self, seq, features):
        self.drafter.prefill(seq.budget + seq.committed, features, seq.request.prompt[-1])

    def prefill_more(self, seq, features):
        # each chunk as the target computed it: a chunked join's last part then holds no
        # drafter pass over the whole prompt (the context keys are the same either way)
        self.drafter.prefill_more(features, seq.request.prompt[-1])

    def join(self, seq):
        first = self.drafter.join_prefilled()
        seq.row = BlockRow([first], self.lookup() if self.lookup else None)

    def remove(self, row):
        self.drafter.remove(row)

    def propose(self, batch, aside=frozenset()):
        # drafter drafts set aside: the drafter does not run (its rows make plain decode
        # steps, as Decoder.step's aside would leave them)
        idle = DraftKind.GREEDY in aside
        proposals = []
        for s in batch:
            p, lookup = Proposal(), s.row.lookup
            if lookup is not None:
                offered = lookup.propose(s.tokens)[:s.room]
                p.strong = bool(offered) and lookup.matched >= LOOKUP_MIN_MATCH
                p.offered = len(offered)
                p.tokens = offered[:s.policy.lookup_drafts(p.offered, p.strong, s.committed)]
            # a lookup step: verify the lookup's drafts (maybe none: a plain decode step)
            if p.strong or not s.policy.use_drafter(s.committed):
                p.kind = DraftKind.ONE_HOT
            elif idle:
                p = Proposal()  # the drafter's row, its drafts set aside: a plain step
            proposals.append(p)
        drafting = [p.kind is DraftKind.NONE and not idle for p in proposals]
        # A fused drafter (one call for the batch) runs every step it is not set aside and
        # reads every row's features, so a row's context stays within one step's commits
        # (_catch_up keeps it so after steps set aside): the call pads every row to the
        # widest context, and its cache holds a block past the budget. Drafters run row
        # by row skip the rows that sit out (they read it all later). Where no row drafts
        # (the policy sat it out: the step costs say the drafter loses at this context; or
        # a 2+-token lookup is verified instead), the fused drafter sits out too, as when
        # set aside: a pass whose drafts nobody verifies is the time drafter modes lost
        # against target-only.
        if idle or not any(drafting):
            return proposals
        fused = getattr(self.drafter, "fused", True)
        contexts = []
        for s, drafts in zip(batch, drafting):
            unread = s.row.unread
            if drafts or fused:
                contexts.append(unread[0] if len(unread) == 1 else torch.cat(unread))
                s.row.unread = []
            else:
                contexts.append(unread[0][:0])
        bonuses = [s.gen.tokens[-1] for s in batch]
        if fused:
            contexts = self._catch_up(contexts, bonuses)
        logits, visible = self.drafter.draft(contexts, bonuses)
        for i, (s, p) in enumerate(zip(batch, proposals)):
            if drafting[i]:
                row = logits[i, :s.room]
                p.tokens, p.q = s.sampler.propose(row, self.drafter.vocab)
                p.kind = DraftKind.drawn(p.q)
                p.tokens = s.policy.trim(p.tokens, row, p.q, s.sampler, s.committed)
                p.visible = int(visible[i])
                p.beta = beta_used(self.drafter, p.visible)
        return proposals

    def _catch_up(self, contexts: list[torch.Tensor], bonuses: list[int]) -> list[torch.Tensor]:
        """Features a fused drafter's rows left unread while its drafts were set aside,
        read in passes of at most a block per row before the pass that drafts (their
        blocks are scratch: a context key depends only on its token's features and
        position). A pass then pads rows no wider than one step's commits do, so it
        writes no further past a row's length than a step does (a torch cache writes
        the padding). Returns what the drafting pass reads."""
        piece = self.drafter.block_size
        while max(len(c) for c in contexts) > piece:
            self.drafter.draft([c[:piece] for c in contexts], bonuses)
            contexts = [c[piece:] for c in contexts]
        return contexts

    def accept(self, seq, proposal, new, features):
        seq.row.unread.append(features)


@dataclasses.dataclass
class PromptRead:
    """A drafter reading a prompt in parts (a chunked join): the prompt tokens read so
    far, and the newest feature row, held until its token's part comes."""
    drafter: object
    read: int = 0
    held: torch.Tensor | None = None

    def part(self, seq: Sequence, features):
        """The next tokens to read (up to what the target prefilled, seq.prefilled) and
        their features, paired as a chain drafter pairs them in one read of the prompt:
        feature row i with the token after it, so the newest row waits for the next part.
        None while there is nothing to pair (a first part of one token)."""
        if features is not None:
            features = features if self.held is None else torch.cat([self.held, features])
            features, self.held = features[:-1], features[-1:]
            if not len(features):
                return None
        ids, self.read = seq.request.prompt[self.read:seq.prefilled], seq.prefilled
        return ids, features


@dataclasses.dataclass
class ChainRow:
    unread: list[int]  # committed tokens before the newest that the drafter has not read
    features: torch.Tensor | None  # the target's features of the newest unread tokens


class Chain(Proposer):
    """Chains over a batch chain drafter (runtime/backends: BatchChainDrafter): one call
    for the whole batch (one drafter pass per chain step across the rows)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def add(self, seq, features):
        prompt = seq.request.prompt
        read = len(prompt) if len(prompt) > 1 else 0  # its prefill: all but the last feature row
        self.drafter.add(seq.committed + seq.budget, prompt[:read],
                         None if features is None or not read else features[:-1])
        if read and features is not None:
            features = features[-1:]
        seq.row = ChainRow(prompt[read:], features)

    def prefill(self, seq, features):
        # the drafter's prefill a part at a time, each right after the target's (a chunked
        # join): its last part then reads no prompt; add() reads it in one piece
        self.drafter.prefill(seq.committed + seq.budget, [], None)
        seq.row = PromptRead(self.drafter)
        self.prefill_more(seq, features)

    def prefill_more(self, seq, features):
        part = seq.row.part(seq, features)
        if part is not None:
            self.drafter.prefill_more(*part)

    def join(self, seq):
        self.drafter.join_prefilled()
        read = seq.row  # as add() leaves the row: every prompt token read, the last feature held
        seq.row = ChainRow(seq.request.prompt[read.read:], read.held)

    def remove(self, row):
        self.drafter.remove(row)

    def propose(self, batch, aside=frozenset()):
        # no room: the last step is a plain decode step (k = 0: the row does not draft).
        # Drafts set aside: the drafter still reads every row's new tokens (its cache must
        # follow them), but drafts one token, not K (an EAGLE-3 chain's links are passes
        # of their own; PARD pads K - 1 rows); the step drops the draft.
        most = 1 if DraftKind.GREEDY in aside else self.drafter.max_drafts
        ks = [min(most, s.room) if s.room > 0 else 0 for s in batch]
        drafts = self.drafter.draft(TokenRows.of([s.row.unread + s.gen.tokens[-1:] for s in batch]),
                                    [s.row.features for s in batch], ks,
                                    [s.sampler for s in batch])
        proposals = []
        for s, draft in zip(batch, drafts):
            p = Proposal()
            if draft is not None:
                p.tokens, p.q, p.kind = draft.tokens, draft.probs, DraftKind.drawn(draft.probs)
                p.tokens = s.policy.trim(p.tokens, draft.logits, p.q, s.sampler, s.committed)
                # N of the first draft row: the row whose acceptance every other one needs
                p.visible = int(draft.visible[0])
                p.beta = beta_used(self.drafter, p.visible)
            proposals.append(p)
        return proposals

    def accept(self, seq, proposal, new, features):
        seq.row.unread, seq.row.features = new[:-1], features


class Tree(Chain):
    """EAGLE-3's dynamic trees over a batch tree drafter (runtime/backends/roles.py:
    BatchTreeDrafter): one call for the whole batch, one drafter pass ingesting every
    row's new entries and then one per tree level over every row's frontier. A row reads
    and joins as a chain's does (Chain: add, prefill, accept)."""

    drafts_trees = True

    def __init__(self, drafter, shape: TreeShape):
        super().__init__(drafter)
        self.shape = shape

    def check(self, sampler):
        if not sampler.sampling.greedy:
            raise ValueError("tree speculation verifies greedily; to sample, draft a chain "
                             "(EAGLE-3: top_k 1, build_engine.py --tree-top-k 1)")
        if sampler.sampling.reorders:
            raise ValueError("tree speculation verifies the target's own argmax; penalties and "
                             "min_tokens need a chain (EAGLE-3: top_k 1, build_engine.py "
                             "--tree-top-k 1)")

    def propose(self, batch, aside=frozenset()):
        # no room: the last step is a plain decode step (a tree of its root alone)
        shapes = [self.shape.within(s.room) if s.room > 0 else None for s in batch]
        grown = self.drafter.draft_trees(TokenRows.of([s.row.unread + s.gen.tokens[-1:]
                                                       for s in batch]),
                                         [s.row.features for s in batch], shapes)
        proposals = []
        for s, drafted in zip(batch, grown):
            if drafted is None:
                proposals.append(Proposal(tree=DraftTree.root_only(s.gen.tokens[-1]), beta=1.0))
            else:
                tree, visible = drafted
                proposals.append(Proposal(visible=visible, tree=tree,
                                          beta=beta_used(self.drafter, visible)))
        return proposals
