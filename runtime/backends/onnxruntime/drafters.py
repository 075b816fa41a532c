"""The drafter graphs, one sequence and batched: DFlash blocks (drafter.onnx over a
HostKVCache: OnnxDFlash, OnnxBatchDFlash; drafter-kv.onnx over bound buffers: BoundDFlash,
BoundBatchDFlash), PARD chains (OnnxPARD, OnnxBatchPARD) and EAGLE-3 trees and chains
(OnnxEagle3, OnnxBatchEagle3); a batch over host caches keeps one row per sequence
(HostRows)."""

from __future__ import annotations


import numpy as np
import torch

from plugins.scaling import QueryScaling
from runtime.backends.roles import BlockPrefill, ChainDraft, ChainPrefill
from runtime.sampling import DraftVocab, log_softmax
from runtime.step_metadata import StepMetadata, padded, padded_context
from runtime.tree import grow_tree
from runtime.backends.onnxruntime.buffers import (BoundKVCache, HostKVCache, PREFILL_CHUNK,
                                                  buffer_dims, cache_dims, run_bound, takes_lengths,
                                                  window_feed)
from runtime.backends.onnxruntime.bound_rows import BoundRows, check_room, store

class OnnxDFlash:
    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None):
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.dims = cache_dims(session)
        self.feature_size = next(i.shape[-1] for i in session.get_inputs() if i.name == "context")
        self.cache: HostKVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = HostKVCache(capacity, *self.dims)

    def draft(self, context: torch.Tensor, bonus: int):
        meta = StepMetadata(self.cache.length, context.shape[0])
        block = np.asarray([[bonus] + [self.mask_token_id] * (self.block_size - 1)], dtype=np.int64)
        feeds = {"block_ids": block,
                 "context": np.ascontiguousarray(context.numpy(), dtype=np.float32)[None],
                 "context_lens": np.asarray([meta.new], dtype=np.int64),
                 "past_lens": np.asarray([meta.cached], dtype=np.int64)}
        logits, keys, values = self.session.run(None, feeds | self.cache.past())
        self.cache.append(keys, values)
        return torch.from_numpy(logits[0]), meta.block_keys(self.block_size)


class OnnxPARD:
    """A PARD drafter graph: [unread tokens, pard x (k - 1)] after the HostKVCache's
    committed tokens; logits of the last k rows; the real tokens' keys/values are kept."""

    def __init__(self, session, pard_token: int, max_drafts: int, scaling: QueryScaling | None):
        self.session, self.pard_token, self.scaling = session, pard_token, scaling
        self.max_drafts = max_drafts
        self.dims = cache_dims(session)
        self.cache: HostKVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = HostKVCache(capacity, *self.dims)

    def _step(self, row: list[int], logit_rows: int, keep: int):
        meta = StepMetadata(self.cache.length, len(row))
        feeds = {"ids": np.asarray([row], dtype=np.int64),
                 "logit_positions": np.arange(len(row) - logit_rows, len(row), dtype=np.int64),
                 "past_lens": np.asarray([meta.cached], dtype=np.int64)}
        logits, keys, values = self.session.run(None, feeds | self.cache.past())
        self.cache.append(keys[:keep], values[:keep])
        return torch.from_numpy(logits[0]), meta.causal_visible(len(row), 1)[0]

    def read(self, ids: list[int], features=None) -> None:
        # in PREFILL_CHUNK-token steps, as the target's prefill reads the prompt: each
        # step's scores are [chunk, past + chunk]
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = list(ids[start:start + PREFILL_CHUNK])
            self._step(chunk, 1, len(chunk))

    def draft(self, ids: list[int], features, k: int, sampler) -> ChainDraft:
        ids = list(ids)
        if len(ids) > PREFILL_CHUNK:  # a long first read that skipped read()
            self.read(ids[:-PREFILL_CHUNK])
            ids = ids[-PREFILL_CHUNK:]
        row = ids + [self.pard_token] * max(k - 1, 0)
        logits, visible = self._step(row, max(k, 1), len(ids))
        return ChainDraft.propose(logits[logits.shape[0] - k:], visible[len(row) - k:], sampler)


