"""The onnxruntime backend: an engine's exported graphs (build/export.py) in ONNX Runtime
sessions on the CPU, behind the same Target / BlockDrafter interface as the torch
backend. SharpDraftAttention nodes run through the onnxruntime-extensions op of
plugins/onnx.py, so the drafter file TensorRT would parse is the file that runs here.

The target runs target-kv.onnx over a BoundKVCache: one [layers, batch, kv_heads,
capacity, head_dim] array per keys/values, each layer's slice wrapped once in an OrtValue
and bound through IO binding for as long as the cache lives. A step reads the buffers
where they lie and hands back only its own keys/values, which land in the buffer at the
committed length; a rollback is a length change. (The previous backend fed the committed
prefix as an input and the graph concatenated it with the step's keys in every layer:
at 4,096 tokens 4.2 tok/s against torch's 9.6 in one session; now 16.9 against 10.5 in
another; see build/export.py.) A prefill runs in HOST_PREFILL_CHUNK-token steps over
compact copies of the prefix (OnnxTarget.prefill).

The drafters of native-form engines run the same way: drafter-kv.onnx over a
BoundKVCache (BoundDFlash, BoundBatchDFlash), storing only each step's context keys.
Older engines, and plugin-form ones, run drafter.onnx with the committed cache as an
input (HostKVCache; OnnxDFlash, OnnxBatchDFlash); engine.json's graph keys say which.

EAGLE-3 engines: the target verifies a draft tree in one pass of target-tree.onnx over
the same bound buffers (OnnxTarget.verify_tree; keep_path compacts the accepted path);
the drafter (OnnxEagle3) runs its causal step and its tree levels over a HostKVCache,
the levels' keys as scratch past the committed entries; a batch's chains draft in one
run of each per step and chain link (OnnxBatchEagle3: past_lens per row, as PARD's).

Threads: intra-op pools spin while a run is in flight (fast hand-off between small
decode nodes) but stop when it returns (session.force_spinning_stop), else the target's
idle workers starve the drafter that runs next; a graph with the Python plugin op does
not spin at all, since that op's torch threads need the cores. Measured at 4,096 tokens:
SharpDraft speculation 9.5 tok/s with default spinning, 13.5 with this policy.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from runtime import modes
from runtime.backends.roles import BlockPrefill, ChainDraft, ChainPrefill, load_tokenizer
from runtime.backends import bf16_prefill
from runtime.backends.rows import RowChainDrafters
from runtime.backends.slots import Group, Slots
from runtime.manifest import EngineError, Manifest, read_draft_vocab
from plugins.onnx import onnxruntime_session_options
from plugins.scaling import QueryScaling
from runtime.sampling import DraftVocab, log_softmax
from runtime.step_metadata import StepMetadata, padded, padded_context, row_group
from runtime.tree import TreeShape, grow_tree, pack

# The graph layout this runtime runs (build/export.py writes it into engine.json):
# 2: the target's KV cache lives in buffers bound to target-kv.onnx (1: cache as an input).
# 3: per-sequence lengths are inputs (target-kv past_len [batch]; the drafter's past_lens
#    and context_lens [batch]), so one graph steps a batch of sequences at different lengths.
#    Engines exported since may add the drafters over cache buffers (graphs drafter_kv,
#    drafter_frozen_kv): the runtime runs them where present; without them, drafter.onnx.
EXPORT_VERSION = 3
PREFILL_CHUNK = 512  # the longest step an engine's graphs take (TensorRT's profiles)
# Tokens per step of the target's prefill here. The graph scores a chunk against the
# whole prefix in one materialised block ([kv_heads, group x chunk, prefix]) and passes
# over it several times (mask, join, softmax, split), so ONNX Runtime's arena grows with
# the chunk: at 7,680 tokens of pydoc.py, peak RSS 2,834 / 2,583 / 2,441 MiB with
# 512 / 256 / 128-token chunks, the prefill no slower (91 / 86 / 86 s beside a training
# run; one session, fresh process each). The pass count, not the chunk, sets its cost.
HOST_PREFILL_CHUNK = 128


def cache_buffer(shape: tuple, dtype=np.float32) -> np.ndarray:
    """A zeroed cache buffer in 4 KiB pages. numpy advises the kernel to back any array
    over 4 MiB with 2 MiB huge pages (madvise MADV_HUGEPAGE), so the first write to each
    2 MiB of a KV buffer stops to zero the whole huge page: on our 2-core VM a joining
    row's copy into a fresh batch buffer took 0.2-1.0 s instead of about 5 ms, and eight
    requests in flight took 14.2 s in process before this and the shared row groups
    (row_group), 10.2-10.7 s after (results/loadtest-mixed/bound-*.json). A cache fills
    a few rows at a time, so it takes base pages, mapped as they are written."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not size or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, size)  # anonymous: zero-filled, pages mapped on first write
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype=dtype).reshape(shape)


