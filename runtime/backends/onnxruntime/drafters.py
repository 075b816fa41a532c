"""The drafter graphs over a batch -- DFlash blocks (drafter.onnx over a HostKVCache:
OnnxBatchDFlash; drafter-kv.onnx over bound buffers: BoundBatchDFlash), PARD chains
(OnnxBatchPARD), EAGLE-3 chains and trees (OnnxBatchEagle3). A batch over host caches
keeps one row per sequence (join_row, drop_row). A joining sequence's prompt is read as
a batch of one on a cache of its own, with the graph runs the steps make."""

from __future__ import annotations


import numpy as np
import torch

from plugins.scaling import QueryScaling
from runtime.backends.roles import (BatchBlockDrafter, BatchChainDrafter, BatchTreeDrafter,
                                    JoinInParts, TokenRows)
from runtime.chain import ChainDraft
from runtime.sampling import DraftVocab, log_softmax
from runtime.step_metadata import StepMetadata, padded_context
from runtime.tree import TreeShape, group_shapes, grow_trees
from runtime.backends.onnxruntime.buffers import (BoundKVCache, HostKVCache, PREFILL_CHUNK,
                                                  buffer_dims, cache_dims, run_bound, window_feed)
from runtime.backends.onnxruntime.bound_rows import BoundSlots, check_room, store

def join_row(cache: HostKVCache | None, lengths: list[int], new: HostKVCache) -> HostKVCache:
    """A batch's host cache (`lengths`: its rows' committed lengths, to which the new
    row's is appended) with the sequence `new` holds as its last row: rebuilt, as long as
    the longer of the two."""
    rows = host_rows(cache, lengths) + [(new.k[:, :, 0], new.v[:, :, 0])]
    lengths.append(new.length)
    return rebuilt(max(cache.capacity if cache is not None else 0, new.capacity), rows)


def drop_row(cache: HostKVCache, lengths: list[int], row: int) -> HostKVCache | None:
    """The batch's host cache without `row`, whose length leaves `lengths` (rebuilt;
    None when it was the last)."""
    rows = host_rows(cache, lengths)
    del rows[row], lengths[row]
    return rebuilt(cache.capacity, rows) if rows else None


def host_rows(cache: HostKVCache | None, lengths: list[int]) -> list:
    """Each row's (keys, values), views of the batch's host cache."""
    if cache is None:
        return []
    return [(cache.k[:, :, i], cache.v[:, :, i]) for i in range(len(lengths))]


def rebuilt(capacity: int, rows: list) -> HostKVCache:
    """A host cache of `capacity` holding `rows` ((k, v) [tokens, layers, kv_heads,
    head_dim] each), one batch row each."""
    _, layers, kv_heads, head_dim = rows[0][0].shape
    cache = HostKVCache(capacity, layers, kv_heads, head_dim, batch=len(rows))
    for i, (k, v) in enumerate(rows):
        cache.k[:k.shape[0], :, i] = k
        cache.v[:v.shape[0], :, i] = v
    return cache


