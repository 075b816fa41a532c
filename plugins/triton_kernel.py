"""The fused SharpDraft attention kernel (Triton): flash-attention over prefix-visible keys
with beta(N) computed per query row inside the kernel, from the row's visible-key count.

`attention()` is what `sharpdraft::attention` runs on CUDA; `aot_compile()` turns the same
kernel source into PTX for the TensorRT plugin (plugins/tensorrt.py). Under
TRITON_INTERPRET=1 the kernel runs on CPU, which is how the tests check it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from plugins.op_inputs import check_inputs
from plugins.scaling import QueryScaling

__all__ = ["attention", "launch", "plan_for", "LaunchPlan", "VARIANTS", "DTYPES", "kernel_beta", "key_splits", "launch_blocks", "exact_row_tile", "launch_grid", "launch_scalars",
           "contiguous_scalars", "aot_compile", "CompiledAttention", "SCALAR_ARGS", "SLICE_ARGS", "MAX_HEAD_DIM",
           "aot_slices", "aot_slice_scalars"]

MAX_HEAD_DIM = 256  # above this one tile of Q and O no longer fits in registers
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = tuple(_DTYPES)  # the torch dtypes the kernel takes

# The kernel's int32 scalar arguments, in order. TensorRT's AOT plugins launch a kernel as
# (input pointers..., int32 scalars..., output pointers...), so the signature keeps that
# shape: q, k, v, visible, these scalars, out. Anything that is not an int32 (the beta
# constants, block sizes) is a compile-time constant instead.
SCALAR_ARGS = ("q_len", "kv_len", "kv_heads", "group",
               "stride_qb", "stride_qh", "stride_qm",
               "stride_kb", "stride_kh", "stride_kn",
               "stride_vb", "stride_vh", "stride_vn",
               "stride_ob", "stride_oh", "stride_om",
               "stride_visible_b")


@triton.jit
def _row_beta(visible, SCALED: tl.constexpr, TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr,
              BIAS: tl.constexpr, CAP: tl.constexpr):
    """beta for each row from its visible-key count, in QueryScaling.kernel_constants form."""
    n = visible.to(tl.float32)
    if SCALED:
        beta = tl.log(tl.maximum(n - TOP_K, 1.0)) * INV_SLOPE + BIAS
        beta = tl.minimum(tl.maximum(beta, 1.0), CAP)
    else:
        beta = n * 0.0 + 1.0
    return beta


@triton.jit
def _attend_key_tile(acc, m_i, l_i, q, k_base, v_base, start, stride_kn, stride_vn, visible,
                     key_end, row_scale, d, d_ok, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N)."""
    keys = start + tl.arange(0, BLOCK_N)
    if MASKED:
        # Keys past a row's visible count (or past the tile's longest row) are cut here;
        # tiles every row sees whole skip this work.
        key_ok = keys < key_end
        k_t = tl.load(k_base + keys[None, :] * stride_kn + d[:, None],
                      mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vn + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k_t = tl.load(k_base + keys[None, :] * stride_kn + d[:, None], mask=d_ok[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vn + d[None, :], mask=d_ok[None, :], other=0.0)
    # beta scales the fp32 scores rather than Q, so fp16/bf16 inputs are not rounded twice.
    if q.shape[0] < 16:
        # A row tile under tl.dot's 16-row minimum (one-row decode with a small GQA group):
        # products on the CUDA cores instead of a 16-row tensor-core tile mostly padding.
        s = tl.sum(q.to(tl.float32)[:, :, None] * k_t.to(tl.float32)[None, :, :], 1) * row_scale[:, None]
    else:
        s = tl.dot(q, k_t, input_precision=PRECISION) * row_scale[:, None]
    if MASKED:
        s = tl.where(keys[None, :] < visible[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if q.shape[0] < 16:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_rows(Q, K, V, VISIBLE, tile, batch, kv_head, key_lo, key_hi,
                 q_len, kv_len, group,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_visible_b,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SCORE_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                 SCALED: tl.constexpr, TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr,
                 BIAS: tl.constexpr, CAP: tl.constexpr):
    """Online softmax of one tile of packed rows over keys [key_lo, key_hi) (key_lo and
    key_hi multiples of BLOCK_N, or key_hi >= kv_len): unnormalised acc, row max, row sum.

    Rows pack (query, head in the GQA group) as row = query * group + head_in_group, so
    every head sharing a KV head reads each K/V tile once: a drafter step is memory-bound
    on K/V."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * group
    query = (rows // group).to(tl.int64)
    head = kv_head * group + (rows % group)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM  # head_dim need not be a power of two: pad the tile, mask the rest

    q = tl.load(Q + batch * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qm
                + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    visible = tl.load(VISIBLE + batch * stride_visible_b + query, mask=row_ok, other=0)
    # Callers check counts (plugins.attention.check_inputs); TensorRT's plugin cannot check
    # on the host, so the clamp keeps a bad count there from reading out of bounds.
    visible = tl.minimum(tl.maximum(visible, 0), kv_len).to(tl.int32)
    row_scale = _row_beta(visible, SCALED, TOP_K, INV_SLOPE, BIAS, CAP) * SCORE_SCALE

    # Keys below every row's count need no mask; only the ragged tail does.
    seen_by_all = tl.min(tl.where(row_ok, visible, kv_len), 0)
    seen_by_any = tl.max(visible, 0)
    unmasked_end = (seen_by_all // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seen_by_any, key_hi)
    mid = tl.minimum(tl.maximum(unmasked_end, key_lo), hi)

    # A finite start keeps fully masked rows (padding, or visible = 0) free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    for start in range(key_lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(acc, m_i, l_i, q, k_base, v_base, start, stride_kn,
                                         stride_vn, visible, hi, row_scale, d, d_ok, False, BLOCK_N,
                                         PRECISION)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(acc, m_i, l_i, q, k_base, v_base, start, stride_kn,
                                         stride_vn, visible, hi, row_scale, d, d_ok, True, BLOCK_N,
                                         PRECISION)
    return acc, m_i, l_i


@triton.jit
def _store_rows(OUT, out, batch, kv_head, rows, row_ok, group, stride_ob, stride_oh, stride_om, d,
                HEAD_DIM: tl.constexpr):
    """Normalised fp32 rows of one tile into OUT (q's dtype), unpacking row = query * group +
    head_in_group."""
    query = (rows // group).to(tl.int64)
    head = kv_head * group + (rows % group)
    tl.store(OUT + batch * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om
             + d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _store_partial(PARTIAL_OUT, PARTIAL_LSE, slot, acc, m_i, l_i, row_ok, d, HEAD_DIM: tl.constexpr):
    """One key slice's partial of a row tile, at scratch rows `slot`: the rows' output
    normalised over the slice and their log2-domain log-sum-exp (-inf where a row sees
    none of the slice's keys)."""
    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(PARTIAL_LSE + slot, lse, mask=row_ok)
    tl.store(PARTIAL_OUT + slot[:, None] * HEAD_DIM + d[None, :],
             acc / tl.where(seen, l_i, 1.0)[:, None], mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _merge_partials(PARTIAL_OUT, PARTIAL_LSE, first_slot, slot_step, slices, row_ok, d,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    CACHE: tl.constexpr):
    """The partials of `slices` key slices (_store_partial's, slice i at scratch rows
    first_slot + i * slot_step) merged by their log-sum-exp in slice order: the row tile's
    normalised output (fp32). CACHE: the loads' cache modifier."""
    d_ok = d < HEAD_DIM
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, slices):
        slot = first_slot + i * slot_step
        lse = tl.load(PARTIAL_LSE + slot, mask=row_ok, other=float("-inf"), cache_modifier=CACHE)
        part = tl.load(PARTIAL_OUT + slot[:, None] * HEAD_DIM + d[None, :],
                       mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + weight[:, None] * part
        total = total * alpha + weight
        m = m_new
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]


@triton.jit
def _sharpdraft_attention_kernel(
        Q, K, V, VISIBLE,
        q_len, kv_len, kv_heads, group,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        stride_visible_b,
        OUT,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SCORE_SCALE: tl.constexpr, PRECISION: tl.constexpr,
        SCALED: tl.constexpr, TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr,
        BIAS: tl.constexpr, CAP: tl.constexpr):
    # One program: BLOCK_M packed rows of one (batch, kv head), over all their keys.
    tile = tl.program_id(0)
    batch = (tl.program_id(1) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    acc, m_i, l_i = _attend_rows(
        Q, K, V, VISIBLE, tile, batch, kv_head, 0, kv_len, q_len, kv_len, group,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_visible_b,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SCORE_SCALE, PRECISION, SCALED, TOP_K, INV_SLOPE, BIAS, CAP)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    _store_rows(OUT, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], batch, kv_head, rows,
                rows < q_len * group, group, stride_ob, stride_oh, stride_om, tl.arange(0, BLOCK_D), HEAD_DIM)


@triton.jit
def _split_slots(rows, row_count):
    """Where the two-launch split keeps this program's rows in its partials, laid out
    [split, batch * kv_head, row]: (slice 0's slots, the step from one slice to the next)."""
    first_slot = tl.program_id(1).to(tl.int64) * row_count + rows
    return first_slot, tl.num_programs(1).to(tl.int64) * row_count


@triton.jit
def _split_keys_kernel(
        Q, K, V, VISIBLE,
        q_len, kv_len, kv_heads, group,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_visible_b, keys_per_split,
        PARTIAL_OUT, PARTIAL_LSE,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SCORE_SCALE: tl.constexpr, PRECISION: tl.constexpr,
        SCALED: tl.constexpr, TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr,
        BIAS: tl.constexpr, CAP: tl.constexpr):
    # Flash-decoding: a drafter step has few rows per KV head, too few programs to fill a
    # GPU over a long context, so each program takes one slice of the keys; _merge_splits
    # combines the slices by their log-sum-exp. Partials are fp32 [split, b*kv_head, row, d].
    tile = tl.program_id(0)
    split = tl.program_id(2)
    batch = (tl.program_id(1) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    key_lo = split * keys_per_split
    acc, m_i, l_i = _attend_rows(
        Q, K, V, VISIBLE, tile, batch, kv_head, key_lo, key_lo + keys_per_split, q_len, kv_len, group,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_visible_b,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SCORE_SCALE, PRECISION, SCALED, TOP_K, INV_SLOPE, BIAS, CAP)
    row_count = q_len * group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    first_slot, slot_step = _split_slots(rows, row_count)
    _store_partial(PARTIAL_OUT, PARTIAL_LSE, first_slot + split * slot_step, acc, m_i, l_i,
                   rows < row_count, tl.arange(0, BLOCK_D), HEAD_DIM)


@triton.jit
def _merge_splits(PARTIAL_OUT, PARTIAL_LSE, q_len, kv_heads, group, splits,
                  stride_ob, stride_oh, stride_om, OUT,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    tile = tl.program_id(0)
    batch = (tl.program_id(1) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    row_count = q_len * group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row_count
    d = tl.arange(0, BLOCK_D)
    first_slot, slot_step = _split_slots(rows, row_count)
    out = _merge_partials(PARTIAL_OUT, PARTIAL_LSE, first_slot, slot_step, splits, row_ok, d,
                          HEAD_DIM, BLOCK_D, BLOCK_M, "")
    _store_rows(OUT, out, batch, kv_head, rows, row_ok, group, stride_ob, stride_oh, stride_om, d, HEAD_DIM)


@triton.jit
def _slice_plan(programs, slices, kv_len, fill_programs, min_keys_per_split, scratch_rows, counters,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key slices of the single-launch kernel, worked out by every program alike from
    runtime scalars: key_splits' rule (about two programs per SM, no slice under
    min_keys_per_split keys) within the launched `slices` and what the scratch holds.
    Returns (active slices, keys per slice); 1 slice: plain single pass, no scratch."""
    want = tl.minimum(slices, (2 * fill_programs + programs - 1) // programs)
    want = tl.minimum(want, kv_len // min_keys_per_split)
    want = tl.where(programs >= fill_programs, 1, want)
    want = tl.minimum(want, scratch_rows // (programs * BLOCK_M))
    want = tl.where(programs > counters, 1, tl.maximum(want, 1))
    per_slice = ((kv_len + want - 1) // want + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return (kv_len + per_slice - 1) // per_slice, per_slice


@triton.jit
def _single_launch_kernel(
        Q, K, V, VISIBLE,
        q_len, kv_len, kv_heads, group,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        stride_visible_b,
        fill_programs, min_keys_per_split, scratch_rows, counters,
        OUT, PARTIAL_OUT, PARTIAL_LSE, ARRIVALS,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SCORE_SCALE: tl.constexpr, PRECISION: tl.constexpr,
        SCALED: tl.constexpr, TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr,
        BIAS: tl.constexpr, CAP: tl.constexpr, REVERSED: tl.constexpr = False):
    # Split-K in ONE launch (what an AOT TensorRT plugin can run): each program attends
    # one key slice of one row tile and leaves its partial in scratch; the last program of
    # the tile to arrive (an atomic counter per tile) merges every slice from scratch and
    # resets the counter to 0, so the next launch finds it as the first one did. The merge
    # reads all partials, its own included, in slice order: the result does not depend on
    # which program merges. REVERSED (tests only) turns the slice order around so another
    # program arrives last under the interpreter's sequential order.
    tile = tl.program_id(0)
    slice_id = tl.program_id(2)
    if REVERSED:
        slice_id = tl.num_programs(2) - 1 - slice_id
    batch = (tl.program_id(1) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    programs = tl.num_programs(0) * tl.num_programs(1)
    active, per_slice = _slice_plan(programs, tl.num_programs(2), kv_len, fill_programs,
                                    min_keys_per_split, scratch_rows, counters, BLOCK_M, BLOCK_N)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * group
    d = tl.arange(0, BLOCK_D)
    if slice_id < active:
        key_lo = slice_id * per_slice
        acc, m_i, l_i = _attend_rows(
            Q, K, V, VISIBLE, tile, batch, kv_head, key_lo, key_lo + per_slice, q_len, kv_len, group,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_visible_b,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SCORE_SCALE, PRECISION, SCALED, TOP_K, INV_SLOPE, BIAS, CAP)
        if active == 1:
            _store_rows(OUT, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], batch, kv_head, rows, row_ok,
                        group, stride_ob, stride_oh, stride_om, d, HEAD_DIM)
        else:
            # Scratch laid out [slice, row tile, BLOCK_M]: one tile's rows per (slice, counter).
            counter = tl.program_id(1) * tl.num_programs(0) + tile
            first_slot = counter.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            slot_step = programs.to(tl.int64) * BLOCK_M
            _store_partial(PARTIAL_OUT, PARTIAL_LSE, first_slot + slice_id * slot_step, acc, m_i, l_i,
                           row_ok, d, HEAD_DIM)
            # Every thread's stores before one thread's release: a CTA barrier, then the
            # counter's acq_rel atomic at GPU scope (the merging program acquires it).
            tl.debug_barrier()
            arrived = tl.atomic_add(ARRIVALS + counter, 1, sem="acq_rel", scope="gpu")
            if arrived == active - 1:
                # .cg: partials come from other SMs; never from this SM's L1.
                out = _merge_partials(PARTIAL_OUT, PARTIAL_LSE, first_slot, slot_step, active, row_ok, d,
                                      HEAD_DIM, BLOCK_D, BLOCK_M, ".cg")
                _store_rows(OUT, out, batch, kv_head, rows, row_ok, group, stride_ob, stride_oh, stride_om,
                            d, HEAD_DIM)
                tl.atomic_xchg(ARRIVALS + counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _beta_probe_kernel(VISIBLE, count, BETA, BLOCK: tl.constexpr, SCALED: tl.constexpr,
                       TOP_K: tl.constexpr, INV_SLOPE: tl.constexpr, BIAS: tl.constexpr,
                       CAP: tl.constexpr):
    # Runs the attention kernel's own _row_beta, so tests can hold it against scaling.beta.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < count
    visible = tl.load(VISIBLE + offsets, mask=ok, other=0)
    tl.store(BETA + offsets, _row_beta(visible, SCALED, TOP_K, INV_SLOPE, BIAS, CAP), mask=ok)


def _scaling_constants(scaling: QueryScaling | None) -> dict:
    if scaling is None:
        return dict(SCALED=False, TOP_K=0.0, INV_SLOPE=0.0, BIAS=0.0, CAP=1.0)
    top_k, inv_slope, bias, cap = scaling.kernel_constants()
    return dict(SCALED=True, TOP_K=top_k, INV_SLOPE=inv_slope, BIAS=bias, CAP=cap)


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton SharpDraft kernel supports head_dim 1..{MAX_HEAD_DIM}, "
                         f"got {head_dim}; use the reference op (plugins.attention) instead")


def launch_blocks(rows: int, head_dim: int) -> dict:
    """Tile sizes for `rows` packed query rows (q_len * group) and a head_dim.

    tl.dot needs every tile side >= 16; a drafter step has few rows (16 queries x group),
    so BLOCK_M shrinks to fit them instead of padding to a prefill-sized tile.
    """
    _check_head_dim(head_dim)
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(BLOCK_D=block_d, BLOCK_M=min(64, max(16, triton.next_power_of_2(rows))),
                BLOCK_N=64 if block_d <= 128 else 32)


def exact_row_tile(rows: int) -> int | None:
    """block_m for a step of fewer than 16 packed rows (one-row decode, GQA group <= 8):
    the rows rounded up to a power of two, taken by the kernel's CUDA-core path instead of
    a 16-row tile (4x padding at group 4). None where the default tile already fits.
    Opt-in (attention(..., block_m=exact_row_tile(rows))) until a GPU run measures it."""
    tile = triton.next_power_of_2(rows)
    return tile if tile < 16 else None


def launch_grid(batch, q_len, kv_heads, group, block_m: int):
    """(tiles of packed rows, batch * kv_heads). Plain +, *, // only, so the same formula
    runs on ints here and on TensorRT's symbolic shape expressions in the plugin."""
    return ((q_len * group + (block_m - 1)) // block_m, batch * kv_heads)


def contiguous_scalars(heads, q_len, kv_heads, kv_len, head_dim) -> tuple:
    """SCALAR_ARGS for contiguous q/out [b, heads, q_len, d], k/v [b, kv_heads, kv_len, d]
    and visible [b, q_len] -- what TensorRT hands the plugin. Same operator rule as
    launch_grid: ints or TensorRT shape expressions."""
    q_head, kv_head = q_len * head_dim, kv_len * head_dim
    return (q_len, kv_len, kv_heads, heads // kv_heads,
            q_head * heads, q_head, head_dim,
            kv_head * kv_heads, kv_head, head_dim,
            kv_head * kv_heads, kv_head, head_dim,
            q_head * heads, q_head, head_dim,
            q_len)


def _score_scale(head_dim: int) -> float:
    # 1/sqrt(d) softmax scale times log2(e): the kernel's softmax runs on exp2.
    return math.log2(math.e) / math.sqrt(head_dim)


def launch_scalars(q, k, visible, out, v=None) -> tuple:
    """SCALAR_ARGS from real tensors (any strides with a unit last stride)."""
    v = k if v is None else v
    return (q.shape[2], k.shape[2], k.shape[1], q.shape[1] // k.shape[1],
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], visible.stride(0))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not go through TF32 tensor cores: fp32 engines promise fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_kernel_inputs(q, k, v) -> None:
    """What this kernel adds to the op's contract (plugins.attention.check_inputs)."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Triton SharpDraft kernel takes float32/float16/bfloat16 q, k, v of "
                         f"one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_head_dim(q.shape[-1])


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


MIN_KEYS_PER_SPLIT = 256  # below this a key slice costs more to merge than it saves


def key_splits(programs: int, kv_len: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """(slices, keys per slice) for flash-decoding: enough programs to give every SM about
    two, never slices shorter than MIN_KEYS_PER_SPLIT keys. Slices are whole key tiles."""
    splits = 1
    if programs < sm_count:
        splits = max(1, min(triton.cdiv(2 * sm_count, programs), kv_len // MIN_KEYS_PER_SPLIT))
    per_split = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
    return triton.cdiv(kv_len, per_split), per_split


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: one program at a time, nothing to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


VARIANTS = ("split", "single")  # key slices merged by a second launch, or in the same one


def attention(q, k, v, visible, scaling: QueryScaling | None = None, *, block_m: int | None = None,
              block_n: int | None = None, splits: int | None = None, variant: str = "split",
              num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Fused `sharpdraft_attention(q, k, v, visible, scaling)` (no tree mask).

    q [batch, heads, q_len, d]; k, v [batch, kv_heads, kv_len, d]; visible int64
    [batch, q_len]: row (b, i) attends to keys [0, visible[b, i]) with its query scaled by
    beta(visible[b, i]) (scaling=None: beta = 1). Returns q's dtype; accumulates in fp32.
    block_m / block_n override the tile sizes and `splits` the number of key slices
    (default: key_splits for this GPU; 1 is the single-pass kernel). variant "split"
    merges the slices in a second launch, "single" inside the one launch (what the
    TensorRT plugin runs). Counts are checked on the host only off CUDA (op_inputs).
    """
    check_inputs(q, k, v, visible)
    _check_kernel_inputs(q, k, v)
    return launch(q, k, v, visible, scaling, block_m=block_m, block_n=block_n, splits=splits,
                  variant=variant, num_warps=num_warps, num_stages=num_stages)


# Scratch of the single-launch kernel: one int32 arrival counter per row tile (zeroed once,
# reset by the kernel itself) and fp32 partials per slice.
@dataclasses.dataclass
class LaunchPlan:
    """Everything a launch needs that depends only on shapes, strides, dtype, device and
    the scaling: worked out once per key (plan_for) and reused, so a call costs one dict
    lookup, the output allocation and the Triton launch(es). Scratch buffers are reused
    across calls, so calls sharing a plan must be stream-ordered (as one stream is)."""

    variant: str  # "single_pass", "split" or "single"
    grid: tuple
    constants: dict
    scalars: tuple
    splits: int
    per_split: int
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None
    arrivals: torch.Tensor | None = None
    extra: tuple = ()
    merge_args: tuple = ()
    launch_options: dict = dataclasses.field(default_factory=dict)

    def run(self, q, k, v, visible, out) -> None:
        if self.variant == "single_pass":
            _sharpdraft_attention_kernel[self.grid](q, k, v, visible, *self.scalars, out,
                                                    **self.launch_options, **self.constants)
        elif self.variant == "single":
            _single_launch_kernel[self.grid](q, k, v, visible, *self.scalars, *self.extra, out,
                                             self.partial_out, self.partial_lse, self.arrivals,
                                             **self.launch_options, **self.constants)
        else:
            without_out = self.scalars[:13] + self.scalars[16:]  # the partials replace out's strides
            _split_keys_kernel[self.grid](q, k, v, visible, *without_out, self.per_split,
                                          self.partial_out, self.partial_lse,
                                          **self.launch_options, **self.constants)
            _merge_splits[self.grid[:2]](self.partial_out, self.partial_lse, *self.merge_args, out,
                                         HEAD_DIM=self.constants["HEAD_DIM"],
                                         BLOCK_D=self.constants["BLOCK_D"], BLOCK_M=self.constants["BLOCK_M"])


_PLANS: dict = {}


def plan_for(q, k, v, visible, scaling: QueryScaling | None = None, *, block_m=None, block_n=None,
             splits=None, variant: str = "split", num_warps: int = 4, num_stages: int = 2,
             reversed_slices: bool = False) -> LaunchPlan:
    """The cached LaunchPlan for these tensors' layout (tensors with a unit last stride)."""
    key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), visible.stride(),
           q.dtype, q.device, scaling, block_m, block_n, splits, variant, num_warps, num_stages,
           reversed_slices)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _make_plan(q, k, v, visible, scaling, block_m, block_n, splits, variant,
                                        num_warps, num_stages, reversed_slices)
    return plan


def _make_plan(q, k, v, visible, scaling, block_m, block_n, splits, variant, num_warps, num_stages,
               reversed_slices) -> LaunchPlan:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    blocks = launch_blocks(q_len * group, head_dim)
    if block_m is not None:
        blocks["BLOCK_M"] = block_m
        if block_m < 16:  # the CUDA-core path holds a [rows, d, keys] product: keep it small
            blocks["BLOCK_N"] = max(8, min(64, 8192 // (block_m * blocks["BLOCK_D"])))
    if block_n is not None:
        blocks["BLOCK_N"] = block_n
    grid = launch_grid(batch, q_len, kv_heads, group, blocks["BLOCK_M"])
    constants = dict(HEAD_DIM=head_dim, SCORE_SCALE=_score_scale(head_dim), PRECISION=_precision(q.dtype),
                     **blocks, **_scaling_constants(scaling))
    forced = splits is not None
    if forced:
        per_split = triton.cdiv(triton.cdiv(kv_len, splits), blocks["BLOCK_N"]) * blocks["BLOCK_N"]
        splits = triton.cdiv(kv_len, per_split)
    else:
        splits, per_split = key_splits(grid[0] * grid[1], kv_len, blocks["BLOCK_N"], _sm_count(q.device))
    out_strides = (heads * q_len * head_dim, q_len * head_dim, head_dim)  # out is contiguous
    scalars = (q_len, kv_len, kv_heads, group, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
               *out_strides, visible.stride(0))
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if splits == 1:
        return LaunchPlan("single_pass", grid, constants, scalars, 1, per_split, launch_options=options)
    rows = q_len * group
    programs = grid[0] * grid[1]
    if variant == "split":
        return LaunchPlan("split", grid + (splits,), constants, scalars, splits, per_split,
                          partial_out=torch.empty(splits, grid[1], rows, head_dim, dtype=torch.float32,
                                                  device=q.device),
                          partial_lse=torch.empty(splits, grid[1], rows, dtype=torch.float32, device=q.device),
                          merge_args=(q_len, kv_heads, group, splits, *out_strides),
                          launch_options=options)
    scratch_rows = splits * programs * blocks["BLOCK_M"]
    # Forced slices (tests, the bench) bypass key_splits' rule in the kernel's own copy of it.
    fill, min_keys = (1 << 30, 1) if forced else (_sm_count(q.device), MIN_KEYS_PER_SPLIT)
    constants["REVERSED"] = reversed_slices
    return LaunchPlan("single", grid + (splits,), constants, scalars, splits, per_split,
                      partial_out=torch.empty(scratch_rows, head_dim, dtype=torch.float32, device=q.device),
                      partial_lse=torch.empty(scratch_rows, dtype=torch.float32, device=q.device),
                      arrivals=torch.zeros(programs, dtype=torch.int32, device=q.device),
                      extra=(fill, min_keys, scratch_rows, programs), launch_options=options)


def launch(q, k, v, visible, scaling: QueryScaling | None = None, *, block_m: int | None = None,
           block_n: int | None = None, splits: int | None = None, variant: str = "split",
           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """attention() without input checks, for callers that validated already (the op).
    No host read of a tensor's values and nothing per call beyond the plan lookup, the
    output allocation and the launch: capturable in a CUDA graph."""
    q, k, v, visible = (_last_dim_contiguous(t) for t in (q, k, v, visible))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    plan = plan_for(q, k, v, visible, scaling, block_m=block_m, block_n=block_n, splits=splits,
                    variant=variant, num_warps=num_warps, num_stages=num_stages)
    plan.run(q, k, v, visible, out)
    return out


def kernel_beta(visible: torch.Tensor, scaling: QueryScaling | None) -> torch.Tensor:
    """beta for each visible-key count as the attention kernel computes it (float32)."""
    flat = visible.reshape(-1).to(torch.int64).contiguous()
    beta = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    block = 128
    if flat.numel():
        _beta_probe_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, flat.numel(), beta, BLOCK=block, **_scaling_constants(scaling))
    return beta.reshape(visible.shape)


@dataclasses.dataclass(frozen=True)
class CompiledAttention:
    """The kernel compiled ahead of time for one dtype, head_dim and QueryScaling.

    `scratch`: for the single-launch kernel, the pointer parameters after OUT that the
    launch does not pass (TensorRT passes inputs, int32s, outputs only), as
    (parameter name, bytes) in order; plugins/tensorrt.tensorrt_ptx turns each into a
    zero-initialised module global of that size."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int
    block_n: int
    scratch: tuple = ()


# Without an opt-in attribute a CUDA launch gets at most 48 KiB of dynamic shared memory,
# and nothing documents TensorRT's AOT launcher setting that attribute: stay under it.
AOT_SHARED_MEMORY_LIMIT = 48 * 1024

# The single-launch kernel's extra int32 arguments (after SCALAR_ARGS), and the fixed
# scratch an AOT plugin compiles in: partials for AOT_SCRATCH_ROWS packed rows (16 MiB of
# fp32 at head_dim 128; a 16-row block x group 4 x 8 KV heads x 32 slices fits at batch 1)
# and one arrival counter per row tile for AOT_COUNTERS tiles. A launch that would need
# more cuts its slices in the kernel (_slice_plan), down to the single pass.
SLICE_ARGS = ("fill_programs", "min_keys_per_split", "scratch_rows", "counters")
AOT_SCRATCH_ROWS = 1 << 15
AOT_COUNTERS = 1 << 16
AOT_MAX_SLICES = 64


def aot_slices(programs_at_batch_1: int, sm_count: int) -> int:
    """grid z of the AOT single-launch kernel: enough key slices to give every SM about two
    programs at batch 1; the kernel uses fewer where the shapes call for fewer."""
    return max(1, min(AOT_MAX_SLICES, triton.cdiv(2 * sm_count, max(1, programs_at_batch_1))))


def aot_slice_scalars(sm_count: int) -> tuple:
    """SLICE_ARGS for the AOT kernel: key_splits' rule for this GPU, the compiled-in scratch."""
    return (sm_count, MIN_KEYS_PER_SPLIT, AOT_SCRATCH_ROWS, AOT_COUNTERS)


def aot_compile(dtype: str, head_dim: int, scaling: QueryScaling | None, arch: int,
                rows_hint: int = 64, num_warps: int = 4, single_launch: bool = True) -> CompiledAttention:
    """Compile the attention kernel to PTX for GPU arch `arch` (e.g. 90) without a GPU.

    dtype is "fp32", "fp16" or "bf16" (q, k, v and the output); visible is int64. The beta
    constants, block sizes and head_dim become compile-time constants; everything that
    varies with the input shapes stays an int32 argument (SCALAR_ARGS, then SLICE_ARGS for
    the single-launch kernel). rows_hint (q_len * group at the optimisation profile's opt
    shape) picks BLOCK_M. single_launch=False compiles the single-pass kernel.
    """
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    kernel = _single_launch_kernel if single_launch else _sharpdraft_attention_kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset "
                           "(the kernel was loaded for the interpreter)")
    torch_dtype = {name: t for t, name in _DTYPES.items()}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES.values())}, got {dtype!r}")
    blocks = launch_blocks(rows_hint, head_dim)
    pointer = f"*{dtype}"
    signature = {"Q": pointer, "K": pointer, "V": pointer, "VISIBLE": "*i64",
                 **{name: "i32" for name in SCALAR_ARGS}}
    scratch = ()
    if single_launch:
        signature |= {name: "i32" for name in SLICE_ARGS}
        signature |= {"OUT": pointer, "PARTIAL_OUT": "*fp32", "PARTIAL_LSE": "*fp32", "ARRIVALS": "*i32"}
        scratch = (("PARTIAL_OUT", AOT_SCRATCH_ROWS * head_dim * 4), ("PARTIAL_LSE", AOT_SCRATCH_ROWS * 4),
                   ("ARRIVALS", AOT_COUNTERS * 4))
    else:
        signature["OUT"] = pointer
    # TensorRT allocates every tensor at least 256-byte aligned: let Triton vectorise loads.
    aligned = {(list(signature).index(name),): [["tt.divisibility", 16]]
               for name in ("Q", "K", "V", "VISIBLE", "OUT", *(n for n, _ in scratch))}
    # Largest key tile and pipeline depth first; fall back until shared memory fits.
    for block_n, num_stages in ((blocks["BLOCK_N"], 2), (blocks["BLOCK_N"], 1), (16, 1)):
        constexprs = dict(HEAD_DIM=head_dim, SCORE_SCALE=_score_scale(head_dim),
                          PRECISION=_precision(torch_dtype), **(blocks | {"BLOCK_N": block_n}),
                          **_scaling_constants(scaling))
        if single_launch:
            constexprs["REVERSED"] = False
        source = triton.compiler.ASTSource(
            fn=kernel, signature=signature | {name: "constexpr" for name in constexprs},
            constexprs=constexprs, attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        if compiled.metadata.shared <= AOT_SHARED_MEMORY_LIMIT:
            break
    else:
        raise RuntimeError(f"no tile configuration of the {dtype} head_dim {head_dim} kernel fits "
                           f"{AOT_SHARED_MEMORY_LIMIT} bytes of shared memory")
    metadata = compiled.metadata
    # Triton appends two scratch pointers after the outputs; TensorRT passes null there,
    # which is only right while the kernel asks for no scratch memory.
    triton_scratch = (getattr(metadata, "global_scratch_size", 0), getattr(metadata, "profile_scratch_size", 0))
    if any(triton_scratch):
        raise RuntimeError(f"compiled kernel needs scratch memory {triton_scratch}; TensorRT's AOT "
                           "launch cannot provide it")
    return CompiledAttention(name=metadata.name, ptx=compiled.asm["ptx"], num_warps=metadata.num_warps,
                             shared_mem=metadata.shared, block_m=blocks["BLOCK_M"], block_n=block_n,
                             scratch=scratch)
