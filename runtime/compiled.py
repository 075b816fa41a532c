"""Compiled fixed-shape steps for the torch backend, in gpt-fast's manner: KV buffers
preallocated on the model's device, one `torch.compile(fullgraph=True)` graph per step
shape (target decode, verify per draft-length bucket, the DFlash drafter's block), on
CUDA replayed as CUDA graphs (mode="reduce-overhead"); prefill stays eager.

Lengths enter a step as device tensors ([batch] int64), never as Python ints, so one graph
serves every position: only the shapes (batch, bucket width, buffer capacity) pick a
graph. The models' own forwards run unchanged over `StaticView`, a KVCache whose write is
a scatter at per-sequence positions (no host read) and whose attention spans the whole
buffer, bounded per row by the visible counts of runtime/step_metadata.py; attention goes
through `sharpdraft::attention` as everywhere else (on CUDA the op must be capturable: no
host read of the counts inside it). CompiledTarget and CompiledDFlash are drop-in
TorchTarget / TorchDFlash roles over the same KVCache, so a step the buckets do not cover
(a prompt, a long catch-up context) runs eagerly on the very same buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from plugins.scaling import QueryScaling
from runtime.backends.pytorch import TorchDFlash, TorchTarget
from runtime.models.dflash import DFlashDrafter, DraftHead
from runtime.models.layers import KVCache
from runtime.models.target import ModelError, TargetModel
from runtime.step_metadata import StepMetadata, capacity_bucket

DEVICES = ("cpu", "cuda")
# compile_step's backends: TorchLoaded's `steps`, the commands' --steps
STEPS = ("eager", "inductor", "cudagraph")
# float64: the exactness tests' dtype (tests/test_loaders.py); the command line offers the rest
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


# -- device and dtype: what a torch loader calls ------------------------------------------

def resolve_device(name: str | torch.device) -> torch.device:
    """'cpu' / 'cuda' / 'cuda:N' as a torch.device, or a one-line ModelError."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ModelError(f"device {name!r} is not one of {', '.join(DEVICES)}") from None
    if device.type not in DEVICES:
        raise ModelError(f"device {name!r} is not one of {', '.join(DEVICES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device cuda asked for, but torch sees no CUDA device here — "
                         "pass --device cpu")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ModelError(f"dtype {name} is not one of {', '.join(DTYPES)}")
        return name
    if name not in DTYPES:
        raise ModelError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def place(model: nn.Module, device, dtype=None) -> nn.Module:
    """A loaded model moved onto `device` (in `dtype` when given), in eval mode."""
    device = resolve_device(device)
    return model.to(device=device, dtype=None if dtype is None else resolve_dtype(dtype)).eval()


def load_target(target_dir, device="cpu", dtype="float32"):
    """Our TargetModel on `device` in `dtype` and its tokenizer (runtime/models/target.py
    loads; this places). Its static caches are made per request by CompiledTarget."""
    from runtime.models.target import load_target as load

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    model, tokenizer = load(target_dir, dtype)
    return place(model, device), tokenizer


def load_dflash(drafter_dir, device="cpu", dtype="float32") -> DFlashDrafter:
    from runtime.models.dflash import load_dflash as load

    return place(load(drafter_dir, resolve_dtype(dtype)), resolve_device(device))


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


class TargetStep(nn.Module):
    """The target over `ids` [b, t] after `cached` [b] tokens: logits [b, t, vocab] and
    the drafter's features [b, t, F] (None without feature layers)."""

    STATIC = (1, 2)  # k, v: the KV buffers (a tensor per layer), written in place

    def __init__(self, model: TargetModel, feature_layers=()):
        super().__init__()
        self.model, self.feature_layers = model, tuple(feature_layers)

    def forward(self, ids, k, v, cached):
        h, features = self.model.final_hidden(ids, StaticView(k, v, cached), self.feature_layers)
        return self.model.lm_head(h), features


