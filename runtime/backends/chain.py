"""What a chain drafter proposes in one call, and the one way to grow a chain token by
token (runtime/backends/__init__.py: ChainDrafter)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class ChainDraft:
    """What a chain drafter proposes in one call."""
    tokens: list[int]
    probs: torch.Tensor | None  # the distributions the tokens were drawn from; None: greedy
    logits: torch.Tensor  # [k, vocab]
    visible: torch.Tensor  # [k]: visible-key count of each draft row

    @classmethod
    def propose(cls, logits: torch.Tensor, visible: torch.Tensor, sampler) -> "ChainDraft":
        """Drafts drawn from logits computed in one pass (PARD): each row's token from
        its own row, by the sampler's rule."""
        tokens, probs = sampler.propose(logits)
        return cls(tokens, probs, logits, visible)

    @classmethod
    def grow(cls, logits: torch.Tensor, hidden: torch.Tensor, visible: int, step, k: int,
             sampler, to_row=None) -> "ChainDraft":
        """k >= 1 drafts token by token (EAGLE-3 with top_k 1, on any backend): each chosen
        by the sampler's rule from its row (to_row(logits): the row over the target's
        vocabulary; default the logits themselves), then fed back with the row's own state,
        step(token, hidden, i) -> (logits, hidden, visible) of link i + 1."""
        tokens, dists, rows, counts = [], [], [], []
        for i in range(k):
            row = logits if to_row is None else to_row(logits)
            token, q = sampler.propose(row[None])
            tokens += token
            dists.append(q)
            rows.append(row)
            counts.append(visible)
            if i + 1 < k:  # the last draft needs no row of its own
                logits, hidden, visible = step(token, hidden, i)
        probs = None if dists[0] is None else torch.cat(dists)
        return cls(tokens, probs, torch.stack(rows), torch.tensor(counts, dtype=torch.long))
