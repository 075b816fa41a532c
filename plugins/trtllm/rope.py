"""SharpDraft in TensorRT-LLM's generic `Attention` (EAGLE-3 and PARD drafters).

`Attention.forward(position_ids, hidden_states, attn_metadata, ..., attention_window_size)`
runs qkv_proj -> `self.apply_rope(q, k, v, position_ids)` -> the attention backend
(pins.SOURCES["attention"]). apply_rope returns either (q, k, v) with RoPE applied (after
q_norm in Qwen3-style subclasses), or, when RoPE is fused into the kernel, its input
unrotated ((qkv, None, None) for a fused qkv). Either way its output is the query the
kernel will use up to a rotation, so multiplying q's rows there by beta is exact:
RoPE(beta * q) = beta * RoPE(q), and every norm is already behind.

N per token row comes from the attention metadata the kernel itself is handed, not from
position_ids (which TensorRT-LLM adjusts for dynamic trees only when RoPE is *not* fused):
the wrapper around `forward` keeps (attn_metadata, attention_window_size) on the layer for
the duration of the call, and the wrapper around `apply_rope` counts, for the batch's
rows in order (context requests first, then generation requests, as TensorRT-LLM lays
them out):
- a context request's row j of q_len new tokens over kv_len keys (kv_lens_cuda: cached +
  new): kv_len - q_len + j + 1 (causal);
- a generation request with speculative decoding: past = kv_len - gen_len keys plus the
  draft tokens the tree mask leaves visible, its ancestors and itself: depth + 1, with
  the depth TensorRT-LLM's own kernel uses (spec_decoding_position_offsets); a chain is
  the tree whose depths are 0..gen_len-1; a dynamic tree's depths (1-D) are read as
  TensorRT-LLM's own `_adjust_position_ids_for_spec_dec` reads them: the draft loop writes
  them from row 0 with row stride gen_len (offsets[:num_gens * gen_len].view(num_gens,
  gen_len)), generation request g in row g, whatever the number of context requests
  before it in the batch;
- capped at attention_window_size when the call passes one;
- rows of q past num_tokens get N = 1 (nothing in the metadata describes them).
Configurations whose count these cannot give exactly (chunked attention, KV compression),
and metadata classes that lack a field read here, are refused when the drafter is built
(plugins/trtllm/hook.py); MetadataError below is the last resort for a metadata object
that still differs at run time. Each scaled call adds one to its layer's device counter
(`count`, plugins/trtllm/proof.py Tally).

CUDA graphs (on by default in TensorRT-LLM's PyTorch backend; one-model speculative
decoding captures the drafter's forward): every per-sequence length is read from the
metadata's DEVICE tensors, kv_lens_cuda and seq_lens_cuda, which TensorRT-LLM updates in
place between replays. `seq_lens` is a host (pinned CPU) tensor the setter replaces each
step; reading it here would copy host to device inside the captured forward (capture
fails) and a captured copy would replay a stale host address, so it is never read.
Python branches only on the metadata's Python ints (num_seqs, num_contexts, num_tokens,
num_ctx_tokens), which a captured graph fixes anyway. Under CUDA-graph padding those ints
count the padded dummy requests too (interface.py `create_cuda_graph_metadata`: seq_lens
= ones(max_batch_size) * (1 + max_draft_tokens), num_contexts = 0): their rows are
counted like any generation request's, from whatever kv_lens_cuda holds for the dummy
slot, and TensorRT-LLM discards their outputs.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from . import pins
from .kernels import WRAPPED, _active, scale_rows

__all__ = ["wrap_apply_rope", "wrap_forward", "visible_counts", "CALL"]

CALL = "_sharpdraft_call"  # layer attribute: (attn_metadata, attention_window_size) of the running forward


class MetadataError(ValueError):
    """The metadata lacks what the count needs (one line)."""


def _field(metadata, key):
    return getattr(metadata, pins.METADATA[key], None)


def _device_lengths(metadata, key: str, num_seqs: int, device) -> torch.Tensor:
    value = _field(metadata, key)
    if not isinstance(value, torch.Tensor):
        raise MetadataError(f"attention metadata without the device tensor {pins.METADATA[key]}")
    if value.device != torch.device(device):  # a copy here would break CUDA-graph capture
        raise MetadataError(f"attention metadata's {pins.METADATA[key]} is on {value.device}, the query "
                            f"on {device}: SharpDraft counts only from device tensors")
    return value[:num_seqs].to(torch.int64)


def visible_counts(metadata, rows: int, device, window: int | None = None) -> torch.Tensor:
    """[rows] int64 on `device`: keys each token row of this batch sees (see the module
    docstring). Reads kv_lens_cuda / seq_lens_cuda / spec_decoding_position_offsets on the
    device and Python ints only: no host sync, no host-to-device copy."""
    num_seqs = _field(metadata, "num_seqs")
    if not isinstance(num_seqs, int):
        raise MetadataError(f"attention metadata without {pins.METADATA['num_seqs']} (a Python int)")
    num_contexts = int(_field(metadata, "num_contexts") or 0)
    num_tokens = _field(metadata, "num_tokens")
    num_tokens = int(num_tokens) if isinstance(num_tokens, int) else rows
    kv = _device_lengths(metadata, "kv_lens", num_seqs, device)
    q_lens = _device_lengths(metadata, "seq_lens_cuda", num_seqs, device)
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    j = torch.arange(num_tokens, device=device) - starts[seq]
    depth = j  # causal: row j of a request sits j tokens after its first new one
    offsets = _field(metadata, "offsets")
    num_gens = num_seqs - num_contexts
    if num_gens > 0 and isinstance(offsets, torch.Tensor) and bool(_field(metadata, "use_spec")):
        if offsets.device != torch.device(device):
            raise MetadataError(f"attention metadata's {pins.METADATA['offsets']} is on {offsets.device}, "
                                f"the query on {device}")
        gen_rows = num_tokens - int(_field(metadata, "num_ctx_tokens") or 0)
        gen_len = gen_rows // num_gens
        if offsets.dim() == 2:  # [gens, >= gen_len]: one row of depths per request
            offsets = offsets[:num_gens, :gen_len]
        else:
            # A dynamic tree's depths: written by the draft loop from row 0, row stride gen_len
            # (pins.SOURCES["attention"]: _adjust_position_ids_for_spec_dec)
            offsets = offsets[:num_gens * gen_len].view(num_gens, gen_len)
        gen_offsets = offsets.reshape(-1)[:gen_rows].to(torch.int64)
        depth = torch.cat((j[:num_tokens - gen_rows], gen_offsets))
    n = kv[seq] - q_lens[seq] + depth + 1
    if window is not None and window > 0:
        n = n.clamp(max=int(window))
    if rows > num_tokens:
        n = torch.cat((n, torch.ones(rows - num_tokens, dtype=n.dtype, device=device)))
    return n[:rows]


def wrap_forward(forward: Callable, layer) -> Callable:
    """Attention.forward that keeps its attention metadata and window on the layer while
    it runs (apply_rope, called inside, reads them)."""
    if getattr(forward, WRAPPED, None) is not None:
        return forward

    @functools.wraps(forward)
    def wrapper(position_ids, hidden_states, attn_metadata, *args, **kwargs):
        window = kwargs.get("attention_window_size")
        if window is None and len(args) >= 5:  # (mask, mrope, all_reduce, lora, window, ...)
            window = args[4]
        previous = vars(layer).get(CALL)
        vars(layer)[CALL] = (attn_metadata, window)
        try:
            return forward(position_ids, hidden_states, attn_metadata, *args, **kwargs)
        finally:
            vars(layer)[CALL] = previous

    setattr(wrapper, WRAPPED, forward)
    return wrapper


def wrap_apply_rope(apply_rope: Callable, scaling, q_size: int, layer=None, count: Callable | None = None) -> Callable:
    """apply_rope(q, k, v, position_ids) -> (q, k, v) with q's rows (its first q_size
    columns when k is None: fused qkv) multiplied by beta of each row's visible keys, from
    the metadata of the running forward (layer's CALL)."""
    if getattr(apply_rope, WRAPPED, None) is not None:
        return apply_rope

    @functools.wraps(apply_rope)
    def wrapper(q, k, v, position_ids):
        q, k, v = apply_rope(q, k, v, position_ids)
        active = _active(scaling)
        call = vars(layer).get(CALL) if layer is not None else None
        if active is None or call is None or call[0] is None:
            return q, k, v  # outside a forward we wrapped there is no metadata to count from
        metadata, window = call
        n = visible_counts(metadata, q.shape[0], q.device, window)
        if k is None:  # fused qkv [tokens, q_size + 2 * kv_size]: scale the q columns only
            q = torch.cat((scale_rows(q[..., :q_size], n, active), q[..., q_size:]), dim=-1)
        else:
            q = scale_rows(q, n, active)
        if count is not None:  # the layer's device counter: one in-place add, captured with the call
            count(q)
        return q, k, v

    setattr(wrapper, WRAPPED, apply_rope)
    return wrapper
