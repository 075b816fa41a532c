"""The DFlash kernel wrappers (plugins/trtllm/kernels.py), driven by torch stand-ins that
follow each kernel's real signature and layout (plugins/trtllm/standins.py): every row's
result equals the kernel's own attention with that row's logits multiplied by beta of the
keys its mask leaves visible, for a batch whose sequences sit below the reference count,
at it, at the cap and past it; with scaling off the call is untouched; and nothing reads a
tensor back to the host while a wrapper runs."""

import math

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import kernels
from plugins.trtllm import standins
from plugins.trtllm.standins import no_host_sync, reference

# A small rule so that short sequences cover every regime: beta = 1 up to 64 keys, the cap
# (e^0.5) from ~115.1 keys on.
SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)
TOTALS = [40, 64, 116, 300]  # keys per sequence: below, at the reference, at the cap, past it
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_chosen_lengths_span_every_regime_of_beta():
    betas = [SCALING.beta(n) for n in TOTALS]
    assert betas[0] == betas[1] == 1.0 and 1.0 < SCALING.beta(100) < SCALING.cap
    assert betas[2] == betas[3] == SCALING.cap and math.ceil(SCALING.cap_keys) == 116


def test_beta_on_device_matches_query_scaling_beta():
    n = torch.arange(0, 4000, 3)
    with no_host_sync():
        got64 = SCALING.beta_on_device(n, torch.float64)
        got32 = QueryScaling().beta_on_device(n.to(torch.int32))
    want = [SCALING.beta(int(x)) for x in n]
    close(got64, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(got32, torch.tensor([QueryScaling().beta(int(x)) for x in n]),
                               rtol=1e-6, atol=0)
    assert got32.dtype == torch.float32


# --- flash_attn_with_kvcache (VANILLA) ----------------------------------------------------

def vanilla_call(append: bool, causal: bool, window, seed=1):
    """Arguments as DFlash passes them: a pooled cache indexed by cache_batch_idx; older
    DFlash appends the block (k/v, cache_seqlens = context), the newest writes it first
    (cache_seqlens = context + block)."""
    g = gen(seed)
    batch, pool, slots = len(TOTALS), len(TOTALS) + 1, max(TOTALS) + 8
    q = randn(batch, BLOCK, HEADS, DIM, g=g)
    k_cache, v_cache = randn(pool, slots, KV_HEADS, DIM, g=g), randn(pool, slots, KV_HEADS, DIM, g=g)
    idx = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    totals = torch.tensor(TOTALS, dtype=torch.int32)
    kwargs = dict(cache_batch_idx=idx, causal=causal, window_size=window)
    if append:
        kwargs |= dict(k=randn(batch, BLOCK, KV_HEADS, DIM, g=g), v=randn(batch, BLOCK, KV_HEADS, DIM, g=g),
                       cache_seqlens=totals - BLOCK)
    else:
        kwargs |= dict(cache_seqlens=totals)
    return (q, k_cache, v_cache), kwargs


def fresh(args, kwargs):
    # flash-attn writes appended k/v into the caches: every call gets its own copies.
    return tuple(a.clone() for a in args), dict(kwargs)


# Windows wider than the reference count, so that they change beta (a window narrower
# than ref_keys keeps every row at beta = 1).
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (150, 0)), (False, (90, 90))]


@pytest.mark.parametrize("append", [True, False], ids=["appends_block", "block_prewritten"])
@pytest.mark.parametrize("causal,window", MASKS, ids=["block", "causal", "sliding_causal", "sliding_both"])
def test_flash_attn_wrapper_equals_reference_with_per_sequence_beta(append, causal, window):
    args, kwargs = vanilla_call(append, causal, window)
    want = reference(standins.flash_attn_with_kvcache, SCALING, *fresh(args, kwargs)[0], **kwargs)
    wrapped = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, SCALING)
    a, kw = fresh(args, kwargs)
    with no_host_sync():
        got = wrapped(*a, **kw)
    close(got, want)
    plain = standins.flash_attn_with_kvcache(*fresh(args, kwargs)[0], **kwargs)
    assert not torch.allclose(got[3], plain[3])  # the long sequence really is sharpened


def test_flash_attn_wrapper_takes_positional_arguments_and_packed_gqa_rows():
    # Newest VANILLA packs the query heads of a KV group into rows ([B, group*blk, Hkv, D])
    # on non-causal unwindowed layers: every row of a sequence sees all its keys.
    args, kwargs = vanilla_call(False, False, (-1, -1))
    q = args[0].reshape(len(TOTALS), BLOCK * HEADS // KV_HEADS, KV_HEADS, DIM)
    positional = (q, args[1], args[2], None, None, None, None, kwargs["cache_seqlens"],
                  kwargs["cache_batch_idx"])
    want = reference(standins.flash_attn_with_kvcache, SCALING, *positional)
    with no_host_sync():
        got = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, SCALING)(*positional)
    close(got, want)


def test_flash_attn_wrapper_leaves_the_call_untouched_when_scaling_is_off():
    args, kwargs = vanilla_call(True, False, (-1, -1))
    plain = standins.flash_attn_with_kvcache(*fresh(args, kwargs)[0], **kwargs)
    off = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, None)
    assert torch.equal(off(*fresh(args, kwargs)[0], **kwargs), plain)
    switch = {"on": None}
    lazy = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, lambda: switch["on"])
    assert torch.equal(lazy(*fresh(args, kwargs)[0], **kwargs), plain)
    # Below the reference count beta is exactly 1: the scaled call is bit-identical.
    short = QueryScaling(ref_keys=4096, top_k=8)
    on = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, short)
    assert torch.equal(on(*fresh(args, kwargs)[0], **kwargs), plain)


