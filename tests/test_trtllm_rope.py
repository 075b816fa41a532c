"""The apply_rope / forward wrappers (plugins/trtllm/rope.py) for EAGLE-3 / PARD drafters in
TensorRT-LLM's generic Attention: they scale each query row by beta of the keys it sees,
counted from the attention metadata of the running forward (not position_id + 1), and
nothing else, with RoPE applied here (unfused) or inside the kernel (fused qkv); scaling
commutes with RoPE so both orders give the kernel the same query. Where position_id + 1
is not the count (a dynamic tree with fused RoPE, a window), the true count wins."""

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm.rope import CALL, visible_counts, wrap_apply_rope, wrap_forward
from plugins.trtllm.standins import Metadata
from plugins.trtllm.standins import no_host_sync

SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)
HEADS, KV_HEADS, DIM = 4, 2, 8
Q_SIZE, KV_SIZE = HEADS * DIM, KV_HEADS * DIM
POSITIONS = torch.tensor([[0, 5, 39, 63, 64, 100, 115, 116, 299, 4000]])  # [1, tokens], as TensorRT-LLM passes
# The same rows as ten context requests of one new token each: row i sees position_i + 1 keys.
PER_ROW = Metadata([1] * 10, [int(p) + 1 for p in POSITIONS[0]], num_contexts=10)