class HostKVCache:
    """A drafter graph's KV cache on the host: preallocated [capacity, layers, batch,
    kv_heads, head_dim] (sequence-major), `length` tokens committed. The past fed to a
    step is a contiguous slice, so no copy; a rollback is a length change."""

    def __init__(self, capacity: int, layers: int, kv_heads: int, head_dim: int,
                 batch: int = 1, dtype=np.float32):
        shape = (capacity, layers, batch, kv_heads, head_dim)
        self.k = cache_buffer(shape, dtype)
        self.v = cache_buffer(shape, dtype)
        self.capacity = capacity
        self.length = 0

    def past(self) -> dict[str, np.ndarray]:
        return {"past_keys": self.k[:self.length], "past_values": self.v[:self.length]}

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        end = self.length + k.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; asked to write up to {end}")
        self.k[self.length:end] = k
        self.v[self.length:end] = v
        self.length = end

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length


def open_session(path: Path, threads: int | None = None, python_ops: bool = False):
    """A CPU session; `python_ops`: the graph holds nodes run by a Python op (the plugin)."""
    import onnxruntime

    options = onnxruntime_session_options()
    # Same thread count as torch's, so backends compare like for like.
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if python_ops:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _cache_dims(session) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a drafter graph's past_keys input."""
    shape = next(i.shape for i in session.get_inputs() if i.name == "past_keys")
    return shape[1], shape[3], shape[4]


class BoundKVCache:
    """The target's KV cache: keys and values [layers, batch, kv_heads, capacity,
    head_dim] in host memory, `length` tokens committed. Each layer's slice is wrapped
    once in an OrtValue (no copy) and stays bound to the step graph, which reads it
    where it lies; a rollback is a length change."""

    def __init__(self, capacity: int, layers: int, kv_heads: int, head_dim: int, batch: int = 1):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self._hold(cache_buffer(shape), cache_buffer(shape), capacity)

    def _hold(self, k: np.ndarray, v: np.ndarray, capacity: int) -> None:
        """Buffers k, v [layers, batch, ...], each layer wrapped once, empty."""
        import onnxruntime

        wrap = onnxruntime.OrtValue.ortvalue_from_numpy
        self.k, self.v = k, v
        self.k_values = [wrap(k[i]) for i in range(k.shape[0])]
        self.v_values = [wrap(v[i]) for i in range(v.shape[0])]
        self.capacity, self.length = capacity, 0

    @classmethod
    def row_of(cls, group, slot: int) -> "BoundKVCache":
        """A one-sequence cache that is buffer row `slot` of `group` (a view, no copy),
        empty: a sequence prefilled into it joins the group without a copy
        (BoundSlots.reserve)."""
        cache = cls.__new__(cls)
        cache._hold(group.cache.k[:, slot:slot + 1], group.cache.v[:, slot:slot + 1],
                    group.cache.capacity)
        cache.group, cache.slot = group, slot
        return cache

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    def bind(self, session):
        """An IO binding of `session` with every layer's buffers bound as its
        cache_keys_i / cache_values_i inputs, for as long as the cache lives."""
        binding = session.io_binding()
        for i, (keys, values) in enumerate(zip(self.k_values, self.v_values)):
            binding.bind_ortvalue_input(f"cache_keys_{i}", keys)
            binding.bind_ortvalue_input(f"cache_values_{i}", values)
        return binding


def keep_rows(buffers, start: int, nodes: list[int]) -> None:
    """Commit a verified tree's accepted path in buffers [..., capacity, head_dim]: the
    keys written at start + nodes[i] move to start + i (KVCache.keep's rule)."""
    if len(set(nodes)) != len(nodes) or any(r < 0 for r in nodes):
        raise ValueError(f"rows to keep must be distinct and >= 0, got {nodes}")
    rows = start + np.asarray(nodes, dtype=np.int64)
    for buffer in buffers:  # fancy indexing copies before the write: overlaps are safe
        buffer[..., start:start + len(nodes), :] = buffer[..., rows, :]


