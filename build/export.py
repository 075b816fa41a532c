"""torch -> ONNX: the target step graphs and the drafter step graphs (DFlash, PARD, EAGLE-3) of an engine.

Graphs are traced from the same torch modules the torch backend runs, through a cache
stand-in (the `attend`/`write` methods of KVCache), never rewritten here. Their weights
go to one external-data file, weights.bin, each distinct tensor once (share_weights).

- target.onnx and the drafter graphs take their KV cache as an input, sequence-major
  [tokens, layers, batch, kv_heads, head_dim], and return only the keys/values of the
  tokens they add: portable graphs of standard ops, the form another runtime (TensorRT's
  ONNX parser) reads. The drafter's attention is the SharpDraftAttention plugin node or
  plain ONNX ops (plugins/onnx.py). A PARD drafter graph (PARD_INPUTS) takes ids [batch,
  t] (unread tokens, then pard tokens), the rows whose logits to return, its own cache and
  past_lens [batch]: each row's visible-key count is past_lens + row + 1
  (StepMetadata.causal_visible), read from that input, never from a shape.
- target-kv.onnx is the target step ONNX Runtime runs (runtime/backends/onnxruntime.py):
  each layer's cache is its own input, a preallocated buffer [batch, kv_heads, capacity,
  head_dim] (one slice of the runtime's [layers, batch, kv_heads, capacity, head_dim]
  array) bound once and only read; `past_len` [batch] says how much of each sequence's
  row is committed (sequences of a batch sit at different lengths). Attention
  (buffered_attention) scores the step's queries against the buffer and against the
  step's own keys and takes one softmax over both, so nothing copies, transposes or
  concatenates the cache; the step's keys/values come out for the runtime to store.
  Running target.onnx, where every step concatenated and transposed the whole past in
  every layer, ONNX Runtime decoded at 0.43x torch's speed at 4,096 tokens and 0.37x at
  7,680; on target-kv.onnx it decodes at 1.5-1.6x torch's (SmolLM2-135M, fp32, 2
  threads, scripts/bench_backends.py, same machine and session for each pair).
- EAGLE-3 engines: drafter.onnx / drafter-frozen.onnx are the drafter's causal step
  (Eagle3Step: committed tokens' entries from the target's features, plugin node or
  native), drafter-tree.onnx / drafter-frozen-tree.onnx one level of a draft tree, or
  one link of a chain (Eagle3TreeStep, native: the plugin node takes no mask), both over
  the committed cache as an input with past_lens [batch] like PARD's, so one run steps
  every row of a batch at its own length (engines exported before took one committed
  length per run, the past's shape, and draft row by row); target-tree.onnx verifies a
  whole tree in one pass over the target's cache buffers, under its ancestor mask at
  per-node positions (TargetTreeStep), the nodes' keys out as scratch for keep_path.
- drafter-kv.onnx / drafter-frozen-kv.onnx (native-form engines) are the drafter steps
  ONNX Runtime runs, in the same way (BlockBufferCache): per-layer buffers read in place
  under `past_lens` [batch]; the block's rows attend to the buffer, the step's context
  keys and the block's own in one softmax; only the context's keys/values come out (the
  block's are scratch). drafter.onnx fed the past as an input, permuted it per layer and
  widened-and-scattered it for each of its two writes per layer: several full copies of
  K and V per layer per step (4.4 ms at 512 tokens, 14.9 ms at 4,096 for a ~2 ms step).
  The plugin form (TensorRT's) has no such graph: its drafters stay in drafter.onnx.

  Chosen by measurement (target-only decode tok/s, medians of 5): ORT's com.microsoft
  GroupQueryAttention with a shared past/present buffer (in-place cache writes, cost
  proportional to the length; also exported and run) made 33.3 / 12.7 tok/s at 512 /
  7,680 tokens where this graph made 32.3 / 15.9: GQA's CPU kernel reads each kv head
  once per query head (3 times here). A form of this graph with a hand-written two-part
  softmax (no Concat) made 28.9 at 512: per-node overhead. The price of plain ops:
  buffer positions past `past_len` are masked but still multiplied, so a decode/verify
  step costs the buffer's capacity, not the length (the runtime sizes the buffer to the
  prompt plus the generation budget; a prefill binds compact copies of the prefix).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from plugins import onnx as onnx_attention
from plugins.attention import register as register_attention_op
from plugins.attention import scaled_query, sharpdraft_attention
from plugins.plugin_spec import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, plugin_fields
from plugins.scaling import QueryScaling
from runtime.backends.onnxruntime import EXPORT_VERSION
from runtime.manifest import DRAFT_VOCAB_FILE
from runtime.models.dflash import DFlashDrafter, DraftHead
from runtime.models.eagle3 import DraftVocabulary, Eagle3Drafter
from runtime.models.pard import PARDDrafter
from runtime.models.target import TargetModel
from runtime.step_metadata import StepMetadata

OPSET = 18  # the dynamo exporter's lowest; nothing these graphs use needs a newer one
TARGET_FILE, DRAFTER_FILE, FROZEN_FILE = "target.onnx", "drafter.onnx", "drafter-frozen.onnx"
TARGET_KV_FILE = "target-kv.onnx"
TARGET_TREE_FILE = "target-tree.onnx"
TREE_FILE, FROZEN_TREE_FILE = "drafter-tree.onnx", "drafter-frozen-tree.onnx"
DRAFTER_KV_FILE, FROZEN_KV_FILE = "drafter-kv.onnx", "drafter-frozen-kv.onnx"
WEIGHTS_FILE = "weights.bin"  # every graph's initializers, as ONNX external data
TARGET_INPUTS = ("ids", "logit_positions", "past_keys", "past_values")
TARGET_OUTPUTS = ("logits", "features", "present_keys", "present_values")
TARGET_KV_OUTPUTS = ("logits", "features", "new_keys", "new_values")  # inputs: target_kv_inputs
DRAFTER_INPUTS = ("block_ids", "context", "context_lens", "past_keys", "past_values", "past_lens")
DRAFTER_OUTPUTS = ("logits", "present_keys", "present_values")
PARD_INPUTS = ("ids", "logit_positions", "past_keys", "past_values", "past_lens")
DRAFTER_KV_OUTPUTS = ("logits", "new_keys", "new_values")  # inputs: drafter_kv_inputs
TARGET_TREE_OUTPUTS = TARGET_KV_OUTPUTS  # inputs: target_tree_inputs
EAGLE3_INPUTS = ("ids", "features", "context_lens", "past_keys", "past_values", "past_lens")
EAGLE3_TREE_INPUTS = ("ids", "hidden", "ancestors", "offsets", "past_keys", "past_values",
                      "scratch_keys", "scratch_values", "past_lens")
# The step graph's logits are over the target's vocabulary (a sampler reads them), with the
# target id of each draft-vocabulary index beside them; a tree level's are over the draft
# vocabulary (runtime/backends/onnxruntime/drafters.py maps them): a level scores every
# node's children, and the target vocabulary is several times the draft's.
EAGLE3_OUTPUTS = ("logits", "state", "visible", "present_keys", "present_values", "draft_ids")
EAGLE3_TREE_OUTPUTS = ("draft_logits", "state", "visible", "present_keys", "present_values")


class ExportCache:
    """Stands in for KVCache while tracing: the past comes in as a graph input and a
    write concatenates instead of storing. The models append in order (each write
    starts where the last ended), so concatenation is exactly what KVCache.write
    returns; the first write of each layer is the step's contribution to the cache.

    With `lengths` [batch] (the drafter graph: sequences at different lengths, the past
    padded to the longest), a write of t tokens widens the buffer by t and scatters each
    sequence's rows to its own start instead, as KVCache.write does per sequence."""

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor, lengths=None):
        self.length = past_keys.shape[0]
        self.lengths = lengths
        # the padded past's width (a shape), where packed tree rows' keys run from
        # (StepMetadata.past_width)
        self.past_width = None if lengths is None else past_keys.shape[0]
        # [past, layers, batch, kv_heads, d] -> per layer [batch, kv_heads, past, d]
        self.keys = [[past_keys[:, i].permute(1, 2, 0, 3)] for i in range(past_keys.shape[1])]
        self.values = [[past_values[:, i].permute(1, 2, 0, 3)] for i in range(past_values.shape[1])]
        self.buffers = [[keys[0], values[0]] for keys, values in zip(self.keys, self.values)]

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor):
        self.keys[layer].append(k)
        self.values[layer].append(v)
        if self.lengths is None:
            return torch.cat(self.keys[layer], 2), torch.cat(self.values[layer], 2)
        index = (start[:, None] + torch.arange(k.shape[2]))[:, None, :, None].expand_as(k)
        for j, new in enumerate((k, v)):
            wider = torch.cat([self.buffers[layer][j], torch.zeros_like(new)], 2)
            self.buffers[layer][j] = wider.scatter(2, index, new)
        return tuple(self.buffers[layer])

    def attend(self, layer: int, start, q, k, v, visible, mask=None):
        if mask is not None:
            raise ValueError("tree verification (a tree mask) is not exported; run trees on torch")
        k, v = self.write(layer, start, k, v)
        return sharpdraft_attention(q, k, v, visible)

    def attend_block(self, layer: int, start, q, k, v, visible, scaling, probe=None,
                     window=None):
        if window is not None:  # the plugin node has no window field (TensorRT's graphs)
            raise ValueError("a draft window is exported in drafter-kv.onnx only")
        k, v = self.write(layer, start, k, v)
        return sharpdraft_attention(q, k, v, visible, scaling)

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first write of every layer, as [t, layers, batch, kv_heads, d]."""
        def stack(per_layer):
            return torch.stack([written[1] for written in per_layer]).permute(3, 0, 1, 2, 4)
        return stack(self.keys), stack(self.values)


class TargetStep(nn.Module):
    """Prefill and verify in one graph: `ids` after `past_len` cached tokens; logits
    only at `logit_positions` (prefill asks for the last row, verify for all)."""

    def __init__(self, target: TargetModel, feature_layers: tuple[int, ...]):
        super().__init__()
        self.target, self.feature_layers = target, tuple(feature_layers)

    def forward(self, ids, logit_positions, past_keys, past_values):
        cache = ExportCache(past_keys, past_values)
        return self.logits_and_features(ids, logit_positions, cache) + cache.present()

    def logits_and_features(self, ids, logit_positions, cache):
        h, features = self.target.final_hidden(ids, cache, self.feature_layers)
        if features is None:  # no drafter reads features (n-gram engines): an empty output
            features = h[..., :0]
        return self.target.lm_head(h.index_select(1, logit_positions)), features


class DrafterStep(nn.Module):
    """One DFlash step with the target's embedding and head inside the graph: block ids
    in, logits of block positions 1.. out (over the draft vocabulary where the drafter
    has one: DraftHead); new context features join the cache."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, scaling: QueryScaling | None):
        super().__init__()
        self.drafter, self.scaling = drafter, scaling
        self.embed_tokens = target.embed_tokens
        self.head = DraftHead.for_drafter(drafter, target.lm_head)

    def forward(self, block_ids, context, context_lens, past_keys, past_values, past_lens):
        """context_lens [batch]: real rows of each sequence's context (padded to the
        longest); past_lens [batch]: each sequence's committed drafter cache (past_keys is
        padded to the longest). One graph runs a batch of sequences at different lengths:
        the visible-key counts come from these two inputs (StepMetadata), never shapes."""
        cache = ExportCache(past_keys, past_values, past_lens)
        return (self.logits(block_ids, context, context_lens, cache),) + cache.present()

    def logits(self, block_ids, context, context_lens, cache):
        hidden, _ = self.drafter(self.embed_tokens(block_ids), context, cache, self.scaling,
                                 context_lens=context_lens)
        return self.head(hidden[:, 1:])