def test_wrapping_twice_wraps_once():
    once = kernels.wrap_flash_attn_with_kvcache(standins.flash_attn_with_kvcache, SCALING)
    assert kernels.wrap_flash_attn_with_kvcache(once, SCALING) is once
    assert getattr(once, kernels.WRAPPED) is standins.flash_attn_with_kvcache


# --- trtllm-gen decode / context (TRTLLM) -------------------------------------------------

PAGE = 16


def paged(totals, g, q_rows):
    """HND page pool, block tables and a query, as DFlash's TRTLLM path hands them."""
    batch = len(totals)
    per_seq = -(-max(totals) // PAGE)
    pages = batch * per_seq + 2
    k_pages, v_pages = randn(pages, KV_HEADS, PAGE, DIM, g=g), randn(pages, KV_HEADS, PAGE, DIM, g=g)
    tables = torch.randperm(pages, generator=g)[:batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    query = randn(q_rows, HEADS, DIM, g=g)
    return query, (k_pages, v_pages), tables, torch.tensor(totals, dtype=torch.int32)


@pytest.mark.parametrize("window_left", [-1, 100])
def test_trtllm_gen_decode_wrapper_equals_reference(window_left):
    query, kv, tables, seq_lens = paged(TOTALS, gen(2), len(TOTALS) * BLOCK)
    call = dict(query=query, kv_cache=kv, workspace_buffer=None, block_tables=tables, seq_lens=seq_lens,
                max_seq_len=tables.shape[1] * PAGE, bmm1_scale=DIM ** -0.5, bmm2_scale=1.0,
                window_left=window_left, q_len_per_req=BLOCK)
    want = reference(standins.trtllm_batch_decode_with_kv_cache, SCALING, **call,
                     out=torch.empty_like(query))
    wrapped = kernels.wrap_trtllm_gen_decode(standins.trtllm_batch_decode_with_kv_cache, SCALING)
    out = torch.empty_like(query)
    with no_host_sync():
        got = wrapped(**call, out=out)
    assert got is out
    close(got, want)
    off = kernels.wrap_trtllm_gen_decode(standins.trtllm_batch_decode_with_kv_cache, None)
    assert torch.equal(off(**call), standins.trtllm_batch_decode_with_kv_cache(**call))


@pytest.mark.parametrize("causal", [False, True])
def test_trtllm_gen_context_wrapper_equals_reference_with_ragged_queries(causal):
    q_lens = [BLOCK, 1, BLOCK, 3]  # DFlash passes equal blocks; ragged ones must work too
    cum_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query, kv, tables, seq_lens = paged(TOTALS, gen(3), sum(q_lens))
    cum_kv = torch.cat((torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0, dtype=torch.int32)))
    call = dict(query=query, kv_cache=kv, workspace_buffer=None, block_tables=tables, seq_lens=seq_lens,
                max_q_len=max(q_lens), max_kv_len=tables.shape[1] * PAGE, bmm1_scale=DIM ** -0.5,
                bmm2_scale=1.0, batch_size=len(TOTALS), cum_seq_lens_q=cum_q, cum_seq_lens_kv=cum_kv,
                window_left=-1, causal=causal)
    want = reference(standins.trtllm_batch_context_with_kv_cache, SCALING, **call)
    wrapped = kernels.wrap_trtllm_gen_context(standins.trtllm_batch_context_with_kv_cache, SCALING)
    with no_host_sync():
        got = wrapped(**call)
    close(got, want)
    off = kernels.wrap_trtllm_gen_context(standins.trtllm_batch_context_with_kv_cache, None)
    assert torch.equal(off(**call), standins.trtllm_batch_context_with_kv_cache(**call))


# --- FlashAttention-4 (FA4) ---------------------------------------------------------------

@pytest.mark.parametrize("causal,left,right", [(False, None, None), (True, None, None), (True, 30, 0)])
def test_fa4_wrapper_equals_reference(causal, left, right):
    g = gen(4)
    batch = len(TOTALS)
    per_seq = -(-max(TOTALS) // PAGE)
    pages = batch * per_seq
    k_pages, v_pages = randn(pages, PAGE, KV_HEADS, DIM, g=g), randn(pages, PAGE, KV_HEADS, DIM, g=g)
    table = torch.randperm(pages, generator=g).reshape(batch, per_seq).to(torch.int32)
    q = randn(batch, BLOCK, HEADS, DIM, g=g)
    call = dict(seqused_k=torch.tensor(TOTALS, dtype=torch.int32), page_table=table,
                softmax_scale=DIM ** -0.5, causal=causal, window_size_left=left,
                window_size_right=right, num_splits=1, pack_gqa=None, return_lse=False)
    want, _ = reference(standins._flash_attn_fwd, SCALING, q, k_pages, v_pages, **call)
    wrapped = kernels.wrap_fa4_fwd(standins._flash_attn_fwd, SCALING)
    with no_host_sync():
        got, _ = wrapped(q, k_pages, v_pages, **call)
    close(got, want)
    off = kernels.wrap_fa4_fwd(standins._flash_attn_fwd, None)
    assert torch.equal(off(q, k_pages, v_pages, **call)[0], standins._flash_attn_fwd(q, k_pages, v_pages, **call)[0])


def test_the_guard_trips_on_a_host_read():
    with no_host_sync(), pytest.raises(standins.HostSync):
        torch.ones(1).item()
    with no_host_sync(), pytest.raises(standins.HostSync):
        QueryScaling().beta(torch.tensor([5000]))  # the checked form reads values back
    assert torch.ones(1).item() == 1.0
