"""The torch backend's roles run eagerly: our TargetModel and the drafters (DFlash, PARD,
EAGLE-3 chains and trees) over a batch (TorchSlots: runtime/backends/slots.py; a request
alone is a batch of one), on the loader's device (cpu, cuda) in its
dtype. Their compiled forms: compiled.py; the loader:
loader.py."""

from __future__ import annotations

import torch

from plugins.scaling import QueryScaling
from runtime.backends.roles import (BatchBlockDrafter, BatchChainDrafter, BatchTarget,
                                    BatchTreeDrafter, JoinInParts, TokenRows)
from runtime.chain import ChainDraft
from runtime.backends.slots import TorchSlots
from runtime.models.dflash import DFlashDrafter, DraftHead
from runtime.models.eagle3 import DraftVocabulary, Eagle3Drafter
from runtime.models.pard import PARDDrafter
from runtime.models.target import TargetModel
from runtime.sampling import log_softmax
from runtime.step_metadata import padded_context
from runtime.tree import DraftTree, TreeShape, group_shapes, grow_trees, pack


def scatter_rows(out: torch.Tensor | None, part: torch.Tensor, members: list[int], batch: int,
                 width: int) -> torch.Tensor:
    """part [g, t, ...] into rows `members` of out [batch, width, ...] (made on the first
    part; positions past a part's t stay 0: padding whose outputs are never read)."""
    if out is None:
        out = part.new_zeros((batch, width) + part.shape[2:])
    out[members, :part.shape[1]] = part
    return out


class TorchBatchTarget(BatchTarget):
    """The target over a batch: per-sequence KVCaches (TorchSlots), each row at its own
    length; verify and verify_trees run one pass per group. A joining sequence prefills
    on a cache of its own (`held`: prefill, prefill_more), whole or in chunks between the
    batch's steps, then joins as the last row (join_prefilled); add() is both at once."""

    def __init__(self, model: TargetModel, feature_layers: tuple[int, ...] = (),
                 context_limit: int | None = None):
        self.model, self.feature_layers = model, tuple(feature_layers)
        # the longest sequence it takes: the target's positions, or the engine's limit
        self.context_limit = context_limit or model.config.max_position_embeddings
        self.caches = TorchSlots(lambda: model.new_cache(1, batch=0, per_sequence=True))
        self.held = None  # the joining sequence's cache, until it joins

    def add(self, ids: list[int], capacity: int):
        result = self.prefill(ids, capacity)
        self.join_prefilled()
        return result

    @torch.inference_mode()
    def prefill(self, ids: list[int], capacity: int):
        """A joining sequence's first part, on a fresh cache of `capacity` keys held aside
        (not a row yet): its last token's logits [vocab] and every token's features."""
        self.held = self.model.new_cache(capacity)
        return self._prefill_held(ids)

    @torch.inference_mode()
    def prefill_more(self, ids: list[int]):
        """The held sequence's next part, from its cached length (chunked prefill)."""
        return self._prefill_held(ids)

    def _prefill_held(self, ids: list[int]):
        x = torch.tensor([ids], dtype=torch.long, device=self.model.embed_tokens.weight.device)
        logits, features = self.model(x, self.held, self.feature_layers, last_logits_only=True)
        return logits[0, -1], None if features is None else features[0]

    def join_prefilled(self) -> None:
        """The held sequence becomes the batch's last row."""
        self.caches.join(self.held)
        self.held = None

    def snapshot(self):
        """A copy of the held sequence (after prefill / prefill_more, before it joins),
        independent of later steps: restore() makes it the held sequence again, as often
        as asked (several decoding runs from one prefill)."""
        held, n = self.held, self.held.length
        return n, held.capacity, held.k[:, :, :, :n].clone(), held.v[:, :, :, :n].clone()

    def restore(self, snap, capacity: int | None = None) -> None:
        """The snapshot's sequence held again, in a cache of `capacity` keys (default: the
        one it was prefilled in)."""
        n, held, k, v = snap
        self.held = self.model.new_cache(capacity or held)
        self.held.k[:, :, :, :n] = k
        self.held.v[:, :, :, :n] = v
        self.held.length = n

    @torch.inference_mode()
    def verify(self, rows: TokenRows):
        """One pass per group, its rows padded to its widest; the outputs padded to the
        batch's widest row."""
        width, logits, features = rows.width, None, None
        for cache, members in self.caches.each():
            ids = rows.padded(members).to(cache.k.device)
            part_logits, part_features = self.model(ids, cache, self.feature_layers)
            logits = scatter_rows(logits, part_logits, members, len(rows), width)
            if part_features is not None:
                features = scatter_rows(features, part_features, members, len(rows), width)
        return logits, features

    @torch.inference_mode()
    def verify_trees(self, trees: list[DraftTree]):
        """Every row's draft tree in one pass per group (runtime/tree.py: pack): each
        node sees its own sequence's committed keys and its ancestors, at that
        sequence's length + depth; the nodes' keys stay scratch until keep_paths.
        Returns (logits [n_i, vocab], features [n_i, F] or None) per row."""
        out = [None] * len(trees)
        for cache, members in self.caches.each():
            ids, mask, depths = pack([trees[r] for r in members], cache.k.device)
            cache.reserve(int(cache.lengths.max()) + ids.shape[1])  # the nodes' scratch
            logits, features = self.model(ids, cache, self.feature_layers, tree=(mask, depths))
            for i, r in enumerate(members):
                n = len(trees[r])
                out[r] = (logits[i, :n], None if features is None else features[i, :n])
        return out

    @torch.inference_mode()  # the caches were made under inference mode
    def keep_paths(self, paths: TokenRows) -> None:
        """Commit each row's accepted path (node indices, root first) of its verified tree."""
        for cache, members in self.caches.each():
            cache.keep_each([paths.row(r).tolist() for r in members])

    def rollback(self, lengths: list[int]) -> None:
        self.caches.rollback(lengths)

    def remove(self, row: int) -> None:
        self.caches.drop(row)