class OnnxBatchPARD(JoinInParts, BatchChainDrafter):
    """A PARD drafter graph over a batch (BatchChainDrafter): one HostKVCache row per
    sequence, each row's committed length fed as past_lens, so one run drafts every
    row's chain ([unread tokens, pard x (k - 1)], padded to the widest) at its own
    length, counts and beta. A joining sequence reads its prompt (whole or in parts:
    JoinInParts) as a batch of one on a host cache of its own, then joins. (EAGLE-3's
    chains batch the same way: OnnxBatchEagle3.)"""

    fused = True

    def __init__(self, session, pard_token: int, max_drafts: int, scaling: QueryScaling | None):
        self.session, self.pard_token, self.scaling = session, pard_token, scaling
        self.max_drafts = max_drafts
        self.dims = cache_dims(session)
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []
        self.joining: HostKVCache | None = None

    def _reset_joining(self, capacity: int) -> None:
        # + a padded row's real tokens
        self.joining = HostKVCache(capacity + self.max_drafts + 1, *self.dims)

    def _read_joining(self, ids: list[int], features=None) -> None:
        # in PREFILL_CHUNK-token steps, as the target's prefill reads the prompt: each
        # step's scores are [chunk, past + chunk]
        cache = self.joining
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = list(ids[start:start + PREFILL_CHUNK])
            _, [cache.length] = self._run(cache, [cache.length], TokenRows.of([chunk]), [len(chunk)],
                                          np.asarray([len(chunk) - 1], dtype=np.int64))

    def _join_row(self) -> None:
        self.cache = join_row(self.cache, self.lengths, self.joining)
        self.joining = None

    def remove(self, row: int) -> None:
        self.cache = drop_row(self.cache, self.lengths, row)

    def _run(self, cache: HostKVCache, lengths: list[int], rows: TokenRows, real: list[int],
             logit_positions: np.ndarray):
        """One graph run of each row's ids `rows` (its first real[r] real tokens, then pard
        tokens) after its committed `lengths` in `cache`: the logits, and each row's length
        once its ids (only the real tokens) are stored."""
        ends = [n + k for n, k in zip(lengths, real)]
        if max(ends) > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to "
                             f"{max(ends)}")
        longest = max(lengths)
        feeds = {"ids": rows.padded().numpy(),
                 "logit_positions": logit_positions,
                 "past_keys": cache.k[:longest], "past_values": cache.v[:longest],
                 "past_lens": np.asarray(lengths, dtype=np.int64)}
        logits, keys, values = self.session.run(None, feeds)
        for r, (start, end) in enumerate(zip(lengths, ends)):
            cache.k[start:end, :, r] = keys[:end - start, :, r]
            cache.v[start:end, :, r] = values[:end - start, :, r]
        return logits, ends

    def draft(self, ids: TokenRows, features, ks: list[int], samplers: list):
        if not any(ks):
            return [None] * len(ids)
        # each row's [unread tokens, pard x (k - 1)]
        rows = ids.extended((torch.tensor(ks, dtype=torch.long) - 1).clamp(min=0), self.pard_token)
        widths = rows.lengths.tolist()
        width = max(widths)
        first = min(w - k for w, k in zip(widths, ks) if k)  # the first row read
        meta = StepMetadata(torch.tensor(self.lengths), width)
        logits, self.lengths = self._run(self.cache, self.lengths, rows, ids.lengths.tolist(),
                                         np.arange(first, width, dtype=np.int64))
        visible = meta.causal_visible(width, len(ids))
        logits = torch.from_numpy(logits)
        return [ChainDraft.propose(logits[r, w - k - first:w - first], visible[r, w - k:w], sampler)
                if k else None for r, (w, k, sampler) in enumerate(zip(widths, ks, samplers))]

