"""The tensorrt backend: an engine's TensorRT plans (build/tensorrt_build.py builds them from the
ONNX graphs the onnxruntime backend runs) executed through TensorRT's Python runtime, behind
the same batch roles as the torch and onnxruntime backends, one sequence at a time.

One execution context per plan, tensors bound by name (set_input_shape /
set_tensor_address) and run with execute_async_v3 on one CUDA stream. The KV caches are
torch tensors preallocated on the GPU and updated in place: the target's
[layers, batch, kv_heads, capacity, head_dim] buffers are bound to target-kv.plan layer by
layer (as OnnxBatchTarget binds them to ONNX Runtime), and the drafter's sequence-major cache
is bound twice, the committed prefix as the past and the free space after it as the
step's present keys/values, so TensorRT writes the new context's keys straight into it.

Every address bound is 256-byte aligned, as setTensorAddress requires: buffers come from
`aligned_empty`, the target cache pads each layer to a multiple of 256 bytes (its capacity,
and so the graph's arithmetic, stays exact), and a drafter step whose free rows do not
start on a boundary writes its new keys to an aligned staging buffer and copies them in.

Where buffers live is decided in one place, `gpu()`: the first CUDA device, or none (then
the backend refuses in one line). The stand-in test run (tests/fake_tensorrt.py) replaces
`gpu` with the CPU, so the same code binds host addresses that the stand-in reads back.
tensorrt and CUDA are imported only when an engine is opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import torch

from plugins.scaling import QueryScaling
from runtime import modes
from runtime.backends.roles import BatchBlockDrafter, BatchTarget, Loaded, TokenRows, load_tokenizer
from runtime.manifest import EngineError, Manifest, read_draft_vocab
from runtime.backends.onnxruntime import PREFILL_CHUNK
from runtime.sampling import DraftVocab
from runtime.step_metadata import StepMetadata

PLAN_SUFFIX = ".plan"
STEP_OUTPUTS = ("logits", "features", "new_keys", "new_values")


def gpu() -> torch.device | None:
    """The device TensorRT runs on and every buffer of this backend lives on, or None.
    The only place the backend chooses a device."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def device_name(device: torch.device) -> str:
    """What engine.json records as the GPU a plan was built for (plans run only there)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def no_gpu_reason() -> str:
    return ("no CUDA GPU is visible; TensorRT plans are built for and run on an NVIDIA GPU "
            "— use --backend onnxruntime")


class Device:
    """A device and the one stream every plan of an engine runs on. Every torch operation
    of the backend (allocations, cache writes, input copies) is issued on the same stream,
    so it is ordered with the plans without events; a step synchronises once, before its
    logits go back to the speculative loop, which reads them on torch's current stream.
    (Not torch's default stream itself: TensorRT synchronises after every
    execute_async_v3 on the legacy default stream.) Host memory (the stand-in run) has no
    stream."""

    def __init__(self, device: torch.device):
        self.torch = device
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
            self.handle = self.stream.cuda_stream
        else:
            self.stream, self.handle = None, 0

    def on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


ALIGNMENT = 256  # bytes: "The pointer must have at least 256-byte alignment" (NvInferRuntime.h)


def aligned_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A dense tensor of `shape` whose first element lies on an ALIGNMENT boundary. CUDA's
    caching allocator already gives 512-byte blocks; host memory (the stand-in run) does
    not, and the rule is stated once here rather than trusted to an allocator."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = math.prod(shape)
    raw = torch.empty(count + ALIGNMENT // itemsize, dtype=dtype, device=device)
    skip = (-raw.data_ptr() % ALIGNMENT) // itemsize
    return raw[skip:skip + count].view(shape)


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when it is dense and aligned, else an aligned dense copy (for the
    small per-step inputs; the caches are aligned by construction)."""
    if tensor.is_contiguous() and tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    out = aligned_empty(tuple(tensor.shape), tensor.dtype, tensor.device)
    out.copy_(tensor)
    return out


def torch_dtypes(trt) -> dict:
    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64, trt.int32: torch.int32}