class TorchBatchDFlash(JoinInParts, BatchBlockDrafter):
    """The drafter over a batch: per-sequence KVCaches (TorchSlots), each row at its own
    length; under any QueryScaling (the engine's, a family preset) and, with a `window`,
    each row seeing only the last `window` of its own context keys (StepMetadata.block_window
    gives every row its own range in the one pass). A joining sequence reads its prompt's
    features into a cache of its own (`joining`; whole or in parts: JoinInParts), one
    block pass per part whose block is scratch, then joins."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, scaling: QueryScaling | None,
                 window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"a draft window must be >= 1 token, got {window}")
        self.window = window  # draft window (layers.window_mask); None: the whole context
        self.drafter, self.scaling = drafter, scaling
        self.head = DraftHead.for_drafter(drafter, target.lm_head)
        self.vocab = self.head.vocab  # what the logits' columns are (None: all target ids)
        self.embed_tokens = target.embed_tokens
        self.block_size, self.mask_token_id = drafter.config.block_size, drafter.config.mask_token_id
        self.caches = TorchSlots(lambda: drafter.new_cache(0, batch=0, per_sequence=True))
        self.joining = None

    def _reset_joining(self, capacity: int) -> None:
        self.joining = self.drafter.new_cache(capacity)

    @torch.inference_mode()
    def _read_joining(self, context: torch.Tensor, last: int) -> None:
        # the context's keys land at the joining cache's length; the block's past it are
        # scratch, and so are its outputs (not read)
        block = [last] + [self.mask_token_id] * (self.block_size - 1)
        ids = torch.tensor([block], dtype=torch.long, device=context.device)
        self.drafter(self.embed_tokens(ids), context[None], self.joining, self.scaling,
                     window=self.window)

    def _join_row(self) -> None:
        self.caches.join(self.joining)
        self.joining = None

    @torch.inference_mode()
    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        """One pass per group, its rows' contexts padded to its longest (an empty context,
        [0, F], adds nothing to its row's cache)."""
        logits, visible = None, None
        for cache, members in self.caches.each():
            context, lengths = padded_context([contexts[r] for r in members])
            block = [[bonuses[r]] + [self.mask_token_id] * (self.block_size - 1) for r in members]
            ids = torch.tensor(block, dtype=torch.long, device=context.device)
            hidden, part_visible = self.drafter(self.embed_tokens(ids), context, cache,
                                                self.scaling, context_lens=lengths.to(context.device),
                                                window=self.window)
            logits = scatter_rows(logits, self.head(hidden[:, 1:]), members, len(contexts),
                                  self.block_size - 1)
            if visible is None:
                visible = part_visible.new_zeros(len(contexts))
            visible[members] = part_visible
        return logits, visible

    def remove(self, row: int) -> None:
        self.caches.drop(row)


