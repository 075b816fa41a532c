"""SharpDraft around the attention kernels TensorRT-LLM's DFlash drafter calls.

DFlash (`DFlashForCausalLM.dflash_forward`) applies q_norm/k_norm and RoPE itself and then
calls one kernel per draft layer, held on the instance: flash-attn's
`flash_attn_with_kvcache` (VANILLA), flashinfer's trtllm-gen decode/context ops (TRTLLM)
or FlashAttention-4's forward (FA4). Each wrapper here reads the key count that very call
is handed (cache_seqlens [+ appended k], seq_lens, seqused_k), derives every query row's
visible-key count N under the call's own mask (causal, sliding window), and multiplies
that row's query by beta(N) — one beta per sequence along the batch, per row where the
mask differs by row. Scaling q after RoPE equals scaling the softmax scale (RoPE is a
rotation), so nothing else in the call changes.

No wrapper reads a tensor's values on the host (.item, .tolist, Python branches on
values): they stay valid inside CUDA-graph capture. Python branches only on the call's
Python arguments (causal, window sizes, which optional tensors are given), which a
captured graph fixes anyway. Each scaled call also adds one to its layer's device counter
(`count`, plugins/trtllm/proof.py Tally): a tensor op, so replays count too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from ..scaling import QueryScaling
from . import pins

__all__ = ["visible_keys", "scale_rows", "wrap_flash_attn_with_kvcache", "wrap_trtllm_gen_decode", "wrap_dflash_hybrid",
           "wrap_trtllm_gen_context", "wrap_fa4_fwd", "WRAPPED"]

# Marks a wrapper (value: the kernel it wraps), so wrapping is never applied twice.
WRAPPED = "__sharpdraft_wraps__"


def _active(scaling) -> QueryScaling | None:
    # A wrapper holds either a fixed QueryScaling or a getter (the drafter's own parameters
    # while the hook is installed), so an uninstalled hook turns every wrapper it left
    # behind into a plain pass-through -- in Python: a CUDA graph captured through the
    # wrapper keeps replaying the scaled kernels it recorded.
    return scaling() if callable(scaling) else scaling


def visible_keys(total: torch.Tensor, q_len: torch.Tensor, row: torch.Tensor, causal: bool,
                 left: int | None, right: int | None) -> torch.Tensor:
    """Keys each query row may see, elementwise over rows.

    total: keys the sequence holds for this call; q_len: query rows of the sequence;
    row: the row's index among them. The flash-attn family aligns queries to the END of
    the keys: row i sits at key position p = total - q_len + i and sees keys
    [max(0, p - left), min(total - 1, p if causal else p + right)] (left/right None or
    negative: unbounded).
    """
    if not causal and (right is None or right < 0) and (left is None or left < 0):
        # every row sees every key (DFlash's bidirectional block): no per-row positions to build
        return (total + torch.zeros_like(row)).clamp(min=0)
    p = total - q_len + row
    hi = total - 1
    if causal:
        hi = torch.minimum(hi, p)
    elif right is not None and right >= 0:
        hi = torch.minimum(hi, p + right)
    if left is not None and left >= 0:
        return (hi - (p - left).clamp(min=0) + 1).clamp(min=0)
    return (hi + 1).clamp(min=0)


def scale_rows(q: torch.Tensor, n: torch.Tensor, scaling: QueryScaling) -> torch.Tensor:
    """q multiplied row-wise by beta(n); n's shape is q's leading dims (rows), the rest
    (heads, head_dim) broadcast (QueryScaling.scale_rows: the rule in one expression)."""
    return scaling.scale_rows(q, n)


class Call:
    """Where a kernel's parameters sit in a call, resolved once, when the kernel is wrapped:
    reading one is a dict look-up and a tuple index, not `inspect.Signature.bind` on every
    call (a wrapped call runs on the host for every drafter layer of every step that is not
    replayed from a CUDA graph; TensorRT-LLM runs mixed context + generation batches eagerly).
    Defaults are the kernel's own (causal, windows decide the mask)."""

    def __init__(self, kernel: Callable, name: str, needed: tuple[str, ...] = ()):
        try:
            parameters = inspect.signature(kernel).parameters
        except (TypeError, ValueError):
            raise TypeError(f"SharpDraft cannot read the signature of {name} ({kernel!r}) to find "
                            "its query and length arguments") from None
        if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            absent = [n for n in needed if n not in parameters]
            if absent:
                raise TypeError(f"{name} has no parameter {', '.join(absent)}, which SharpDraft reads to count "
                                "visible keys: its signature moved")
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.position = {p.name: i for i, p in enumerate(parameters.values()) if p.kind in positional}
        self.default = {p.name: p.default for p in parameters.values() if p.default is not p.empty}

    def get(self, args: tuple, kwargs: dict, name: str, default=None):
        if name in kwargs:
            return kwargs[name]
        index = self.position.get(name)
        if index is not None and index < len(args):
            return args[index]
        return self.default.get(name, default)

    def replace(self, args: tuple, kwargs: dict, name: str, value) -> tuple:
        """args with `name` set to value where it was passed positionally; else kwargs (the
        wrapper's own dict) gets it. Returns the args to call with."""
        index = self.position.get(name)
        if name not in kwargs and index is not None and index < len(args):
            return args[:index] + (value,) + args[index + 1:]
        kwargs[name] = value
        return args