class PARDStep(nn.Module):
    """One PARD step: ids after each sequence's past_lens committed tokens, causal; logits
    (over the target's vocab_size ids) only at `logit_positions`; every row's keys and
    values come out, the runtime keeps the real tokens' rows."""

    def __init__(self, drafter: PARDDrafter, vocab_size: int, scaling: QueryScaling | None):
        super().__init__()
        self.drafter, self.vocab_size, self.scaling = drafter, vocab_size, scaling

    def forward(self, ids, logit_positions, past_keys, past_values, past_lens):
        cache = ExportCache(past_keys, past_values, past_lens)
        hidden, _ = self.drafter(ids, cache, self.scaling)
        logits = self.drafter.logits(hidden.index_select(1, logit_positions), self.vocab_size)
        return (logits,) + cache.present()


class Eagle3Step(nn.Module):
    """EAGLE-3's causal step (the drafter-*.onnx of an EAGLE-3 engine): the entries of
    newly committed tokens, `ids` [b, c] (the token after each row) with the target's
    `features` [b, c, F], context_lens [b] of them real (padded to the longest), after
    each sequence's past_lens [b] committed entries (past_keys/past_values padded to the
    longest: PARD's form, so one run steps a batch of sequences at different lengths).
    Row i of sequence b sees past_lens[b] + i + 1 keys (StepMetadata.causal_visible, read
    from that input, never from a shape), returned as `visible`. Out: each sequence's
    last real row's logits over the target's vocabulary (DraftVocabulary puts -inf where
    the drafter cannot propose), its state for the next drafting step, every row's
    keys/values, of which the runtime commits the real ones, and `draft_ids`, the target
    id of each draft-vocabulary index (a tree level's logits are over the draft
    vocabulary: Eagle3TreeStep). (Engines exported before
    took no lengths: the past's length was the one committed count of the run.)"""

    def __init__(self, drafter: Eagle3Drafter, scaling: QueryScaling | None):
        super().__init__()
        self.drafter, self.scaling = drafter, scaling
        self.vocab = DraftVocabulary(drafter)

    def forward(self, ids, features, context_lens, past_keys, past_values, past_lens):
        cache = ExportCache(past_keys, past_values, past_lens)
        logits, hidden, visible = self.drafter(ids, self.drafter.project(features), cache,
                                               self.scaling)
        rows, last = torch.arange(ids.shape[0], device=ids.device), context_lens - 1
        return ((self.vocab.target_logits(logits[rows, last]), hidden[rows, last], visible)
                + cache.present() + (self.vocab.ids.clone(),))