def onto_target(logits: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., draft vocab] on the target's vocabulary, -inf where
    the drafter cannot propose (as runtime/models/eagle3.py DraftVocabulary.target_logits:
    a token it cannot propose has draft probability 0, so verification stays lossless);
    draft_ids None: already there."""
    if draft_ids is None:
        return logits
    out = logits.new_full(logits.shape[:-1] + (vocab_size,), float("-inf"))
    out[..., draft_ids] = logits
    return out


def same_ids(indices: torch.Tensor) -> torch.Tensor:
    """Indices that are target ids already."""
    return indices


class OnnxBatchEagle3(JoinInParts, BatchChainDrafter, BatchTreeDrafter):
    """EAGLE-3 over a batch, chains (top_k 1: BatchChainDrafter) or trees (BatchTreeDrafter),
    on an engine's two drafter graphs (build/export.py): `step` (Eagle3Step, causal)
    commits the entries of newly committed tokens, `tree` (Eagle3TreeStep) runs one level
    of a draft tree, or one link of a chain, in scratch past them. One HostKVCache row per
    sequence, each row's committed length fed as past_lens, as OnnxBatchPARD does. A step
    is one run of the step graph, ingesting every row's newly committed entries (padded
    to the longest, context_lens real), then one run of the tree graph per chain link or
    tree level for every row: each link a one-row level, each tree level every row's
    frontier (runtime/tree.py: grow_trees), seeing its row's committed entries and the
    earlier links' or levels' keys of its own that it may (its ancestors): those keys are
    the scratch input, [scratch, layers, batch, ...], which the graph places after each
    row's own committed entries. So every row drafts at its own length, N and beta (the
    graphs return each row's N, the one they scaled by), a chain's drafts drawn by its
    row's own sampler (ChainDraft.grow_rows). The step graph returns logits over the
    target's vocabulary (the draft vocabulary mapped in-graph) and `draft_ids`, the target
    id of each draft-vocabulary index; the tree graph returns logits over the draft
    vocabulary, which a tree level scores and maps through draft_ids (a chain link's go
    onto the target's vocabulary for its sampler: onto_target). Engines exported before
    that give the tree graph's logits over the target's vocabulary (no draft_ids), and
    still draft alike. A joining sequence reads its prompt (whole or in parts:
    JoinInParts) as a batch of one through the step graph, on a host cache of its own,
    then joins."""

    fused = True
    STEP_OUTPUTS = ("logits", "state", "visible", "present_keys", "present_values")

    def __init__(self, step, tree, scaling: QueryScaling | None, shape, max_drafts: int):
        self.step_session, self.tree_session, self.scaling = step, tree, scaling
        self.tree, self.max_drafts = shape, max_drafts
        self.dims = cache_dims(step)
        # whether the graphs are the pair that leaves a tree level in the draft vocabulary
        self.draft_vocab = "draft_logits" in {o.name for o in tree.get_outputs()}
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []
        self.joining: HostKVCache | None = None

    def _reset_joining(self, capacity: int) -> None:
        # + scratch past the committed entries, as the torch drafter's rows have
        room = max(self.max_drafts, 0 if self.tree is None else self.tree.depth * self.tree.top_k)
        self.joining = HostKVCache(capacity + room, *self.dims)

    def _read_joining(self, ids: list[int], features: torch.Tensor) -> None:
        # entry p: the target's features of token p with token p + 1 (roles.py: JoinInParts)
        cache = self.joining
        following = list(ids[-len(features):])
        feeds = {"ids": np.asarray([following], dtype=np.int64),
                 "features": np.ascontiguousarray(features.numpy(), dtype=np.float32)[None],
                 "context_lens": np.asarray([len(following)], dtype=np.int64),
                 "past_lens": np.asarray([cache.length], dtype=np.int64)} | cache.past()
        keys, values = self.step_session.run(["present_keys", "present_values"], feeds)
        cache.append(keys, values)

    def _join_row(self) -> None:
        self.cache = join_row(self.cache, self.lengths, self.joining)
        self.joining = None

    def remove(self, row: int) -> None:
        self.cache = drop_row(self.cache, self.lengths, row)

    def _ingest(self, ids: TokenRows, features: list[torch.Tensor]):
        """One run of the step graph over every row's newly committed entries (they stay
        committed): each row's newest entry's logits [b, vocab], state [b, H] and N [b],
        which predict its first draft, and the draft vocabulary's target ids (None: an
        engine whose tree levels give target-vocabulary logits)."""
        context, counts = padded_context(features)
        # entry p: the target's features of token p with token p + 1 (each row's last
        # len(features) ids)
        following = ids.tails(counts).padded()
        meta = StepMetadata(torch.tensor(self.lengths), counts)
        ends = meta.committed().tolist()
        if max(ends) > self.cache.capacity:
            raise ValueError(f"KV cache holds {self.cache.capacity} tokens; asked to write up to "
                             f"{max(ends)}")
        feeds = {"ids": following.numpy(),
                 "features": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                 "context_lens": counts.numpy(), "past_lens": meta.cached.numpy()}
        names = self.STEP_OUTPUTS + (("draft_ids",) if self.draft_vocab else ())
        logits, state, visible, keys, values, *draft_ids = self.step_session.run(
            list(names), feeds | self._past(max(self.lengths)))
        for r, (start, end) in enumerate(zip(self.lengths, ends)):  # only the real entries stay
            self.cache.k[start:end, :, r] = keys[:end - start, :, r]
            self.cache.v[start:end, :, r] = values[:end - start, :, r]
        self.lengths = ends
        last = visible[np.arange(len(ends)), counts.numpy() - 1]  # N of each row's draft 1
        return (torch.from_numpy(logits), torch.from_numpy(state), torch.from_numpy(last),
                torch.from_numpy(draft_ids[0]) if draft_ids else None)

    def _scratch_run(self):
        """A run of the tree graph after every row's committed entries, the keys of the
        runs before it (this step's) as scratch: (ids [b, t], hidden [b, t, H], ancestors
        [b, t, S] over those S scratch keys, offset) -> logits, states, N."""
        past, lengths = self._past(max(self.lengths)), np.asarray(self.lengths, dtype=np.int64)
        empty = np.zeros((0,) + self.cache.k.shape[1:], self.cache.k.dtype)
        scratch = [empty, empty]

        def run(ids, hidden: torch.Tensor, ancestors: np.ndarray, offset: int):
            feeds = {"ids": np.asarray(ids, dtype=np.int64),
                     "hidden": np.ascontiguousarray(hidden.numpy(), dtype=np.float32),
                     "ancestors": ancestors, "offsets": np.full(ancestors.shape[:2], offset,
                                                               dtype=np.int64),
                     "scratch_keys": scratch[0], "scratch_values": scratch[1],
                     "past_lens": lengths}
            out, state, n, k, v = self.tree_session.run(None, feeds | past)
            scratch[:] = np.concatenate([scratch[0], k]), np.concatenate([scratch[1], v])
            return torch.from_numpy(out), torch.from_numpy(state), torch.from_numpy(n)
        return run

    def draft(self, ids: TokenRows, features: list[torch.Tensor], ks: list[int],
              samplers: list):
        if not any(ks):
            return [None] * len(ids)
        logits, state, last, draft_ids = self._ingest(ids, features)
        run = self._scratch_run()

        def step(tokens, hidden, i):
            out, new, n = run([[t] for t in tokens], hidden[:, None],
                              np.ones((len(tokens), 1, i), dtype=bool), i)
            return onto_target(out[:, 0], draft_ids, logits.shape[-1]), new[:, 0], n[:, 0]

        return ChainDraft.grow_rows(logits, state, last, step, ks, samplers)

    def draft_trees(self, ids: TokenRows, features: list[torch.Tensor],
                    shapes: list[TreeShape | None]):
        """As TorchBatchEagle3.draft_trees: one step-graph run, then one tree-graph run
        per level for every row."""
        shaped = group_shapes(shapes, list(range(len(ids))))
        if shaped is None:
            return [None] * len(ids)
        logits, state, last, draft_ids = self._ingest(ids, features)
        run = self._scratch_run()

        def expand(tokens, hidden, scratch_mask, offset):
            written = scratch_mask.shape[2] - scratch_mask.shape[1]  # the graph adds the own keys
            out, new, n = run(tokens, hidden, np.ascontiguousarray(scratch_mask[:, :, :written].numpy()),
                              offset)
            return log_softmax(out, -1), new, n

        if draft_ids is None:  # an engine exported before: every level over the target's vocabulary
            first, to_target = logits, same_ids
        else:  # the first level's drafts from the draft vocabulary too, as the torch drafter's
            first, to_target = logits[:, draft_ids], draft_ids.__getitem__
        grown = grow_trees(ids.last.tolist(), log_softmax(first, -1), state, last.tolist(),
                           expand, shaped, to_target)
        return [tree if shape is not None else None for tree, shape in zip(grown, shapes)]

    def _past(self, longest: int) -> dict:
        """Every row's committed entries, padded to the `longest` (a view, no copy)."""
        return {"past_keys": self.cache.k[:longest], "past_values": self.cache.v[:longest]}