def _lengths(value, batch: int, device) -> torch.Tensor:
    # flash-attn accepts an int for cache_seqlens; everything else passes int32 tensors.
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64)
    return torch.full((batch,), int(value), device=device, dtype=torch.int64)


def _fixed_rows(total: torch.Tensor, q_len: int):
    """(total, q_len, row) as [B, q_len] tensors for calls with q_len rows per sequence."""
    row = torch.arange(q_len, device=total.device, dtype=torch.int64)
    return total[:, None], q_len, row[None, :]


def _wrap(kernel: Callable, scaling, name: str, query: str, rows, count: Callable | None = None,
          needed: tuple[str, ...] = ()) -> Callable:
    """The kernel, with its `query` argument multiplied row-wise by beta of `rows(call, args,
    kwargs, q)`: each row's visible-key count, shaped like q's leading (row) dims."""
    if getattr(kernel, WRAPPED, None) is not None:
        return kernel
    call = Call(kernel, name, needed)

    @functools.wraps(kernel)
    def wrapper(*args, **kwargs):
        active = _active(scaling)
        if active is None:
            return kernel(*args, **kwargs)
        q = call.get(args, kwargs, query)
        scaled = active.scale_rows(q, rows(call, args, kwargs, q))
        if count is not None:  # the layer's device counter: one in-place add, captured with the call
            count(scaled)
        return kernel(*call.replace(args, kwargs, query, scaled), **kwargs)

    setattr(wrapper, WRAPPED, kernel)
    return wrapper


