"""What a chain drafter proposes for a row in one call, and the one way to grow chains
token by token for a batch of rows at once (runtime/backends/roles.py: BatchChainDrafter):
the chain's counterpart of runtime/tree.py, outside the backends, each of which supplies
one drafter pass."""

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
    def grow_rows(cls, logits: torch.Tensor, hidden: torch.Tensor, visible, step, ks: list[int],
                  samplers: list, to_row=None) -> list["ChainDraft | None"]:
        """Chains of ks[r] drafts for every row r of a batch, one step(tokens [b], hidden
        [b, H], i) -> (logits [b, ...], hidden [b, H], visible [b]) per link for all rows
        together (EAGLE-3's batched chain drafter). Row r's drafts are drawn by its own
        sampler from its own row only (to_row(logits): the rows over the target's
        vocabulary; default the logits themselves), one draw per position, as a row alone
        draws them, so sampling stays lossless; a row past its k rides along (its token
        is a filler, its outputs never read); a link's processors read the row's drafts
        before it. None for a row with k = 0."""
        longest = max(ks, default=0)
        tokens, dists, rows, counts = ([[] for _ in ks] for _ in range(4))
        for i in range(longest):
            full = logits if to_row is None else to_row(logits)
            fed = []
            for r, (k, sampler) in enumerate(zip(ks, samplers)):
                if i < k:
                    token, q = sampler.propose(full[r][None], prefix=tokens[r])
                    tokens[r] += token
                    dists[r].append(q)
                    rows[r].append(full[r])
                    counts[r].append(int(visible[r]))
                fed.append(tokens[r][-1] if tokens[r] else 0)
            if i + 1 < longest:  # the last draft needs no row of its own
                logits, hidden, visible = step(fed, hidden, i)
        return [cls(tokens[r], None if dists[r][0] is None else torch.cat(dists[r]),
                    torch.stack(rows[r]), torch.tensor(counts[r], dtype=torch.long))
                if k else None for r, k in enumerate(ks)]
