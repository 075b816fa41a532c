"""A float32 engine's prefill with its matrix multiplies in bfloat16, for the onnxruntime
backend on a CPU with AMX (`--prefill-dtype bfloat16`; decode steps stay float32 graphs).

Why: on this 2-core VM a prompt's prefill is compute-bound (about 1.3 ms a token in
float32 ONNX Runtime) and it does not batch, so it bounds a loaded instance
(docs/serving.md). AMX multiplies bfloat16 at several times float32's rate.

What it computes: our own TargetModel (runtime/models/target.py) from the engine's target
checkpoint, layer by layer as its final_hidden does, except that every decoder linear
multiplies bfloat16 inputs by bfloat16 weights (float32 accumulation, widened back to
float32): q/k/v in one multiply and gate/up in another, their weights packed once for
oneDNN's kernels; attention reads bfloat16 queries, keys and values (softmax and sums in
float32 inside SDPA's kernel); the residual stream, norms, rotary, the keys/values
stored and the LM head stay float32. The prompt's keys/values land in the ONNX Runtime
cache buffers where they lie (a torch view of the same memory), and the features the
drafter reads come out as the graph's do. So the target an engine serves this way is
the float32 model with a bfloat16 prompt pass: its tokens can differ from the
all-float32 target's (measured: docs/engines.md), and speculative decoding is lossless
against it, because every mode prefills a prompt the same way and decodes with the same
float32 graphs.

That last point needs the prefill of a prompt to give the same bits however it is cut
into calls (alone, or in chunks between batch steps: runtime/serve/scheduler.py). A
kernel may round a row differently at another row count (plugins/row_invariant.py), so a
prefill runs in blocks of at most ROWS positions that start at multiples of ROWS,
whatever the call's chunking: with chunks that are multiples of ROWS (the scheduler's
default, 128; others are refused) every block, the prompt's short last one included, has
the same rows and the same row count as in an unchunked prefill, so every kernel is
handed the same shapes.

Threads: build() converts the weights with torch on one thread (runtime/openmp.py: a pool
left in the loading thread made a prefill on the serving thread take about twice as long).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.backends import PREFILL_DTYPES
from runtime.backends.roles import drafter_feature_layers
from runtime.manifest import EngineError, Manifest
from runtime.models.layers import KVCache
from runtime.openmp import one_thread
from runtime.step_metadata import StepMetadata

ROWS = 128  # the grid a prefill's blocks start on, and their most rows
# the registry's --prefill-dtype choices, under the name commands and scripts import today
DTYPES = PREFILL_DTYPES


def chunk_problem(prefill_chunk: int, grid: int | None) -> str | None:
    """Why a served prefill_chunk (0: none) cannot go with a prefill on `grid` (None:
    any chunk can), else None: the one check, made by `serve` before it writes the model
    repository and by the scheduler that loads the engine (in process and in Triton)."""
    if grid and prefill_chunk % grid:
        return (f"--prefill-chunk {prefill_chunk} must be a multiple of {grid} with "
                "--prefill-dtype bfloat16 (0: no chunking; a prompt prefilled in other "
                "chunks would round differently than alone)")
    return None


class PackedLinear:
    """The linears `parts` side by side as one bfloat16 multiply: x [rows, in] bfloat16 ->
    [rows, sum of outs] bfloat16. The weight is packed once into oneDNN's layout for
    blocks of ROWS rows (torch's mkldnn linear, as inductor's CPU freezing packs it),
    where this torch and CPU have them (oneDNN's bfloat16 kernels need AVX-512 or AMX);
    else a plain bfloat16 linear (torch's own kernels, slower, the same rows per call)."""

    def __init__(self, parts: list[nn.Linear]):
        weight = torch.cat([p.weight.detach() for p in parts]).to(torch.bfloat16)
        biases = [p.bias for p in parts]
        self.bias = (None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(p.out_features)
             for b, p in zip(biases, parts)]).to(torch.bfloat16))
        self.widths = [p.out_features for p in parts]
        mkldnn = torch.ops.mkldnn
        self.packed = all(hasattr(mkldnn, op) for op in (
            "_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
        ) and mkldnn._is_mkldnn_bf16_supported()
        self.weight = mkldnn._reorder_linear_weight(weight, ROWS) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Bf16Prefill:
    """The prefill of an ONNX Runtime target's cache (OnnxBatchTarget.prefill_more calls
    it): each decoder layer's multiplies packed (`packed`: q/k/v in one, o, gate/up in
    one, down); its norms and attention stay the layer's."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.model, self.layers = model, layers
        self.packed = [(PackedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                      layer.self_attn.v_proj]),
                        PackedLinear([layer.self_attn.o_proj]),
                        PackedLinear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                        PackedLinear([layer.mlp.down_proj])) for layer in model.layers]
        for layer in model.layers:  # the packed copies replace the float32 weights
            for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    setattr(owner, name, None)

    def _layer(self, index: int, h, cos, sin, cache: KVCache, start, allowed):
        """Decoder layer `index` over h [n, hidden] float32 (the block's positions) -> h
        after it. allowed [n, keys]: the causal mask of the block's rows over the
        cache's keys."""
        layer, (qkv, o, gate_up, down) = self.model.layers[index], self.packed[index]
        attn = layer.self_attn
        x = layer.input_layernorm(h).to(torch.bfloat16)
        q, k, v = qkv(x).float().split(qkv.widths, -1)
        q = attn.shape_query(q[None], cos, sin)
        k, v = attn.shape_key_value(k[None], v[None], cos, sin)
        keys, values = cache.write(index, start, k, v)  # float32 in the cache
        # attention in bfloat16 too (SDPA's CPU kernel is more than twice as fast in it
        # here), softmax and sums in float32 inside the kernel; a plain causal mask, as
        # the target's op computes it without query scaling
        out = F.scaled_dot_product_attention(
            q.to(torch.bfloat16), keys.to(torch.bfloat16), values.to(torch.bfloat16),
            attn_mask=allowed, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != keys.shape[1])
        out = out[0].transpose(0, 1).flatten(1).float()
        h = h + o(out.to(torch.bfloat16)).float()
        gate, up = gate_up(layer.post_attention_layernorm(h).to(torch.bfloat16)).float().chunk(2, -1)
        return h + down((F.silu(gate) * up).to(torch.bfloat16)).float()

    @classmethod
    def build(cls, manifest: Manifest, features_width: int) -> "Bf16Prefill":
        from runtime.models.target import ModelError, load_target

        if not torch.backends.mkldnn.is_available():
            raise EngineError("--prefill-dtype bfloat16 needs torch's oneDNN kernels (this "
                              "torch has none)")
        with one_thread():
            try:
                model, _ = load_target(manifest.target_dir)
            except ModelError as exc:
                raise EngineError(f"--prefill-dtype bfloat16: {exc}") from None
            layers = drafter_feature_layers(manifest, model.config.num_layers)
            if len(layers) * model.config.hidden_size != features_width:
                raise EngineError(f"--prefill-dtype bfloat16: the drafter reads layers "
                                  f"{list(layers)} ({len(layers) * model.config.hidden_size} "
                                  f"features), the target graph gives {features_width}")
            return cls(model, layers)

    def _block(self, ids: list[int], cache: KVCache):
        """ids (at most ROWS) after the cache's committed tokens: the final norm's states
        and the features."""
        model, n = self.model, len(ids)
        meta = StepMetadata.of(cache, n)
        cos, sin = model.rotary(meta.positions(n, 1, None), torch.float32)
        allowed = torch.arange(meta.committed()) < meta.causal_visible(n, 1, None)[0, :, None]
        h = model.embed_tokens(torch.tensor(ids))
        states, last = {}, len(self.packed) - 1
        for i in range(len(self.packed)):
            h = self._layer(i, h, cos, sin, cache, meta.cached, allowed)
            if i in self.layers and i != last:
                states[i] = h
        cache.length = meta.committed()
        h = model.norm(h)
        states[last] = h
        features = torch.cat([states[i] for i in self.layers], -1) if self.layers else h[:, :0]
        return h, features

    def __call__(self, cache, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `ids` after `cache`'s committed tokens (an onnxruntime BoundKVCache,
        written in place); the last token's logits [vocab] and every token's features."""
        kv = KVCache.__new__(KVCache)  # a view of the ONNX Runtime buffers, no copy
        kv.k, kv.v = torch.from_numpy(cache.k), torch.from_numpy(cache.v)
        kv.capacity, kv.length, kv.lengths = cache.capacity, cache.length, None
        if kv.length + len(ids) > kv.capacity:
            raise ValueError(f"KV cache holds {kv.capacity} tokens; asked to write up to "
                             f"{kv.length + len(ids)}")
        features, begin = [], 0
        with torch.inference_mode():
            while begin < len(ids):
                end = min(len(ids), begin + ROWS - (kv.length % ROWS))  # next multiple of ROWS
                h, part = self._block(ids[begin:end], kv)
                features.append(part)
                begin = end
            logits = self.model.lm_head(h[-1])
        cache.length = kv.length
        return logits, torch.cat(features) if len(features) > 1 else features[0]


def check_dtype(name: str | None) -> str:
    if name not in (None,) + PREFILL_DTYPES:
        raise EngineError(f"--prefill-dtype {name!r} is not one of {', '.join(PREFILL_DTYPES)}")
    return name or "float32"
