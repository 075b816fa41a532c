"""Building blocks shared by the target and the drafters: Llama/Qwen-style RMSNorm,
rotary embeddings, gated MLP, grouped-query attention projections and a preallocated
KV cache whose rollback is a length change (no tensor copies, as in gpt-fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugins.attention import sharpdraft_attention
from plugins.scaling import _tracing
from runtime.step_metadata import StepMetadata

# Up to how many rows (a step's tokens across its batch) a float32 linear layer on CPU
# may compute as weight @ x.T (few_rows_linear), where the machine's BLAS reads it faster.
FEW_ROWS = 8


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    transposed_rows: frozenset[int] = frozenset()) -> torch.Tensor:
    """F.linear(x, weight, bias), x [..., in] and weight [out, in], computed as weight @ x.T
    where x has a row count in `transposed_rows` (1..FEW_ROWS; none by default).

    A decode or verify step's few rows make every linear layer a read of its whole weight,
    and how fast that read goes depends on the kernel the BLAS picks for the shape -- which
    differs by CPU, so the row counts are measured per machine, never assumed
    (runtime/step_costs.py: choose_transposed_rows, at build; the torch loader applies
    them where they were measured). On one 2-core machine MKL ran x @ weight.T (what
    F.linear runs) at half the speed of weight @ x.T for 1-3 rows: SmolLM2-135M's layer
    weights took 33 / 45 / 49 ms for 1 / 2 / 3 rows against 17 / 12 / 17 ms, and a
    one-token step at 4,096 tokens of context went from 85 to 59 ms. On another (a Xeon
    with AVX-512 and AMX) it was the other way round: weight @ x.T made the same step
    105 ms against F.linear's 62.

    The products are the same sums in another order (float32 rounding apart). Other
    dtypes (bfloat16: plugins/row_invariant.py), CUDA and traced graphs keep F.linear."""
    # (the trace test before the row count: a traced graph's row count is symbolic, and
    # comparing it would guard the graph to this branch's shapes)
    if (not transposed_rows or _tracing() or x.dtype != torch.float32
            or weight.dtype != torch.float32 or weight.device.type != "cpu"):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows not in transposed_rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # a matrix-vector product would pick the matrix-vector kernel again
        out = (weight @ flat.repeat(2, 1).T)[:, :1]
    else:
        out = weight @ flat.T
    out = out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state keys) whose steps run few_rows_linear."""

    transposed_rows: frozenset[int] = frozenset()  # set per model: transpose_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias, self.transposed_rows)


