"""Compiled fixed-shape steps for the torch backend, in gpt-fast's manner: KV buffers
preallocated on the model's device, each step a plain function over the models (the
target's verify, the DFlash block, the PARD chain, EAGLE-3's ingest, link and tree level)
and one `torch.compile(fullgraph=True)` graph per step shape (slot count, row width and
capacity bucket), on CUDA replayed as CUDA graphs (mode="reduce-overhead"); prefill stays eager.

Lengths enter a step as device tensors ([batch] int64), never as Python ints, so one graph
serves every position: only the shapes (slot count, row width, buffer capacity) pick a
graph. The models' own forwards run unchanged over `StaticView`, a KVCache whose write is
a scatter at per-sequence positions (no host read) and whose attention spans the whole
buffer, bounded per row by the visible counts of runtime/step_metadata.py; attention goes
through `sharpdraft::attention` as everywhere else (on CUDA the op must be capturable: no
host read of the counts inside it). CompiledBatchTarget, CompiledBatchDFlash,
CompiledBatchPARD and CompiledBatchEagle3 are the eager batch roles (eager.py) over
slotted fixed-shape buffers (FixedSlots), a graph per slot count, row width and capacity
bucket; a step no row width covers (a long catch-up context), a prompt's prefill and a
draft tree's verify run eagerly on the very same buffers. A request alone is a batch of
one.

What a request does not own belongs to the loaded engine (EngineSteps, held by
TorchLoaded): the compiled step functions (their CUDA graphs), the staging tensors a step
reads, and a pool of KV buffers that roles lease for a request and give back, so the
engine's second request, on any role it hands out, compiles and captures nothing.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from plugins.scaling import QueryScaling
from runtime.backends import STEPS  # noqa: F401 -- compile_step's backends
from runtime.backends.roles import TokenRows
from runtime.backends.pytorch.eager import (TorchBatchDFlash, TorchBatchEagle3, TorchBatchPARD,
                                            TorchBatchTarget, eagle3_entries, scatter_rows)
from runtime.chain import ChainDraft
from runtime.backends.slots import FixedSlots
from runtime.models.dflash import DFlashDrafter, DraftHead
from runtime.models.eagle3 import Eagle3Drafter
from runtime.models.pard import PARDDrafter
from runtime.models.layers import KVCache
from runtime.models.target import ModelError, TargetModel
from runtime.step_metadata import StepMetadata, capacity_bucket
from runtime.sampling import log_softmax
from runtime.tree import DraftTree, TreeShape, group_shapes, grow_trees, pack



# -- the compiled steps -------------------------------------------------------------------

class StaticView(KVCache):
    """A step's view of preallocated buffers: k, v one [batch, kv_heads, capacity, d]
    tensor per layer (views of a KVCache's, KVCache.layers), `lengths` [batch] the cached
    tokens of each sequence, a device tensor. A write puts the step's keys at lengths + i
    (past the committed length they are scratch, as in KVCache) and hands back the whole
    layer buffer: the visible counts bound each row, so the attended shape never depends
    on a length. One tensor per layer, written by index_put_: inductor then writes in
    place (a scatter into a view of one all-layer tensor copied the whole cache per layer
    on CPU, 3x a step's time)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor):
        # no KVCache.__init__: the buffers exist; nothing here allocates
        self.k, self.v, self.lengths = k, v, lengths
        self.capacity, self.length = k[0].shape[2], 0

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor):
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        at = start[:, None] + torch.arange(k.shape[2], device=k.device)
        self.k[layer][rows, :, at] = k.transpose(1, 2)  # [b, t] x heads: [b, t, heads, d]
        self.v[layer][rows, :, at] = v.transpose(1, 2)
        return self.k[layer], self.v[layer]


def layers(cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A KVCache's buffers as one view per layer (what StaticView writes in place)."""
    # select, not unbind: unbind's views may not be written in place outside inference mode
    return [cache.k[i] for i in range(cache.k.shape[0])], [cache.v[i] for i in range(cache.v.shape[0])]


# The steps: plain functions over the models (closures), each reading its KV buffers (a
# tensor per layer, written in place: the arguments at the step's STATIC positions) and
# its other inputs, the lengths among them, as tensors. compile_step compiles one; the
# function itself is the step run eagerly where no graph fits.
TARGET_STATIC = (1, 2)  # target_forward's k, v


def target_forward(model: TargetModel, feature_layers=()):
    """The target over `ids` [b, t] after `cached` [b] tokens: logits [b, t, vocab] and
    the drafter's features [b, t, F] (None without feature layers)."""
    feature_layers = tuple(feature_layers)

    def target(ids, k, v, cached):
        h, features = model.final_hidden(ids, StaticView(k, v, cached), feature_layers)
        return model.lm_head(h), features
    return target


DFLASH_STATIC = (2, 3)  # dflash_forward's k, v


def dflash_forward(drafter: DFlashDrafter, embed: nn.Embedding, head: DraftHead,
                   scaling: QueryScaling | None, window: int | None):
    """The DFlash drafter's block after `cached` [b] keys and `context` [b, c, F] features
    of which the first context_lens [b] are real: logits of the block's draft rows
    [b, block - 1, columns] over the drafter's head."""

    def dflash_block(block_ids, context, k, v, cached, context_lens):
        hidden, _ = drafter(embed(block_ids), context, StaticView(k, v, cached), scaling,
                            context_lens=context_lens, window=window)
        return head(hidden[:, 1:])
    return dflash_block


PARD_STATIC = (1, 2)  # pard_forward's k, v


def pard_forward(drafter: PARDDrafter, scaling: QueryScaling | None, vocab_size: int):
    """The PARD drafter over `ids` [b, t] (the unread tokens, the newest, pard tokens,
    then padding: past every real row, so causally unseen) after `cached` [b] keys:
    logits over the target's `vocab_size` ids [b, t, vocab] and each row's visible-key
    count [b, t]."""

    def pard_chain(ids, k, v, cached):
        hidden, visible = drafter(ids, StaticView(k, v, cached), scaling)
        return drafter.logits(hidden, vocab_size), visible
    return pard_chain


EAGLE3_STATIC = (2, 3)  # eagle3_forward's k, v


def eagle3_forward(drafter: Eagle3Drafter, scaling: QueryScaling | None, ingest: bool):
    """The EAGLE-3 drafter's causal rows (token ids [b, t] and the state each reads: the
    target's features [b, t, F], projected here (`ingest`: a step's newly committed
    entries), or a chain link's own state [b, t, H]) after `cached` [b] entries:
    draft-vocabulary logits [b, t, V], the state each row hands on [b, t, H] and each
    row's visible-key count [b, t]."""

    def eagle3_ingest(ids, features, k, v, cached):
        return drafter(ids, drafter.project(features), StaticView(k, v, cached), scaling)

    def eagle3_link(ids, state, k, v, cached):
        return drafter(ids, state, StaticView(k, v, cached), scaling)
    return eagle3_ingest if ingest else eagle3_link


EAGLE3_LEVEL_STATIC = (4, 5)  # eagle3_level_forward's k, v


def eagle3_level_forward(drafter: Eagle3Drafter, scaling: QueryScaling | None):
    """One level of every row's EAGLE-3 draft tree: nodes (token ids [b, t], their
    parents' states [b, t, H]) at `offsets` [b, t] past each row's `cached` [b] entries,
    each seeing its committed entries and the scratch keys scratch_mask [b, t, s] allows
    (earlier levels' keys right after its committed ones, then the level's own: its
    ancestors and itself); the level's keys land after the earlier levels'. N per node
    from StepMetadata.tree_rows, over the whole buffer (past_width: the buffer less the
    scratch, so no length is read): draft-vocabulary logits [b, t, V], states [b, t, H]
    and N [b, t]."""

    def eagle3_level(ids, state, scratch_mask, offsets, k, v, cached):
        view = StaticView(k, v, cached)
        view.past_width = view.capacity - scratch_mask.shape[-1]
        return drafter(ids, state, view, scaling, tree=(scratch_mask, offsets))
    return eagle3_level


def compile_step(step, static: tuple[int, ...], device: torch.device, backend: str = "inductor"):
    """A step function compiled. backend "inductor": torch.compile(fullgraph=True), one
    graph per input shape (dynamic=False: a new shape is a new graph, a new length is
    not), replayed as CUDA graphs on CUDA (mode="reduce-overhead"); "eager": dynamo alone
    (the graph-break and recompile checks, in seconds); "cudagraph": no compiler, the
    eager step captured as a CUDA graph per shape (captured: seconds to make, where
    inductor takes minutes). `static`: the positions of the step's KV buffer arguments
    (read and written in place: a capture keys on their addresses, never copies them)."""
    from plugins.attention import register

    register()  # the op must exist before dynamo meets it (or a capture runs it)
    if backend == "cudagraph":
        if device.type != "cuda":
            raise ModelError("CUDA graphs need a CUDA device — use backend inductor on CPU")
        return captured(step, static)
    # one graph per (slot count, row width, capacity bucket): more than dynamo's
    # default 8 entries per code object, all of them expected
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    return torch.compile(step, fullgraph=True, dynamic=False, backend=backend, mode=mode)


def captured(step, static: tuple[int, ...]):
    """`step` run eagerly, captured as one CUDA graph per input shapes and KV buffer
    addresses (its `static` arguments: read and written in place, never copied); the
    other inputs are copied into the graph's own before each replay, and the outputs are
    the graph's (overwritten by its next replay: callers clone)."""
    static, graphs = set(static), {}

    def replay(*args):
        key = capture_key(static, args)
        if key not in graphs:
            inputs = [a if i in static else a.clone() for i, a in enumerate(args)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, autotune)
                step(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = step(*inputs)
            graphs[key] = (graph, inputs, outputs)
        graph, inputs, outputs = graphs[key]
        for i, a in enumerate(args):
            if i not in static:
                inputs[i].copy_(a, non_blocking=True)
        graph.replay()
        return outputs
    return replay


def capture_key(static, args) -> tuple:
    """What picks a step's CUDA graph (captured): the addresses of its `static`
    arguments (the KV buffers, read and written in place) and the shapes and dtypes of
    the rest (copied in). A call with a key not seen before captures a graph."""
    return tuple(tuple(t.data_ptr() for t in a) if i in static else (tuple(a.shape), a.dtype)
                 for i, a in enumerate(args))


def static_capacity(needed: int, limit: int) -> int:
    """Buffer capacity for `needed` tokens: the next power of two (the batched backends'
    capacity_bucket), but no more than `limit` when that covers the need, so a request at
    the model's full context does not attend over twice its keys. Few capacities, few
    graphs: the capacity is part of a step's shape."""
    rounded = 1 << capacity_bucket(needed)
    return needed if needed > limit else min(rounded, limit)


def width_for(width: int, widths: tuple[int, ...]) -> int | None:
    """The smallest of a step's compiled row `widths` that holds `width` tokens, or None
    (run it eagerly)."""
    return next((w for w in widths if w >= width), None)


def bind(cache: KVCache) -> KVCache:
    """A cache's per-layer views for the steps (StaticView); on CUDA its buffers marked as
    static addresses, so compiled CUDA graphs read them in place."""
    cache.layers = layers(cache)
    if cache.k.is_cuda:
        for t in cache.layers[0] + cache.layers[1]:
            torch._dynamo.mark_static_address(t)
    return cache


class BufferPool:
    """KV buffers by shape, leased for a request and given back after it. A CUDA graph
    reads fixed addresses: the engine's next request finds buffers its steps have
    captured already (their stale keys lie past its lengths, unread), and memory does not
    grow with the requests served. make(capacity, slots): a KVCache of `capacity` keys,
    one sequence (slots None) or `slots` rows at their own lengths."""

    def __init__(self, make):
        self.make, self.free, self.made = make, {}, 0

    def take(self, capacity: int, slots: int | None = None) -> KVCache:
        free = self.free.get((capacity, slots))
        if free:
            cache = free.pop()
        else:
            with torch.inference_mode(False):  # see EngineSteps.staging
                cache = bind(self.make(capacity, slots))
            self.made += 1
        cache.length = 0
        if cache.lengths is not None:
            cache.lengths.zero_()
        return cache

    def give(self, cache: KVCache) -> None:
        slots = None if cache.lengths is None else cache.k.shape[1]
        self.free.setdefault((cache.capacity, slots), []).append(cache)

    def lease(self, owner, capacity: int, slots: int | None = None):
        """Buffers for `owner` and the lease that gives them back: call it (the owner's
        next request), or it runs when the owner is gone (a row that left the batch)."""
        cache = self.take(capacity, slots)
        return cache, weakref.finalize(owner, self.give, cache)


class EngineSteps:
    """The compiled steps of one loaded engine (TorchLoaded with `steps`), shared by every
    role it hands out, request after request: one target step (every width, batch and
    capacity bucket a graph of it), one DFlash block step per (scaling, window), the
    staging tensors they read, and pools of KV buffers roles lease per request. Each
    graph is made by the first request that needs its shape; no later one compiles or
    captures it again."""

    def __init__(self, model: TargetModel, feature_layers=(), widths=(1,), backend: str = "inductor",
                 drafter: DFlashDrafter | None = None, context_span: int | None = None,
                 context_limit: int | None = None):
        self.model, self.feature_layers = model, tuple(feature_layers)
        self.context_limit = context_limit  # its batch targets' (None: the target's positions)
        self.widths, self.backend = tuple(sorted(set(widths))), backend
        self.device = model.embed_tokens.weight.device
        # the target step eagerly (rows wider than every compiled width), and compiled
        self.target_module = target_forward(model, self.feature_layers)
        self.target_step = compile_step(self.target_module, TARGET_STATIC, self.device, backend)
        self.target_buffers = BufferPool(
            lambda capacity, slots: model.new_cache(capacity) if slots is None
            else model.new_cache(capacity, batch=slots, per_sequence=True))
        self.drafter, self._drafts, self._staging = drafter, {}, {}
        if isinstance(drafter, (PARDDrafter, Eagle3Drafter)):  # chain drafters
            self.chain_buffers = BufferPool(
                lambda capacity, slots: drafter.new_cache(capacity) if slots is None
                else drafter.new_cache(capacity, batch=slots, per_sequence=True))
        if isinstance(drafter, DFlashDrafter):
            self.head = DraftHead.for_drafter(drafter, model.lm_head)
            block = self.block_size = drafter.config.block_size
            # a step's context: the tokens one verify committed (a block's, or a lookup's)
            self.context_span = context_span or max(block, self.widths[-1])
            # drafter.new_cache adds the block's scratch; a pool's capacity is the whole
            self.draft_buffers = BufferPool(
                lambda capacity, slots: drafter.new_cache(capacity - block) if slots is None
                else drafter.new_cache(capacity - block, batch=slots, per_sequence=True))

    def draft_step(self, scaling: QueryScaling | None, window: int | None):
        """The drafter's block step under `scaling` and `window`: (the step function, run
        eagerly where no graph fits, and its compiled form)."""
        key = (scaling, window)
        if key not in self._drafts:
            step = dflash_forward(self.drafter, self.model.embed_tokens, self.head, scaling, window)
            self._drafts[key] = step, compile_step(step, DFLASH_STATIC, self.device, self.backend)
        return self._drafts[key]

    def chain_step(self, scaling: QueryScaling | None):
        """The PARD drafter's step under `scaling`: (the step function, its compiled form)."""
        key = ("chain", scaling)
        if key not in self._drafts:
            step = pard_forward(self.drafter, scaling, self.model.config.vocab_size)
            self._drafts[key] = step, compile_step(step, PARD_STATIC, self.device, self.backend)
        return self._drafts[key]

    def eagle3_step(self, scaling: QueryScaling | None, ingest: bool):
        """The EAGLE-3 drafter's step under `scaling`, ingesting target features or
        running a chain link: (the step function, its compiled form)."""
        key = ("eagle3", scaling, ingest)
        if key not in self._drafts:
            step = eagle3_forward(self.drafter, scaling, ingest)
            self._drafts[key] = step, compile_step(step, EAGLE3_STATIC, self.device, self.backend)
        return self._drafts[key]

    def eagle3_level_step(self, scaling: QueryScaling | None):
        """The EAGLE-3 drafter's tree-level step under `scaling`: (the step function, its
        compiled form; a graph per level, whose scratch width is part of its shape)."""
        key = ("eagle3-level", scaling)
        if key not in self._drafts:
            step = eagle3_level_forward(self.drafter, scaling)
            self._drafts[key] = step, compile_step(step, EAGLE3_LEVEL_STATIC, self.device,
                                                   self.backend)
        return self._drafts[key]

    def staging(self, name: str, shape: tuple, dtype=torch.long, fill=0) -> torch.Tensor:
        """A step input the roles fill before each call: one tensor per engine and shape (a
        step runs at a time, its outputs cloned), so a CUDA graph sees one address. Step
        inputs and KV buffers are made outside inference mode whoever asks first: dynamo
        guards on the difference, and a graph made for one kind would not serve the other."""
        key = (name, tuple(shape), dtype)
        if key not in self._staging:
            with torch.inference_mode(False):
                t = self._staging[key] = torch.full(shape, fill, dtype=dtype, device=self.device)
            if self.device.type == "cuda":
                torch._dynamo.mark_static_address(t)
        return self._staging[key]

    # the roles, as TorchLoaded hands them out
    def batch_target(self) -> "CompiledBatchTarget":
        return CompiledBatchTarget(self)

    def batch_dflash(self, scaling: QueryScaling | None) -> "CompiledBatchDFlash":
        return CompiledBatchDFlash(self, scaling)

    def batch_pard(self, scaling: QueryScaling | None, max_drafts: int) -> "CompiledBatchPARD":
        return CompiledBatchPARD(self, scaling, max_drafts)

    def batch_eagle3(self, scaling: QueryScaling | None, max_drafts: int,
                     tree: TreeShape | None = None) -> "CompiledBatchEagle3":
        return CompiledBatchEagle3(self, scaling, max_drafts, tree)


# -- batched: rows in fixed-shape buffers (runtime/backends/slots.py: FixedSlots) --------

class CompiledBatchTarget(TorchBatchTarget):
    """TorchBatchTarget whose verify runs the engine's compiled target step, one call per
    group: every slot's row padded to the compiled row width that holds the group's
    widest (the engine's widths; wider runs the step eagerly). A joining prompt prefills as
    TorchBatchTarget's does, whole (add) or in chunks between the batch's steps (prefill
    / prefill_more, then join_prefilled: Decoder.join), eagerly on a cache of its own --
    a prefill is compute-bound, and a graph per chunk length would compile one per
    prompt -- then copies into its slot; no step shape depends on how it was chunked."""

    def __init__(self, steps: EngineSteps):
        super().__init__(steps.model, steps.feature_layers, steps.context_limit)
        self.steps, self.step = steps, steps.target_step
        self.caches = FixedSlots(steps.target_buffers)

    @torch.inference_mode()
    def verify(self, rows: TokenRows):
        width, logits, features = rows.width, None, None
        lengths = rows.lengths
        for group in self.caches.groups:
            t = int(lengths[group.members].max())
            padded, step = width_for(t, self.steps.widths), self.step
            if padded is None or max(group.lengths) + padded > group.cache.capacity:
                padded, step = t, self.steps.target_module
            x = self.steps.staging("target.ids", (len(group.lengths), padded))
            x.copy_(slot_rows(group, rows, padded))
            part_logits, part_features = step(x, *group.cache.layers, group.cache.lengths)
            # indexing copies: a CUDA graph's outputs are overwritten by its next replay
            logits = scatter_rows(logits, part_logits[group.slots, :t], group.members, len(rows), width)
            if part_features is not None:
                features = scatter_rows(features, part_features[group.slots, :t], group.members,
                                        len(rows), width)
            for slot in group.slots:  # as the eager pass: every row past its group's widest
                group.lengths[slot] += t
            group.sync()
        return logits, features

    @torch.inference_mode()
    def verify_trees(self, trees: list[DraftTree]):
        """Every row's draft tree packed in one pass per group (TorchBatchTarget's, run
        eagerly: a tree's mask changes every step) over the group's slotted buffers, each
        node at its row's length + depth, idle slots a lone root (padding, never read).
        The nodes' keys are scratch past each row's committed ones until keep_paths."""
        out = [None] * len(trees)
        for group in self.caches.groups:
            slotted = [DraftTree.root_only(0)] * len(group.lengths)
            for r, slot in zip(group.members, group.slots):
                slotted[slot] = trees[r]
            ids, mask, depths = pack(slotted, self.steps.device)
            self.caches.reserve(group, max(group.lengths) + ids.shape[1])
            logits, features = self.model(ids, group.cache, self.feature_layers, tree=(mask, depths))
            for r, slot in zip(group.members, group.slots):
                n = len(trees[r])
                out[r] = (logits[slot, :n], None if features is None else features[slot, :n])
        return out

    @torch.inference_mode()
    def keep_paths(self, paths: TokenRows) -> None:
        """Commit each row's accepted path (node indices, root first) of its verified tree
        (KVCache.keep_each over the slots; an idle slot keeps nothing)."""
        for group in self.caches.groups:
            slotted = [[] for _ in group.lengths]
            for r, slot in zip(group.members, group.slots):
                slotted[slot] = paths.row(r).tolist()
                group.lengths[slot] += len(slotted[slot])
            lengths = group.cache.lengths  # the tensor every step reads: kept, refilled by sync
            group.cache.keep_each(slotted)
            group.cache.lengths = lengths
            group.sync()


class CompiledBatchDFlash(TorchBatchDFlash):
    """TorchBatchDFlash whose draft runs the engine's compiled block step, one call per
    group: every slot's context padded to the engine's context span (a longer one runs
    the step eagerly), context_lens saying how many rows are real."""

    def __init__(self, steps: EngineSteps, scaling: QueryScaling | None):
        super().__init__(steps.drafter, steps.model, scaling)
        self.steps, self.context_span = steps, steps.context_span
        self.eager, self.step = steps.draft_step(scaling, None)
        # room: a padded context's rows past a sequence's budget (its cache holds the block's)
        self.caches = FixedSlots(steps.draft_buffers, room=self.context_span)

    @torch.inference_mode()
    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        logits = None
        visible = torch.zeros(len(contexts), dtype=torch.long)
        for group in self.caches.groups:
            c = max(len(contexts[r]) for r in group.members)
            width, step = self.context_span, self.step
            if c > width:
                width, step = c, self.eager
            slots, staging = len(group.lengths), self.steps.staging
            context = staging("dflash.context", (slots, width, self.drafter.fc.in_features),
                              contexts[0].dtype)
            context.zero_()
            lens, block = [0] * slots, [[self.mask_token_id] * self.block_size for _ in range(slots)]
            for r, slot in zip(group.members, group.slots):
                context[slot, :len(contexts[r])] = contexts[r]
                lens[slot], block[slot][0] = len(contexts[r]), bonuses[r]
            ids = staging("dflash.block", (slots, self.block_size), fill=self.mask_token_id)
            ids.copy_(torch.tensor(block))
            context_lens = staging("dflash.context_lens", (slots,))
            context_lens.copy_(torch.tensor(lens))
            part = step(ids, context, *group.cache.layers, group.cache.lengths, context_lens)
            logits = scatter_rows(logits, part[group.slots], group.members, len(contexts),
                                  self.block_size - 1)
            meta = StepMetadata(torch.tensor(group.lengths), torch.tensor(lens))
            keys = meta.block_keys(self.block_size)
            visible[group.members] = keys[group.slots]
            for slot in group.slots:
                group.lengths[slot] += lens[slot]
            group.sync()
        return logits, visible


def chain_widths(max_drafts: int) -> tuple[int, ...]:
    """The compiled row widths of a chain drafter's step (CompiledBatchPARD's): a row that accepted
    little (max_drafts), or every draft and the bonus read with k drafted (2 x max_drafts)."""
    return tuple(sorted({max(max_drafts, 1), 2 * max(max_drafts, 1)}))


def slot_rows(group, rows: TokenRows, width: int) -> torch.Tensor:
    """Each member's row of ids in its slot, padded at its end to `width`: [slots, width];
    idle slots all padding (their outputs are never read)."""
    out = torch.zeros(len(group.lengths), width, dtype=torch.long)
    out[group.slots] = rows.padded(group.members, width)
    return out


class CompiledBatchPARD(TorchBatchPARD):
    """TorchBatchPARD whose draft runs the engine's compiled chain step, one call per
    group (FixedSlots: a graph per slot count, row width and capacity bucket): every slot's
    row [unread tokens, the newest, pard x (k - 1)] padded at its end to the compiled
    row width that holds the group's widest (chain_widths; wider runs the step eagerly). The pard
    rows' keys and the padding's lie past each row's committed tokens, as scratch."""

    def __init__(self, steps: EngineSteps, scaling: QueryScaling | None, max_drafts: int):
        super().__init__(steps.drafter, steps.model.config.vocab_size, max_drafts, scaling)
        self.steps = steps
        self.eager, self.step = steps.chain_step(scaling)
        self.widths = chain_widths(max_drafts)
        self.caches = FixedSlots(steps.chain_buffers, room=self.widths[-1])

    @torch.inference_mode()
    def draft(self, ids: TokenRows, features, ks: list[int], samplers: list):
        drafts = [None] * len(ids)
        # each row's [unread tokens, pard x (k - 1)]
        rows = ids.extended((torch.tensor(ks, dtype=torch.long) - 1).clamp(min=0), self.pard_token)
        ends, counts = rows.lengths.tolist(), ids.lengths.tolist()
        for group in self.caches.groups:
            if not any(ks[r] for r in group.members):
                continue
            t = max(ends[r] for r in group.members)
            width, step = width_for(t, self.widths), self.step
            if width is None or max(group.lengths) + width > group.cache.capacity:
                width, step = t, self.eager
            x = self.steps.staging("pard.ids", (len(group.lengths), width))
            x.copy_(slot_rows(group, rows, width))
            logits, visible = step(x, *group.cache.layers, group.cache.lengths)
            for r, slot in zip(group.members, group.slots):
                if ks[r]:
                    end = ends[r]
                    first = end - ks[r]  # the newest real token's row, then the pard rows
                    # clone: a CUDA graph's outputs are overwritten by its next replay
                    drafts[r] = ChainDraft.propose(logits[slot, first:end].clone(),
                                                   visible[slot, first:end].clone(), samplers[r])
                group.lengths[slot] += counts[r]  # the real tokens' keys; the rest scratch
            group.sync()
        return drafts


class CompiledBatchEagle3(TorchBatchEagle3):
    """TorchBatchEagle3 whose passes run the engine's compiled EAGLE-3 steps, per group
    (FixedSlots): one ingest of every slot's newly committed entries, padded at its end to
    the compiled row width that holds the group's longest (1, or every draft and the bonus:
    max_drafts + 1; longer runs eagerly), then one link step [slots, 1] per chain link, or
    one level step [slots, top_k] per tree level (a graph per level). The links and levels
    are scratch past each row's committed entries, as the eager drafter leaves them; the
    host lengths go back to the committed ones after a chain."""

    def __init__(self, steps: EngineSteps, scaling: QueryScaling | None, max_drafts: int,
                 tree: TreeShape | None = None):
        super().__init__(steps.drafter, scaling, max_drafts, tree)
        self.steps = steps
        self.ingest_eager, self.ingest = steps.eagle3_step(scaling, ingest=True)
        _, self.link = steps.eagle3_step(scaling, ingest=False)
        self.level = steps.eagle3_level_step(scaling)[1] if tree is not None else None
        self.widths = (1, max_drafts + 1)
        self.caches = FixedSlots(steps.chain_buffers, room=self.widths[-1] + max_drafts)

    def _ingest_group(self, group, entries: TokenRows, features: list[torch.Tensor]):
        """The ingest step over the group's slots (TorchBatchEagle3._ingest's pass; `entries`:
        each row's ids paired with its features, eagle3_entries), its host lengths then the
        committed ones: each member's newest entry's logits, state and N, and the committed
        lengths per slot."""
        staging = self.steps.staging
        slots, at = len(group.lengths), group.slots
        counts = {r: len(features[r]) for r in group.members}
        c = max(counts.values())
        width, step = width_for(c, self.widths), self.ingest
        if width is None or max(group.lengths) + width + self.max_drafts > group.cache.capacity:
            width, step = c, self.ingest_eager
        x = staging("eagle3.ids", (slots, width))
        x.copy_(slot_rows(group, entries, width))
        context = staging("eagle3.context", (slots, width, features[0].shape[-1]),
                          features[0].dtype)
        context.zero_()
        for r, slot in zip(group.members, at):
            context[slot, :counts[r]] = features[r]
        logits, hidden, visible = step(x, context, *group.cache.layers, group.cache.lengths)
        last = torch.tensor([counts[r] - 1 for r in group.members])  # each row's newest entry
        committed = list(group.lengths)
        for r, slot in zip(group.members, at):
            committed[slot] += counts[r]
        group.lengths = list(committed)
        group.sync()
        # indexing copies: a CUDA graph's outputs are overwritten by its next replay
        return logits[at, last], hidden[at, last], visible[at, last], committed

    @torch.inference_mode()
    def draft(self, ids: TokenRows, features: list[torch.Tensor], ks: list[int],
              samplers: list):
        drafts = [None] * len(ids)
        staging = self.steps.staging
        entries = eagle3_entries(ids, features)
        for group in self.caches.groups:
            if not any(ks[r] for r in group.members):
                continue
            slots, at = len(group.lengths), group.slots
            logits, hidden, visible, committed = self._ingest_group(group, entries, features)

            def link(tokens, hidden, i):
                x = staging("eagle3.link", (slots, 1))
                x.zero_()
                x[at, 0] = torch.tensor(tokens, dtype=torch.long, device=x.device)
                state = staging("eagle3.state", (slots, 1, hidden.shape[-1]), hidden.dtype)
                state.zero_()
                state[at, 0] = hidden
                out, new, n = self.link(x, state, *group.cache.layers, group.cache.lengths)
                for slot in at:  # the next link reads this one's key
                    group.lengths[slot] += 1
                group.sync()
                return out[at, -1], new[at, -1], n[at, -1]

            grown = ChainDraft.grow_rows(logits, hidden, visible, link,
                                         [ks[r] for r in group.members],
                                         [samplers[r] for r in group.members],
                                         self.vocab.target_logits)
            group.lengths = committed  # the links are scratch
            group.sync()
            for r, draft in zip(group.members, grown):
                drafts[r] = draft
        return drafts

    @torch.inference_mode()
    def draft_trees(self, ids: TokenRows, features: list[torch.Tensor],
                    shapes: list[TreeShape | None]):
        trees = [None] * len(ids)
        staging = self.steps.staging
        entries = eagle3_entries(ids, features)
        for group in self.caches.groups:
            shaped = group_shapes(shapes, group.members)
            if shaped is None:
                continue
            slots, at = len(group.lengths), group.slots
            logits, hidden, visible, _ = self._ingest_group(group, entries, features)

            def expand(tokens, parent_hidden, scratch_mask, offset):
                t, s = scratch_mask.shape[1:]
                x = staging("eagle3.level.ids", (slots, t))
                x.zero_()
                x[at] = torch.tensor(tokens, dtype=torch.long, device=x.device)
                state = staging("eagle3.level.state", (slots, t, parent_hidden.shape[-1]),
                                parent_hidden.dtype)
                state.zero_()
                state[at] = parent_hidden
                # an idle slot's nodes see themselves (padding, never read)
                mask = staging("eagle3.level.mask", (slots, t, s), torch.bool)
                mask.zero_()
                mask[:, :, s - t:] = torch.eye(t, dtype=torch.bool)  # the level's own keys: last
                mask[at] = scratch_mask
                offsets = staging("eagle3.level.offsets", (slots, t))
                offsets.fill_(offset)
                out, new, n = self.level(x, state, mask, offsets, *group.cache.layers,
                                         group.cache.lengths)
                return log_softmax(out[at], -1), new[at], n[at]

            grown = grow_trees(ids.last[group.members].tolist(), log_softmax(logits, -1),
                               hidden, visible.tolist(), expand, shaped, self.vocab.to_target)
            for r, tree in zip(group.members, grown):
                if shapes[r] is not None:
                    trees[r] = tree
        return trees