class ScratchExportCache(ExportCache):
    """ExportCache with scratch keys between the committed past and the step's own: the
    keys earlier levels of a draft tree (or links of a chain) wrote past the committed
    length. The metadata counts committed keys and scratch keys apart; the step's own
    keys are the second write. With `lengths` [batch] (the past padded to the longest),
    each sequence's scratch keys go right after its own committed ones, where
    StepMetadata.tree_rows looks for them, as they lie in a per-sequence KVCache."""

    def __init__(self, past_keys, past_values, scratch_keys, scratch_values, lengths=None):
        super().__init__(past_keys, past_values, lengths)
        for i in range(len(self.keys)):
            k, v = (s[:, i].permute(1, 2, 0, 3) for s in (scratch_keys, scratch_values))
            if lengths is None:
                self.keys[i].append(k)
                self.values[i].append(v)
            else:
                self.write(i, lengths, k, v)

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        def stack(per_layer):
            return torch.stack([written[2] for written in per_layer]).permute(3, 0, 1, 2, 4)
        return stack(self.keys), stack(self.values)


class Eagle3TreeStep(Eagle3Step):
    """One level of an EAGLE-3 draft tree (or one link of a chain: a tree of one child per
    node) (drafter-tree.onnx): rows (ids [b, t], the parents' states hidden [b, t, H])
    at `offsets` [b, t] past each sequence's past_lens [b] committed entries (the past
    padded to the longest, as Eagle3Step takes it), after them the scratch keys earlier
    levels wrote [S, layers, b, ...]. ancestors [b, t, S] says which scratch keys each
    row sees; it also sees its own key and no sibling's, as a tree level does
    (runtime/tree.py: grow_trees), so the scratch mask the drafter gets is [ancestors,
    identity]. Each row's N is the keys that mask leaves unmasked, committed ones
    included (StepMetadata.tree_visible), returned as `visible`. Its logits are over the
    draft vocabulary (`draft_logits`: the runtime scores children there and maps the ones
    it keeps through the step graph's draft_ids; engines exported before gave them over
    the target's, which cost a gather of the whole target vocabulary per node). The
    attention is the native form: the plugin node has no mask input."""

    def forward(self, ids, hidden, ancestors, offsets, past_keys, past_values, scratch_keys,
                scratch_values, past_lens):
        cache = ScratchExportCache(past_keys, past_values, scratch_keys, scratch_values,
                                   past_lens)
        t = ids.shape[1]
        own = torch.arange(t)[:, None] == torch.arange(t)[None, :]
        scratch_mask = torch.cat([ancestors, own.expand(ids.shape[0], t, t)], -1)
        logits, out, visible = self.drafter(ids, hidden, cache, self.scaling,
                                            tree=(scratch_mask, offsets))
        return (logits, out, visible) + cache.present()