class DraftStep(nn.Module):
    """The DFlash drafter's block after `cached` [b] keys and `context` [b, c, F] features
    of which the first context_lens [b] are real: logits of the block's draft rows
    [b, block - 1, columns] over the drafter's head."""

    STATIC = (2, 3)  # k, v

    def __init__(self, drafter: DFlashDrafter, embed: nn.Embedding, head: DraftHead,
                 scaling: QueryScaling | None, window: int | None):
        super().__init__()
        self.drafter, self.embed, self.head = drafter, embed, head
        self.scaling, self.window = scaling, window

    def forward(self, block_ids, context, k, v, cached, context_lens):
        hidden, _ = self.drafter(self.embed(block_ids), context, StaticView(k, v, cached),
                                 self.scaling, context_lens=context_lens, window=self.window)
        return self.head(hidden[:, 1:])


def compile_step(module: nn.Module, device: torch.device, backend: str = "inductor"):
    """backend "inductor": torch.compile(fullgraph=True), one graph per input shape
    (dynamic=False: a new bucket is a new graph, a new length is not), replayed as CUDA
    graphs on CUDA (mode="reduce-overhead"); "eager": dynamo alone (the graph-break and
    recompile checks, in seconds); "cudagraph": no compiler, the eager step captured as
    a CUDA graph per shape (CapturedStep: seconds to make, where inductor takes minutes)."""
    from plugins.attention import register

    register()  # the op must exist before dynamo meets it (or a capture runs it)
    if backend == "cudagraph":
        if device.type != "cuda":
            raise ModelError("CUDA graphs need a CUDA device — use backend inductor on CPU")
        return CapturedStep(module)
    # one graph per (batch, width bucket, capacity bucket): more than dynamo's default 8
    # entries per code object, all of them expected
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    return torch.compile(module, fullgraph=True, dynamic=False, backend=backend, mode=mode)


