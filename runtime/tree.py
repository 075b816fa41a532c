"""Draft trees (EAGLE-2/3's dynamic tree): how a drafter grows one, what the target
verifies it under, and which path is accepted.

A tree's node 0 is the root: the last committed token, not yet in the target's cache.
The target verifies every node in one pass, each row seeing the committed tokens plus
its own ancestors (ancestor_mask) at position committed + depth; under greedy decoding
the accepted path follows, from the root, the child whose token is the target's argmax
at its parent, and the target's argmax at the path's last node is the next token. The
caches then keep only that path (KVCache.keep).

Growing (grow_trees), as EAGLE-3 does it, every row of a batch at once (one drafter pass
per level over all the rows' frontiers): the root's top_k continuations form the first
frontier; each later level expands every frontier node into its top_k children, scores
each by its path's summed log-probability, and keeps the top_k best children as the next
frontier; finally the total_tokens - 1 best-scored nodes of everything seen make the
tree. A child never outscores its parent (log-probabilities are <= 0), so the best
nodes, taken best first and parents before children on ties, always form a tree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """top_k: children kept per expanded node (and the frontier's width); depth: the
    longest path of drafts (levels below the root; EAGLE's code counts expansions, so
    its depth d means d + 1 levels here); total_tokens: nodes the target verifies,
    root included (EAGLE's total_token)."""

    # Smaller than EAGLE's GPU defaults (10, 6, 60): on a CPU a verify pass costs about
    # in proportion to the tokens it checks, so a tree pays for every node it adds.
    top_k: int = 4
    depth: int = 5
    total_tokens: int = 16

    def __post_init__(self):
        for name in ("top_k", "depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"tree {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.total_tokens, int) or self.total_tokens < 2:
            raise ValueError(f"tree total_tokens must be an integer >= 2 (the root and one draft), "
                             f"got {self.total_tokens!r}")

    def within(self, room: int) -> "TreeShape":
        """This shape with paths no longer than `room` drafts (room >= 1)."""
        return dataclasses.replace(self, depth=min(self.depth, room))


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """tokens[i]: node i's token; parents[i]: its parent's index (< i), -1 for the root."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.parents) or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per token")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"every non-root node's parent must come before it: {self.parents}")

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls((token,), (-1,))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[n, n] bool: row i may see node j when j is i or one of its ancestors."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for i in range(1, len(self)):  # parents come first: their rows are complete
            mask[i] |= mask[self.parents[i]]
        return mask.to(device)

    def greedy_path(self, choice: list[int]) -> tuple[list[int], int]:
        """choice[i]: the target's token after node i's path (its argmax there).
        Returns the accepted path's nodes, root first, and the target's next token."""
        children: dict[int, dict[int, int]] = {}
        for i in range(1, len(self)):
            children.setdefault(self.parents[i], {})[self.tokens[i]] = i
        path = [0]
        while (child := children.get(path[-1], {}).get(choice[path[-1]])) is not None:
            path.append(child)
        return path, choice[path[-1]]


def pack(trees: list[DraftTree], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several sequences' trees for one pass: ids [b, t], ancestor masks [b, t, t] and
    depths [b, t], each tree padded to the widest. A padding node repeats its tree's
    root at depth 0 and sees only itself (no real node sees it); its outputs are never
    read, its key lands in the sequence's scratch."""
    width = max(len(tree) for tree in trees)
    ids = torch.zeros((len(trees), width), dtype=torch.long)
    depths = torch.zeros((len(trees), width), dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for i, tree in enumerate(trees):
        n = len(tree)
        ids[i] = tree.tokens[0]
        ids[i, :n] = torch.tensor(tree.tokens)
        depths[i, :n] = torch.tensor(tree.depths)
        mask[i, :n, :n] = tree.ancestor_mask()
    return ids.to(device), mask.to(device), depths.to(device)


# expand(tokens [b][k], hidden [b, k, H], scratch_mask [b, k, s], offset) -> (log-probs
# [b, k, V], hidden [b, k, H], visible [b, k]): one drafter pass over every row's frontier,
# its nodes at `offset` past their row's committed tokens, each seeing the scratch keys
# scratch_mask allows (its ancestors, written by earlier passes, then itself); visible:
# each node's visible-key count N, as the step's metadata gave it to the attention.
Expand = Callable[[list[list[int]], torch.Tensor, torch.Tensor, int],
                  tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class _Node:
    score: float  # summed log-probability of the path root -> node
    depth: int
    parent: int  # index into the candidate list, -1: the root
    token: int


def grow_trees(roots: list[int], first_logp: torch.Tensor, first_hidden: torch.Tensor,
               first_visible: list[int], expand: Expand, shapes: list[TreeShape],
               to_target: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[DraftTree, int]]:
    """EAGLE-3's dynamic tree below each row's root, every row's level in one drafter pass
    (`expand`). first_logp [b, V]: each row's log-probs for the token after its root
    (over the draft vocabulary); first_hidden [b, H]: the states those came with;
    first_visible: the N of the rows that made them. shapes: each row's tree (they differ
    in depth only: TreeShape.within); a row past its depth rides along in the passes, its
    outputs unread. to_target maps draft-vocabulary indices to token ids. Returns each
    row's tree and the most keys any drafter row of it saw (N)."""
    b, vocab = first_logp.shape
    k = min(shapes[0].top_k, vocab)
    top = first_logp.topk(k, dim=-1)
    tokens = to_target(top.indices).tolist()
    nodes = [[_Node(float(s), 1, -1, t) for s, t in zip(scores, row)]
             for scores, row in zip(top.values.tolist(), tokens)]
    largest = list(first_visible)
    frontier = [list(range(k)) for _ in range(b)]  # candidate indices, per row
    hidden = first_hidden[:, None].expand(b, k, first_hidden.shape[-1])
    device = first_hidden.device
    seen = torch.zeros((b, k, 0), dtype=torch.bool, device=device)  # scratch ancestry
    own = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
    at = torch.arange(b, device=device)[:, None]
    for level in range(2, max(shape.depth for shape in shapes) + 1):
        scratch_mask = torch.cat([seen, own], -1)
        logp, out, visible = expand([[nodes[r][i].token for i in frontier[r]] for r in range(b)],
                                    hidden, scratch_mask, level - 2)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        width = top.indices.shape[-1]
        children = to_target(top.indices).tolist()
        parents = torch.tensor([[nodes[r][i].score for i in frontier[r]] for r in range(b)],
                               dtype=torch.float64, device=logp.device)
        scores = top.values.double() + parents[:, :, None]
        best = scores.flatten(1).topk(k, dim=-1).indices
        flat, chosen, most = scores.flatten(1).tolist(), best.tolist(), visible.amax(-1).tolist()
        for r, shape in enumerate(shapes):
            if level > shape.depth:
                continue
            first_child = len(nodes[r])
            for row, parent in enumerate(frontier[r]):
                for c in range(width):
                    nodes[r].append(_Node(flat[r][row * width + c], level, parent, children[r][row][c]))
            frontier[r] = [first_child + i for i in chosen[r]]
            largest[r] = max(largest[r], int(most[r]))
        rows = best // width  # the frontier row each new frontier node came from
        hidden, seen = out[at, rows], scratch_mask[at, rows]
    return [(_best_tree(root, row, shape.total_tokens - 1), n)
            for root, row, shape, n in zip(roots, nodes, shapes, largest)]


def group_shapes(shapes: list[TreeShape | None], members: list[int]) -> list[TreeShape] | None:
    """The tree shape each of a group's rows grows under, a row that drafts none this step
    (None) riding along one level deep (its tree unread); None when no row drafts."""
    drafting = [shapes[r] for r in members if shapes[r] is not None]
    if not drafting:
        return None
    return [shapes[r] or drafting[0].within(1) for r in members]


def _best_tree(root: int, nodes: list[_Node], drafts: int) -> DraftTree:
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
    place = {-1: 0}  # candidate index -> node index in the tree
    tokens, parents = [root], [-1]
    for i in order:
        if len(tokens) > drafts:
            break
        if nodes[i].parent in place:  # always: a parent never scores below its child, sorts first on ties
            place[i] = len(tokens)
            tokens.append(nodes[i].token)
            parents.append(place[nodes[i].parent])
    return DraftTree(tuple(tokens), tuple(parents))
