"""Teacher-forced acceptance: what one greedy speculative step anchored at each token of
the target's own greedy continuation accepts, at EVERY anchor, per drafting style.

Greedy speculation commits exactly the target's greedy tokens, so a step whose bonus
token (the last one committed) is continuation token j accepts the leading drafts equal
to the tokens that follow j there. A decoding run visits only the anchors its steps land
on (one every MAL tokens) and pays a target verify pass at each. Here the target decodes
the continuation once; a drafter then drafts at every anchor, its cache fed one committed
token per call. That cache is the one a decoding run reaching j would hold: a DFlash
context row's entry depends on its own features and position alone, and chain and tree
drafters commit exactly the tokens they are given (anything they write while drafting is
scratch the next call overwrites). Comparing drafter settings this way (calibrate) reuses
the target's passes across settings and scores about MAL times as many anchors as a
decoding run of the same length.
"""

from __future__ import annotations

import dataclasses

import torch

from runtime import families
from runtime.backends.roles import TokenRows
from runtime.sampling import Sampler, greedy_choice
from runtime.tree import TreeShape


@dataclasses.dataclass
class Continuation:
    """The target's greedy continuation of a prompt, with the features the drafters read."""
    prompt: list[int]
    prompt_features: torch.Tensor | None  # [len(prompt), F]
    tokens: list[int]  # g_0 .. g_(n-1)
    features: torch.Tensor | None  # [n - 1, F]: the target's features of g_0 .. g_(n-2)

    def row_before(self, j: int) -> torch.Tensor | None:
        """The feature row of the token just before g_j (what the drafter reads with it)."""
        if self.prompt_features is None:  # a drafter that reads no features (PARD)
            return None
        return self.prompt_features[-1:] if j == 0 else self.features[j - 1:j]


def greedy_continuation(target, prompt: list[int], n: int) -> Continuation:
    """n greedy tokens after `prompt`, decoded one per pass as target-only decoding does,
    on a batch target (a batch of one, left empty again)."""
    logits, prompt_features = target.add(prompt, len(prompt) + n)
    tokens, features = [int(greedy_choice(logits))], []
    while len(tokens) < n:
        logits, f = target.verify(TokenRows.of([tokens[-1:]]))
        features.append(None if f is None else f[0])
        tokens.append(int(greedy_choice(logits[0, -1])))
    target.remove(0)
    have = [f for f in features if f is not None]
    return Continuation(list(prompt), prompt_features, tokens, torch.cat(have) if have else None)


def max_drafts(drafter, drafting: str, tree_shape: TreeShape | None = None) -> int:
    """The most drafts one step of this drafting style ("block", "chain", "tree") checks."""
    if families.drafts_trees(drafting):
        return tree_shape.depth
    return drafter.max_drafts if families.drafts_chains(drafting) else drafter.block_size - 1


def committed_per_anchor(drafter, cont: Continuation, drafting: str,
                         tree_shape: TreeShape | None = None) -> list[int]:
    """For anchors j = 0 .. n - 1 - max_drafts (each with a whole step's tokens after it):
    the tokens a greedy step anchored at g_j commits (its accepted drafts + the target's).
    drafting: the drafter's style, as Engine.style names it; tree_shape: a tree's."""
    d = max_drafts(drafter, drafting, tree_shape)
    g, prompt, pf = cont.tokens, cont.prompt, cont.prompt_features
    anchors = range(len(g) - d)
    if not anchors:
        raise ValueError(f"a continuation of {len(g)} tokens has no anchor with {d} tokens after it")
    if len(prompt) < 2:
        raise ValueError("teacher-forced acceptance needs a prompt of 2+ tokens")
    sampler = Sampler()  # greedy
    capacity = len(prompt) + len(g)
    out = []
    # a batch drafter's one row, prefilled as proposers.Tree / Chain / Block prefill it
    if families.drafts_from_ids(drafting):
        drafter.add(capacity, prompt, None if pf is None else pf[:-1])
    else:
        held = drafter.add(capacity, pf[:-1], prompt[-1])
    for j in anchors:
        if families.drafts_trees(drafting):
            (tree, _), = drafter.draft_trees(TokenRows.of([[g[j]]]), [cont.row_before(j)], [tree_shape])
            # the target's choice after each node: the continuation's next token, which is
            # what greedy verification computes for every node on the matching path (the
            # only nodes greedy_path reaches)
            choice = [g[j + depth + 1] if j + depth + 1 < len(g) else -1 for depth in tree.depths]
            out.append(len(tree.greedy_path(choice)[0]))
            continue
        if families.drafts_chains(drafting):
            drafts = drafter.draft(TokenRows.of([[g[j]]]), [cont.row_before(j)], [d], [sampler])[0].tokens
        else:
            context = cont.row_before(j)
            if j == 0:  # what its prefill held back for the first draft (none, fused)
                context = torch.cat([held, context])
            logits, _ = drafter.draft([context], [g[j]])
            drafts, _ = sampler.propose(logits[0], drafter.vocab)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == g[j + 1 + accepted]:
            accepted += 1
        out.append(accepted + 1)
    drafter.remove(0)
    return out
