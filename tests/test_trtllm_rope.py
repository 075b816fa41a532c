"""The apply_rope wrapper (plugins/trtllm/rope.py) for EAGLE-3 / PARD drafters in
TensorRT-LLM's generic Attention: it scales the query rows by beta(position + 1) and
nothing else, with RoPE applied here (unfused) or inside the kernel (fused qkv), and
scaling commutes with RoPE so both orders give the kernel the same query."""

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm.rope import wrap_apply_rope
from tests.trtllm_standins import no_host_sync

SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)
HEADS, KV_HEADS, DIM = 4, 2, 8
Q_SIZE, KV_SIZE = HEADS * DIM, KV_HEADS * DIM
POSITIONS = torch.tensor([[0, 5, 39, 63, 64, 100, 115, 116, 299, 4000]])  # [1, tokens], as TensorRT-LLM passes


def rope(x: torch.Tensor, positions: torch.Tensor, heads: int) -> torch.Tensor:
    """NeoX rotary embedding of [tokens, heads * DIM] by each token's position."""
    t = x.reshape(x.shape[0], heads, DIM)
    inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    angle = positions.reshape(-1, 1).to(torch.float64) * inv  # [tokens, DIM/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = t[..., : DIM // 2], t[..., DIM // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).reshape(x.shape)


class StandInAttention(torch.nn.Module):
    """TensorRT-LLM's Attention.apply_rope contract: unfused -> RoPE'd (q, k, v);
    rope_fusion -> (qkv, None, None), RoPE left to the attention kernel."""

    q_size, kv_size = Q_SIZE, KV_SIZE

    def __init__(self, rope_fusion: bool):
        super().__init__()
        self.rope_fusion = rope_fusion

    def apply_rope(self, q, k, v, position_ids):
        if self.rope_fusion:
            return torch.cat((q, k, v), dim=-1) if k is not None else q, None, None
        return rope(q, position_ids, HEADS), rope(k, position_ids, KV_HEADS), v


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = POSITIONS.shape[1]
    return [torch.randn(tokens, size, generator=g, dtype=torch.float64) for size in (Q_SIZE, KV_SIZE, KV_SIZE)]


def betas():
    return torch.tensor([SCALING.beta(int(p) + 1) for p in POSITIONS.reshape(-1)], dtype=torch.float64)[:, None]


def test_rope_commutes_with_the_query_scale():
    q, _, _ = qkv()
    beta = betas()
    torch.testing.assert_close(rope(beta * q, POSITIONS, HEADS), beta * rope(q, POSITIONS, HEADS),
                               rtol=1e-12, atol=1e-12)


def test_unfused_apply_rope_scales_q_rows_by_beta_of_visible_keys_and_nothing_else():
    layer = StandInAttention(rope_fusion=False)
    q, k, v = qkv()
    plain = layer.apply_rope(q, k, v, POSITIONS)
    with no_host_sync():
        got = wrap_apply_rope(layer.apply_rope, SCALING, Q_SIZE)(q, k, v, POSITIONS)
    torch.testing.assert_close(got[0], betas() * plain[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
    assert (betas()[:4] == 1).all() and (betas()[-3:] == SCALING.cap).all()  # every regime is hit


def test_fused_apply_rope_scales_only_the_q_columns_and_kernel_rope_gives_the_same_query():
    fused, unfused = StandInAttention(rope_fusion=True), StandInAttention(rope_fusion=False)
    q, k, v = qkv(1)
    with no_host_sync():
        qkv_out, k_out, v_out = wrap_apply_rope(fused.apply_rope, SCALING, Q_SIZE)(q, k, v, POSITIONS)
    assert k_out is None and v_out is None
    plain = torch.cat((q, k, v), dim=-1)
    assert torch.equal(qkv_out[:, Q_SIZE:], plain[:, Q_SIZE:])  # k and v columns untouched
    torch.testing.assert_close(qkv_out[:, :Q_SIZE], betas() * q, rtol=1e-12, atol=1e-12)
    # The kernel applies RoPE to the fused q afterwards: the same query as scaling after RoPE.
    with no_host_sync():
        q_unfused = wrap_apply_rope(unfused.apply_rope, SCALING, Q_SIZE)(q, k, v, POSITIONS)[0]
    torch.testing.assert_close(rope(qkv_out[:, :Q_SIZE], POSITIONS, HEADS), q_unfused, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_queries_keep_their_dtype(dtype):
    layer = StandInAttention(rope_fusion=True)
    q, k, v = (t.to(dtype) for t in qkv(2))
    out = wrap_apply_rope(layer.apply_rope, SCALING, Q_SIZE)(q, k, v, POSITIONS)[0]
    assert out.dtype == dtype
    want = (q.to(torch.float32) * betas().to(torch.float32)).to(dtype)
    assert torch.equal(out[:, :Q_SIZE], want)


def test_scaling_off_or_no_positions_leaves_apply_rope_untouched():
    layer = StandInAttention(rope_fusion=False)
    q, k, v = qkv(3)
    plain = layer.apply_rope(q, k, v, POSITIONS)
    off = wrap_apply_rope(layer.apply_rope, lambda: None, Q_SIZE)(q, k, v, POSITIONS)
    assert all(torch.equal(a, b) for a, b in zip(off, plain))
    fused = StandInAttention(rope_fusion=True)
    assert torch.equal(wrap_apply_rope(fused.apply_rope, SCALING, Q_SIZE)(q, k, v, None)[0],
                       fused.apply_rope(q, k, v, None)[0])