def step_masks(past_len, visible, capacity: int, group: int, positions=None, lowest=None):
    """Additive masks (0 or -inf) of a step's attention, rows (g, i) for g < group:
    row i sees buffer position j when j < min(past_len, visible[b, i]) and the step's
    own key j when its position positions[b, j] < visible[b, i], exactly the keys
    sharpdraft_attention gives it over the joined cache; with `lowest` [b, t] (a draft
    window), only positions >= lowest[b, i]. positions default to past_len + j (a causal
    step's keys sit where its rows do). [b, 1, group * t, capacity] and [b, 1, group * t,
    keys]; every layer of a step shares them."""
    t = visible.shape[1]
    past_len = past_len.reshape(-1, 1)  # one per sequence (or one for all)
    if positions is None:
        positions = torch.arange(t, device=visible.device) + past_len
    sees = visible.repeat(1, group)[:, None, :, None]
    in_buffer = torch.arange(capacity, device=visible.device)
    sees_buffer = (in_buffer < past_len[:, :, None, None]) & (in_buffer < sees)
    sees_step = positions[:, None, None, :] < sees
    if lowest is not None:
        lowest = lowest.repeat(1, group)[:, None, :, None]
        sees_buffer = sees_buffer & (in_buffer >= lowest)
        sees_step = sees_step & (positions[:, None, None, :] >= lowest)
    zero = torch.zeros((), dtype=torch.float32, device=visible.device)
    return (torch.where(sees_buffer, zero, -torch.inf), torch.where(sees_step, zero, -torch.inf))


def buffered_attention(q, k_buf, v_buf, k, v, masks):
    """Attention of a step over a cache buffer and the step's own keys, without joining
    the two: one softmax over both score blocks. q [b, heads, t, d]; k_buf/v_buf
    [b, kv_heads, capacity, d], read where they lie; k/v [b, kv_heads, t, d]; masks from
    step_masks. The query heads that share a kv head are stacked as rows of one product,
    so every cached key is read once per step, not once per query head."""
    b, heads, t, d = q.shape
    kv_heads, capacity = k_buf.shape[1], k_buf.shape[2]
    group = heads // kv_heads
    rows = (q * (1.0 / math.sqrt(d))).reshape(b, kv_heads, group * t, d)  # row = (g, i)
    mask_buffer, mask_step = masks
    scores = torch.cat([rows @ k_buf.transpose(-1, -2) + mask_buffer.to(q.dtype),
                        rows @ k.transpose(-1, -2) + mask_step.to(q.dtype)], -1)
    p = torch.softmax(scores, -1)  # [b, kv_heads, group * t, capacity + t]
    out = p[..., :capacity] @ v_buf + p[..., capacity:] @ v
    return out.unflatten(2, (group, t)).flatten(1, 2)


class BufferCache:
    """Stands in for KVCache while tracing target-kv.onnx: layer i's cache is a graph
    input [batch, kv_heads, capacity, head_dim] whose first `past_len` positions are
    committed. The graph only reads it; the step's keys/values come out as
    [layers, batch, kv_heads, t, head_dim] for the runtime to store at past_len."""

    def __init__(self, past_len, keys, values):
        self.length = past_len  # [batch]: StepMetadata reads each sequence's length
        self.keys, self.values = keys, values
        self.new_keys, self.new_values = [], []
        self.masks = None

    def attend(self, layer: int, start, q, k, v, visible, mask=None):
        if mask is not None:
            raise ValueError("tree verification (a tree mask) is not exported; run trees on torch")
        self.new_keys.append(k)
        self.new_values.append(v)
        if self.masks is None:  # once per step: every layer sees the same keys
            self.masks = step_masks(start, visible, self.keys[layer].shape[2],
                                    q.shape[1] // k.shape[1])
        return buffered_attention(q, self.keys[layer], self.values[layer], k, v, self.masks)

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new_keys), torch.stack(self.new_values)


class TreeBufferCache(BufferCache):
    """BufferCache for a draft tree verified in one pass (target-tree.onnx): every row
    sees the buffer's first `past_len` positions and, of the step's own keys, those its
    tree mask allows (its ancestors and itself). The step's metadata counts no committed
    keys (length 0): the graph's positions input already holds committed + depth, and the
    committed keys are read from the buffer, so the mask the model hands attend() covers
    the step's own keys only. The step's keys come out as scratch (keep_path commits)."""

    def __init__(self, past_len, keys, values):
        super().__init__(past_len, keys, values)
        self.past_len, self.length = past_len, 0

    def attend(self, layer: int, start, q, k, v, visible, mask=None):
        self.new_keys.append(k)
        self.new_values.append(v)
        if self.masks is None:  # once per step: every layer sees the same keys
            group, capacity = q.shape[1] // k.shape[1], self.keys[layer].shape[2]
            sees_buffer = torch.arange(capacity, device=q.device) < self.past_len[:, None]
            zero = torch.zeros((), dtype=torch.float32, device=q.device)
            self.masks = (torch.where(sees_buffer, zero, -torch.inf)[:, None, None, :],
                          torch.where(mask.repeat(1, group, 1), zero, -torch.inf)[:, None])
        return buffered_attention(q, self.keys[layer], self.values[layer], k, v, self.masks)


class BlockBufferCache:
    """Stands in for KVCache while tracing the in-place drafter graphs (drafter-kv.onnx):
    layer i's cache is a graph input [batch, kv_heads, capacity, head_dim] whose first
    `lengths` positions are committed; the graph only reads it. Each layer's new context
    keys (its first write) join the block's as the step's own keys; the context's come
    out as [layers, batch, kv_heads, context, head_dim] for the runtime to store at
    `lengths`, the block's are scratch (KVCache overwrites them next step) and never
    leave the graph."""

    def __init__(self, past_lens, keys, values, window=None):
        self.lengths = past_lens  # [batch]: StepMetadata reads each sequence's length
        self.keys, self.values = keys, values
        self.window = window  # [1] int64, the graph's draft window (0: the whole context)
        self.new_keys, self.new_values = [], []
        self.masks = self.counts = None

    def write(self, layer: int, start, k, v):
        self.new_keys.append(k)
        self.new_values.append(v)

    def attend_block(self, layer: int, start, q, k, v, visible, scaling, probe=None,
                     window=None):
        """Block rows over the buffer, the context and the block, which starts at `start`
        [batch] (each sequence's cached + real context tokens). The draft window is the
        graph's input (self.window), not the argument: the rule is KVCache's
        (StepMetadata.block_window, per row), with beta read from the keys left."""
        context = self.new_keys[layer].shape[2]
        if self.masks is None:  # once per step: every layer's block sees the same keys
            lowest, self.counts = None, visible
            if self.window is not None:  # window 0: lowest 0, every key (counts unchanged)
                lowest, self.counts = StepMetadata.block_window(visible, k.shape[2], self.window)
            held = torch.arange(context, device=q.device) + self.lengths[:, None]
            # A padding row of the context sits where the block goes (KVCache writes the
            # block over it): give it the first position no block row sees.
            held = torch.where(held < start[:, None], held, visible[:, :1])
            block = torch.arange(k.shape[2], device=q.device) + start[:, None]
            positions = torch.cat([held, block], 1)
            self.masks = step_masks(self.lengths, visible, self.keys[layer].shape[2],
                                    q.shape[1] // k.shape[1], positions, lowest)
        k = torch.cat([self.new_keys[layer], k], 2)
        v = torch.cat([self.new_values[layer], v], 2)
        return buffered_attention(scaled_query(q, self.counts, scaling), self.keys[layer],
                                  self.values[layer], k, v, self.masks)

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new_keys), torch.stack(self.new_values)