class HostRows:
    """A batch drafter's cache: one HostKVCache row per sequence (`lengths`: each row's
    committed length, fed as past_lens), joined from the single-sequence drafter
    (`self.single`) that read the sequence's prompt, rebuilt when a row joins or leaves."""

    cache: HostKVCache | None = None

    def _join_single(self) -> None:
        """Append the row `self.single` holds (a prompt it has just read)."""
        rows = self._rows() + [(self.single.cache.k[:, :, 0], self.single.cache.v[:, :, 0])]
        held = self.cache.capacity if self.cache is not None else 0
        self._rebuild(max(held, self.single.cache.capacity), rows)
        self.lengths.append(self.single.cache.length)

    def _rows(self):
        if self.cache is None:
            return []
        return [(self.cache.k[:, :, i], self.cache.v[:, :, i]) for i in range(len(self.lengths))]

    def _rebuild(self, capacity: int, rows: list) -> None:
        cache = HostKVCache(capacity, *self.single.dims, batch=len(rows))
        for i, (k, v) in enumerate(rows):
            cache.k[:k.shape[0], :, i] = k
            cache.v[:v.shape[0], :, i] = v
        self.cache = cache

    def remove(self, row: int) -> None:
        rows = self._rows()
        del rows[row], self.lengths[row]
        if rows:
            self._rebuild(self.cache.capacity, rows)
        else:
            self.cache = None


class OnnxBatchPARD(ChainPrefill, HostRows):
    """A PARD drafter graph over a batch (BatchChainDrafter): one HostKVCache row per
    sequence, each row's committed length fed as past_lens, so one run drafts every
    row's chain ([unread tokens, pard x (k - 1)], padded to the widest) at its own
    length, counts and beta. A sequence reads its prompt alone (OnnxPARD.read, whole or
    in parts: ChainPrefill), then joins. (EAGLE-3's chains batch the same way:
    OnnxBatchEagle3.)"""

    fused = True

    def __init__(self, session, pard_token: int, max_drafts: int, scaling: QueryScaling | None):
        self.single = OnnxPARD(session, pard_token, max_drafts, scaling)
        self.session, self.pard_token, self.scaling = session, pard_token, scaling
        self.max_drafts = max_drafts
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []

    def _reset(self, capacity: int):
        self.single.reset(capacity + self.max_drafts + 1)  # + a padded row's real tokens
        return self.single

    def _join_row(self) -> None:
        self._join_single()

    def draft(self, ids: list[list[int]], features, ks: list[int], samplers: list):
        if not any(ks):
            return [None] * len(ids)
        rows = [list(i) + [self.pard_token] * max(k - 1, 0) for i, k in zip(ids, ks)]
        width = max(len(row) for row in rows)
        meta = StepMetadata(torch.tensor(self.lengths), width)
        first = min(len(row) - k for row, k in zip(rows, ks) if k)  # the first row read
        ends = [n + len(i) for n, i in zip(self.lengths, ids)]
        if max(ends) > self.cache.capacity:
            raise ValueError(f"KV cache holds {self.cache.capacity} tokens; asked to write up to "
                             f"{max(ends)}")
        longest = max(self.lengths)
        feeds = {"ids": np.asarray(padded(rows), dtype=np.int64),
                 "logit_positions": np.arange(first, width, dtype=np.int64),
                 "past_keys": self.cache.k[:longest], "past_values": self.cache.v[:longest],
                 "past_lens": meta.cached.numpy()}
        logits, keys, values = self.session.run(None, feeds)
        for r, (start, end) in enumerate(zip(self.lengths, ends)):  # only the real tokens stay
            self.cache.k[start:end, :, r] = keys[:end - start, :, r]
            self.cache.v[start:end, :, r] = values[:end - start, :, r]
        self.lengths = ends
        visible = meta.causal_visible(width, len(rows))
        logits = torch.from_numpy(logits)
        return [ChainDraft.propose(logits[r, len(row) - k - first:len(row) - first],
                                   visible[r, len(row) - k:len(row)], sampler) if k else None
                for r, (row, k, sampler) in enumerate(zip(rows, ks, samplers))]