def run_bound(session, binding, feeds: dict, outputs) -> list[np.ndarray]:
    """One step over a binding whose cache buffers are bound: the step's small inputs
    copied in, its outputs (their shapes change with the step) allocated by ORT."""
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name in outputs:
        binding.bind_output(name)
    session.run_with_iobinding(binding)
    return [o.numpy() for o in binding.get_outputs()]


def _buffer_dims(session) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a graph over cache buffers (target-kv, drafter-kv)."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    _, kv_heads, _, head_dim = inputs["cache_keys_0"]
    return sum(name.startswith("cache_keys_") for name in inputs), kv_heads, head_dim


class OnnxTarget:
    """target-kv.onnx run through one IO binding per BoundKVCache; an EAGLE-3 engine's
    target-tree.onnx (tree_session) verifies draft trees over the same buffers through
    a second binding."""

    STEP_OUTPUTS = ("logits", "features", "new_keys", "new_values")

    def __init__(self, session, context_limit: int, tree_session=None, reserve=None,
                 prefiller=None):
        self.session, self.tree_session = session, tree_session
        self.context_limit = context_limit
        # --prefill-dtype bfloat16: prefills run through runtime/backends/bf16_prefill.py
        self.prefiller = prefiller
        self.layers, self.kv_heads, self.head_dim = _buffer_dims(session)
        self.cache: BoundKVCache | None = None
        self.binding = self.tree_binding = None
        self.reserve = reserve  # capacity -> the cache to prefill into (a batch's: BoundRows._reserve)

    def _new_cache(self, capacity: int) -> None:
        self.cache = (self.reserve(capacity) if self.reserve is not None else
                      BoundKVCache(capacity, self.layers, self.kv_heads, self.head_dim))
        self.binding = self.cache.bind(self.session)
        if self.tree_session is not None:
            self.tree_binding = self.cache.bind(self.tree_session)

    def _bind(self, keys, values) -> None:
        for i in range(self.layers):
            self.binding.bind_ortvalue_input(f"cache_keys_{i}", keys[i])
            self.binding.bind_ortvalue_input(f"cache_values_{i}", values[i])

    def _step(self, ids: list[int], logit_positions):
        cache, binding = self.cache, self.binding
        start, t = cache.length, len(ids)
        if start + t > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to "
                             f"{start + t}")
        feeds = {"ids": np.asarray([ids], dtype=np.int64),
                 "logit_positions": np.asarray(logit_positions, dtype=np.int64),
                 "past_len": np.asarray([start], dtype=np.int64)}
        logits, features, keys, values = run_bound(self.session, binding, feeds, self.STEP_OUTPUTS)
        cache.k[:, :, :, start:start + t] = keys  # [layers, batch, kv_heads, t, head_dim]
        cache.v[:, :, :, start:start + t] = values
        cache.length = start + t
        return torch.from_numpy(logits[0]), torch.from_numpy(features[0])

    def prefill(self, ids: list[int], capacity: int):
        """In HOST_PREFILL_CHUNK-token steps, each over a compact copy of the prefix
        committed so far rather than the whole buffer: a step's scores are [chunk, prefix +
        chunk] per head, so a long prefill costs causal attention (the masked capacity
        would roughly double it) at the price of copying the prefix once per chunk."""
        self._new_cache(capacity)
        return self.prefill_more(ids)

    def prefill_more(self, ids: list[int]):
        """Continue a prefill from the cached length (prefill's loop; chunked prefill
        calls it per chunk): the last token's logits and every new token's features."""
        import onnxruntime

        if self.prefiller is not None:
            return self.prefiller(self.cache, ids)
        cache, wrap = self.cache, onnxruntime.OrtValue.ortvalue_from_numpy
        features, done = [], cache.length
        for begin in range(0, len(ids), HOST_PREFILL_CHUNK):
            held = max(done + begin, 1)  # a buffer needs a position; past_len 0 masks it
            prefix = [[wrap(np.ascontiguousarray(buffer[i, :, :, :held]))
                       for i in range(self.layers)] for buffer in (cache.k, cache.v)]
            self._bind(*prefix)
            chunk = ids[begin:begin + HOST_PREFILL_CHUNK]
            logits, chunk_features = self._step(chunk, [len(chunk) - 1])
            features.append(chunk_features)
        self._bind(cache.k_values, cache.v_values)
        return logits[-1], torch.cat(features) if len(features) > 1 else features[0]

    def verify(self, ids: list[int]):
        return self._step(ids, range(len(ids)))

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def verify_tree(self, tree):
        """Every node of a DraftTree (runtime/tree.py) in one pass of target-tree.onnx,
        each row seeing the committed tokens and its ancestors at committed + depth; the
        nodes' keys land past the committed length as scratch until keep_path."""
        if self.tree_session is None:
            raise EngineError("this engine has no target-tree.onnx (not an EAGLE-3 engine) — "
                              "rebuild it with build_engine.py --drafter eagle3")
        cache, start, n = self.cache, self.cache.length, len(tree)
        if start + n > cache.capacity:  # a tree near the end of the budget: grow, as torch does
            self.restore(self.snapshot(), start + n)
            cache = self.cache
        feeds = {"ids": np.asarray([tree.tokens], dtype=np.int64),
                 "positions": np.asarray([tree.depths], dtype=np.int64) + start,
                 "tree_mask": tree.ancestor_mask().numpy()[None],
                 "past_len": np.asarray([start], dtype=np.int64)}
        logits, features, keys, values = run_bound(self.tree_session, self.tree_binding, feeds,
                                                   self.STEP_OUTPUTS)
        cache.k[:, :, :, start:start + n] = keys
        cache.v[:, :, :, start:start + n] = values
        return torch.from_numpy(logits[0]), torch.from_numpy(features[0])

    def keep_path(self, nodes: list[int]) -> None:
        """Commit a verified tree's accepted path (node indices, root first)."""
        keep_rows((self.cache.k, self.cache.v), self.cache.length, nodes)
        self.cache.length += len(nodes)

    def snapshot(self):
        n = self.cache.length
        return n, self.cache.k[:, :, :, :n].copy(), self.cache.v[:, :, :, :n].copy()

    def restore(self, snap, capacity: int) -> None:
        n, k, v = snap
        self._new_cache(capacity)
        self.cache.k[:, :, :, :n] = k
        self.cache.v[:, :, :, :n] = v
        self.cache.length = n