# Cache room a batched chain drafter's rows need past their capacity: a row is padded to
# the batch's widest (at most K + 1 real tokens, then K - 1 pard rows), and an EAGLE-3
# chain's links are scratch past the committed entries.
def _chain_room(max_drafts: int) -> int:
    return 2 * max_drafts + 1


# How the torch chain drafters (TorchBatchPARD, TorchBatchEagle3) prefill a joining row
# (JoinInParts's hooks): a cache of its own (`joining`), with the chain's room past the
# capacity, reads the prompt (each class's `_read_joining`), then joins the groups
# (`caches`).
def _chain_reset(self, capacity: int) -> None:
    self.joining = self.drafter.new_cache(capacity + _chain_room(self.max_drafts))


def _chain_join(self) -> None:
    self.caches.join(self.joining)
    self.joining = None


class TorchBatchPARD(JoinInParts, BatchChainDrafter):
    """PARD over a batch (BatchChainDrafter): per-sequence KVCaches (TorchSlots), each
    row at its own length; one pass per group drafts every row's chain, each row's
    [unread tokens, pard x (k - 1)] padded to the group's widest. A row's counts are its
    own (causal over its own cache: StepMetadata.causal_visible), so its beta is too. A
    joining sequence reads its prompt into a cache of its own (whole or in parts:
    _chain_reset / _chain_join), then joins."""

    fused = True
    _reset_joining, _join_row = _chain_reset, _chain_join

    def __init__(self, drafter: PARDDrafter, vocab_size: int, max_drafts: int,
                 scaling: QueryScaling | None):
        self.drafter, self.vocab_size, self.scaling = drafter, vocab_size, scaling
        self.max_drafts, self.pard_token = max_drafts, drafter.config.pard_token
        self.caches = TorchSlots(lambda: drafter.new_cache(0, batch=0, per_sequence=True))
        self.joining = None

    @torch.inference_mode()
    def _read_joining(self, ids: list[int], features=None) -> None:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.drafter.embed_tokens.weight.device)
        self.drafter(x, self.joining, self.scaling, keep=len(ids))

    @torch.inference_mode()
    def draft(self, ids: TokenRows, features, ks: list[int], samplers: list):
        drafts = [None] * len(ids)
        device = self.drafter.embed_tokens.weight.device
        # each row's [unread tokens, pard x (k - 1)]
        rows = ids.extended((torch.tensor(ks, dtype=torch.long) - 1).clamp(min=0), self.pard_token)
        ends = rows.lengths.tolist()
        for cache, members in self.caches.each():
            if not any(ks[r] for r in members):
                continue
            keep = ids.lengths[members].to(device)
            x = rows.padded(members).to(device)
            hidden, visible = self.drafter(x, cache, self.scaling, keep=keep)
            for i, r in enumerate(members):
                if ks[r]:
                    end = ends[r]
                    first = end - ks[r]  # the newest real token's row, then the pard rows
                    drafts[r] = ChainDraft.propose(
                        self.drafter.logits(hidden[i, first:end], self.vocab_size),
                        visible[i, first:end], samplers[r])
        return drafts

    def remove(self, row: int) -> None:
        self.caches.drop(row)