class TargetKVStep(TargetStep):
    """TargetStep over the runtime's cache buffers: `ids` after `past_len` committed
    tokens, then 2 x layers buffers (every layer's keys, then every layer's values)."""

    def forward(self, ids, logit_positions, past_len, *buffers):
        layers = len(buffers) // 2
        cache = BufferCache(past_len, buffers[:layers], buffers[layers:])
        return self.logits_and_features(ids, logit_positions, cache) + cache.present()


class TargetTreeStep(TargetStep):
    """A draft tree's nodes verified in one pass over the runtime's cache buffers: ids
    [b, t], positions [b, t] (committed + each node's depth), tree_mask [b, t, t] (node j
    is i or one of its ancestors: DraftTree.ancestor_mask), past_len [b], then the 2 x
    layers buffers. Logits of every node; the nodes' keys/values come out as scratch."""

    def forward(self, ids, positions, tree_mask, past_len, *buffers):
        layers = len(buffers) // 2
        cache = TreeBufferCache(past_len, buffers[:layers], buffers[layers:])
        h, features = self.target.final_hidden(ids, cache, self.feature_layers,
                                               tree=(tree_mask, positions))
        if features is None:
            features = h[..., :0]
        return (self.target.lm_head(h), features) + cache.present()


class DrafterKVStep(DrafterStep):
    """DrafterStep over the runtime's cache buffers: past_lens [batch] committed, the
    draft window [1] (0: none; layers.window_mask), then 2 x layers buffers (every layer's keys, then every layer's values); out come the
    logits and the step's context keys/values."""

    def forward(self, block_ids, context, context_lens, past_lens, window, *buffers):
        layers = len(buffers) // 2
        cache = BlockBufferCache(past_lens, buffers[:layers], buffers[layers:], window)
        return (self.logits(block_ids, context, context_lens, cache),) + cache.present()


def cache_buffer_inputs(layers: int) -> tuple[str, ...]:
    return (tuple(f"cache_keys_{i}" for i in range(layers))
            + tuple(f"cache_values_{i}" for i in range(layers)))


def target_kv_inputs(layers: int) -> tuple[str, ...]:
    return ("ids", "logit_positions", "past_len") + cache_buffer_inputs(layers)


def target_tree_inputs(layers: int) -> tuple[str, ...]:
    return ("ids", "positions", "tree_mask", "past_len") + cache_buffer_inputs(layers)


def drafter_kv_inputs(layers: int) -> tuple[str, ...]:
    return ("block_ids", "context", "context_lens", "past_lens", "window") + cache_buffer_inputs(layers)


def _cache_example(layers, kv_heads, head_dim, past, batch, dtype):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(past, layers, batch, kv_heads, head_dim, generator=g).to(dtype)
                 for _ in range(2))


# Example sizes are distinct and > 1 so torch.export neither specialises a dimension
# nor merges two of them; the graphs stay general in every dynamic one.
BATCH, Q_LEN, N_LOGITS, PAST, CONTEXT, CAPACITY, SCRATCH = 2, 5, 3, 7, 3, 13, 6