class Plan:
    """One deserialized plan and its execution context. `run` binds each input tensor where
    it lies and each output to a given tensor (written in place) or a new one."""

    def __init__(self, trt, runtime, path: Path, device: Device):
        self.name, self.device = path.name, device
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineError(f"TensorRT could not load {path} (a plan runs only with the "
                              "TensorRT version and GPU it was built with) — rebuild the engine")
        self.engine = engine
        self.context = engine.create_execution_context()
        dtypes = torch_dtypes(trt)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {}
        for n in names:
            kind = engine.get_tensor_dtype(n)
            if kind not in dtypes:
                raise EngineError(f"{path}: tensor {n} has TensorRT type {kind}, which this "
                                  "backend does not bind")
            self.dtypes[n] = dtypes[kind]
        # The shapes profile 0 admits, per input: (min, opt, max).
        self.profile = {n: [tuple(s) for s in engine.get_tensor_profile_shape(n, 0)]
                        for n in self.inputs}

    def check_dtype(self, name: str, dtype: torch.dtype, engine_dtype: str) -> None:
        if self.dtypes[name] != dtype:
            raise EngineError(f"{self.name}: {name} is {str(self.dtypes[name]).removeprefix('torch.')} "
                              f"but the engine is {engine_dtype} — rebuild the engine")

    def limit(self, name: str, axis: int) -> int:
        """The largest size the profile admits for one axis of an input."""
        return self.profile[name][2][axis]

    def run(self, inputs: dict, outputs: dict | None = None) -> dict:
        outputs = dict(outputs or {})
        context = self.context
        for name in self.inputs:
            tensor = inputs[name]
            shape = tuple(tensor.shape)
            low, _, high = self.profile[name]
            if len(low) == len(shape) and not all(lo <= s <= hi for lo, s, hi in zip(low, shape, high)):
                raise EngineError(f"{self.name}: input {name} of shape {list(shape)} lies outside "
                                  f"the plan's profile ({list(low)} .. {list(high)}) — rebuild the "
                                  "engine with a larger --max-seq-len")
            self._check(name, tensor)
            if not context.set_input_shape(name, shape):
                raise EngineError(f"{self.name}: TensorRT refused shape {list(shape)} for {name}")
            self._bind(name, tensor)
        for name in self.outputs:
            shape = tuple(context.get_tensor_shape(name))
            if name not in outputs:
                outputs[name] = aligned_empty(shape, self.dtypes[name], self.device.torch)
            elif tuple(outputs[name].shape) != shape:
                raise EngineError(f"{self.name}: output {name} has shape {list(shape)}, the buffer "
                                  f"for it {list(outputs[name].shape)}")
            self._check(name, outputs[name])
            self._bind(name, outputs[name])
        if not context.execute_async_v3(self.device.handle):
            raise EngineError(f"{self.name}: TensorRT failed to run the plan (see its log above)")
        return outputs

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        address = tensor.data_ptr()
        if address % ALIGNMENT or not self.context.set_tensor_address(name, address):
            raise EngineError(f"{self.name}: TensorRT refused the address {address:#x} of {name} "
                              f"(it needs {ALIGNMENT}-byte alignment)")

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        # TensorRT reads and writes dense row-major memory at the address it is given.
        if tensor.dtype != self.dtypes[name] or not tensor.is_contiguous() or \
                tensor.device != self.device.torch:
            raise EngineError(f"{self.name}: {name} must be a contiguous {self.dtypes[name]} tensor "
                              f"on {self.device.torch} (got {tensor.dtype}, {tensor.device})")