class OnnxDFlash:
    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, vocab: DraftVocab | None = None):
        self.session, self.scaling, self.vocab = session, scaling, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.dims = _cache_dims(session)
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
        self.dims = _cache_dims(session)
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


def takes_lengths(session) -> bool:
    """Whether a drafter graph over a past input takes each sequence's committed length
    (past_lens [batch]) over a past padded to the longest, so one run steps a batch of
    sequences at different lengths: PARD's and DFlash's always, EAGLE-3's exported since
    (before, the past's length, a shape, was the run's one committed count)."""
    return any(i.name == "past_lens" for i in session.get_inputs())


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
        self.dims = _cache_dims(step)
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


# Buffer rows of a new group: serve's default --max-batch, so a batch of up to 8 rows in
# one bucket never moves its rows into a bigger buffer (a regrowth copies every row's keys:
# at 4,096 tokens, 4 rows' worth in the turn that joined the fifth). Spare rows cost no
# memory until written.
FIRST_SLOTS = 8


class BoundSlots(Slots):
    """The slot manager (runtime/backends/slots.py) over BoundKVCaches bound to `session`
    (and `tree_session`, a graph that also reads the groups' buffers: target-tree.onnx):
    a group's cache has room for more rows than it holds, member i in buffer row i, and
    the first len(members) buffer rows are what the session's binding holds. A row joins
    into the next free buffer row -- prefilled there in place (reserve: joining copies
    nothing) or copied in -- and leaves by the last member moving into its place: one
    copy of one row's committed keys each. (Rebuilding the batch's buffer at every join
    and leave, as before, took 46 s of bench --batch 8's 320 at 512 / 4,096 tokens,
    beside 84 s of steps.) Spare rows cost no memory until written: a cache_buffer maps
    its pages as they are written. `length_of(row)`: a batch row's committed length."""

    def __init__(self, session, single, length_of, tree_session=None):
        super().__init__()
        self.session, self.single, self.tree_session = session, single, tree_session
        self.length_of = length_of

    def _new(self, capacity: int, slots: int) -> Group:
        single = self.single
        return Group(row_group(capacity), BoundKVCache(capacity, single.layers, single.kv_heads,
                                                      single.head_dim, batch=slots))

    def group_for(self, capacity: int) -> Group:
        """The group a row of `capacity` joins, with a free buffer row that holds it: its
        bucket's group, remade larger if full or too short (a larger buffer, or twice the
        rows; the members copied in), or a new group -- which joins self.groups only with
        its first row (a step must not meet an empty group)."""
        old = self.find(row_group(capacity))
        if old is None:
            return self._new(capacity, FIRST_SLOTS)
        slots = old.cache.k.shape[1]
        if len(old.members) < slots and capacity <= old.cache.capacity:
            return old
        group = self._new(max(old.cache.capacity, capacity),
                          2 * slots if len(old.members) == slots else slots)
        for i, r in enumerate(old.members):
            self._put(group, old.cache.k[:, i], old.cache.v[:, i], self.length_of(r), i)
        group.members, group.slots = list(old.members), list(old.slots)
        self._bind(group)
        self.groups[self.groups.index(old)] = group
        return group

    def reserve(self, capacity: int) -> BoundKVCache:
        """The cache a sequence about to join prefills into: the next free row of its
        group's buffer (BoundKVCache.row_of), so that joining copies nothing. A
        4,096-token row is about 190 MB of keys and values; copied in at the join, into
        a buffer row never touched before, it took up to 1.4 s of one turn on our VM
        (results/chunked-prefill-ab-128-base-pages.json), every running stream waiting."""
        group = self.group_for(capacity)
        return BoundKVCache.row_of(group, len(group.members))

    def join(self, new: BoundKVCache) -> None:
        """`new` becomes the batch's last row: a cache reserved in a group's buffer
        (reserve) is that buffer row already, unless members left while it prefilled
        (then it moves down, into rows touched before); any other is copied in."""
        group = getattr(new, "group", None)
        at = None if group is None else len(group.members)
        if group is None:
            group = self.group_for(new.capacity)
            at = len(group.members)
            self._put(group, new.k[:, 0], new.v[:, 0], new.length, at)
        elif new.slot != at:
            n = new.length
            group.cache.k[:, at, :, :n] = group.cache.k[:, new.slot, :, :n]
            group.cache.v[:, at, :, :n] = group.cache.v[:, new.slot, :, :n]
        self._admit(group, at)
        self._bind(group)

    @staticmethod
    def _put(group: Group, k: np.ndarray, v: np.ndarray, length: int, at: int) -> None:
        """Committed keys/values ([layers, kv_heads, >= length, head_dim]) into buffer row
        `at`."""
        group.cache.k[:, at, :, :length] = k[:, :, :length]
        group.cache.v[:, at, :, :length] = v[:, :, :length]

    def _leave(self, group: Group, at: int) -> None:
        """Member `at` leaves; the last member moves into its buffer row."""
        last = len(group.members) - 1
        if at != last:
            n = self.length_of(group.members[last])
            group.cache.k[:, at, :, :n] = group.cache.k[:, last, :, :n]
            group.cache.v[:, at, :, :n] = group.cache.v[:, last, :, :n]
            group.members[at] = group.members[last]
        group.members.pop()
        group.slots.pop()
        self._bind(group)

    def _bind(self, group: Group) -> None:
        """Bind the members' buffer rows (a contiguous view of each layer: no copy), to
        the step graph and, where there is one, the tree graph."""
        import onnxruntime

        wrap, n = onnxruntime.OrtValue.ortvalue_from_numpy, len(group.members)
        values = [(f"cache_{name}_{i}", wrap(buffer[i, :n])) for name, buffer in
                  (("keys", group.cache.k), ("values", group.cache.v))
                  for i in range(self.single.layers)]
        group.binding = self.session.io_binding()
        group.tree_binding = self.tree_session.io_binding() if self.tree_session else None
        for binding in filter(None, (group.binding, group.tree_binding)):
            for name, value in values:
                binding.bind_ortvalue_input(name, value)


