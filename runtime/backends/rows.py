"""Batch roles (runtime/backends/__init__.py: BatchTarget, BatchBlockDrafter,
BatchChainDrafter) made of single-sequence ones, one per row: how the decode loop runs a
batch of one on any target, trees where the batch target cannot pack them, tree
drafting, and drafters with no batched form (TensorRT, ONNX Runtime's EAGLE-3 chains).
Rows run one after another; their outputs are padded as the batched roles' are."""

from __future__ import annotations

import torch

from runtime.backends.roles import ChainPrefill
from runtime.step_metadata import padded_context


class RowTargets:
    """A BatchTarget over one single-sequence Target per row, made by `make()` (for a
    batch of one, the caller's target: a generate costs one single-sequence call)."""

    packs_trees = False  # one verify_tree call per row

    def __init__(self, make, context_limit: int):
        self.make, self.context_limit = make, context_limit
        self.rows: list = []

    def add(self, ids: list[int], capacity: int):
        target = self.make()
        result = target.prefill(ids, capacity)
        self.rows.append(target)
        return result

    def verify(self, rows: list[list[int]]):
        results = [target.verify(ids) for target, ids in zip(self.rows, rows)]
        logits = stack_padded([r[0] for r in results])
        features = None if results[0][1] is None else stack_padded([r[1] for r in results])
        return logits, features

    def rollback(self, lengths: list[int]) -> None:
        for target, length in zip(self.rows, lengths):
            target.rollback(length)

    def remove(self, row: int) -> None:
        self.rows.pop(row)

    def verify_trees(self, trees: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [target.verify_tree(tree) for target, tree in zip(self.rows, trees)]

    def keep_paths(self, paths: list[list[int]]) -> None:
        for target, path in zip(self.rows, paths):
            target.keep_path(path)


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[t_i, X] per row -> [b, max t_i, X], zeros past each row's own (never read); one
    row is a view, not a copy (a batch of one costs nothing here)."""
    return rows[0][None] if len(rows) == 1 else padded_context(rows)[0]


class RowBlockDrafters:
    """A BatchBlockDrafter over one single-sequence BlockDrafter per row, made by
    `make()`: drafters with no batched form (TensorRT plans; a mode the table,
    modes.drafts_fused, does not fuse) and a batch of one. A row whose context is empty this step does not draft
    (its logits are zeros, never read)."""

    fused = False  # one call per row: rows that sit a step out pass an empty context

    def __init__(self, make):
        self.make = make
        self.spare = make()  # the first row's; its attributes describe them all
        self.scaling, self.vocab = self.spare.scaling, self.spare.vocab
        self.block_size = self.spare.block_size
        self.rows: list = []

    def add(self, capacity: int, context: torch.Tensor, last: int) -> torch.Tensor:
        self.prefill(capacity, context, last)
        return self.join_prefilled()

    def prefill(self, capacity: int, context: torch.Tensor, last: int) -> None:
        """A new row's drafter reads the prompt's features but the last row, which its
        first draft() passes (an empty context would sit that draft out), whole or in
        parts (prefill_more), as the fused drafters' BlockPrefill."""
        self.joining, self.spare = self.spare or self.make(), None
        self.joining.reset(capacity)
        self.held = context[:0]
        self.prefill_more(context, last)

    def prefill_more(self, context: torch.Tensor, last: int) -> None:
        context = torch.cat([self.held, context])
        if len(context) > 1:  # all but the last row now; the block drafted is scratch
            self.joining.draft(context[:-1], last)
        self.held = context[-1:]

    def join_prefilled(self) -> torch.Tensor:
        self.rows.append(self.joining)
        self.joining = None
        return self.held

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        drafted = [d.draft(c, b) if len(c) else None
                   for d, c, b in zip(self.rows, contexts, bonuses)]
        like = next(r[0] for r in drafted if r is not None)
        logits = stack_padded([r[0] if r else like.new_zeros(like.shape) for r in drafted])
        return logits, torch.tensor([r[1] if r else 0 for r in drafted], dtype=torch.long)

    def remove(self, row: int) -> None:
        self.rows.pop(row)


class RowChainDrafters(ChainPrefill):
    """A BatchChainDrafter over one single-sequence ChainDrafter per row, made by
    `make()`: chain drafters with no batched form and a batch of one. A row with k = 0
    does not draft (None)."""

    fused = False  # one call per row

    def __init__(self, make):
        self.make = make
        self.spare = make()  # the first row's; its attributes describe them all
        self.scaling, self.max_drafts = self.spare.scaling, self.spare.max_drafts
        self.rows: list = []

    def _reset(self, capacity: int):
        """A new row's drafter, which reads the prompt (ChainPrefill: whole or in parts)."""
        drafter, self.spare = self.spare or self.make(), None
        drafter.reset(capacity)
        return drafter

    def _join_row(self) -> None:
        self.rows.append(self.reading)

    def draft(self, ids: list[list[int]], features: list, ks: list[int], samplers: list):
        return [d.draft(i, f, k, s) if k else None
                for d, i, f, k, s in zip(self.rows, ids, features, ks, samplers)]

    def remove(self, row: int) -> None:
        self.rows.pop(row)
