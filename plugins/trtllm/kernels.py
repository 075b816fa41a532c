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

__all__ = ["visible_keys", "scale_rows", "wrap_flash_attn_with_kvcache", "wrap_trtllm_gen_decode",
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
    p = total - q_len + row
    hi = total - 1
    if causal:
        hi = torch.minimum(hi, p)
    elif right is not None and right >= 0:
        hi = torch.minimum(hi, p + right)
    lo = torch.zeros_like(p)
    if left is not None and left >= 0:
        lo = (p - left).clamp(min=0)
    return (hi - lo + 1).clamp(min=0)


def scale_rows(q: torch.Tensor, n: torch.Tensor, scaling: QueryScaling) -> torch.Tensor:
    """q multiplied row-wise by beta(n); n's shape is q's leading dims (rows), the rest
    (heads, head_dim) broadcast. One rounding back to q's dtype (bf16 keeps beta exact
    to float32 before it)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    beta = scaling.beta_on_device(n, work)
    beta = beta.reshape(*n.shape, *([1] * (q.dim() - n.dim())))
    return (q.to(work) * beta).to(q.dtype)


def _binder(kernel: Callable, name: str):
    try:
        signature = inspect.signature(kernel)
    except (TypeError, ValueError):
        raise TypeError(f"SharpDraft cannot read the signature of {name} ({kernel!r}) to find "
                        "its query and length arguments") from None

    def bind(args, kwargs) -> inspect.BoundArguments:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()  # the kernel's own defaults (causal, windows) decide the mask
        return bound

    return bind


def _lengths(value, batch: int, device) -> torch.Tensor:
    # flash-attn accepts an int for cache_seqlens; everything else passes int32 tensors.
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64)
    return torch.full((batch,), int(value), device=device, dtype=torch.int64)


def _fixed_rows(total: torch.Tensor, q_len: int):
    """(total, q_len, row) as [B, q_len] tensors for calls with q_len rows per sequence."""
    row = torch.arange(q_len, device=total.device, dtype=torch.int64)
    return total[:, None], q_len, row[None, :]


def _binder_checked(kernel: Callable, name: str, needed: tuple[str, ...]):
    bind = _binder(kernel, name)
    parameters = inspect.signature(kernel).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        absent = [n for n in needed if n not in parameters]
        if absent:
            raise TypeError(f"{name} has no parameter {', '.join(absent)}, which SharpDraft reads to count "
                            "visible keys: its signature moved")
    return bind


def _wrap(kernel: Callable, scaling, name: str, rescale, count: Callable | None = None,
          needed: tuple[str, ...] = ()) -> Callable:
    if getattr(kernel, WRAPPED, None) is not None:
        return kernel
    bind = _binder_checked(kernel, name, needed)

    @functools.wraps(kernel)
    def wrapper(*args, **kwargs):
        active = _active(scaling)
        if active is None:
            return kernel(*args, **kwargs)
        bound = bind(args, kwargs)
        scaled = rescale(bound.arguments, active)
        if count is not None:  # the layer's device counter: one in-place add, captured with the call
            count(scaled)
        return kernel(*bound.args, **bound.kwargs)

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
    def rescale(a, active):
        q = a["q"]
        batch, q_len = q.shape[0], q.shape[1]
        if a.get("cache_seqlens") is None:
            total = _lengths(a["k_cache"].shape[1], batch, q.device)
        else:
            total = _lengths(a["cache_seqlens"], batch, q.device)
        if a.get("k") is not None:
            total = total + a["k"].shape[1]
        left, right = a.get("window_size", (-1, -1))
        n = visible_keys(*_fixed_rows(total, q_len), bool(a.get("causal", False)), left, right)
        a["q"] = scale_rows(q, n, active)
        return a["q"]

    return _wrap(kernel, scaling, "flash_attn_with_kvcache", rescale, count, pins.KERNEL_PARAMETERS["VANILLA"])


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
    def rescale(a, active):
        query = a["query"]
        seq_lens = a["seq_lens"].to(torch.int64)
        left = a.get("window_left", -1)
        if a.get("cum_seq_lens_q") is not None:
            total, q_len, row = _varlen_rows(query.shape[0], a["cum_seq_lens_q"], seq_lens)
        else:
            total, q_len, row = _fixed_rows(seq_lens, int(a.get("q_len_per_req") or 1))
        n = visible_keys(total, q_len, row, True, left, None).reshape(-1)
        a["query"] = scale_rows(query, n, active)
        return a["query"]

    return _wrap(kernel, scaling, "trtllm_batch_decode_with_kv_cache", rescale, count,
                 pins.KERNEL_PARAMETERS["TRTLLM"])


def wrap_trtllm_gen_context(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """flashinfer trtllm_batch_context_with_kv_cache(query [sum q_len, H, D], kv_cache, ...,
    seq_lens [B], max_q_len, max_kv_len, ..., batch_size, cum_seq_lens_q [B + 1],
    cum_seq_lens_kv, window_left, ..., causal, ...).

    DFlash calls it for non-causal (bidirectional block) layers: every row of a request
    sees all seq_lens keys, or the last window_left + 1 + (rows after it) with a window.
    """
    def rescale(a, active):
        query = a["query"]
        total, q_len, row = _varlen_rows(query.shape[0], a["cum_seq_lens_q"], a["seq_lens"])
        n = visible_keys(total, q_len, row, bool(a.get("causal", True)),
                         a.get("window_left", -1), None)
        a["query"] = scale_rows(query, n, active)
        return a["query"]

    return _wrap(kernel, scaling, "trtllm_batch_context_with_kv_cache", rescale, count,
                 pins.KERNEL_PARAMETERS["TRTLLM_CONTEXT"])


def wrap_fa4_fwd(kernel: Callable, scaling, count: Callable | None = None) -> Callable:
    """FlashAttention-4 `_flash_attn_fwd(q [B, sq, H, D], k, v, ..., seqused_k [B],
    page_table, softmax_scale, causal, ..., window_size_left, window_size_right, ...)`.

    Keys per sequence: seqused_k (DFlash passes ctx + block); without it, k.shape[1]
    (unpaged). Ragged queries (cu_seqlens_q) are not used by DFlash and are refused.
    """
    def rescale(a, active):
        q = a["q"]
        if a.get("cu_seqlens_q") is not None:
            raise ValueError("SharpDraft's FA4 wrapper handles [B, sq, H, D] queries; "
                             "this call passes cu_seqlens_q (ragged queries)")
        batch, q_len = q.shape[0], q.shape[1]
        if a.get("seqused_k") is not None:
            total = _lengths(a["seqused_k"], batch, q.device)
        elif a.get("page_table") is None:
            total = _lengths(a["k"].shape[1], batch, q.device)
        else:
            raise ValueError("SharpDraft's FA4 wrapper needs seqused_k with a page_table")
        n = visible_keys(*_fixed_rows(total, q_len), bool(a.get("causal", False)),
                         a.get("window_size_left"), a.get("window_size_right"))
        a["q"] = scale_rows(q, n, active)
        return a["q"]

    return _wrap(kernel, scaling, "_flash_attn_fwd", rescale, count, pins.KERNEL_PARAMETERS["FA4"])