def target_example(target: TargetModel):
    c = target.config
    ids = torch.randint(0, c.vocab_size, (BATCH, Q_LEN), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(Q_LEN - N_LOGITS, Q_LEN)
    dtype = target.embed_tokens.weight.dtype
    return (ids, positions) + _cache_example(c.num_layers, c.num_kv_heads, c.head_dim, PAST, BATCH, dtype)


def drafter_example(drafter: DFlashDrafter, dtype: torch.dtype):
    c = drafter.config
    g = torch.Generator().manual_seed(0)
    block = torch.tensor([[1] + [c.mask_token_id] * (c.block_size - 1)] * BATCH)
    context = torch.randn(BATCH, CONTEXT, drafter.fc.in_features, generator=g).to(dtype)
    context_lens = torch.tensor([CONTEXT, CONTEXT - 1][:BATCH])
    past = _cache_example(c.num_layers, c.num_kv_heads, c.head_dim, PAST, BATCH, dtype)
    return (block, context, context_lens) + past + (torch.tensor([PAST, PAST - 2][:BATCH]),)


def _cache_buffers(layers, kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(BATCH, kv_heads, CAPACITY, head_dim, generator=g).to(dtype)
                 for _ in range(2 * layers))


def _dims():
    D = torch.export.Dim
    return {name: D(name, min=low) for name, low in
            (("batch", 1), ("q_len", 1), ("n_logits", 1), ("past_len", 0), ("context_len", 1))}


def export_target(target: TargetModel, feature_layers, path: Path) -> dict:
    d = _dims()
    cache = {0: d["past_len"], 2: d["batch"]}
    shapes = ({0: d["batch"], 1: d["q_len"]}, {0: d["n_logits"]}, cache, cache)
    _export(TargetStep(target, feature_layers), target_example(target), shapes,
            TARGET_INPUTS, TARGET_OUTPUTS, path, attention="native")
    return graph_record(path, attention=None)


def export_target_kv(target: TargetModel, feature_layers, path: Path) -> dict:
    c = target.config
    d = _dims()
    capacity = torch.export.Dim("capacity", min=2)
    ids, positions = target_example(target)[:2]
    buffers = _cache_buffers(c.num_layers, c.num_kv_heads, c.head_dim,
                             target.embed_tokens.weight.dtype)
    shapes = ({0: d["batch"], 1: d["q_len"]}, {0: d["n_logits"]}, {0: d["batch"]},
              tuple({0: d["batch"], 2: capacity} for _ in buffers))
    past_lens = torch.tensor([PAST, PAST - 2][:BATCH])
    _export(TargetKVStep(target, feature_layers), (ids, positions, past_lens) + buffers,
            shapes, target_kv_inputs(c.num_layers), TARGET_KV_OUTPUTS, path, attention="native")
    return graph_record(path, attention=None)


def export_drafter(drafter: DFlashDrafter | PARDDrafter, target: TargetModel,
                   scaling: QueryScaling | None, attention: str, path: Path) -> dict:
    """The drafter step graph; scaling=None exports the frozen drafter (plain attention)."""
    if attention not in onnx_attention.ATTENTION_FORMS:
        raise ValueError(f"attention form must be one of {onnx_attention.ATTENTION_FORMS}, "
                         f"got {attention!r}")
    form = attention if scaling is not None else "native"
    if isinstance(drafter, PARDDrafter):
        return export_pard(drafter, target, scaling, form, path)
    if isinstance(drafter, Eagle3Drafter):
        return export_eagle3(drafter, scaling, form, path)
    d = _dims()
    cache = {0: d["past_len"], 2: d["batch"]}
    shapes = ({0: d["batch"]}, {0: d["batch"], 1: d["context_len"]}, {0: d["batch"]}, cache,
              cache, {0: d["batch"]})
    example = drafter_example(drafter, target.embed_tokens.weight.dtype)
    _export(DrafterStep(drafter, target, scaling), example, shapes, DRAFTER_INPUTS,
            DRAFTER_OUTPUTS, path, attention=form)
    return graph_record(path, attention=form if scaling is not None else None)


def export_pard(drafter: PARDDrafter, target: TargetModel, scaling: QueryScaling | None,
                form: str, path: Path) -> dict:
    d = _dims()
    c = drafter.config.layers
    cache = {0: d["past_len"], 2: d["batch"]}
    shapes = ({0: d["batch"], 1: d["q_len"]}, {0: d["n_logits"]}, cache, cache, {0: d["batch"]})
    ids = torch.randint(0, c.vocab_size, (BATCH, Q_LEN), generator=torch.Generator().manual_seed(0))
    example = ((ids, torch.arange(Q_LEN - N_LOGITS, Q_LEN))
               + _cache_example(c.num_layers, c.num_kv_heads, c.head_dim, PAST, BATCH,
                                drafter.embed_tokens.weight.dtype)
               + (torch.tensor([PAST, PAST - 2][:BATCH]),))
    _export(PARDStep(drafter, target.config.vocab_size, scaling), example, shapes, PARD_INPUTS,
            DRAFTER_OUTPUTS, path, attention=form)
    return graph_record(path, attention=form if scaling is not None else None)


def export_target_tree(target: TargetModel, feature_layers, path: Path) -> dict:
    """target-tree.onnx: a draft tree verified in one pass (TargetTreeStep)."""
    c = target.config
    d = _dims()
    capacity = torch.export.Dim("capacity", min=2)
    ids = target_example(target)[0]
    positions = torch.arange(Q_LEN).expand(BATCH, Q_LEN) + torch.tensor([[PAST], [PAST - 2]])
    tree_mask = torch.ones(Q_LEN, Q_LEN, dtype=torch.bool).tril().expand(BATCH, Q_LEN, Q_LEN)
    buffers = _cache_buffers(c.num_layers, c.num_kv_heads, c.head_dim,
                             target.embed_tokens.weight.dtype)
    rows = {0: d["batch"], 1: d["q_len"]}
    shapes = (rows, rows, {0: d["batch"], 1: d["q_len"], 2: d["q_len"]}, {0: d["batch"]},
              tuple({0: d["batch"], 2: capacity} for _ in buffers))
    past_lens = torch.tensor([PAST, PAST - 2][:BATCH])
    _export(TargetTreeStep(target, feature_layers), (ids, positions, tree_mask, past_lens) + buffers,
            shapes, target_tree_inputs(c.num_layers), TARGET_TREE_OUTPUTS, path,
            attention="native")
    return graph_record(path, attention=None)


def _eagle3_past(drafter: Eagle3Drafter, length: int):
    c = drafter.config
    return _cache_example(1, c.num_kv_heads, c.head_dim, length, BATCH, drafter.fc.weight.dtype)


def export_eagle3(drafter: Eagle3Drafter, scaling: QueryScaling | None, form: str,
                  path: Path) -> dict:
    """EAGLE-3's causal step (Eagle3Step) in `form` (scaling=None: frozen, native)."""
    d = _dims()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.config.vocab_size, (BATCH, CONTEXT), generator=g)
    features = torch.randn(BATCH, CONTEXT, drafter.fc.in_features, generator=g).to(
        drafter.fc.weight.dtype)
    cache = {0: d["past_len"], 2: d["batch"]}
    rows = {0: d["batch"], 1: d["context_len"]}
    shapes = (rows, rows, {0: d["batch"]}, cache, cache, {0: d["batch"]})
    context_lens = torch.tensor([CONTEXT, CONTEXT - 1][:BATCH])
    example = ((ids, features, context_lens) + _eagle3_past(drafter, PAST)
               + (torch.tensor([PAST, PAST - 2][:BATCH]),))
    _export(Eagle3Step(drafter, scaling), example, shapes, EAGLE3_INPUTS, EAGLE3_OUTPUTS, path,
            attention=form)
    return graph_record(path, attention=form if scaling is not None else None)