def check_room(group: Group, ends) -> None:
    """Refuse a pass whose rows would write up to `ends` past the group's buffer."""
    end = int(max(ends))
    if end > group.cache.capacity:
        raise ValueError(f"KV cache holds {group.cache.capacity} tokens; asked to write up to "
                         f"{end}")


def store(group: Group, lengths: list[int], keys: np.ndarray, values: np.ndarray,
          counts: list[int]) -> None:
    """A pass's new keys/values [layers, g, kv_heads, t, head_dim]: the first counts[i] of
    the group's row i at its committed length lengths[i]."""
    for i, (start, c) in enumerate(zip(lengths, counts)):
        group.cache.k[:, i, :, start:start + c] = keys[:, i, :, :c]
        group.cache.v[:, i, :, start:start + c] = values[:, i, :, :c]


class BoundRows:
    """A batch's rows in BoundKVCaches bound to `session`, grouped by capacity bucket
    (`slots`: BoundSlots), `lengths` committed per row in the batch's order. A step runs
    one pass per group, so each row reads a buffer near its own capacity rather than the
    batch's largest; the steps between joins and leaves read the buffers in place.
    Subclasses set `single` (its layers, kv_heads and head_dim), `session`, `lengths`
    (empty) and call _slots()."""

    lengths: list[int]
    tree_session = None  # a graph that also reads the groups' buffers (target-tree.onnx)

    def _slots(self) -> None:
        self.slots = BoundSlots(self.session, self.single, lambda r: self.lengths[r],
                                self.tree_session)

    @property
    def groups(self) -> list[Group]:
        return self.slots.groups

    def _reserve(self, capacity: int) -> BoundKVCache:
        return self.slots.reserve(capacity)

    def _join(self, new: BoundKVCache) -> None:
        self.slots.join(new)
        self.lengths.append(new.length)

    def _group_lengths(self, group: Group) -> list[int]:
        return [self.lengths[r] for r in group.members]

    def remove(self, row: int) -> None:
        self.slots.drop(row)
        del self.lengths[row]