class CapturedStep:
    """A step module's eager forward captured as one CUDA graph per input shapes and KV
    buffer addresses (the module's STATIC arguments: read and written in place, never
    copied); the other inputs are copied into the graph's own before each replay, and the
    outputs are the graph's (overwritten by its next replay: callers clone)."""

    def __init__(self, module: nn.Module):
        self.module, self.static = module, set(module.STATIC)
        self.graphs = {}

    def _key(self, args):
        return tuple(tuple(t.data_ptr() for t in a) if i in self.static else (tuple(a.shape), a.dtype)
                     for i, a in enumerate(args))

    def __call__(self, *args):
        key = self._key(args)
        if key not in self.graphs:
            inputs = [a if i in self.static else a.clone() for i, a in enumerate(args)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, autotune)
                self.module(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.module(*inputs)
            self.graphs[key] = (graph, inputs, outputs)
        graph, inputs, outputs = self.graphs[key]
        for i, a in enumerate(args):
            if i not in self.static:
                inputs[i].copy_(a, non_blocking=True)
        graph.replay()
        return outputs


def static_capacity(needed: int, limit: int) -> int:
    """Buffer capacity for `needed` tokens: the next power of two (the batched backends'
    capacity_bucket), but no more than `limit` when that covers the need, so a request at
    the model's full context does not attend over twice its keys. Few capacities, few
    graphs: the capacity is part of a step's shape."""
    bucket = 1 << capacity_bucket(needed)
    return needed if needed > limit else min(bucket, limit)


def bucket_for(width: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `width` rows, or None (run it eagerly)."""
    return next((b for b in buckets if b >= width), None)


class _Buffers:
    """KV buffers kept between requests per capacity: a CUDA graph reads fixed addresses,
    so a new request reuses the buffers (their stale keys lie past its length, unread)."""

    def __init__(self, make):
        self.make, self.pool = make, {}

    def cache(self, capacity: int) -> KVCache:
        cache = self.pool.get(capacity)
        if cache is None:
            cache = self.pool[capacity] = self.make(capacity)
            cache.layers = layers(cache)
            if cache.k.is_cuda:
                for t in cache.layers[0] + cache.layers[1]:
                    torch._dynamo.mark_static_address(t)
        cache.length = 0
        return cache


class CompiledTarget(TorchTarget):
    """TorchTarget whose verify runs a compiled step per width bucket (1: a decode step;
    the draft-length buckets: a verify), rows past the real ones padded (their keys are
    scratch past the committed length, their logits unread)."""

    def __init__(self, model: TargetModel, feature_layers=(), buckets=(1,),
                 backend: str = "inductor"):
        super().__init__(model, feature_layers)
        self.device = model.embed_tokens.weight.device
        self.buckets = tuple(sorted(set(buckets)))
        self.step = compile_step(TargetStep(model, self.feature_layers), self.device, backend)
        self.buffers = _Buffers(lambda c: model.new_cache(c))
        self.cached = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self.cached)

    @torch.inference_mode()
    def prefill(self, ids: list[int], capacity: int):
        slack = self.buckets[-1]  # a padded verify writes up to the widest bucket's rows
        self.cache = self.buffers.cache(static_capacity(capacity + slack,
                                                        self.context_limit + slack))
        logits, features = self.model(self._ids(ids), self.cache, self.feature_layers,
                                      last_logits_only=True)
        return logits[0, -1], None if features is None else features[0]

    @torch.inference_mode()
    def verify(self, ids: list[int]):
        t, n = len(ids), self.cache.length
        width = bucket_for(t, self.buckets)
        if width is None or n + width > self.cache.capacity:
            return super().verify(ids)
        self.cached.fill_(n)
        x = self._ids(list(ids) + [0] * (width - t))
        logits, features = self.step(x, *self.cache.layers, self.cached)
        self.cache.length = n + t
        # clone: a CUDA graph's outputs are overwritten by its next replay
        return logits[0, :t].clone(), None if features is None else features[0, :t].clone()

    def verify_tree(self, tree):
        result = super().verify_tree(tree)  # may grow the cache (KVCache.reserve): new buffers
        self.cache.layers = layers(self.cache)
        return result

    def restore(self, snap, capacity: int) -> None:
        n, k, v = snap
        slack = self.buckets[-1]
        self.cache = self.buffers.cache(static_capacity(capacity + slack,
                                                        self.context_limit + slack))
        self.cache.k[:, :, :, :n] = k
        self.cache.v[:, :, :, :n] = v
        self.cache.length = n


class CompiledDFlash(TorchDFlash):
    """TorchDFlash whose steps run one compiled graph: the block after a context of at
    most `context_bucket` feature rows (a step's accepted tokens; padded, context_lens
    says how many are real). A longer context (the prompt's) runs eagerly on the same
    cache."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, scaling: QueryScaling | None,
                 window: int | None = None, context_bucket: int | None = None,
                 backend: str = "inductor"):
        super().__init__(drafter, target, scaling, window)
        self.device = drafter.fc.weight.device
        self.context_bucket = context_bucket or self.block_size
        self.step = compile_step(DraftStep(drafter, target.embed_tokens, self.head, scaling, window),
                                 self.device, backend)
        self.buffers = _Buffers(lambda c: drafter.new_cache(c - self.block_size))
        self.block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long,
                                device=self.device)
        self.cached = torch.zeros(1, dtype=torch.long, device=self.device)
        self.context_lens = torch.zeros(1, dtype=torch.long, device=self.device)
        self.context = torch.zeros((1, self.context_bucket, self.feature_size),
                                   dtype=drafter.fc.weight.dtype, device=self.device)
        if self.device.type == "cuda":
            for t in (self.block, self.cached, self.context_lens, self.context):
                torch._dynamo.mark_static_address(t)

    def reset(self, capacity: int) -> None:
        # room: the padded context's rows, then the block's, past the committed keys
        limit = self.drafter.config.max_position_embeddings
        needed = capacity + self.context_bucket + self.block_size
        self.cache = self.buffers.cache(static_capacity(needed, limit + self.context_bucket
                                                        + self.block_size))

    @torch.inference_mode()
    def draft(self, context: torch.Tensor, bonus: int):
        c, n = context.shape[0], self.cache.length
        if c > self.context_bucket or n + self.context_bucket + self.block_size > self.cache.capacity:
            return super().draft(context, bonus)
        self.context.zero_()
        self.context[0, :c] = context
        self.block[0, 0] = bonus
        self.cached.fill_(n)
        self.context_lens.fill_(c)
        logits = self.step(self.block, self.context, *self.cache.layers, self.cached,
                           self.context_lens)
        self.cache.length = n + c
        return logits[0].clone(), StepMetadata(n, c).block_keys(self.block_size)
