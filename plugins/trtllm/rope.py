"""SharpDraft in TensorRT-LLM's generic `Attention` (EAGLE-3 and PARD drafters).

`Attention.forward` runs qkv_proj -> `self.apply_rope(q, k, v, position_ids)` -> the
attention backend. apply_rope returns either (q, k, v) with RoPE applied (after q_norm in
Qwen3-style subclasses, before QK norm in Llama-4's), or, when RoPE is fused into the
attention kernel, the concatenated qkv unrotated as (qkv, None, None). Either way its
output is the query the kernel will use up to a rotation, so multiplying q's columns
there by beta is exact: RoPE(beta * q) = beta * RoPE(q), and every norm is already behind.

The wrapper goes on the drafter's attention *instances* only (PARD's drafter is an
ordinary architecture whose classes the target shares).

Visible keys per row: position_id + 1. Exact for chain drafting and PARD's block (causal,
KV positions contiguous from 0, as TensorRT-LLM's drafting loops lay them out: the row at
position p sees keys 0..p). Approximate where the mask is not "everything up to my
position": EAGLE-3 tree drafting (a node sees its ancestors, i.e. stable KV + depth + 1,
which equals position_id + 1 only when tree positions are depth-based and siblings are
masked), sliding-window layers (the window caps the count) and padded CUDA-graph rows
(scaled, then discarded).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from plugins.trtllm.kernels import WRAPPED, _active, scale_rows

__all__ = ["wrap_apply_rope"]


def wrap_apply_rope(apply_rope: Callable, scaling, q_size: int) -> Callable:
    """apply_rope(q, k, v, position_ids) -> (q, k, v) with q's rows (its first q_size
    columns when k is None: fused qkv) multiplied by beta(position_id + 1)."""
    if getattr(apply_rope, WRAPPED, None) is not None:
        return apply_rope

    @functools.wraps(apply_rope)
    def wrapper(q, k, v, position_ids):
        q, k, v = apply_rope(q, k, v, position_ids)
        active = _active(scaling)
        if active is None or position_ids is None:  # no positions: nothing to count from
            return q, k, v
        n = position_ids.reshape(-1).to(torch.int64) + 1  # one count per token row
        if k is None:  # fused qkv [tokens, q_size + 2 * kv_size]: scale the q columns only
            q = torch.cat((scale_rows(q[..., :q_size], n, active), q[..., q_size:]), dim=-1)
        else:
            q = scale_rows(q, n, active)
        return q, k, v

    setattr(wrapper, WRAPPED, apply_rope)
    return wrapper