class OnnxEagle3:
    """EAGLE-3 drafting over an engine's two drafter graphs (build/export.py): `step`
    (Eagle3Step, causal) commits the entries of newly committed tokens; `tree`
    (Eagle3TreeStep) runs one level of a draft tree, or one link of a chain, in scratch
    past them. The HostKVCache holds the committed entries, then the scratch keys the
    current draft wrote (never committed: the next step overwrites them). The graphs
    return logits over the target's vocabulary (the draft vocabulary mapped in-graph)
    and each row's visible-key count N, the one the graph scaled by. Same roles as
    TorchEagle3 (TreeDrafter; ChainDrafter with top_k 1). Graphs that take past_lens
    (takes_lengths) are fed this sequence's committed length; older ones read it from
    the past's shape."""

    def __init__(self, step, tree, scaling: QueryScaling | None, shape, max_drafts: int):
        self.step_session, self.tree_session, self.scaling = step, tree, scaling
        self.tree, self.max_drafts = shape, max_drafts
        self.dims = cache_dims(step)
        self.cache: HostKVCache | None = None
        self.step_lengths, self.tree_lengths = takes_lengths(step), takes_lengths(tree)

    def _lengths(self, takes: bool) -> dict:
        """The past_lens feed of a graph that takes it: the committed entries."""
        return {"past_lens": np.asarray([self.cache.length], dtype=np.int64)} if takes else {}

    def reset(self, capacity: int) -> None:
        # + scratch past the committed entries, as TorchEagle3.reset sizes it
        self.cache = HostKVCache(capacity + max(self.tree.depth * self.tree.top_k,
                                                self.max_drafts), *self.dims)

    def _ingest(self, context: torch.Tensor, following: list[int]):
        feeds = {"ids": np.asarray([following], dtype=np.int64),
                 "features": np.ascontiguousarray(context.numpy(), dtype=np.float32)[None]}
        if self.step_lengths:
            feeds["context_lens"] = np.asarray([len(following)], dtype=np.int64)
        logits, state, visible, keys, values = self.step_session.run(
            None, feeds | self.cache.past() | self._lengths(self.step_lengths))
        self.cache.append(keys, values)
        return torch.from_numpy(logits[0]), torch.from_numpy(state[0]), int(visible[0, -1])

    def _level(self, tokens: list[int], hidden: torch.Tensor, ancestors: np.ndarray, offset: int):
        """Rows (tokens, parents' states [t, H]) at `offset` past the committed entries,
        seeing the scratch keys `ancestors` [t, S] marks (the first S scratch rows) and
        their own; their keys go to scratch rows S.. S + t."""
        cache, t, written = self.cache, len(tokens), ancestors.shape[1]
        start, end = cache.length + written, cache.length + written + t
        if end > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to {end}")
        feeds = {"ids": np.asarray([tokens], dtype=np.int64),
                 "hidden": np.ascontiguousarray(hidden.numpy(), dtype=np.float32)[None],
                 "ancestors": ancestors[None], "offsets": np.full((1, t), offset, dtype=np.int64),
                 "scratch_keys": cache.k[cache.length:start],
                 "scratch_values": cache.v[cache.length:start]}
        logits, state, visible, keys, values = self.tree_session.run(
            None, feeds | cache.past() | self._lengths(self.tree_lengths))
        cache.k[start:end], cache.v[start:end] = keys, values
        return torch.from_numpy(logits[0]), torch.from_numpy(state[0]), torch.from_numpy(visible[0])

    def read(self, ids: list[int], features: torch.Tensor) -> None:
        self._ingest(features, list(ids[-len(features):]))

    def draft_tree(self, context: torch.Tensor, following: list[int], shape=None):
        """As TorchEagle3.draft_tree: the tree and the most keys any drafter row saw."""
        logits, hidden, visible = self._ingest(context, following)
        largest = [visible]

        def expand(tokens, parent_hidden, scratch_mask, offset):
            written = scratch_mask.shape[1] - len(tokens)
            if not torch.equal(scratch_mask[:, written:], torch.eye(len(tokens), dtype=torch.bool)):
                raise ValueError("a tree level's rows see their own keys and no sibling's")
            out_logits, out_hidden, counts = self._level(
                tokens, parent_hidden, np.ascontiguousarray(scratch_mask[:, :written].numpy()),
                offset)
            largest.append(int(counts.max()))
            return log_softmax(out_logits, -1), out_hidden

        tree = grow_tree(following[-1], log_softmax(logits, -1), hidden, expand,
                         shape or self.tree, lambda indices: indices)  # target ids already
        return tree, max(largest)

    def draft(self, ids: list[int], features: torch.Tensor, k: int, sampler) -> ChainDraft:
        """As TorchEagle3.draft (the chain role): ingest, then k drafts, each link a tree
        level of one row that sees every earlier link."""
        logits, hidden, visible = self._ingest(features, list(ids[-len(features):]))

        def step(token, hidden, i):
            out, state, n = self._level(token, hidden[None], np.ones((1, i), dtype=bool), i)
            return out[0], state[0], int(n[0])

        return ChainDraft.grow(logits, hidden, visible, step, k, sampler)


