"""Stand-ins, in plain torch, for what TensorRT-LLM's drafters call, with the real
signatures and tensor layouts: flash-attn's flash_attn_with_kvcache, flashinfer's
trtllm-gen decode/context ops (HND pages), FlashAttention-4's _flash_attn_fwd (NHD pages).
Each builds the kernel's own mask from its documented semantics (queries aligned to the
end of the keys; causal; sliding windows) and attends with it.

Setting REFERENCE["scaling"] makes every kernel multiply each row's logits by beta of the
number of keys its mask leaves visible (counted from the mask, with Python ints): the
reference the SharpDraft wrappers must reproduce by scaling q alone. And `no_host_sync()`
makes any read of a tensor's values on the host raise while the wrappers run.

Shipped (not under tests/) because scripts/gpu_trtllm.py runs the same stand-ins on a GPU;
nothing in the hook imports this module.
"""

from __future__ import annotations

import contextlib

import torch

REFERENCE = {"scaling": None}


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync():
    """Tensor.item / .tolist / bool() / int() / float() raise inside: what a CUDA graph
    capture forbids and what stalls the stream outside one."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def trap(name):
        def raiser(self, *args, **kwargs):
            raise HostSync(f"Tensor.{name} called inside a SharpDraft wrapper")
        return raiser

    for name in names:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def window_mask(total: torch.Tensor, q_len: torch.Tensor, row: torch.Tensor, keys: int,
                causal: bool, left, right) -> torch.Tensor:
    """[..., keys] bool: key j visible to query row `row` of `q_len` rows over `total` keys,
    flash-attn style (row i sits at key position total - q_len + i)."""
    j = torch.arange(keys)
    pos = (total - q_len + row)[..., None]
    mask = (j < total[..., None]).expand(*pos.shape[:-1], keys)
    if causal:
        mask = mask & (j <= pos)
    elif right is not None and right >= 0:
        mask = mask & (j <= pos + right)
    if left is not None and left >= 0:
        mask = mask & (j >= pos - left)
    return mask


def attend(q, K, V, mask, scale):
    """q [B, sq, H, D], K/V [B, S, Hk, D], mask [B, sq, S] -> [B, sq, H, D]."""
    group = q.shape[2] // K.shape[2]
    K, V = K.repeat_interleave(group, dim=2), V.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, K) * scale
    scaling = REFERENCE["scaling"]
    if scaling is not None:
        counts = mask.sum(-1).tolist()
        beta = torch.tensor([[scaling.beta(int(c)) for c in row] for row in counts], dtype=logits.dtype)
        logits = logits * beta[:, None, :, None]
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), V)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn 2: q [B, sq, H, D]; k_cache/v_cache [B_cache, S, Hk, D]; new k/v
    [B, sn, Hk, D] are written at cache_seqlens (in place) and attended too."""
    batch, q_len = q.shape[:2]
    index = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch)
    if cache_seqlens is None:
        seqlens = torch.full((batch,), k_cache.shape[1])
    elif isinstance(cache_seqlens, int):
        seqlens = torch.full((batch,), cache_seqlens)
    else:
        seqlens = cache_seqlens.long()
    if k is not None:
        positions = seqlens[:, None] + torch.arange(k.shape[1])
        k_cache[index[:, None], positions] = k
        v_cache[index[:, None], positions] = v
        seqlens = seqlens + k.shape[1]
    K, V = k_cache[index], v_cache[index]
    row = torch.arange(q_len)[None, :]
    mask = window_mask(seqlens[:, None], q_len, row, K.shape[1], causal, *window_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return attend(q, K, V, mask, scale)


def _hnd_pages(kv_cache, block_tables):
    k_pages, v_pages = kv_cache  # [pages, Hk, page_size, D]

    def gather(pages):
        x = pages[block_tables.long()]  # [B, pages_per_seq, Hk, page, D]
        return x.permute(0, 1, 3, 2, 4).reshape(x.shape[0], -1, x.shape[2], x.shape[4])

    return gather(k_pages), gather(v_pages)


def trtllm_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                                      max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1,
                                      out=None, sinks=None, enable_pdl=None, kv_layout="HND",
                                      backend="auto", q_len_per_req=1, max_q_len=None,
                                      cum_seq_lens_q=None, kv_cache_sf=None,
                                      uses_shared_paged_kv_idx=True, bmm1_scale_log2=None,
                                      multi_ctas_kv_counter_buffer=None):
    """flashinfer trtllm-gen decode: query [B * q_len_per_req, H, D]; seq_lens [B] keys
    including this step's; the q_len_per_req rows of a request are causal."""
    K, V = _hnd_pages(kv_cache, block_tables)
    batch = seq_lens.shape[0]
    q = query.reshape(batch, q_len_per_req, *query.shape[1:])
    row = torch.arange(q_len_per_req)[None, :]
    mask = window_mask(seq_lens.long()[:, None], q_len_per_req, row, K.shape[1], True, window_left, None)
    result = (attend(q, K, V, mask, bmm1_scale) * bmm2_scale).reshape(query.shape)
    if out is None:
        return result
    out.copy_(result)
    return out


