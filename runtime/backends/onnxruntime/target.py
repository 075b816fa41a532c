"""The target's graphs: target-kv.onnx over a batch (OnnxBatchTarget: the rows in
BoundSlots, one pass per group; a joining sequence prefilled in host chunks into the
buffer row it will hold; every row's draft tree in one target-tree.onnx pass per group)."""

from __future__ import annotations


import numpy as np
import torch

from runtime.backends.roles import BatchTarget, TokenRows
from runtime.manifest import EngineError
from runtime.step_metadata import StepMetadata
from runtime.tree import pack
from runtime.backends.onnxruntime.buffers import (BoundKVCache, HOST_PREFILL_CHUNK, buffer_dims,
                                                  keep_rows, run_bound)
from runtime.backends.onnxruntime.bound_rows import BoundSlots, check_room, store

class OnnxBatchTarget(BatchTarget):
    """target-kv.onnx over a batch: the rows in BoundSlots, each group's committed
    lengths fed as past_len [g]. A joining sequence prefills aside (prefill,
    prefill_more) into the buffer row it will hold (BoundSlots.reserve), then joins
    without a copy (join_prefilled). An EAGLE-3 engine's target-tree.onnx
    (`tree_session`) verifies every row's draft tree in one pass per group over the
    same buffers."""

    STEP_OUTPUTS = ("logits", "features", "new_keys", "new_values")

    def __init__(self, session, context_limit: int, tree_session=None, prefiller=None):
        self.session, self.tree_session = session, tree_session
        self.context_limit = context_limit
        # --prefill-dtype bfloat16: prefills run through runtime/backends/bf16_prefill.py
        self.prefiller = prefiller
        self.slots = BoundSlots(session, tree_session)
        # the slot manager's lists (it changes them in place): groups, each row's length
        self.groups, self.lengths = self.slots.groups, self.slots.lengths
        self.joining: BoundKVCache | None = None  # the sequence held aside until it joins

    def add(self, ids: list[int], capacity: int):
        result = self.prefill(ids, capacity)
        self.join_prefilled()
        return result

    def prefill(self, ids: list[int], capacity: int):
        """A joining sequence's first part, into the buffer row it will hold; (the last
        token's logits, every token's features)."""
        self.joining = self.slots.reserve(capacity)
        return self.prefill_more(ids)

    def prefill_more(self, ids: list[int]):
        """The held sequence's next part, in HOST_PREFILL_CHUNK-token steps, each over a
        compact copy of the prefix committed so far rather than the whole buffer: a
        step's scores are [chunk, prefix + chunk] per head, so a long prefill costs
        causal attention (the masked capacity would roughly double it) at the price of
        copying the prefix once per chunk."""
        import onnxruntime

        cache = self.joining
        if self.prefiller is not None:
            return self.prefiller(cache, ids)
        wrap, binding = onnxruntime.OrtValue.ortvalue_from_numpy, self.session.io_binding()
        features = []
        for begin in range(0, len(ids), HOST_PREFILL_CHUNK):
            chunk, start = ids[begin:begin + HOST_PREFILL_CHUNK], cache.length
            end = start + len(chunk)
            check_room(cache, [end])
            held = max(start, 1)  # a buffer needs a position; past_len 0 masks it
            for name, buffer in (("keys", cache.k), ("values", cache.v)):
                for i in range(buffer.shape[0]):
                    binding.bind_ortvalue_input(f"cache_{name}_{i}", wrap(
                        np.ascontiguousarray(buffer[i, :, :, :held])))
            feeds = {"ids": np.asarray([chunk], dtype=np.int64),
                     "logit_positions": np.asarray([len(chunk) - 1], dtype=np.int64),
                     "past_len": np.asarray([start], dtype=np.int64)}
            logits, chunk_features, keys, values = run_bound(self.session, binding, feeds,
                                                             self.STEP_OUTPUTS)
            store(cache, [start], keys, values, [len(chunk)])
            cache.length = end
            features.append(torch.from_numpy(chunk_features[0]))
        last = torch.from_numpy(logits[0, -1])
        return last, torch.cat(features) if len(features) > 1 else features[0]

    def join_prefilled(self) -> None:
        """The sequence held aside (prefill, prefill_more, restore) becomes the last row:
        add() in two halves, so a prompt can prefill in chunks between batch steps."""
        self.slots.join(self.joining)
        self.joining = None

    def snapshot(self):
        """A copy of the held sequence (before join_prefilled), independent of later steps."""
        cache, n = self.joining, self.joining.length
        return cache.capacity, n, cache.k[..., :n, :].copy(), cache.v[..., :n, :].copy()

    def restore(self, snap, capacity: int | None = None) -> None:
        """The snapshot's sequence held aside again, in a buffer row of its own of
        `capacity` keys (default: the one it was prefilled in)."""
        held, n, k, v = snap
        self.joining = self.slots.reserve(capacity or held)
        self.joining.k[..., :n, :] = k
        self.joining.v[..., :n, :] = v
        self.joining.length = n

    def verify(self, rows: TokenRows):
        """One pass per group, its rows padded to its widest; the outputs padded to the
        batch's widest row (a padding position's outputs are never read)."""
        width, logits, features = rows.width, None, None
        for group in self.groups:
            ids = rows.padded(group.members).numpy()
            meta = StepMetadata(torch.tensor(self.slots.lengths_of(group)), ids.shape[1])
            check_room(group.cache, meta.committed().tolist())
            feeds = {"ids": ids, "logit_positions": np.arange(meta.new, dtype=np.int64),
                     "past_len": meta.cached.numpy()}
            out_logits, out_features, keys, values = run_bound(
                self.session, group.binding, feeds, self.STEP_OUTPUTS)
            store(group.cache, meta.cached.tolist(), keys, values, [meta.new] * len(group.members))
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
            meta = StepMetadata(torch.tensor(self.slots.lengths_of(group)), ids.shape[1])
            rows = meta.tree_rows(mask, depths)
            check_room(group.cache, (meta.cached + torch.tensor([len(t) for t in part])).tolist())
            feeds = {"ids": ids.numpy(), "positions": rows.positions.numpy(),
                     "tree_mask": mask.numpy(), "past_len": meta.cached.numpy()}
            logits, features, keys, values = run_bound(self.tree_session, group.tree_binding,
                                                       feeds, self.STEP_OUTPUTS)
            store(group.cache, meta.cached.tolist(), keys, values, [len(t) for t in part])
            for i, (r, tree) in enumerate(zip(group.members, part)):
                out[r] = (torch.from_numpy(logits[i, :len(tree)]),
                          torch.from_numpy(features[i, :len(tree)]))
        return out

    def keep_paths(self, paths: TokenRows) -> None:
        """Commit each row's accepted path (node indices, root first) of its verified tree."""
        for group in self.groups:
            for i, r in enumerate(group.members):
                path = paths.row(r).tolist()
                keep_rows((group.cache.k[:, i], group.cache.v[:, i]), self.lengths[r], path)
                self.lengths[r] += len(path)

    def rollback(self, lengths: list[int]) -> None:
        if any(not 0 <= n <= have for n, have in zip(lengths, self.lengths)):
            raise ValueError(f"cannot roll back caches of {self.lengths} tokens to {lengths}")
        self.lengths[:] = lengths

    def remove(self, row: int) -> None:
        self.slots.drop(row)