class OnnxBatchTarget(BoundRows):
    """target-kv.onnx over a batch (BoundRows), each group's `lengths` fed as past_len
    [g]. A sequence is prefilled alone (OnnxTarget.prefill) into the buffer row it
    will hold (BoundSlots.reserve), then joins without a copy. An EAGLE-3
    engine's target-tree.onnx (`tree_session`) verifies every row's draft tree in one
    pass per group over the same buffers (packs_trees: its graph takes a batch)."""

    def __init__(self, session, context_limit: int, tree_session=None, prefiller=None):
        self.single = OnnxTarget(session, context_limit, reserve=self._reserve,
                                 prefiller=prefiller)
        self.session, self.context_limit = session, context_limit
        self.tree_session = tree_session
        self.lengths: list[int] = []
        self._slots()

    @property
    def packs_trees(self) -> bool:
        """Whether verify_trees can run: a tree graph whose batch dimension is free (a
        graph fixed to one sequence leaves the decoder verifying trees row by row)."""
        if self.tree_session is None or not modes.BACKENDS["onnxruntime"].packed_trees:
            return False
        batch = next(i.shape[0] for i in self.tree_session.get_inputs() if i.name == "ids")
        return not isinstance(batch, int) or batch > 1

    def add(self, ids: list[int], capacity: int):
        result = self.single.prefill(ids, capacity)
        self._join(self.single.cache)
        return result

    def join_prefilled(self) -> None:
        """Make the sequence prefilled on `single` (prefill, prefill_more) the last row:
        add() in two halves, so a prompt can prefill in chunks between batch steps."""
        self._join(self.single.cache)

    def verify(self, rows: list[list[int]]):
        """One pass per group, its rows padded to its widest; the outputs padded to the
        batch's widest row (a padding position's outputs are never read)."""
        width, logits, features = max(len(r) for r in rows), None, None
        for group in self.groups:
            ids = np.asarray(padded([rows[r] for r in group.members]), dtype=np.int64)
            meta = StepMetadata(torch.tensor(self._group_lengths(group)), ids.shape[1])
            check_room(group, meta.committed().tolist())
            feeds = {"ids": ids, "logit_positions": np.arange(meta.new, dtype=np.int64),
                     "past_len": meta.cached.numpy()}
            out_logits, out_features, keys, values = run_bound(
                self.session, group.binding, feeds, OnnxTarget.STEP_OUTPUTS)
            store(group, meta.cached.tolist(), keys, values, [meta.new] * len(group.members))
            if logits is None:
                logits = np.zeros((len(rows), width) + out_logits.shape[2:], np.float32)
                features = np.zeros((len(rows), width) + out_features.shape[2:], np.float32)
            logits[group.members, :meta.new] = out_logits
            features[group.members, :meta.new] = out_features
            for r, n in zip(group.members, meta.committed().tolist()):
                self.lengths[r] = n
        return torch.from_numpy(logits), torch.from_numpy(features)

    def verify_trees(self, trees: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every row's draft tree (runtime/tree.py: pack) in one target-tree.onnx pass per
        group: each node sees its own row's committed keys and its ancestors, at that
        row's length + depth; the nodes' keys land past each row's committed length as
        scratch until keep_paths. (logits [n_i, vocab], features [n_i, F]) per row."""
        out = [None] * len(trees)
        for group in self.groups:
            part = [trees[r] for r in group.members]
            ids, mask, depths = pack(part)
            meta = StepMetadata(torch.tensor(self._group_lengths(group)), ids.shape[1])
            rows = meta.tree_rows(mask, depths)
            check_room(group, (meta.cached + torch.tensor([len(t) for t in part])).tolist())
            feeds = {"ids": ids.numpy(), "positions": rows.positions.numpy(),
                     "tree_mask": mask.numpy(), "past_len": meta.cached.numpy()}
            logits, features, keys, values = run_bound(self.tree_session, group.tree_binding,
                                                       feeds, OnnxTarget.STEP_OUTPUTS)
            store(group, meta.cached.tolist(), keys, values, [len(t) for t in part])
            for i, (r, tree) in enumerate(zip(group.members, part)):
                out[r] = (torch.from_numpy(logits[i, :len(tree)]),
                          torch.from_numpy(features[i, :len(tree)]))
        return out

    def keep_paths(self, paths: list[list[int]]) -> None:
        """Commit each row's accepted path (node indices, root first) of its verified tree."""
        for group in self.groups:
            for i, r in enumerate(group.members):
                keep_rows((group.cache.k[:, i], group.cache.v[:, i]), self.lengths[r], paths[r])
                self.lengths[r] += len(paths[r])

    def rollback(self, lengths: list[int]) -> None:
        if any(not 0 <= n <= have for n, have in zip(lengths, self.lengths)):
            raise ValueError(f"cannot roll back caches of {self.lengths} tokens to {lengths}")
        self.lengths = list(lengths)


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


def has_window(session) -> bool:
    """Whether a drafter-kv graph takes a draft window (engines exported since it does)."""
    return any(i.name == "window" for i in session.get_inputs())


def window_feed(session, window: int | None) -> dict:
    """The `window` input of a drafter-kv graph: 0 (none) unless one is asked for; graphs
    exported before the input existed take none, and refuse a window."""
    if not has_window(session):
        if window is not None:
            raise EngineError("this engine's drafter graph takes no draft window — rebuild it "
                              "with build_engine.py")
        return {}
    if window is not None and window < 1:
        raise ValueError(f"a draft window must be >= 1 token, got {window}")
    return {"window": np.asarray([window or 0], dtype=np.int64)}


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
        self.layers, self.kv_heads, self.head_dim = _buffer_dims(session)
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


class OnnxEngine:
    """The sessions of one engine directory: target, SharpDraft drafter, frozen drafter.
    The onnxruntime backend's loader (runtime/backends/__init__.py: LOADERS): float32
    graphs on the CPU, so `device` and `dtype` take those values only; `prefill_dtype`
    bfloat16 prefills through runtime/backends/bf16_prefill.py instead of the graph."""

    can = modes.BACKENDS["onnxruntime"]

    def __init__(self, engine_dir: Path, manifest: Manifest, drafting=None,
                 threads: int | None = None, device: str = "cpu", dtype: str | None = None,
                 prefill_dtype: str | None = None):
        if str(device) != "cpu" or dtype not in (None, "float32"):
            raise EngineError(f"{engine_dir}: the onnxruntime backend runs float32 graphs on the "
                              f"cpu, not {dtype or 'float32'} on {device} — pass --backend torch")
        self.device, self.dtype = "cpu", "float32"
        record = manifest.extra.get("onnx")
        if not record:
            raise EngineError(f"{engine_dir} holds no ONNX graphs (built for backend "
                              f"{manifest.backend!r}) — rebuild with build_engine.py "
                              "--backend onnxruntime")
        if manifest.dtype != "float32":
            raise EngineError(f"{engine_dir}: the onnxruntime backend runs float32 graphs, this "
                              f"engine is {manifest.dtype}")
        version = record.get("export_version", 1)
        if version != EXPORT_VERSION or "target_kv" not in record["graphs"]:
            raise EngineError(f"{engine_dir} holds ONNX graphs of export version {version}; this "
                              f"runtime runs version {EXPORT_VERSION} (per-sequence lengths as "
                              "inputs) — rebuild it with build_engine.py --backend onnxruntime")
        graphs = record["graphs"]
        # A graph whose form over the runtime's cache buffers (name + "_kv") the engine
        # has is not run here: target.onnx, and the drafter graphs of native-form engines
        # built since drafter-kv.onnx (older engines and plugin-form ones have none).
        self.sessions = {name: open_session(Path(engine_dir) / g["file"], threads,
                                            python_ops=bool(g.get("plugin_nodes")))
                         for name, g in graphs.items() if name + "_kv" not in graphs}
        self.scaling = manifest.query_scaling
        self.block_size = manifest.block_size
        self.mask_token_id = record["mask_token_id"]  # None in n-gram engines (no drafter)
        self.vocab = read_draft_vocab(engine_dir, record)
        self.drafter_family = manifest.drafter
        self.tree_shape = TreeShape(**manifest.extra["eagle3"]) if manifest.drafter == "eagle3" else None
        self.context_limit = int(manifest.extra["max_seq_len"])
        self.prefill_dtype = bf16_prefill.check_dtype(prefill_dtype)
        self.prefiller, self.prefill_grid = None, None
        if self.prefill_dtype == "bfloat16":
            self.prefill_grid = bf16_prefill.ROWS  # chunks must cut a prompt on it
            width = next(o for o in graphs["target_kv"]["outputs"] if o["name"] == "features")
            self.prefiller = bf16_prefill.Bf16Prefill.build(manifest, width["shape"][-1])
        self.target = self.new_target()
        self.tokenizer = load_tokenizer(manifest.target_dir)

    def new_target(self) -> OnnxTarget:
        """A target with its own cache over the shared sessions (one per sequence)."""
        return OnnxTarget(self.sessions["target_kv"], self.context_limit,
                          self.sessions.get("target_tree"), prefiller=self.prefiller)

    def _drafter_graph(self, sharpdraft: bool):
        """(session, scaling, in place) of the SharpDraft or the frozen drafter."""
        name, scaling = (("drafter", self.scaling) if sharpdraft and self.scaling is not None
                         else ("drafter_frozen", None))
        in_place = name + "_kv" in self.sessions
        return self.sessions[name + "_kv" if in_place else name], scaling, in_place

    def has_window(self) -> bool:
        """Whether the frozen drafter can draft under a window (window mode)."""
        session, _, in_place = self._drafter_graph(sharpdraft=False)
        return self.drafter_family == "dflash" and in_place and has_window(session)

    def drafter(self, scaling: QueryScaling | None, window: int | None = None
                ) -> OnnxDFlash | BoundDFlash | OnnxPARD | OnnxEagle3:
        """The SharpDraft drafter (`scaling`: the engine's, compiled in) or the frozen one
        (None)."""
        session, scaling, in_place = self._drafter_graph(scaling is not None)
        if window is not None:
            if not self.has_window():
                raise EngineError("this engine's drafter graphs take no draft window — rebuild "
                                  "it with build_engine.py (native attention)")
            return BoundDFlash(session, self.block_size, self.mask_token_id, scaling, self.vocab,
                               window)
        if self.drafter_family == "eagle3":
            tree = self.sessions["drafter_tree" if scaling is not None else "drafter_frozen_tree"]
            return OnnxEagle3(session, tree, scaling, self.tree_shape, max(self.block_size - 1, 1))
        if self.drafter_family == "pard":
            return OnnxPARD(session, self.mask_token_id, self.block_size - 1, scaling)
        return (BoundDFlash if in_place else OnnxDFlash)(session, self.block_size,
                                                         self.mask_token_id, scaling, self.vocab)

    def batch_target(self) -> OnnxBatchTarget:
        return OnnxBatchTarget(self.sessions["target_kv"], self.target.context_limit,
                               self.sessions.get("target_tree"), prefiller=self.prefiller)

    def batch_drafter(self, scaling: QueryScaling | None, window: int | None = None):
        """The drafter over a batch: DFlash blocks (with a `window`, over the drafter graph
        that takes one) and PARD chains in one run per step, EAGLE-3 chains in one run
        per step and chain link (modes.BACKENDS["onnxruntime"].batched_drafters); an
        EAGLE-3 engine exported before its graphs took past_lens (takes_lengths) drafts
        its chains one row at a time (RowChainDrafters)."""
        session, scaling, in_place = self._drafter_graph(scaling is not None)
        if self.drafter_family == "eagle3":
            tree = self.sessions["drafter_tree" if scaling is not None else "drafter_frozen_tree"]
            if not (takes_lengths(session) and takes_lengths(tree)):
                return RowChainDrafters(lambda: self.drafter(scaling))
            return OnnxBatchEagle3(session, tree, scaling, self.tree_shape,
                                   max(self.block_size - 1, 1))
        if self.drafter_family == "pard":
            return OnnxBatchPARD(session, self.mask_token_id, self.block_size - 1, scaling)
        if window is not None:
            if not self.has_window():
                raise EngineError("this engine's drafter graphs take no draft window — rebuild "
                                  "it with build_engine.py (native attention)")
            return BoundBatchDFlash(session, self.block_size, self.mask_token_id, scaling,
                                    self.vocab, window)
        return (BoundBatchDFlash if in_place else OnnxBatchDFlash)(session, self.block_size,
                                                                   self.mask_token_id, scaling,
                                                                   self.vocab)