class OnnxBatchDFlash(JoinInParts, BatchBlockDrafter):
    """drafter.onnx over a batch: one HostKVCache row per sequence, `lengths` per row
    fed as past_lens and each step's context lengths as context_lens. A joining
    sequence reads its prompt's features (whole or in parts: JoinInParts) as a batch of
    one on a host cache of its own, then joins."""

    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None):
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.dims = cache_dims(session)
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []
        self.joining: HostKVCache | None = None
        self.room = block_size

    def _reset_joining(self, capacity: int) -> None:
        self.joining = HostKVCache(capacity, *self.dims)

    def _read_joining(self, context: torch.Tensor, last: int) -> None:
        _, [self.joining.length], _ = self._run(self.joining, [self.joining.length], [context],
                                                [last])

    def _join_row(self) -> None:
        self.cache = join_row(self.cache, self.lengths, self.joining)
        self.joining = None

    def remove(self, row: int) -> None:
        self.cache = drop_row(self.cache, self.lengths, row)

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        logits, self.lengths, visible = self._run(self.cache, self.lengths, contexts, bonuses)
        return logits, visible

    def _run(self, cache: HostKVCache, lengths: list[int], contexts: list[torch.Tensor],
             bonuses: list[int]):
        """One graph run of every row's block after its context (stored after its
        committed `lengths` in `cache`): the logits, the rows' new lengths, their N."""
        context, context_lens = padded_context(contexts)
        meta = StepMetadata(torch.tensor(lengths), context_lens)
        ends = meta.committed().tolist()
        if max(ends) > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to "
                             f"{max(ends)}")
        block = np.asarray([[b] + [self.mask_token_id] * (self.block_size - 1) for b in bonuses],
                           dtype=np.int64)
        longest = max(lengths)
        feeds = {"block_ids": block,
                 "context": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                 "context_lens": context_lens.numpy(), "past_lens": meta.cached.numpy(),
                 "past_keys": cache.k[:longest], "past_values": cache.v[:longest]}
        logits, keys, values = self.session.run(None, feeds)
        for i, (start, c) in enumerate(zip(lengths, context_lens.tolist())):
            cache.k[start:start + c, :, i] = keys[:c, :, i]
            cache.v[start:start + c, :, i] = values[:c, :, i]
        return torch.from_numpy(logits), ends, meta.block_keys(self.block_size)