def export_eagle3_tree(drafter: Eagle3Drafter, scaling: QueryScaling | None, path: Path) -> dict:
    """One EAGLE-3 tree level (Eagle3TreeStep), native form (scaling=None: frozen)."""
    d = _dims()
    scratch = torch.export.Dim("scratch_len", min=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.config.vocab_size, (BATCH, Q_LEN), generator=g)
    hidden = torch.randn(BATCH, Q_LEN, drafter.config.hidden_size, generator=g).to(
        drafter.fc.weight.dtype)
    ancestors = torch.rand(BATCH, Q_LEN, SCRATCH, generator=g) < 0.5
    offsets = torch.full((BATCH, Q_LEN), 2)
    rows = {0: d["batch"], 1: d["q_len"]}
    cache = {0: d["past_len"], 2: d["batch"]}
    scratch_cache = {0: scratch, 2: d["batch"]}
    shapes = (rows, rows, {0: d["batch"], 1: d["q_len"], 2: scratch}, rows, cache, cache,
              scratch_cache, scratch_cache, {0: d["batch"]})
    example = ((ids, hidden, ancestors, offsets) + _eagle3_past(drafter, PAST)
               + _eagle3_past(drafter, SCRATCH) + (torch.tensor([PAST, PAST - 2][:BATCH]),))
    _export(Eagle3TreeStep(drafter, scaling), example, shapes, EAGLE3_TREE_INPUTS,
            EAGLE3_TREE_OUTPUTS, path, attention="native")
    return graph_record(path, attention="native" if scaling is not None else None)