class OnnxBatchEagle3(ChainPrefill, HostRows):
    """EAGLE-3 chains (top_k 1) over a batch (BatchChainDrafter), on graphs that take
    past_lens (takes_lengths): one HostKVCache row per sequence, each row's committed
    length fed as past_lens, as OnnxBatchPARD does. A step is one run of the causal
    step graph, ingesting every row's newly committed entries (padded to the longest,
    context_lens real), then one run of the tree graph per chain link for every row,
    each link a one-row tree level seeing its row's committed entries and every earlier
    link of its own chain: those links' keys are the scratch input, [links, layers,
    batch, ...], which the graph places after each row's own committed entries. So
    every row drafts at its own length, N and beta, each draft drawn by its row's own
    sampler (ChainDraft.grow_rows), as OnnxEagle3.draft drafts it alone. A sequence
    reads its prompt alone (OnnxEagle3.read, whole or in parts: ChainPrefill), then
    joins."""

    fused = True

    def __init__(self, step, tree, scaling: QueryScaling | None, shape, max_drafts: int):
        self.single = OnnxEagle3(step, tree, scaling, shape, max_drafts)
        self.step_session, self.tree_session, self.scaling = step, tree, scaling
        self.max_drafts = max_drafts
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []

    def _reset(self, capacity: int):
        self.single.reset(capacity)
        return self.single

    def _join_row(self) -> None:
        self._join_single()

    def draft(self, ids: list[list[int]], features: list[torch.Tensor], ks: list[int],
              samplers: list):
        if not any(ks):
            return [None] * len(ids)
        context, counts = padded_context(features)
        following = padded([list(i[len(i) - len(f):]) for i, f in zip(ids, features)])
        meta = StepMetadata(torch.tensor(self.lengths), counts)
        ends = meta.committed().tolist()
        if max(ends) > self.cache.capacity:
            raise ValueError(f"KV cache holds {self.cache.capacity} tokens; asked to write up to "
                             f"{max(ends)}")
        feeds = {"ids": np.asarray(following, dtype=np.int64),
                 "features": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                 "context_lens": counts.numpy(), "past_lens": meta.cached.numpy()}
        logits, state, visible, keys, values = self.step_session.run(
            None, feeds | self._past(max(self.lengths)))
        for r, (start, end) in enumerate(zip(self.lengths, ends)):  # only the real entries stay
            self.cache.k[start:end, :, r] = keys[:end - start, :, r]
            self.cache.v[start:end, :, r] = values[:end - start, :, r]
        self.lengths = ends
        last = visible[np.arange(len(ends)), counts.numpy() - 1]  # N of each row's draft 1
        past, lengths = self._past(max(ends)), np.asarray(ends, dtype=np.int64)
        links = [np.zeros((0,) + keys.shape[1:], keys.dtype)] * 2  # the chain's scratch keys

        def step(tokens, hidden, i):
            b = len(tokens)
            feeds = {"ids": np.asarray(tokens, dtype=np.int64)[:, None],
                     "hidden": np.ascontiguousarray(hidden.numpy(), dtype=np.float32)[:, None],
                     "ancestors": np.ones((b, 1, i), dtype=bool),
                     "offsets": np.full((b, 1), i, dtype=np.int64),
                     "scratch_keys": links[0], "scratch_values": links[1], "past_lens": lengths}
            out, state, n, k, v = self.tree_session.run(None, feeds | past)
            links[:] = np.concatenate([links[0], k]), np.concatenate([links[1], v])
            return (torch.from_numpy(out[:, 0]), torch.from_numpy(state[:, 0]),
                    torch.from_numpy(n[:, 0]))

        return ChainDraft.grow_rows(torch.from_numpy(logits), torch.from_numpy(state),
                                    torch.from_numpy(last), step, ks, samplers)

    def _past(self, longest: int) -> dict:
        """Every row's committed entries, padded to the `longest` (a view, no copy)."""
        return {"past_keys": self.cache.k[:longest], "past_values": self.cache.v[:longest]}