class DeviceKVCache:
    """The target's KV cache on the device: keys and values [layers, batch, kv_heads,
    capacity, head_dim], `length` tokens committed; layer i's slice (dense) is bound as
    cache_keys_i / cache_values_i. A rollback is a length change.

    Layers lie a multiple of ALIGNMENT bytes apart (padding after each layer), so every
    layer's slice starts aligned whatever the capacity: an odd capacity would otherwise put
    odd layers 128 bytes off for SmolLM2-135M in fp16."""

    def __init__(self, capacity: int, layers: int, kv_heads: int, head_dim: int, dtype, device,
                 batch: int = 1):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        layer = batch * kv_heads * capacity * head_dim
        stride = -(-layer * itemsize // ALIGNMENT) * ALIGNMENT // itemsize
        strides = (stride, kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
        self.k, self.v = (aligned_empty((layers * stride,), dtype, device).zero_().as_strided(shape, strides)
                          for _ in range(2))
        self.capacity, self.length = capacity, 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length


class TensorRTTarget(BatchTarget):
    """target-kv.plan over a DeviceKVCache, as a batch target of at most one row (the
    plans are built for one sequence: modes.batch_refusal keeps a server to one request at
    a time); prefill in PREFILL_CHUNK-token steps over compact copies of the committed
    prefix, as OnnxBatchTarget does (a step costs its bound capacity, and the same binding
    order gives the same arithmetic as ONNX Runtime's)."""

    def __init__(self, plan: Plan, dtype: torch.dtype, context_limit: int):
        self.plan, self.dtype, self.context_limit = plan, dtype, context_limit
        self.layers = sum(name.startswith("cache_keys_") for name in plan.inputs)
        _, self.kv_heads, _, self.head_dim = plan.profile["cache_keys_0"][0]
        # The most cache positions the plan's profile admits.
        self.max_capacity = plan.limit("cache_keys_0", 2)
        self.cache: DeviceKVCache | None = None
        self.rows = 0  # 0 or 1: the sequence in `cache` has joined

    def _new_cache(self, capacity: int) -> None:
        if self.rows:
            raise EngineError(f"{self.plan.name}: a TensorRT target holds one sequence (its plans "
                              "are built for batch 1)")
        if capacity > self.max_capacity:
            raise EngineError(f"{self.plan.name}: a cache of {capacity} tokens is past the plan's "
                              f"profile ({self.max_capacity}) — rebuild the engine with "
                              f"--max-seq-len {capacity} or more")
        with self.plan.device.on_stream():
            self.cache = DeviceKVCache(capacity, self.layers, self.kv_heads, self.head_dim,
                                       self.dtype, self.plan.device.torch)

    def _step(self, ids: list[int], logit_positions, keys=None, values=None):
        """One step at the committed length over `keys`/`values` (per layer; default: the
        whole buffers); the step's keys/values land in the buffers at that length."""
        cache, device = self.cache, self.plan.device
        start, t = cache.length, len(ids)
        if start + t > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to {start + t}")
        keys = [cache.k[i] for i in range(self.layers)] if keys is None else keys
        values = [cache.v[i] for i in range(self.layers)] if values is None else values
        with device.on_stream():
            feeds = {"ids": aligned(torch.tensor([ids], dtype=torch.int64, device=device.torch)),
                     "logit_positions": aligned(torch.tensor(list(logit_positions), dtype=torch.int64,
                                                             device=device.torch)),
                     "past_len": aligned(torch.tensor([start], dtype=torch.int64, device=device.torch))}
            feeds |= {f"cache_keys_{i}": k for i, k in enumerate(keys)}
            feeds |= {f"cache_values_{i}": v for i, v in enumerate(values)}
            out = self.plan.run(feeds)
            cache.k[:, :, :, start:start + t].copy_(out["new_keys"])
            cache.v[:, :, :, start:start + t].copy_(out["new_values"])
        device.synchronize()
        cache.length = start + t
        return out["logits"][0], out["features"][0]

    def add(self, ids: list[int], capacity: int):
        result = self.prefill(ids, capacity)
        self.join_prefilled()
        return result

    def prefill(self, ids: list[int], capacity: int):
        self._new_cache(capacity)
        return self.prefill_more(ids)

    def prefill_more(self, ids: list[int]):
        cache, features = self.cache, []
        for begin in range(0, len(ids), PREFILL_CHUNK):
            held = max(cache.length, 1)  # a buffer needs a position; past_len 0 masks it
            with self.plan.device.on_stream():
                keys = [aligned(cache.k[i, :, :, :held]) for i in range(self.layers)]
                values = [aligned(cache.v[i, :, :, :held]) for i in range(self.layers)]
            chunk = ids[begin:begin + PREFILL_CHUNK]
            logits, chunk_features = self._step(chunk, [len(chunk) - 1], keys, values)
            features.append(chunk_features)
        return logits[-1], torch.cat(features) if len(features) > 1 else features[0]

    def join_prefilled(self) -> None:
        self.rows = 1

    def verify(self, rows: TokenRows):
        row = rows.row(0).tolist()  # a batch of at most one row
        logits, features = self._step(row, range(len(row)))
        return logits[None], features[None]

    def rollback(self, lengths: list[int]) -> None:
        self.cache.rollback(lengths[0])

    def remove(self, row: int) -> None:
        self.rows, self.cache = 0, None

    def snapshot(self):
        n, device = self.cache.length, self.plan.device
        with device.on_stream():
            snap = n, self.cache.k[:, :, :, :n].clone(), self.cache.v[:, :, :, :n].clone()
        device.synchronize()
        return snap

    def restore(self, snap, capacity: int) -> None:
        n, k, v = snap
        self._new_cache(capacity)
        with self.plan.device.on_stream():
            self.cache.k[:, :, :, :n] = k
            self.cache.v[:, :, :, :n] = v
        self.cache.length = n


class TensorRTDFlash(BatchBlockDrafter):
    """A drafter plan over a sequence-major cache [capacity, layers, batch, kv_heads,
    head_dim] on the device: the committed prefix is bound as past_keys/past_values (a
    contiguous view, no copy) and the rows after it as present_keys/present_values, which
    the plan writes in place. A batch block drafter of at most one row (as the target).
    It drafts only the steps its row drafts in (`fused` False: runtime/proposers.py Block),
    so a context is never empty: its prefill holds the prompt's last feature row back for
    the first draft."""

    fused = False

    def __init__(self, plan: Plan, block_size: int, mask_token_id: int,
                 scaling: QueryScaling | None, dtype: torch.dtype, vocab: DraftVocab | None = None):
        self.plan, self.scaling, self.dtype, self.vocab = plan, scaling, dtype, vocab
        self.block_size, self.mask_token_id = block_size, mask_token_id
        low = plan.profile["past_keys"][0]
        self.dims = (low[1], low[3], low[4])  # layers, kv_heads, head_dim
        self.max_capacity = plan.limit("past_keys", 0)
        self.cache = None
        self.length, self.rows = 0, 0

    def add(self, capacity: int, context: torch.Tensor, last: int) -> torch.Tensor:
        self.prefill(capacity, context, last)
        return self.join_prefilled()

    def prefill(self, capacity: int, context: torch.Tensor, last: int) -> None:
        self.reset(capacity)
        self.held = context[:0]
        self.prefill_more(context, last)

    def prefill_more(self, context: torch.Tensor, last: int) -> None:
        context = torch.cat([self.held, context])
        if len(context) > 1:  # all but the last row now; the block drafted is scratch
            self._draft(context[:-1], last)
        self.held = context[-1:]

    def join_prefilled(self) -> torch.Tensor:
        self.rows = 1
        return self.held

    def draft(self, contexts: list[torch.Tensor], bonuses: list[int]):
        logits, visible = self._draft(contexts[0], bonuses[0])
        return logits[None], torch.tensor([visible], dtype=torch.long)

    def remove(self, row: int) -> None:
        self.rows, self.cache = 0, None

    def reset(self, capacity: int) -> None:
        if self.rows:
            raise EngineError(f"{self.plan.name}: a TensorRT drafter holds one sequence (its "
                              "plans are built for batch 1)")
        if capacity > self.max_capacity:
            raise EngineError(f"{self.plan.name}: a drafter cache of {capacity} tokens is past the "
                              f"plan's profile ({self.max_capacity}) — rebuild the engine with "
                              f"--max-seq-len {capacity} or more")
        layers, kv_heads, head_dim = self.dims
        shape = (capacity, layers, 1, kv_heads, head_dim)
        device = self.plan.device
        with device.on_stream():
            self.cache = (aligned_empty(shape, self.dtype, device.torch).zero_(),
                          aligned_empty(shape, self.dtype, device.torch).zero_())
        self.length = 0

    def _draft(self, context: torch.Tensor, bonus: int):
        keys, values = self.cache
        device, start, c = self.plan.device, self.length, context.shape[0]
        if start + c > keys.shape[0]:
            raise ValueError(f"KV cache holds {keys.shape[0]} tokens; asked to write up to {start + c}")
        meta = StepMetadata(start, c)
        with device.on_stream():
            block = torch.tensor([[bonus] + [self.mask_token_id] * (self.block_size - 1)],
                                 dtype=torch.int64, device=device.torch)
            feeds = {"block_ids": aligned(block),
                     "context": aligned(context.to(device.torch, self.dtype)[None]),
                     "context_lens": aligned(torch.tensor([c], dtype=torch.int64, device=device.torch)),
                     "past_keys": keys[:start], "past_values": values[:start],
                     "past_lens": aligned(torch.tensor([start], dtype=torch.int64, device=device.torch))}
            # The plan writes the new rows in place where they start on a boundary; where
            # they do not (rows of layers x kv_heads x head_dim elements need not fill
            # 256 bytes), into an aligned staging buffer copied in after the run.
            present = {"present_keys": keys[start:start + c], "present_values": values[start:start + c]}
            staged = {name: aligned(rows) for name, rows in present.items()}
            out = self.plan.run(feeds, staged)
            for name, rows in present.items():
                if staged[name] is not rows:
                    rows.copy_(staged[name])
        device.synchronize()
        self.length = meta.committed()
        return out["logits"][0], meta.block_keys(self.block_size)


class TensorRTEngine(Loaded):
    """The plans of one engine directory on one device and stream: the target, the
    SharpDraft drafter and the frozen drafter (those the engine has)."""

    can = modes.BACKENDS["tensorrt"]

    def __init__(self, engine_dir: Path, manifest: Manifest, drafting=None,
                 device: str | None = None, dtype: str | None = None):
        """The tensorrt backend's loader (runtime/backends/__init__.py: LOADERS): plans run
        on the GPU gpu() finds, in the dtype they were built for (`device` / `dtype` may
        only name those)."""
        from plugins.tensorrt import import_tensorrt, register_plugin


        record = manifest.extra.get("tensorrt")
        if not record or not record.get("plans"):
            raise EngineError(f"{engine_dir} holds no TensorRT plans (built for backend "
                              f"{manifest.backend!r}) — rebuild with build_engine.py --backend tensorrt")
        trt = import_tensorrt()  # TensorRTUnavailable: one line saying what to do
        where = gpu()
        if where is None:
            raise EngineError(no_gpu_reason())
        if record.get("version") != trt.__version__:
            raise EngineError(f"{engine_dir}: plans built with TensorRT {record.get('version')}, this "
                              f"is TensorRT {trt.__version__} — rebuild the engine here")
        if record.get("gpu") != device_name(where):
            raise EngineError(f"{engine_dir}: plans built for {record.get('gpu')}, this GPU is "
                              f"{device_name(where)} — rebuild the engine here")
        if any(p.get("plugin_nodes") for p in record["plans"].values()):
            # TensorRT finds a plugin's creator in its registry when it loads a plan that
            # does not embed one; registering costs nothing where it is not needed.
            register_plugin()
        if dtype not in (None, manifest.dtype):
            raise EngineError(f"{engine_dir}: its plans are {manifest.dtype}, not {dtype} — "
                              "rebuild the engine with that dtype")
        self.device = Device(where)
        if device is not None and torch.device(device) != self.device.torch:
            raise EngineError(f"{engine_dir}: TensorRT plans run on {self.device.torch}, not {device}")
        self.dtype = getattr(torch, manifest.dtype)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.plans = {name: Plan(trt, runtime, Path(engine_dir) / plan["file"], self.device)
                      for name, plan in record["plans"].items()}
        for plan in self.plans.values():  # a plan of another dtype would misread every buffer
            for name in plan.inputs + plan.outputs:
                if plan.dtypes[name].is_floating_point:
                    plan.check_dtype(name, self.dtype, manifest.dtype)
        self.scaling = manifest.query_scaling
        self.block_size = manifest.block_size
        self.mask_token_id = manifest.extra["onnx"]["mask_token_id"]
        self.vocab = read_draft_vocab(engine_dir, manifest.extra["onnx"])
        if self.vocab is not None:  # the sampler indexes it with the plan's (device) argmax
            self.vocab = dataclasses.replace(self.vocab, ids=self.vocab.ids.to(self.device.torch))
        self.context_limit = int(manifest.extra["max_seq_len"])
        self.dir, self.drafting = Path(engine_dir), drafting
        self.tokenizer = load_tokenizer(manifest.target_dir)

    def batch_target(self) -> TensorRTTarget:
        """The target plan, one sequence at a time (a request's own KV cache)."""
        return TensorRTTarget(self.plans["target_kv"], self.dtype, self.context_limit)

    @staticmethod
    def takes_window(manifest: Manifest) -> bool:
        return False  # the plugin has no window field

    def batch_drafter(self, scaling: QueryScaling | None, window: int | None = None) -> TensorRTDFlash:
        """The SharpDraft drafter (`scaling`: the engine's, compiled in) or the frozen one,
        one sequence at a time."""
        if window is not None:
            raise EngineError(f"{self.dir}: TensorRT plans take no draft window (the plugin "
                              "has no such field) — pass --backend onnxruntime")
        if scaling is not None and self.scaling is not None:
            return TensorRTDFlash(self.plans["drafter"], self.block_size, self.mask_token_id,
                                  self.scaling, self.dtype, self.vocab)
        return TensorRTDFlash(self.plans["drafter_frozen"], self.block_size, self.mask_token_id,
                              None, self.dtype, self.vocab)

    def tree_drafter(self, scaling: QueryScaling | None):
        raise EngineError(f"{self.dir}: TensorRT plans draft DFlash blocks only")