def export_drafter_kv(drafter: DFlashDrafter, target: TargetModel, scaling: QueryScaling | None,
                      path: Path) -> dict:
    """The in-place drafter step graph, native form (scaling=None: frozen)."""
    c = drafter.config
    d = _dims()
    capacity = torch.export.Dim("capacity", min=2)
    dtype = target.embed_tokens.weight.dtype
    block, context, context_lens = drafter_example(drafter, dtype)[:3]
    buffers = _cache_buffers(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    past_lens = torch.tensor([PAST, PAST - 2][:BATCH])
    window = torch.tensor([PAST - 3])  # any value: the mask reads it, nothing branches on it
    shapes = ({0: d["batch"]}, {0: d["batch"], 1: d["context_len"]}, {0: d["batch"]},
              {0: d["batch"]}, None, tuple({0: d["batch"], 2: capacity} for _ in buffers))
    example = (block, context, context_lens, past_lens, window) + buffers
    _export(DrafterKVStep(drafter, target, scaling), example, shapes,
            drafter_kv_inputs(c.num_layers), DRAFTER_KV_OUTPUTS, path, attention="native")
    return graph_record(path, attention="native" if scaling is not None else None)


def _export(module, example, shapes, input_names, output_names, path: Path, attention: str):
    with torch.no_grad(), _quiet():
        program = torch.export.export(module.eval(), example, dynamic_shapes=shapes, strict=False)
        table = None
        if attention == "plugin":
            onnx_attention.register_schema()  # the onnxscript tracer must know the node
            table = {torch.ops.sharpdraft.attention.default: onnx_attention.plugin_translation}
        else:
            register_attention_op()  # a graph over cache buffers may never have called it
        with _native_attention(attention == "native"):
            onnx_program = torch.onnx.export(program, example, input_names=list(input_names),
                                             output_names=list(output_names), opset_version=OPSET,
                                             custom_translation_table=table, verbose=False)
    flat = [axes for spec in shapes
            for axes in (spec if isinstance(spec, tuple) else (spec,))]  # *buffers nest
    _name_dims(onnx_program.model, flat, input_names)
    onnx_program.save(path)


@contextlib.contextmanager
def _native_attention(native: bool):
    """The native form: sharpdraft::attention decomposed into ATen ops (then plain ONNX
    ops) by the exporter's own decomposition pass, which reads torch._decomp's table, for
    the length of the export. (A run_decompositions of our own first retraced the whole
    program once more: about 6 s of a 15 s target export, for graphs that mostly hold no
    such op.)"""
    table, op = torch._decomp.decomposition_table, torch.ops.sharpdraft.attention.default
    if not native or op in table:
        yield
        return
    table[op] = onnx_attention.native_decomposition
    try:
        yield
    finally:
        del table[op]


@contextlib.contextmanager
def _quiet():
    # The exporter's deprecation chatter and its note on torchvision's absent ops are
    # about its own internals, not our model.
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _name_dims(model, shapes, input_names) -> None:
    """Give dynamic dimensions our names (batch, past_len, ...) instead of s17, s42."""
    graph = model.graph
    by_name = {value.name: value for value in graph.inputs}
    rename = {}
    for name, axes in zip(input_names, shapes):
        for axis, dim in (axes or {}).items():
            symbol = by_name[name].shape[axis]
            if not isinstance(symbol, int) and symbol.value is not None:
                rename[symbol.value] = dim.__name__
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
    from onnxscript import ir

    values = list(graph.inputs) + [out for node in ir.traversal.RecursiveGraphIterator(graph)
                                   for out in node.outputs]
    for value in values:
        if value.shape is None:
            continue
        dims = [ir.SymbolicDim(pattern.sub(lambda m: rename[m.group()], d.value))
                if not isinstance(d, int) and d.value is not None else d for d in value.shape]
        value.shape = ir.Shape(dims)


def graph_record(path: Path, attention: str | None) -> dict:
    """What engine.json says of a graph: file, attention form, input/output signature."""
    model = onnx.load(str(path), load_external_data=False)

    def describe(value):
        t = value.type.tensor_type
        return {"name": value.name,
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}

    return {"file": path.name, "attention": attention,
            "plugin_nodes": sum(n.op_type == PLUGIN_NAME for n in model.graph.node),
            "inputs": [describe(v) for v in model.graph.input],
            "outputs": [describe(v) for v in model.graph.output]}


def check_graph(path: Path) -> None:
    """onnx.checker with full shape inference (the plugin's schema is registered)."""
    onnx_attention.register_schema()
    onnx.checker.check_model(str(path), full_check=True)


def share_weights(out_dir: Path, files: list[str], min_bytes: int = 1024) -> None:
    """Move the graphs' initializers into one external-data file (WEIGHTS_FILE), each
    distinct tensor once: target.onnx and target-kv.onnx hold the same weights, and both
    drafter graphs carry the target's embedding and head. Tensors start on 4 KiB
    boundaries; tensors under min_bytes stay inside their graph."""
    from onnx.external_data_helper import set_external_data

    offsets: dict[bytes, int] = {}
    with open(out_dir / WEIGHTS_FILE, "wb") as data:
        for name in files:
            model = onnx.load(str(out_dir / name))
            for tensor in model.graph.initializer:
                raw = tensor.raw_data
                if len(raw) < min_bytes:
                    continue
                key = hashlib.sha256(bytes([tensor.data_type]) + repr(list(tensor.dims)).encode()
                                     + raw).digest()
                if key not in offsets:
                    data.write(b"\0" * (-data.tell() % 4096))
                    offsets[key] = data.tell()
                    data.write(raw)
                set_external_data(tensor, WEIGHTS_FILE, offsets[key], len(raw))
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
            onnx.save(model, str(out_dir / name))


def export_engine(target: TargetModel, drafter: DFlashDrafter | PARDDrafter | Eagle3Drafter | None,
                  scaling: QueryScaling | None, attention: str, out_dir: Path,
                  progress=lambda _msg: None) -> dict:
    """Write every graph of an engine into out_dir; returns engine.json's "onnx" record.
    drafter None (n-gram engines): the target graph alone. A PARD drafter reads no target
    features; its mask token (mask_token_id in the record) is its pard_token. An EAGLE-3
    engine adds the tree graphs: target-tree.onnx and the drafter's tree level (the
    drafter graphs are its causal step); it has no mask token."""
    pard = isinstance(drafter, PARDDrafter)
    eagle3 = isinstance(drafter, Eagle3Drafter)
    layers = ()
    if eagle3:
        layers = drafter.config.feature_layers(target.config.num_layers)
    elif drafter is not None and not pard:
        layers = drafter.config.target_layer_ids
    graphs = {}
    progress(f"      {TARGET_FILE}: prefill/verify step, features of layers {list(layers)}")
    graphs["target"] = export_target(target, layers, out_dir / TARGET_FILE)
    progress(f"      {TARGET_KV_FILE}: the same step over the runtime's cache buffers")
    graphs["target_kv"] = export_target_kv(target, layers, out_dir / TARGET_KV_FILE)
    if eagle3:
        progress(f"      {TARGET_TREE_FILE}: a draft tree verified in one pass, under its "
                 "ancestor mask")
        graphs["target_tree"] = export_target_tree(target, layers, out_dir / TARGET_TREE_FILE)
    if drafter is not None:
        progress(f"      {FROZEN_FILE}: drafter step without SharpDraft (plain attention)")
        graphs["drafter_frozen"] = export_drafter(drafter, target, None, "native",
                                                  out_dir / FROZEN_FILE)
    if scaling is not None:
        progress(f"      {DRAFTER_FILE}: drafter step with SharpDraft ({attention} attention)")
        graphs["drafter"] = export_drafter(drafter, target, scaling, attention,
                                           out_dir / DRAFTER_FILE)
    if eagle3:  # a tree level reads a mask, which the plugin node does not take: native
        progress(f"      {FROZEN_TREE_FILE}: a draft tree level without SharpDraft")
        graphs["drafter_frozen_tree"] = export_eagle3_tree(drafter, None,
                                                           out_dir / FROZEN_TREE_FILE)
        if scaling is not None:
            progress(f"      {TREE_FILE}: a draft tree level with SharpDraft (native attention, "
                     "N from the tree mask)")
            graphs["drafter_tree"] = export_eagle3_tree(drafter, scaling, out_dir / TREE_FILE)
    # The native form's drafters again, over the runtime's cache buffers (what ONNX
    # Runtime runs). A plugin-form engine keeps both drafters in the portable form, so
    # its SharpDraft and frozen steps stay comparable (the overhead command). DFlash
    # only: PARD's and EAGLE-3's graphs still concatenate their past (not written for
    # buffers yet).
    if drafter is not None and not pard and not eagle3 and (scaling is None or attention == "native"):
        progress(f"      {FROZEN_KV_FILE}: the frozen drafter step over the runtime's cache "
                 "buffers")
        graphs["drafter_frozen_kv"] = export_drafter_kv(drafter, target, None,
                                                        out_dir / FROZEN_KV_FILE)
        if scaling is not None:
            progress(f"      {DRAFTER_KV_FILE}: the SharpDraft drafter step over the runtime's "
                     "cache buffers")
            graphs["drafter_kv"] = export_drafter_kv(drafter, target, scaling,
                                                     out_dir / DRAFTER_KV_FILE)
    progress(f"      {WEIGHTS_FILE}: the graphs' weights, each distinct tensor once")
    share_weights(out_dir, [g["file"] for g in graphs.values()])
    draft_vocab = None
    ids = drafter.draft_token_ids() if isinstance(drafter, DFlashDrafter) else None
    if ids is not None:
        # the DFlash graphs' logits are over the draft vocabulary (DraftHead): which
        # target token each column is, for the runtime's sampler (read_draft_vocab)
        np.save(out_dir / DRAFT_VOCAB_FILE, ids.cpu().numpy().astype(np.int64))
        draft_vocab = {"file": DRAFT_VOCAB_FILE, "target_vocab_size": target.config.vocab_size}
    plugin = None
    if scaling is not None and attention == "plugin":
        plugin = {"name": PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE,
                  "domain": onnx_attention.DOMAIN, "fields": plugin_fields(scaling)}
    return {"export_version": EXPORT_VERSION, "opset": OPSET,
            "attention": attention if scaling is not None else None, "plugin": plugin,
            "mask_token_id": (drafter.config.pard_token if pard else
                              None if eagle3 else drafter.config.mask_token_id)
            if drafter else None, "draft_vocab": draft_vocab, "graphs": graphs}