class OnnxBatchDFlash(BlockPrefill, HostRows):
    """A drafter graph over a batch: one HostKVCache row per sequence, `lengths` per row
    fed as past_lens and each step's context lengths as context_lens. A sequence reads
    its prompt's features alone (OnnxDFlash, whole or in parts: BlockPrefill), then joins."""

    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None):
        self.single = OnnxDFlash(session, block_size, mask_token_id, scaling, vocab)
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.cache: HostKVCache | None = None
        self.lengths: list[int] = []
        self.room = block_size

    def _join_row(self) -> None:
        self._join_single()

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        context, context_lens = padded_context(contexts)
        meta = StepMetadata(torch.tensor(self.lengths), context_lens)
        block = np.asarray([[b] + [self.mask_token_id] * (self.block_size - 1) for b in bonuses],
                           dtype=np.int64)
        longest = max(self.lengths)
        feeds = {"block_ids": block, "context": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                 "context_lens": context_lens.numpy(), "past_lens": meta.cached.numpy(),
                 "past_keys": self.cache.k[:longest], "past_values": self.cache.v[:longest]}
        logits, keys, values = self.session.run(None, feeds)
        for i, (start, c) in enumerate(zip(self.lengths, context_lens.tolist())):
            self.cache.k[start:start + c, :, i] = keys[:c, :, i]
            self.cache.v[start:start + c, :, i] = values[:c, :, i]
        self.lengths = meta.committed().tolist()
        return torch.from_numpy(logits), meta.block_keys(self.block_size)

