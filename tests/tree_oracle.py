"""Today's per-row EAGLE-3 tree drafting, kept as the tests' oracle for trees drafted as a
batch: each row its own drafter cache on the torch model, one pass ingesting its new
entries and one pass per tree level, one row after another, growing its tree exactly as
runtime/tree.py did before the rows' levels shared a pass (the code of TorchEagle3 and
grow_tree as they stood, behind the batch tree drafter's methods). A batched drafter is
right when every row's tree and N equal this one's, whatever the batch."""

from __future__ import annotations

import dataclasses

import torch

from runtime.backends.roles import TokenRows
from runtime.models.eagle3 import DraftVocabulary
from runtime.sampling import log_softmax
from runtime.tree import DraftTree, TreeShape


@dataclasses.dataclass
class _Node:
    score: float
    depth: int
    parent: int
    token: int


def grow_tree(root, first_logp, first_hidden, expand, shape: TreeShape, to_target) -> DraftTree:
    """One row's tree, one drafter pass per level over its frontier (expand)."""
    k = min(shape.top_k, first_logp.shape[-1])
    top = first_logp.topk(k)
    tokens = to_target(top.indices).tolist()
    nodes = [_Node(float(s), 1, -1, t) for s, t in zip(top.values.tolist(), tokens)]
    frontier = list(range(k))
    hidden = first_hidden.expand(k, -1)
    seen = torch.zeros((k, 0), dtype=torch.bool, device=first_hidden.device)
    for level in range(2, shape.depth + 1):
        scratch_mask = torch.cat([seen, torch.eye(k, dtype=torch.bool, device=seen.device)], -1)
        logp, out = expand([nodes[i].token for i in frontier], hidden, scratch_mask, level - 2)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        children = to_target(top.indices).tolist()
        scores = top.values.double() + torch.tensor([nodes[i].score for i in frontier],
                                                    dtype=torch.float64, device=logp.device)[:, None]
        first_child = len(nodes)
        width = top.indices.shape[-1]
        for row, parent in enumerate(frontier):
            for c in range(width):
                nodes.append(_Node(float(scores[row, c]), level, parent, children[row][c]))
        best = scores.flatten().topk(min(k, scores.numel())).indices.tolist()
        frontier = [first_child + b for b in best]
        rows = [b // width for b in best]
        hidden, seen = out[rows], scratch_mask[rows]
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
    place = {-1: 0}
    out_tokens, parents = [root], [-1]
    for i in order:
        if len(out_tokens) > shape.total_tokens - 1:
            break
        if nodes[i].parent in place:
            place[i] = len(out_tokens)
            out_tokens.append(nodes[i].token)
            parents.append(place[nodes[i].parent])
    return DraftTree(tuple(out_tokens), tuple(parents))


class RowTrees:
    """One sequence's drafter cache and its trees (TorchEagle3 as it was)."""

    def __init__(self, drafter, scaling, tree: TreeShape, max_drafts: int, capacity: int):
        self.drafter, self.scaling, self.tree = drafter, scaling, tree
        self.vocab = DraftVocabulary(drafter)
        self.cache = drafter.new_cache(capacity + max(tree.depth * tree.top_k, max_drafts))

    def _ingest(self, context, following):
        context = context.to(self.drafter.fc.weight.dtype)  # a float64 target's, say
        ids = torch.tensor([following], dtype=torch.long, device=context.device)
        logits, hidden, visible = self.drafter(ids, self.drafter.project(context[None]),
                                               self.cache, self.scaling)
        return logits[0, -1], hidden[0, -1], int(visible[0, -1])

    @torch.inference_mode()
    def read(self, ids, features):
        self._ingest(features, list(ids[-len(features):]))

    @torch.inference_mode()
    def draft_tree(self, context, following, shape):
        logits, hidden, visible = self._ingest(context, following)
        largest = [visible]

        def expand(tokens, parent_hidden, scratch_mask, offset):
            ids = torch.tensor([tokens], dtype=torch.long, device=parent_hidden.device)
            offsets = torch.full_like(ids, offset)
            out_logits, out_hidden, counts = self.drafter(ids, parent_hidden[None], self.cache,
                                                          self.scaling, tree=(scratch_mask[None], offsets))
            largest.append(int(counts.max()))
            return log_softmax(out_logits[0], -1), out_hidden[0]

        tree = grow_tree(following[-1], log_softmax(logits, -1), hidden, expand, shape,
                         self.vocab.to_target)
        return tree, max(largest)


class PerRowTrees:
    """The batch tree drafter's methods over one RowTrees per row, drafted one row after
    another: what every batched tree drafter must reproduce. `drafter`: the torch
    Eagle3Drafter (for an ONNX Runtime engine, its checkpoint loaded in torch)."""

    fused = True

    def __init__(self, drafter, scaling, tree: TreeShape, max_drafts: int = 16):
        self.drafter, self.scaling, self.tree, self.max_drafts = drafter, scaling, tree, max_drafts
        self.rows: list[RowTrees] = []
        self.joining = None

    def add(self, capacity, ids, features):
        self.prefill(capacity, ids, features)
        return self.join_prefilled()

    def prefill(self, capacity, ids, features):
        self.joining = RowTrees(self.drafter, self.scaling, self.tree, self.max_drafts, capacity)
        self.prefill_more(ids, features)

    def prefill_more(self, ids, features):
        if len(ids):
            self.joining.read(ids, features)

    def join_prefilled(self):
        self.rows.append(self.joining)
        self.joining = None

    def remove(self, row):
        del self.rows[row]

    def draft_trees(self, ids: TokenRows, features, shapes):
        rows = [ids.row(r).tolist() for r in range(len(ids))]
        return [None if shape is None else row.draft_tree(f, i[len(i) - len(f):], shape)
                for row, i, f, shape in zip(self.rows, rows, features, shapes)]