class BoundBatchDFlash(JoinInParts, BatchBlockDrafter):
    """drafter-kv.onnx over a batch: the rows in BoundSlots, each group's committed
    lengths fed as past_lens and its rows' context lengths as context_lens. A joining
    sequence reads its prompt's features (whole or in parts: JoinInParts) as a batch of
    one, straight into the buffer row it joins as (BoundSlots.reserve). With a `window`
    (a graph that takes one: has_window), the graph gives each row the last `window` of
    its own context keys from its own past_lens + context_lens
    (StepMetadata.block_window), so the window modes draft in one pass too."""

    STEP_OUTPUTS = ("logits", "new_keys", "new_values")

    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None,
                 window: int | None = None):
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.window_feed = window_feed(session, window)
        self.slots = BoundSlots(session)
        # the slot manager's lists (it changes them in place): groups, each row's length
        self.groups, self.lengths = self.slots.groups, self.slots.lengths
        # the sequence read aside until it joins, and its binding to the graph
        self.joining: BoundKVCache | None = None
        self.binding = None

    def _reset_joining(self, capacity: int) -> None:
        self.joining = self.slots.reserve(capacity)
        self.binding = self.joining.bind(self.session)

    def _read_joining(self, context: torch.Tensor, last: int) -> None:
        _, [self.joining.length] = self._pass(self.joining, self.binding, [self.joining.length],
                                              [context], [last])

    def _join_row(self) -> None:
        self.slots.join(self.joining)
        self.joining = self.binding = None

    def remove(self, row: int) -> None:
        self.slots.drop(row)

    def _pass(self, cache: BoundKVCache, binding, lengths: list[int],
              contexts: list[torch.Tensor], bonuses: list[int]):
        """One run over the rows `binding` holds (committed `lengths`), their contexts
        padded to the longest (an empty one, [0, F], adds nothing to its row), the new
        context keys stored in `cache`: the logits and the rows' new lengths."""
        context, context_lens = padded_context(contexts)
        meta = StepMetadata(torch.tensor(lengths), context_lens)
        ends = meta.committed().tolist()
        check_room(cache, ends)
        block = np.asarray([[b] + [self.mask_token_id] * (self.block_size - 1) for b in bonuses],
                           dtype=np.int64)
        feeds = {"block_ids": block,
                 "context": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                 "context_lens": context_lens.numpy(), "past_lens": meta.cached.numpy()}
        out, keys, values = run_bound(self.session, binding, feeds | self.window_feed,
                                      self.STEP_OUTPUTS)
        store(cache, lengths, keys, values, context_lens.tolist())
        return out, ends

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        """One pass per group."""
        meta = StepMetadata(torch.tensor(self.lengths),
                            torch.tensor([c.shape[0] for c in contexts], dtype=torch.long))
        logits = None
        for group in self.groups:
            out, ends = self._pass(group.cache, group.binding, self.slots.lengths_of(group),
                                   [contexts[r] for r in group.members],
                                   [bonuses[r] for r in group.members])
            if logits is None:
                logits = np.zeros((len(contexts),) + out.shape[1:], np.float32)
            logits[group.members] = out
            for r, n in zip(group.members, ends):
                self.lengths[r] = n
        return torch.from_numpy(logits), meta.block_keys(self.block_size)
