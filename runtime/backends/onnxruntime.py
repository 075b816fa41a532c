"""The onnxruntime backend: an engine's exported graphs (build/export.py) in ONNX Runtime
sessions on the CPU, behind the same Target / BlockDrafter interface as the torch
backend. SharpDraftAttention nodes run through the onnxruntime-extensions op of
plugins/onnx.py, so the drafter file TensorRT would parse is the file that runs here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.manifest import EngineError, Manifest
from plugins.onnx import onnxruntime_session_options
from plugins.scaling import QueryScaling


class HostKVCache:
    """A graph's KV cache on the host: preallocated [capacity, layers, batch, kv_heads,
    head_dim] (sequence-major), `length` tokens committed. The past fed to a step is a
    contiguous slice, so no copy; a rollback is a length change."""

    def __init__(self, capacity: int, layers: int, kv_heads: int, head_dim: int,
                 batch: int = 1, dtype=np.float32):
        shape = (capacity, layers, batch, kv_heads, head_dim)
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
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


def open_session(path: Path, threads: int | None = None):
    import onnxruntime

    options = onnxruntime_session_options()
    # Same thread count as torch's, so backends compare like for like.
    options.intra_op_num_threads = threads or torch.get_num_threads()
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _cache_dims(session) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from the graph's past_keys input."""
    shape = next(i.shape for i in session.get_inputs() if i.name == "past_keys")
    return shape[1], shape[3], shape[4]


class OnnxTarget:
    def __init__(self, session, context_limit: int):
        self.session = session
        self.context_limit = context_limit
        self.dims = _cache_dims(session)
        self.cache: HostKVCache | None = None

    def _step(self, ids: list[int], logit_positions):
        feeds = {"ids": np.asarray([ids], dtype=np.int64),
                 "logit_positions": np.asarray(logit_positions, dtype=np.int64)}
        logits, features, keys, values = self.session.run(None, feeds | self.cache.past())
        self.cache.append(keys, values)
        return torch.from_numpy(logits[0]), torch.from_numpy(features[0])

    def prefill(self, ids: list[int], capacity: int):
        self.cache = HostKVCache(capacity, *self.dims)
        logits, features = self._step(ids, [len(ids) - 1])
        return logits[-1], features

    def verify(self, ids: list[int]):
        return self._step(ids, range(len(ids)))

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def snapshot(self):
        n = self.cache.length
        return self.cache.k[:n].copy(), self.cache.v[:n].copy()

    def restore(self, snap, capacity: int) -> None:
        self.cache = HostKVCache(capacity, *self.dims)
        self.cache.append(*snap)


class OnnxDFlash:
    def __init__(self, session, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None):
        self.session, self.scaling = session, scaling
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.dims = _cache_dims(session)
        self.feature_size = next(i.shape[-1] for i in session.get_inputs() if i.name == "context")
        self.cache: HostKVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = HostKVCache(capacity, *self.dims)

    def draft(self, context: torch.Tensor, bonus: int):
        block = np.asarray([[bonus] + [self.mask_token_id] * (self.block_size - 1)], dtype=np.int64)
        feeds = {"block_ids": block,
                 "context": np.ascontiguousarray(context.numpy(), dtype=np.float32)[None]}
        logits, keys, values = self.session.run(None, feeds | self.cache.past())
        self.cache.append(keys, values)
        # Every block row saw the cached context plus the whole block (bidirectional).
        return torch.from_numpy(logits[0]), self.cache.length + self.block_size


class OnnxEngine:
    """The sessions of one engine directory: target, SharpDraft drafter, frozen drafter."""

    def __init__(self, engine_dir: Path, manifest: Manifest, threads: int | None = None):
        record = manifest.extra.get("onnx")
        if not record:
            raise EngineError(f"{engine_dir} holds no ONNX graphs (built for backend "
                              f"{manifest.backend!r}) — rebuild with build_engine.py "
                              "--backend onnxruntime")
        if manifest.dtype != "float32":
            raise EngineError(f"{engine_dir}: the onnxruntime backend runs float32 graphs, this "
                              f"engine is {manifest.dtype}")
        graphs = record["graphs"]
        self.sessions = {name: open_session(Path(engine_dir) / g["file"], threads)
                         for name, g in graphs.items()}
        self.scaling = manifest.query_scaling
        self.block_size = manifest.block_size
        self.mask_token_id = record["mask_token_id"]  # None in n-gram engines (no drafter)
        self.target = OnnxTarget(self.sessions["target"], int(manifest.extra["max_seq_len"]))

    def drafter(self, sharpdraft: bool = True) -> OnnxDFlash:
        if sharpdraft and self.scaling is not None:
            return OnnxDFlash(self.sessions["drafter"], self.block_size, self.mask_token_id,
                              self.scaling)
        return OnnxDFlash(self.sessions["drafter_frozen"], self.block_size, self.mask_token_id, None)