class TorchBatchEagle3(JoinInParts, BatchChainDrafter, BatchTreeDrafter):
    """EAGLE-3 over a batch, chains (top_k 1: BatchChainDrafter) or trees (`tree`, the
    engine's TreeShape: BatchTreeDrafter): per-sequence KVCaches (TorchSlots), each row
    at its own length. Per group, one pass ingests every row's newly committed entries
    (padded to the longest), then one pass per chain link drafts the next token of every
    row, or one pass per tree level expands every row's frontier (runtime/tree.py:
    grow_trees); links and levels are scratch past each row's committed entries, each
    row's N from the step's metadata (StepMetadata.tree_rows). A joining sequence reads
    its prompt into a cache of its own (whole or in parts: _reset_joining / _join_row),
    then joins."""

    fused = True
    _join_row = _chain_join

    def __init__(self, drafter: Eagle3Drafter, scaling: QueryScaling | None, max_drafts: int,
                 tree: TreeShape | None = None):
        self.drafter, self.scaling, self.max_drafts = drafter, scaling, max_drafts
        self.tree = tree
        self.vocab = DraftVocabulary(drafter)
        self.caches = TorchSlots(lambda: drafter.new_cache(0, batch=0, per_sequence=True))
        self.joining = None

    def _reset_joining(self, capacity: int) -> None:
        self.joining = self.drafter.new_cache(capacity + eagle3_room(self.max_drafts, self.tree))

    @torch.inference_mode()
    def _read_joining(self, ids: list[int], features: torch.Tensor) -> None:
        # entry p: the target's features of token p with token p + 1 (roles.py: JoinInParts)
        following = torch.tensor([list(ids[-len(features):])], dtype=torch.long,
                                 device=features.device)
        self.drafter(following, self.drafter.project(features[None]), self.joining, self.scaling)

    def _ingest(self, cache, members: list[int], entries: TokenRows, features: list[torch.Tensor]):
        """One pass over the group's rows' newly committed entries (`entries`: each row's
        ids paired with its features, eagle3_entries; committed: each row's cache length
        grows by its own count): each row's newest entry's draft-vocabulary logits [g, V],
        state [g, H] and N [g], which predict its first draft."""
        context, counts = padded_context([features[r] for r in members])
        x = entries.padded(members).to(context.device)
        logits, hidden, visible = self.drafter(x, self.drafter.project(context), cache,
                                               self.scaling, keep=counts.to(context.device))
        last = (counts - 1).to(context.device)  # each row's newest entry predicts its draft 1
        at = torch.arange(len(members), device=context.device)
        return logits[at, last], hidden[at, last], visible[at, last]

    @torch.inference_mode()
    def draft(self, ids: TokenRows, features: list[torch.Tensor], ks: list[int],
              samplers: list):
        drafts = [None] * len(ids)
        entries = eagle3_entries(ids, features)
        for cache, members in self.caches.each():
            if not any(ks[r] for r in members):
                continue
            logits, hidden, visible = self._ingest(cache, members, entries, features)
            committed = cache.lengths.clone()

            def step(tokens, hidden, i):
                x = torch.tensor(tokens, dtype=torch.long, device=hidden.device)[:, None]
                out, state, n = self.drafter(x, hidden[:, None], cache, self.scaling)
                return out[:, -1], state[:, -1], n[:, -1]

            grown = ChainDraft.grow_rows(logits, hidden, visible, step, [ks[r] for r in members],
                                         [samplers[r] for r in members], self.vocab.target_logits)
            cache.lengths = committed
            for r, draft in zip(members, grown):
                drafts[r] = draft
        return drafts

    @torch.inference_mode()
    def draft_trees(self, ids: TokenRows, features: list[torch.Tensor],
                    shapes: list[TreeShape | None]):
        """Per row as draft()'s ids and features, and its tree's shape (None: it drafts
        none this step): its DraftTree and the most keys any of its drafter rows saw (N),
        or None. Per group, one pass ingests, then one pass per level (grow_trees)."""
        trees = [None] * len(ids)
        entries = eagle3_entries(ids, features)
        for cache, members in self.caches.each():
            shaped = group_shapes(shapes, members)
            if shaped is None:
                continue
            logits, hidden, visible = self._ingest(cache, members, entries, features)

            def expand(tokens, parent_hidden, scratch_mask, offset):
                x = torch.tensor(tokens, dtype=torch.long, device=parent_hidden.device)
                out, state, counts = self.drafter(x, parent_hidden, cache, self.scaling,
                                                  tree=(scratch_mask, torch.full_like(x, offset)))
                return log_softmax(out, -1), state, counts

            grown = grow_trees(ids.last[members].tolist(), log_softmax(logits, -1), hidden,
                               visible.tolist(), expand, shaped, self.vocab.to_target)
            for r, tree in zip(members, grown):
                if shapes[r] is not None:
                    trees[r] = tree
        return trees

    def remove(self, row: int) -> None:
        self.caches.drop(row)


def eagle3_entries(ids: TokenRows, features: list[torch.Tensor]) -> TokenRows:
    """Each row's ids its features pair with (an EAGLE-3 entry: the target's features of
    a token with the token after it): its last len(features[r]) ids."""
    return ids.tails(torch.tensor([len(f) for f in features], dtype=torch.long))


def eagle3_room(max_drafts: int, tree: TreeShape | None) -> int:
    """Cache room an EAGLE-3 row needs past its capacity: a chain's (_chain_room), and a
    tree's levels below the first, top_k scratch keys each."""
    return max(_chain_room(max_drafts), 0 if tree is None else tree.depth * tree.top_k)