def transpose_rows(model: nn.Module, rows) -> None:
    """Make every layer of `model` that runs few_rows_linear compute the row counts in
    `rows` as weight @ x.T (an empty `rows`: F.linear everywhere)."""
    rows = frozenset(int(n) for n in rows)
    for module in model.modules():
        if hasattr(type(module), "transposed_rows"):
            module.transposed_rows = rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Default RoPE (rotate-half layout) evaluated at arbitrary positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # float32 exactly as transformers computes it, so logits match to rounding.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [b, t] -> cos, sin [b, 1, t, head_dim] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections (+ optional bias, + optional per-head q_norm/k_norm)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool, eps: float, output_size: int | None = None):
        """output_size: o_proj's width when it differs from the input's (EAGLE-3's layer
        reads [embedding, hidden] = 2 x hidden and writes hidden)."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, output_size or hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def query(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [b, t, hidden] -> q [b, heads, t, head_dim], normed and rotated."""
        return self.shape_query(self.q_proj(x), cos, sin)

    def key_value(self, x: torch.Tensor, cos, sin):
        """x [b, t, hidden] -> k, v [b, kv_heads, t, head_dim]; k normed and rotated."""
        return self.shape_key_value(self.k_proj(x), self.v_proj(x), cos, sin)

    def shape_query(self, q: torch.Tensor, cos, sin) -> torch.Tensor:
        """q_proj's output [b, t, heads * head_dim] -> [b, heads, t, head_dim], normed
        and rotated (a prefill that projects q, k, v in one multiply calls these two)."""
        q = q.unflatten(-1, (self.heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def shape_key_value(self, k: torch.Tensor, v: torch.Tensor, cos, sin):
        """k_proj's and v_proj's outputs -> k, v [b, kv_heads, t, head_dim]."""
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [b, heads, t, head_dim] -> [b, t, hidden]."""
        return self.o_proj(attn.transpose(1, 2).flatten(2))


def window_mask(visible: torch.Tensor, block: int, window: int, kv_len: int) -> torch.Tensor:
    """[batch, block, kv_len]: what each block row sees under a draft window -- its block
    and the last `window` context keys before it (StepMetadata.block_window: each row's
    range from its own visible count, so one batched pass gives every row its own). Beta,
    where it applies, then reads the keys left: min(visible, window + block)."""
    lowest, _ = StepMetadata.block_window(visible, block, window)
    return torch.arange(kv_len, device=visible.device) >= lowest[..., None]


class KVCache:
    """Preallocated keys/values for every layer; `length` tokens are committed, or, in a
    batch of sequences at different lengths, `lengths` [batch] (then `length` is unused).

    Writing past the committed length is allowed (scratch space a step may use and
    discard), so a rollback is only a length change.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device=None, per_sequence: bool = False):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device) if per_sequence else None

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor):
        """Store k/v at [start, start + t) -- start an int, or [batch] per sequence -- and
        return views of keys/values [0, longest start + t)."""
        t = k.shape[2]
        per_sequence = torch.is_tensor(start) and start.dim() == 1
        end = (int(start.max()) if per_sequence else start) + t
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; asked to write up to {end}")
        if per_sequence:
            index = (start[:, None] + torch.arange(t, device=start.device))[:, None, :, None]
            self.k[layer].scatter_(2, index.expand_as(k), k)
            self.v[layer].scatter_(2, index.expand_as(v), v)
        else:
            self.k[layer, :, :, start:end] = k
            self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attend(self, layer: int, start, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               visible: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """A causal step's attention: store the step's k/v at `start`, then row (b, i)
        attends to keys [0, visible[b, i]) -- of them only the unmasked ones with a tree
        `mask` (StepMetadata.tree_rows). The export stand-ins (build/export.py)
        implement the same method over their own storage."""
        k, v = self.write(layer, start, k, v)
        return sharpdraft_attention(q, k, v, visible, None, mask)

    def attend_block(self, layer: int, start, q, k, v, visible, scaling, probe=None,
                     window: int | None = None):
        """A DFlash block's attention: store the block's k/v at `start` (past the committed
        length: scratch the next step overwrites), then row (b, i) attends to keys
        [0, visible[b, i]), the context's and the whole block's, its query scaled by beta;
        with a `window`, to the block and the last `window` context keys only
        (window_mask). probe(q, k), when given, sees the keys attended over (the diagnose
        command)."""
        k, v = self.write(layer, start, k, v)
        if probe is not None:
            probe(q, k)
        mask = None if window is None else window_mask(visible, q.shape[2], window, k.shape[2])
        return sharpdraft_attention(q, k, v, visible, scaling, mask)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    def reserve(self, capacity: int) -> None:
        """Grow to hold `capacity` tokens, keeping the committed ones (one copy): a step
        that needs more scratch than the preallocation left, like a draft tree verified
        near the end of a generation's budget."""
        if capacity <= self.capacity:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (capacity,) + old.shape[4:])
            new[:, :, :, :self.capacity] = old
            setattr(self, name, new)
        self.capacity = capacity

    def keep(self, rows: list[int]) -> None:
        """Commit scratch rows: the keys/values written at length + rows[i] move to
        length + i (a verified tree's accepted path, written in tree order, becomes
        the next committed tokens). One gather per tensor; rows must not repeat."""
        if self.lengths is not None:
            raise ValueError("keep() compacts a one-sequence cache")
        if len(set(rows)) != len(rows) or any(r < 0 for r in rows):
            raise ValueError(f"rows to keep must be distinct and >= 0, got {rows}")
        end = self.length + len(rows)
        if rows and self.length + max(rows) >= self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; row {max(rows)} is past it")
        index = torch.as_tensor(rows, dtype=torch.long, device=self.k.device) + self.length
        # index_select copies before the write, so overlapping source and target are safe
        self.k[:, :, :, self.length:end] = self.k.index_select(3, index)
        self.v[:, :, :, self.length:end] = self.v.index_select(3, index)
        self.length = end

    def keep_each(self, paths: list[list[int]]) -> None:
        """keep() for a batch of sequences (per-sequence `lengths`): sequence i commits
        the scratch rows paths[i] (a tree packed with the others, each verified past its
        own length). One gather and one scatter per tensor; a row past a shorter path
        moves onto itself."""
        if self.lengths is None:
            raise ValueError("keep_each() compacts a batch of per-sequence caches; use keep()")
        if len(paths) != self.k.shape[1]:
            raise ValueError(f"one path per sequence: {len(paths)} paths for {self.k.shape[1]}")
        width = max(len(p) for p in paths)
        if not width:
            return
        for p in paths:
            if len(set(p)) != len(p) or any(r < 0 for r in p):
                raise ValueError(f"rows to keep must be distinct and >= 0, got {p}")
        device = self.k.device
        lengths = self.lengths.to(device)
        dest = lengths[:, None] + torch.arange(width, device=device)  # [b, width]
        rows = torch.tensor([p + list(range(len(p), width)) for p in paths], dtype=torch.long,
                            device=device)
        source = lengths[:, None] + rows  # distinct rows: its largest is >= dest's
        if int(source.max()) >= self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; a row to keep is past it")
        shape = (self.k.shape[0], -1, self.k.shape[2], width, self.k.shape[4])
        source = source[None, :, None, :, None].expand(shape)
        dest = dest[None, :, None, :, None].expand(shape)
        for buffer in (self.k, self.v):
            buffer.scatter_(3, dest, buffer.gather(3, source))  # gathered before the write
        self.lengths = self.lengths + torch.tensor([len(p) for p in paths], dtype=torch.long,
                                                   device=self.lengths.device)

    # Continuous batching: a sequence joins as the last row and leaves from any row. Each
    # costs one copy of the cache; the steps between them write in place.
    def join(self, other: "KVCache") -> None:
        """Append `other`'s rows (a one-sequence cache, say) with their lengths, growing
        the capacity to the larger of the two."""
        capacity = max(self.capacity, other.capacity)
        rows = self.k.shape[1]

        def joined(mine, theirs):
            # zeros, not empty: masked keys still meet a softmax weight of 0, and 0 * NaN = NaN
            out = mine.new_zeros(mine.shape[:1] + (rows + theirs.shape[1],) + mine.shape[2:3]
                                 + (capacity,) + mine.shape[4:])
            out[:, :rows, :, :mine.shape[3]] = mine
            out[:, rows:, :, :theirs.shape[3]] = theirs
            return out

        self.k, self.v = joined(self.k, other.k), joined(self.v, other.v)
        self.capacity = capacity
        theirs = other.lengths if other.lengths is not None else torch.full(
            (other.k.shape[1],), other.length, dtype=torch.long, device=self.k.device)
        self.lengths = torch.cat([self.lengths, theirs])

    def drop(self, row: int) -> None:
        keep = [i for i in range(self.k.shape[1]) if i != row]
        self.k, self.v, self.lengths = self.k[:, keep], self.v[:, keep], self.lengths[keep]