def trtllm_batch_context_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                                       max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size,
                                       cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out=None,
                                       out_dtype=None, o_sf_scale=None, o_sf_vec_size=None,
                                       kv_layout="HND", enable_pdl=None, sinks=None, kv_cache_sf=None,
                                       uses_shared_paged_kv_idx=True, causal=True,
                                       multi_ctas_kv_counter_buffer=None):
    """flashinfer trtllm-gen context: ragged query [sum q_len, H, D] with cum_seq_lens_q."""
    K, V = _hnd_pages(kv_cache, block_tables)
    start = cum_seq_lens_q[:-1].long()
    q_lens = cum_seq_lens_q[1:].long() - start
    row = torch.arange(max_q_len)[None, :]
    valid = row < q_lens[:, None]
    index = (start[:, None] + row).clamp(max=query.shape[0] - 1)
    mask = window_mask(seq_lens.long()[:, None], q_lens[:, None], row, K.shape[1], causal, window_left, None)
    mask = mask & valid[..., None]
    mask[..., 0] |= ~valid  # padding rows attend to something; they are dropped below
    o = attend(query[index], K, V, mask, bmm1_scale) * bmm2_scale
    result = torch.zeros_like(query)
    result[index[valid]] = o[valid]
    if out is None:
        return result
    out.copy_(result)
    return out


def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    page_table=None, softmax_scale=None, causal=False, softcap=None,
                    window_size_left=None, window_size_right=None, learnable_sink=None,
                    num_splits=1, pack_gqa=None, return_lse=False):
    """FlashAttention-4 forward: q [B, sq, H, D]; k/v NHD pages [pages, page, Hk, D] with
    page_table [B, pages_per_seq] and seqused_k [B]. Returns (out, lse)."""
    batch, q_len = q.shape[:2]
    if page_table is not None:
        def gather(pages):
            x = pages[page_table.long()]  # [B, pages_per_seq, page, Hk, D]
            return x.reshape(x.shape[0], -1, x.shape[3], x.shape[4])
        K, V = gather(k), gather(v)
    else:
        K, V = k, v
    total = seqused_k.long() if seqused_k is not None else torch.full((batch,), K.shape[1])
    row = torch.arange(q_len)[None, :]
    mask = window_mask(total[:, None], q_len, row, K.shape[1], causal, window_size_left, window_size_right)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return attend(q, K, V, mask, scale), None


def dflash_ctx_paged_attention(q, k_cache, v_cache, block_idx, ctx_lens, k_noise, v_noise):
    """DFlash's hybrid-context kernel (dflash_hybrid_attn.py): q [B, Q, NH, D]; the context
    K/V in the target manager's NHD pages [pages, TPB, NKV, D] through block_idx [B, W], its
    first ctx_lens[b] tokens valid; then the Q noise keys [B, Q, NKV, D], all visible."""
    batch, q_len = q.shape[:2]

    def gather(pages, noise):
        x = pages[block_idx.long()]  # [B, W, TPB, NKV, D]
        return torch.cat((x.reshape(batch, -1, x.shape[3], x.shape[4]), noise), dim=1)

    K, V = gather(k_cache, k_noise), gather(v_cache, v_noise)
    context = K.shape[1] - k_noise.shape[1]
    j = torch.arange(K.shape[1])
    visible = (j < ctx_lens.long()[:, None]) | (j >= context)  # [B, keys]
    mask = visible[:, None, :].expand(batch, q_len, K.shape[1])
    return attend(q, K, V, mask, q.shape[-1] ** -0.5)


def reference(kernel, scaling, *args, **kwargs):
    """The kernel's result with each row's logits multiplied by beta(visible keys)."""
    REFERENCE["scaling"] = scaling
    try:
        return kernel(*args, **kwargs)
    finally:
        REFERENCE["scaling"] = None


class Metadata:
    """The AttentionMetadata fields the count reads (pins.METADATA), laid out as TensorRT-LLM
    lays them out:
    - `_torch/attention_backend/interface.py` @ 51ea5c96, `AttentionMetadata`: `seq_lens` is a
      HOST tensor (the setter swaps in a new pinned CPU tensor each step, so a copy captured
      in a CUDA graph reads a stale one) and `seq_lens_cuda` its device copy, updated in
      place; `num_seqs` = seq_lens.shape[0] (a Python int);
    - `_torch/attention_backend/trtllm.py`, `TrtllmAttentionMetadata`: `kv_lens_cuda` (cached +
      new keys per sequence) on the device, edited in place by prepare() and the EAGLE-3 /
      PARD workers;
    - `_torch/modules/attention.py` @ 00547a25, `_adjust_position_ids_for_spec_dec`: context
      requests first, then generation requests with spec_decoding_position_offsets (depths;
      1-D for a dynamic tree).
    `stale_host` fills the host seq_lens with values that are wrong for this step (as they are
    inside a replayed graph); `device` is where the "_cuda" tensors live (CPU in CPU tests)."""

    def __init__(self, seq_lens, kv_lens, num_contexts, offsets=None, use_spec=False, stale_host=False,
                 device="cpu"):
        import torch

        host = [max(1, n // 2 + 3) for n in seq_lens] if stale_host else list(seq_lens)
        self.seq_lens = torch.tensor(host, dtype=torch.int32)  # host: may be stale
        self.seq_lens_cuda = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.kv_lens_cuda = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        self.num_contexts = num_contexts
        self.num_tokens = int(sum(seq_lens))
        self.num_ctx_tokens = int(sum(seq_lens[:num_contexts]))
        self.spec_decoding_position_offsets = (None if offsets is None
                                               else torch.tensor(offsets, dtype=torch.int32, device=device))
        self.use_spec_decoding = use_spec

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def cuda_graph(cls, max_batch_size: int, max_draft_tokens: int, kv_lens, device="cpu"):
        """interface.py @ 51ea5c96 `create_cuda_graph_metadata` (decoder, not encode_only):
        seq_lens = ones(max_batch_size) * (1 + max_draft_tokens), num_contexts = 0; the real
        requests fill the first slots, padded dummy requests the rest (kv_lens for every slot,
        dummies included). Chain drafts: depths 0..max_draft_tokens per request."""
        gen = 1 + max_draft_tokens
        return cls([gen] * max_batch_size, kv_lens, num_contexts=0,
                   offsets=[list(range(gen))] * max_batch_size, use_spec=True, device=device)
