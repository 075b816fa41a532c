import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

from plugins import attention
from plugins.attention import reference_attention, sharpdraft_attention
from plugins.scaling import QueryScaling

SCALING = QueryScaling(ref_keys=16, top_k=4, slope=2.0, max_log_scale=0.5)


def naive(q, k, v, visible, scaling, mask=None):
    """Loop-by-row definition: what the op must compute."""
    b, h, t, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for i in range(t):
            allowed = torch.arange(k.shape[2]) < visible[bi, i]
            if mask is not None:
                allowed &= mask[bi, i]
            n = int(allowed.sum())
            scale = scaling.beta(n) if scaling else 1.0
            for hi in range(h):
                s = (q[bi, hi, i] * scale) @ k[bi, hi // group].T / math.sqrt(d)
                s = s.masked_fill(~allowed, float("-inf"))
                out[bi, hi, i] = torch.softmax(s, -1) @ v[bi, hi // group]
    return out


def random_case(seed, b, kvh, group, t, kv, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kvh * group, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kvh, kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kvh, kv, d, generator=g, dtype=torch.float64)
    return q, k, v, g


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 2), st.integers(1, 2), st.integers(1, 3),
       st.integers(1, 6), st.integers(0, 40), st.booleans(), st.booleans())
def test_op_matches_row_by_row_definition(seed, b, kvh, group, t, extra, scaled, use_mask):
    kv = t + extra
    q, k, v, g = random_case(seed, b, kvh, group, t, kv)
    visible = torch.randint(1, kv + 1, (b, t), generator=g)
    mask = None
    if use_mask:
        mask = torch.rand(b, t, kv, generator=g) < 0.7
        mask[..., 0] = True  # every row keeps at least one key
    scaling = SCALING if scaled else None
    got = sharpdraft_attention(q, k, v, visible, scaling, mask)
    assert torch.allclose(got, naive(q, k, v, visible, scaling, mask), atol=1e-10)


def test_dflash_block_and_causal_chain_visibility():
    q, k, v, _ = random_case(0, 1, 2, 2, 4, 40)
    block = torch.full((1, 4), 40)  # DFlash: every row sees context + block
    chain = torch.arange(37, 41)[None]  # causal chain: row i sees past + i + 1
    for visible in (block, chain):
        assert torch.allclose(sharpdraft_attention(q, k, v, visible, SCALING),
                              naive(q, k, v, visible, SCALING), atol=1e-10)


def test_causal_prefill_fast_path_matches_mask_path():
    q, k, v, _ = random_case(1, 2, 1, 3, 30, 30)
    visible = torch.arange(1, 31).expand(2, 30)
    assert torch.allclose(sharpdraft_attention(q, k, v, visible, SCALING),
                          naive(q, k, v, visible, SCALING), atol=1e-10)


def test_scaling_none_is_plain_attention():
    q, k, v, _ = random_case(2, 1, 2, 1, 3, 10)
    visible = torch.full((1, 3), 10)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(sharpdraft_attention(q, k, v, visible), plain, atol=1e-12)


def test_beta_uses_unmasked_key_count_for_trees():
    q, k, v, g = random_case(3, 1, 1, 1, 2, 50)
    visible = torch.full((1, 2), 50)
    mask = torch.zeros(1, 2, 50, dtype=torch.bool)
    mask[0, 0, :20] = True
    mask[0, 1, :45] = True
    assert torch.allclose(sharpdraft_attention(q, k, v, visible, SCALING, mask),
                          naive(q, k, v, visible, SCALING, mask), atol=1e-10)


def test_half_precision_inputs_computed_in_float32():
    q, k, v, _ = random_case(4, 1, 2, 2, 3, 64)
    visible = torch.full((1, 3), 64)
    want = sharpdraft_attention(q, k, v, visible, SCALING)
    got = sharpdraft_attention(q.half(), k.half(), v.half(), visible, SCALING)
    assert got.dtype == torch.float16
    assert (got.double() - want).abs().max() < 2e-3


def test_gradients_flow_through_the_op():
    q, k, v, _ = random_case(5, 1, 1, 2, 3, 12)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    visible = torch.tensor([[10, 11, 12]])
    sharpdraft_attention(q, k, v, visible, SCALING).square().sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    reference_attention(*ref, visible, None, SCALING).square().sum().backward()
    for a, r in zip((q, k, v), ref):
        assert torch.allclose(a.grad, r.grad, atol=1e-10)


@pytest.mark.parametrize("visible, message", [
    (torch.tensor([[0, 3]]), "visible counts"),
    (torch.tensor([[3, 11]]), "visible counts"),
    (torch.tensor([[3.0, 4.0]]), "int64"),
])
def test_bad_visible_counts_are_refused(visible, message):
    q, k, v, _ = random_case(6, 1, 1, 1, 2, 10)
    with pytest.raises(ValueError, match=message):
        sharpdraft_attention(q, k, v, visible, SCALING)


def attention_weights(q, k, scaling):
    """The op's attention weights: with V = identity over the keys, output row = weights."""
    n = k.shape[2]
    v = torch.eye(n, dtype=q.dtype)[None, None]
    visible = torch.full(q.shape[:1] + q.shape[2:3], n)
    return sharpdraft_attention(q, k, v, visible, scaling)[0, 0]


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(40, 300), st.floats(1.0, 10.0))
def test_op_scaling_keeps_argmax_and_top_k_set_and_sharpens(seed, n, slope):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 4, n, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, n, n, generator=g, dtype=torch.float64)
    scaling = QueryScaling(ref_keys=36, top_k=32, slope=slope)  # beta > 1 at n >= 40 keys
    plain, sharp = attention_weights(q, k, None), attention_weights(q, k, scaling)
    assert torch.equal(plain.argmax(-1), sharp.argmax(-1))
    top = plain.topk(32, -1).indices.sort(-1).values
    assert torch.equal(top, sharp.topk(32, -1).indices.sort(-1).values)
    assert bool((sharp.topk(32, -1).values.sum(-1) > plain.topk(32, -1).values.sum(-1)).all())


def test_every_device_path_validates_before_dispatch(monkeypatch):
    # The fused kernel clamps counts it is handed; the op must refuse them first, on the
    # path CUDA takes too. Force that path (the kernel runs under TRITON_INTERPRET here).
    q, k, v, _ = random_case(7, 1, 1, 2, 2, 10, d=16)
    q, k, v = q.float(), k.float(), v.float()
    monkeypatch.setattr(attention, "_fused_kernel_applies", lambda q, mask: True)
    ok = sharpdraft_attention(q, k, v, torch.tensor([[10, 4]]), SCALING)
    assert torch.allclose(ok, reference_attention(q, k, v, torch.tensor([[10, 4]]), scaling=SCALING),
                          atol=1e-5)
    for bad in ([[11, 4]], [[0, 4]]):
        with pytest.raises(ValueError, match=r"visible counts must lie in \[1, kv_len=10\]"):
            sharpdraft_attention(q, k, v, torch.tensor(bad), SCALING)
