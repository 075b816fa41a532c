"""The onnxruntime backend's sessions and cache buffers: a session opened with the
threading policy below, the host caches a graph reads (HostKVCache: an input; BoundKVCache:
bound once through IO binding and read where it lies), and what a graph's inputs say it
takes (a batch's lengths, a draft window)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from plugins.onnx import onnxruntime_session_options
from runtime.manifest import EngineError

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


def cache_dims(session) -> tuple[int, int, int]:
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


def buffer_dims(session) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a graph over cache buffers (target-kv, drafter-kv)."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    _, kv_heads, _, head_dim = inputs["cache_keys_0"]
    return sum(name.startswith("cache_keys_") for name in inputs), kv_heads, head_dim

def takes_lengths(session) -> bool:
    """Whether a drafter graph over a past input takes each sequence's committed length
    (past_lens [batch]) over a past padded to the longest, so one run steps a batch of
    sequences at different lengths: every graph build/export.py writes (EAGLE-3's
    exported before it read the past's length, a shape, as the run's one committed
    count; check_batched refuses them)."""
    return any(i.name == "past_lens" for i in session.get_inputs())


def takes_batch(session) -> bool:
    """Whether a graph's batch dimension (its `ids` input's first) is free, not fixed to
    one sequence."""
    batch = next(i.shape[0] for i in session.get_inputs() if i.name == "ids")
    return not isinstance(batch, int) or batch > 1


def check_batched(engine_dir, sessions: dict) -> None:
    """Refuse an engine whose graphs step one sequence at a time: a target-tree.onnx
    fixed to one sequence, or a drafter graph over a past input without past_lens (EAGLE-3
    engines exported before it). The roles run every batch in one pass per step and
    trees packed; such graphs would leave them row by row."""
    tree = sessions.get("target_tree")
    if tree is not None and not takes_batch(tree):
        raise EngineError(f"{engine_dir}: its target-tree.onnx verifies one sequence at a time "
                          "— rebuild the engine with build_engine.py --backend onnxruntime")
    old = sorted(name for name, session in sessions.items()
                 if any(i.name == "past_keys" for i in session.get_inputs())
                 and not takes_lengths(session))
    if old:
        raise EngineError(f"{engine_dir}: its drafter graphs ({', '.join(old)}) take one "
                          "committed length per run (no past_lens) — rebuild the engine with "
                          "build_engine.py --backend onnxruntime")


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