class BoundDFlash:
    """drafter-kv.onnx for one sequence: its cache is a BoundKVCache whose buffers stay
    bound to the session and are only read; a step's new context keys/values land at
    the committed length, the block's are scratch the graph never returns, and a
    rollback is a length change. (drafter.onnx took the committed cache as an input
    and copied all of it several times per layer and step: 14.9 ms a step at 4,096
    tokens, where the arithmetic is ~2 ms.)"""

    STEP_OUTPUTS = ("logits", "new_keys", "new_values")

    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None,
                 window: int | None = None, reserve=None):
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.layers, self.kv_heads, self.head_dim = buffer_dims(session)
        self.feature_size = next(i.shape[-1] for i in session.get_inputs() if i.name == "context")
        self.cache: BoundKVCache | None = None
        self.window_feed = window_feed(session, window)
        self.reserve = reserve  # capacity -> the cache to read a prompt into (BoundSlots.reserve)

    def reset(self, capacity: int) -> None:
        self.cache = (self.reserve(capacity) if self.reserve is not None else
                      BoundKVCache(capacity, self.layers, self.kv_heads, self.head_dim))
        self.binding = self.cache.bind(self.session)

    def draft(self, context: torch.Tensor, bonus: int):
        cache = self.cache
        meta = StepMetadata(cache.length, context.shape[0])
        end = meta.committed()
        if end > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to {end}")
        feeds = {"block_ids": np.asarray([[bonus] + [self.mask_token_id] * (self.block_size - 1)],
                                         dtype=np.int64),
                 "context": np.ascontiguousarray(context.numpy(), dtype=np.float32)[None],
                 "context_lens": np.asarray([meta.new], dtype=np.int64),
                 "past_lens": np.asarray([meta.cached], dtype=np.int64)} | self.window_feed
        logits, keys, values = run_bound(self.session, self.binding, feeds, self.STEP_OUTPUTS)
        cache.k[:, :, :, meta.cached:end] = keys  # [layers, batch, kv_heads, new, head_dim]
        cache.v[:, :, :, meta.cached:end] = values
        cache.length = end
        return torch.from_numpy(logits[0]), meta.block_keys(self.block_size)


class BoundBatchDFlash(BlockPrefill, BoundRows):
    """drafter-kv.onnx over a batch (BoundRows), each group's `lengths` fed as past_lens
    and its rows' context lengths as context_lens. A sequence reads its prompt's
    features alone (BoundDFlash, whole or in parts: BlockPrefill), then joins. With a
    `window` (a graph that takes one: has_window), the graph gives each row the last
    `window` of its own context keys from its own past_lens + context_lens
    (StepMetadata.block_window), so the window modes draft in one pass too. Like the
    target's, a prompt is read straight into the buffer row it joins as
    (BoundSlots.reserve)."""

    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None,
                 window: int | None = None):
        self.single = BoundDFlash(session, block_size, mask_token_id, scaling, vocab, window,
                                  reserve=self._reserve)
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.lengths: list[int] = []
        self._slots()

    def _join_row(self) -> None:
        self._join(self.single.cache)

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        """One pass per group, its rows' contexts padded to its longest (an empty context,
        [0, F], adds nothing to its row's cache)."""
        logits = None
        for group in self.groups:
            context, context_lens = padded_context([contexts[r] for r in group.members])
            meta = StepMetadata(torch.tensor(self._group_lengths(group)), context_lens)
            check_room(group, meta.committed().tolist())
            block = np.asarray([[bonuses[r]] + [self.mask_token_id] * (self.block_size - 1)
                                for r in group.members], dtype=np.int64)
            feeds = {"block_ids": block,
                     "context": np.ascontiguousarray(context.numpy(), dtype=np.float32),
                     "context_lens": context_lens.numpy(), "past_lens": meta.cached.numpy()}
            out, keys, values = run_bound(self.session, group.binding,
                                          feeds | self.single.window_feed, BoundDFlash.STEP_OUTPUTS)
            store(group, meta.cached.tolist(), keys, values, context_lens.tolist())
            if logits is None:
                logits = np.zeros((len(contexts),) + out.shape[1:], np.float32)
            logits[group.members] = out
        meta = StepMetadata(torch.tensor(self.lengths),
                            torch.tensor([c.shape[0] for c in contexts], dtype=torch.long))
        self.lengths = meta.committed().tolist()
        return torch.from_numpy(logits), meta.block_keys(self.block_size)