def wrapped(layer, metadata=PER_ROW, window=None):
    """layer.apply_rope wrapped, called as if inside a forward given `metadata`."""
    vars(layer)[CALL] = (metadata, window)
    return wrap_apply_rope(layer.apply_rope, SCALING, Q_SIZE, layer)


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
        got = wrapped(layer)(q, k, v, POSITIONS)
    torch.testing.assert_close(got[0], betas() * plain[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
    assert (betas()[:4] == 1).all() and (betas()[-3:] == SCALING.cap).all()  # every regime is hit


def test_fused_apply_rope_scales_only_the_q_columns_and_kernel_rope_gives_the_same_query():
    fused, unfused = StandInAttention(rope_fusion=True), StandInAttention(rope_fusion=False)
    q, k, v = qkv(1)
    with no_host_sync():
        qkv_out, k_out, v_out = wrapped(fused)(q, k, v, POSITIONS)
    assert k_out is None and v_out is None
    plain = torch.cat((q, k, v), dim=-1)
    assert torch.equal(qkv_out[:, Q_SIZE:], plain[:, Q_SIZE:])  # k and v columns untouched
    torch.testing.assert_close(qkv_out[:, :Q_SIZE], betas() * q, rtol=1e-12, atol=1e-12)
    # The kernel applies RoPE to the fused q afterwards: the same query as scaling after RoPE.
    with no_host_sync():
        q_unfused = wrapped(unfused)(q, k, v, POSITIONS)[0]
    torch.testing.assert_close(rope(qkv_out[:, :Q_SIZE], POSITIONS, HEADS), q_unfused, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_queries_keep_their_dtype(dtype):
    layer = StandInAttention(rope_fusion=True)
    q, k, v = (t.to(dtype) for t in qkv(2))
    out = wrapped(layer)(q, k, v, POSITIONS)[0]
    assert out.dtype == dtype
    want = (q.to(torch.float32) * betas().to(torch.float32)).to(dtype)
    assert torch.equal(out[:, :Q_SIZE], want)


def test_scaling_off_or_outside_a_forward_leaves_apply_rope_untouched():
    layer = StandInAttention(rope_fusion=False)
    q, k, v = qkv(3)
    plain = layer.apply_rope(q, k, v, POSITIONS)
    vars(layer)[CALL] = (PER_ROW, None)
    off = wrap_apply_rope(layer.apply_rope, lambda: None, Q_SIZE, layer)(q, k, v, POSITIONS)
    assert all(torch.equal(a, b) for a, b in zip(off, plain))
    fused = StandInAttention(rope_fusion=True)  # no forward running: no metadata to count from
    assert torch.equal(wrap_apply_rope(fused.apply_rope, SCALING, Q_SIZE, fused)(q, k, v, POSITIONS)[0],
                       fused.apply_rope(q, k, v, POSITIONS)[0])


# --- counts from the attention metadata ---------------------------------------------------

def beta_of(counts):
    return torch.tensor([SCALING.beta(int(n)) for n in counts], dtype=torch.float64)[:, None]


def test_dynamic_tree_with_fused_rope_gets_beta_of_ancestors_not_position_plus_one():
    """A generation request drafting a tree: 80 stable keys, then nodes at depths
    [0, 1, 1, 2, 2]. With RoPE fused TensorRT-LLM does not adjust position_ids (they run
    80..84), but node i sees 80 + depth_i + 1 keys (its ancestors and itself)."""
    layer = StandInAttention(rope_fusion=True)
    depths = [0, 1, 1, 2, 2]
    meta = Metadata([5], [85], num_contexts=0, offsets=depths, use_spec=True)  # 1-D: dynamic tree
    positions = torch.arange(80, 85)[None, :]
    true = [80 + d + 1 for d in depths]
    naive = [int(p) + 1 for p in positions[0]]
    assert true != naive and beta_of(true).ne(beta_of(naive)).any()  # the two counts give different betas
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, Q_SIZE + 2 * KV_SIZE, generator=g, dtype=torch.float64)
    with no_host_sync():
        out = wrapped(layer, meta)(q, None, None, positions)[0]
    torch.testing.assert_close(out[:, :Q_SIZE], beta_of(true) * q[:, :Q_SIZE], rtol=1e-12, atol=1e-12)


def test_a_mixed_batch_counts_context_rows_causally_and_generation_rows_by_depth():
    # one context request (3 new tokens over 70 keys), two generation requests of 3 draft
    # tokens each with [gens, gen_len] depths (a chain and a tree), 90 and 100 keys
    meta = Metadata([3, 3, 3], [70, 90, 100], num_contexts=1, offsets=[[0, 1, 2], [0, 1, 1]], use_spec=True)
    counts = visible_counts(meta, rows=11, device="cpu")  # 2 rows of CUDA-graph padding
    assert counts.tolist() == [68, 69, 70, 88, 89, 90, 98, 99, 99, 1, 1]


def random_tree(nodes: int, rng) -> list[int]:
    """parents[i] < i (node 0 is the root: the last accepted token)."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]


def brute_force_counts(context, trees, past):
    """Visible keys per row, counted from masks alone: a context request's row j over L
    cached keys sees the first L + j + 1 keys; a tree node sees the past keys plus the
    nodes the tree mask lets it attend to (itself and its ancestors), found by walking
    parent pointers -- no depths, no offsets."""
    rows = []
    for cached, new in context:
        rows += [sum(1 for key in range(cached + new) if key <= cached + j) for j in range(new)]
    for parents, stable in zip(trees, past):
        for node in range(len(parents)):
            mask, walk = [False] * len(parents), node
            while walk >= 0:
                mask[walk], walk = True, parents[walk]
            rows.append(stable + sum(mask))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_a_dynamic_tree_in_a_mixed_batch_counts_what_the_tree_masks_leave_visible(seed):
    """Context requests first, then generation requests drafting dynamic trees; the 1-D
    offsets laid out as TensorRT-LLM's draft loop writes them and its own
    _adjust_position_ids_for_spec_dec reads them: from row 0, row stride gen_len
    (pins.SOURCES["attention"]), whatever the number of context requests. Each row's count
    must equal a brute-force count over the tree's attention mask."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gen_len = int(rng.integers(2, 7))
    context = [(int(rng.integers(0, 60)), int(rng.integers(1, 5))) for _ in range(int(rng.integers(1, 4)))]
    trees = [random_tree(gen_len, rng) for _ in range(int(rng.integers(1, 4)))]
    past = [int(rng.integers(1, 200)) for _ in trees]

    def depth(parents, node):
        return 0 if parents[node] < 0 else 1 + depth(parents, parents[node])

    offsets = [depth(t, i) for t in trees for i in range(gen_len)]
    offsets += [int(x) for x in rng.integers(0, 9, size=len(context) * gen_len)]  # slots past the gens: not read
    seq_lens = [new for _, new in context] + [gen_len] * len(trees)
    kv_lens = [cached + new for cached, new in context] + [p + gen_len for p in past]
    meta = Metadata(seq_lens, kv_lens, num_contexts=len(context), offsets=offsets, use_spec=True)
    rows = sum(seq_lens)
    with no_host_sync():
        counts = visible_counts(meta, rows=rows + 2, device="cpu")  # 2 rows of CUDA-graph padding
    assert counts.tolist() == brute_force_counts(context, trees, past) + [1, 1]


def test_the_old_slot_reading_of_a_mixed_batch_fails_the_brute_force_count():
    """The test above can fail: reading the generation rows' depths from slot num_contexts
    on (what an earlier version did) disagrees with the mask count on a mixed batch."""
    trees, past, context = [[-1, 0, 0], [-1, 0, 1]], [90, 100], [(48, 2)]
    offsets = [0, 1, 1, 0, 1, 2, 5, 5, 5]
    meta = Metadata([2, 3, 3], [50, 93, 103], num_contexts=1, offsets=offsets, use_spec=True)
    want = brute_force_counts(context, trees, past)
    assert visible_counts(meta, rows=8, device="cpu").tolist() == want
    slot_read = [49, 50] + [p + d + 1 for p, ds in zip(past, ([0, 1, 2], [5, 5, 5])) for d in ds]
    assert slot_read != want


def test_a_window_the_call_is_handed_caps_the_count_and_forward_hands_it_over():
    layer = StandInAttention(rope_fusion=True)
    q = torch.ones(2, Q_SIZE + 2 * KV_SIZE, dtype=torch.float64)
    meta = Metadata([1, 1], [30, 400], num_contexts=2)

    def forward(position_ids, hidden_states, attn_metadata, attention_mask=None, mrope_config=None,
                all_reduce_params=None, lora_params=None, attention_window_size=None, **kwargs):
        return layer.apply_rope(hidden_states, None, None, position_ids)[0]

    layer.apply_rope = wrap_apply_rope(StandInAttention.apply_rope.__get__(layer), SCALING, Q_SIZE, layer)
    run = wrap_forward(forward, layer)
    out = run(torch.tensor([[29, 399]]), q, meta, attention_window_size=100)
    assert out[0, 0] == pytest.approx(SCALING.beta(30)) and out[1, 0] == pytest.approx(SCALING.beta(100))
    assert CALL not in vars(layer) or vars(layer)[CALL] is None  # cleared once the forward returns


# --- counts under CUDA graphs: device tensors only ---------------------------------------

def test_counts_come_from_seq_lens_cuda_when_the_host_seq_lens_is_stale():
    """Inside a replayed CUDA graph the host `seq_lens` holds another step's values; only
    the device tensors (seq_lens_cuda, kv_lens_cuda) are right. The count must not change
    with the host copy (the same mixed batch as above, host values made wrong)."""
    fresh = Metadata([3, 3, 3], [70, 90, 100], num_contexts=1, offsets=[[0, 1, 2], [0, 1, 1]], use_spec=True)
    stale = Metadata([3, 3, 3], [70, 90, 100], num_contexts=1, offsets=[[0, 1, 2], [0, 1, 1]], use_spec=True,
                     stale_host=True)
    assert not torch.equal(stale.seq_lens, stale.seq_lens_cuda)  # the stand-in really is stale
    want = [68, 69, 70, 88, 89, 90, 98, 99, 99]
    with no_host_sync():
        fresh_counts, stale_counts = (visible_counts(m, rows=9, device="cpu") for m in (fresh, stale))
    assert fresh_counts.tolist() == want
    assert stale_counts.tolist() == want


def test_a_padded_cuda_graph_batch_counts_real_requests_from_device_lengths_changed_in_place():
    """create_cuda_graph_metadata's layout: every slot a generation request of 1 + drafts
    tokens, two real requests then dummies; the drafting loop edits kv_lens_cuda in place
    between replays. The counts follow the edit (no host copy taken at capture time)."""
    meta = Metadata.cuda_graph(max_batch_size=4, max_draft_tokens=2, kv_lens=[50, 80, 3, 3])
    meta.seq_lens = torch.ones(4, dtype=torch.int32)  # the host copy of some earlier step
    with no_host_sync():
        first = visible_counts(meta, rows=12, device="cpu")
    assert first[:6].tolist() == [48, 49, 50, 78, 79, 80]
    meta.kv_lens_cuda += 3  # in place, as the EAGLE-3 / PARD workers do between draft steps
    with no_host_sync():
        second = visible_counts(meta, rows=12, device="cpu")
    assert second[:6].tolist() == [51, 52, 53, 81, 82, 83]


def test_device_lengths_on_another_device_than_the_query_are_refused_not_copied():
    from plugins.trtllm.rope import MetadataError

    meta = Metadata([1], [10], num_contexts=1, device="meta")
    with pytest.raises(MetadataError, match="only from device tensors"):
        visible_counts(meta, rows=1, device="cpu")