def wrap_flash_attn_with_kvcache(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """flash_attn_with_kvcache(q [B, sq, H, D], k_cache, v_cache, k=None, v=None, ...,
    cache_seqlens, cache_batch_idx, ..., causal, window_size=(left, right), ...).

    Keys per sequence: cache_seqlens, plus k.shape[1] when k/v are passed to be appended
    (older DFlash); the newest DFlash writes the block first and passes ctx + block.
    With packed GQA (newest VANILLA, non-causal unwindowed layers) every row of a
    sequence sees the same keys, so row packing does not matter.
    """
    def rows(call, args, kwargs, q):
        batch, q_len = q.shape[0], q.shape[1]
        lengths = call.get(args, kwargs, "cache_seqlens")
        total = _lengths(call.get(args, kwargs, "k_cache").shape[1] if lengths is None else lengths, batch, q.device)
        k = call.get(args, kwargs, "k")
        if k is not None:
            total = total + k.shape[1]
        left, right = call.get(args, kwargs, "window_size", (-1, -1))
        return visible_keys(*_fixed_rows(total, q_len), bool(call.get(args, kwargs, "causal", False)), left, right)

    return _wrap(kernel, scaling, "flash_attn_with_kvcache", "q", rows, count, pins.KERNEL_PARAMETERS["VANILLA"])


def _varlen_rows(total_q: int, cum_q: torch.Tensor, seq_lens: torch.Tensor):
    # Rows of a ragged query batch ([sum q_len, H, D] with cumulative offsets): which
    # sequence each row belongs to and its index there, found on the device.
    cum_q = cum_q.to(torch.int64)
    rows = torch.arange(total_q, device=cum_q.device, dtype=torch.int64)
    seq = torch.searchsorted(cum_q[1:].contiguous(), rows, right=True)
    start = cum_q[seq]
    q_len = cum_q[seq + 1] - start
    return seq_lens.to(torch.int64)[seq], q_len, rows - start


def wrap_trtllm_gen_decode(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """flashinfer trtllm_batch_decode_with_kv_cache(query [B * q_len_per_req, H, D], kv_cache,
    workspace_buffer, block_tables, seq_lens [B], max_seq_len, ..., window_left, ...,
    q_len_per_req, ..., cum_seq_lens_q, ...).

    seq_lens counts the keys including this step's block; the q_len_per_req rows of a
    request are causal among themselves (speculative decoding's layout), row i seeing
    seq_lens - q_len + i + 1 keys, at most window_left + 1 when a window is set.
    """
    def rows(call, args, kwargs, query):
        seq_lens = call.get(args, kwargs, "seq_lens").to(torch.int64)
        cum_q = call.get(args, kwargs, "cum_seq_lens_q")
        if cum_q is not None:
            total, q_len, row = _varlen_rows(query.shape[0], cum_q, seq_lens)
        else:
            total, q_len, row = _fixed_rows(seq_lens, int(call.get(args, kwargs, "q_len_per_req") or 1))
        return visible_keys(total, q_len, row, True, call.get(args, kwargs, "window_left", -1), None).reshape(-1)

    return _wrap(kernel, scaling, "trtllm_batch_decode_with_kv_cache", "query", rows, count,
                 pins.KERNEL_PARAMETERS["TRTLLM"])


def wrap_trtllm_gen_context(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """flashinfer trtllm_batch_context_with_kv_cache(query [sum q_len, H, D], kv_cache, ...,
    seq_lens [B], max_q_len, max_kv_len, ..., batch_size, cum_seq_lens_q [B + 1],
    cum_seq_lens_kv, window_left, ..., causal, ...).

    DFlash calls it for non-causal (bidirectional block) layers: every row of a request
    sees all seq_lens keys, or the last window_left + 1 + (rows after it) with a window.
    """
    def rows(call, args, kwargs, query):
        total, q_len, row = _varlen_rows(query.shape[0], call.get(args, kwargs, "cum_seq_lens_q"),
                                         call.get(args, kwargs, "seq_lens"))
        return visible_keys(total, q_len, row, bool(call.get(args, kwargs, "causal", True)),
                            call.get(args, kwargs, "window_left", -1), None)

    return _wrap(kernel, scaling, "trtllm_batch_context_with_kv_cache", "query", rows, count,
                 pins.KERNEL_PARAMETERS["TRTLLM_CONTEXT"])


def wrap_fa4_fwd(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """FlashAttention-4 `_flash_attn_fwd(q [B, sq, H, D], k, v, ..., seqused_k [B],
    page_table, softmax_scale, causal, ..., window_size_left, window_size_right, ...)`.

    Keys per sequence: seqused_k (DFlash passes ctx + block); without it, k.shape[1]
    (unpaged). Ragged queries (cu_seqlens_q) are not used by DFlash and are refused.
    """
    def rows(call, args, kwargs, q):
        if call.get(args, kwargs, "cu_seqlens_q") is not None:
            raise ValueError("SharpDraft's FA4 wrapper handles [B, sq, H, D] queries; "
                             "this call passes cu_seqlens_q (ragged queries)")
        batch, q_len = q.shape[0], q.shape[1]
        seqused_k = call.get(args, kwargs, "seqused_k")
        if seqused_k is not None:
            total = _lengths(seqused_k, batch, q.device)
        elif call.get(args, kwargs, "page_table") is None:
            total = _lengths(call.get(args, kwargs, "k").shape[1], batch, q.device)
        else:
            raise ValueError("SharpDraft's FA4 wrapper needs seqused_k with a page_table")
        return visible_keys(*_fixed_rows(total, q_len), bool(call.get(args, kwargs, "causal", False)),
                            call.get(args, kwargs, "window_size_left"), call.get(args, kwargs, "window_size_right"))

    return _wrap(kernel, scaling, "_flash_attn_fwd", "q", rows, count, pins.KERNEL_PARAMETERS["FA4"])


def wrap_dflash_hybrid(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """`dflash_ctx_paged_attention(q [B, Q, NH, D], k_cache, v_cache, block_idx, ctx_lens [B],
    k_noise [B, Q, NKV, D], v_noise)` (`_torch/speculative/dflash_hybrid_attn.py`, the hybrid
    mode whose draft context lives in the target's KV cache manager): every query row of
    request b attends, unmasked, to its ctx_lens[b] context tokens from the paged pool and
    to the Q keys of the block's dense noise suffix, so N = ctx_lens[b] + Q for every row.
    """
    def rows(call, args, kwargs, q):
        total = _lengths(call.get(args, kwargs, "ctx_lens"), q.shape[0], q.device)
        total = total + call.get(args, kwargs, "k_noise").shape[1]
        return visible_keys(*_fixed_rows(total, q.shape[1]), False, None, None)

    return _wrap(kernel, scaling, "dflash_ctx_paged_attention", "q", rows, count, pins.KERNEL_PARAMETERS["HYBRID"])
