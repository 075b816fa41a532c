"""The fused Triton kernel against the reference op. On CPU it runs under Triton's
interpreter (conftest sets TRITON_INTERPRET=1): fp32 and fp16 only -- the interpreter's
tl.dot is wrong for bf16, which scripts/gpu_check.py covers on a GPU."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

from plugins.attention import reference_attention
from plugins.scaling import QueryScaling

triton_kernel = pytest.importorskip("plugins.triton_kernel", reason="triton is not installed")
import triton  # noqa: E402  (installed: plugins.triton_kernel imported)
import triton.language as tl  # noqa: E402

# Small reference count so "at ref_keys", "just above" and "past the cap" happen at short
# lengths: beta leaves 1 at N = 65 and reaches its cap near N = 1,442.
SMALL = QueryScaling(ref_keys=64, top_k=8)
FP32_TOLERANCE = 1e-5
FP16_TOLERANCE = 2e-3


def make_case(seed, batch, kv_heads, group, q_len, kv_len, head_dim, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), g


def max_error(q, k, v, visible, scaling, **launch):
    got = triton_kernel.attention(q, k, v, visible, scaling, **launch)
    want = reference_attention(q, k, v, visible, None, scaling)
    assert got.dtype == q.dtype and got.shape == q.shape
    return (got.float() - want.float()).abs().max().item()


def visibility(kind, batch, q_len, kv_len, g):
    """The three row patterns the drafters produce, plus arbitrary counts."""
    if kind == "block":  # DFlash: every row of the block sees context + block
        return torch.full((batch, q_len), kv_len)
    if kind == "causal":  # chain drafters / prefill: row i sees past + i + 1
        return (torch.arange(q_len) + kv_len - q_len + 1).expand(batch, q_len).contiguous()
    return torch.randint(1, kv_len + 1, (batch, q_len), generator=g)


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 2), kv_heads=st.integers(1, 2),
       group=st.integers(1, 4), q_len=st.integers(1, 20), extra=st.integers(0, 150),
       head_dim=st.sampled_from([16, 32, 64, 80]), kind=st.sampled_from(["block", "causal", "random"]),
       scaled=st.booleans())
def test_kernel_matches_reference_fp32(seed, batch, kv_heads, group, q_len, extra, head_dim, kind, scaled):
    kv_len = q_len + extra
    q, k, v, g = make_case(seed, batch, kv_heads, group, q_len, kv_len, head_dim)
    visible = visibility(kind, batch, q_len, kv_len, g)
    # Small tiles so most cases cross several key tiles and end on a ragged one.
    assert max_error(q, k, v, visible, SMALL if scaled else None, block_n=16) <= FP32_TOLERANCE


@settings(max_examples=examples(15), deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), group=st.integers(1, 4), q_len=st.integers(1, 17),
       extra=st.integers(0, 200), head_dim=st.sampled_from([16, 64, 128]),
       kind=st.sampled_from(["block", "causal", "random"]))
def test_kernel_matches_reference_fp16(seed, group, q_len, extra, head_dim, kind):
    kv_len = q_len + extra
    q, k, v, g = make_case(seed, 1, 2, group, q_len, kv_len, head_dim, torch.float16)
    visible = visibility(kind, 1, q_len, kv_len, g)
    assert max_error(q, k, v, visible, SMALL, block_n=32) <= FP16_TOLERANCE


# kv lengths from 1 to 4096; q_len and kv_len off the block sizes (BLOCK_M 16..64, BLOCK_N 64).
@pytest.mark.parametrize("q_len, kv_len, group, kind", [
    (1, 1, 1, "block"),          # the smallest attention there is
    (1, 64, 4, "block"),         # decode exactly at ref_keys: beta = 1
    (1, 65, 2, "block"),         # decode one key past ref_keys: beta just above 1
    (16, 80, 3, "block"),        # DFlash block, N = 80
    (7, 1500, 1, "causal"),      # chain rows past the cap (~1,442 keys)
    (37, 37, 2, "causal"),       # causal prefill, ragged in both tiles
    (3, 4096, 4, "random"),      # the longest context in this file, GQA group 4
])
def test_kernel_matches_reference_at_beta_boundaries_fp32(q_len, kv_len, group, kind):
    q, k, v, g = make_case(q_len * 1000 + kv_len, 1, 1, group, q_len, kv_len, 64)
    visible = visibility(kind, 1, q_len, kv_len, g)
    assert max_error(q, k, v, visible, SMALL) <= FP32_TOLERANCE


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), group=st.integers(1, 4), q_len=st.integers(1, 17),
       extra=st.integers(0, 600), splits=st.integers(2, 12), kind=st.sampled_from(["block", "causal", "random"]),
       half=st.booleans())
def test_key_slices_merge_to_the_reference(seed, group, q_len, extra, splits, kind, half):
    # Flash-decoding path: slices of the keys, merged by log-sum-exp. Slices that some rows
    # see none of (short causal rows, random counts) must drop out of the merge.
    kv_len = q_len + extra
    dtype = torch.float16 if half else torch.float32
    q, k, v, g = make_case(seed, 2, 2, group, q_len, kv_len, 32, dtype)
    visible = visibility(kind, 2, q_len, kv_len, g)
    error = max_error(q, k, v, visible, SMALL, block_n=16, splits=splits)
    assert error <= (FP16_TOLERANCE if half else FP32_TOLERANCE)


def test_key_splits_fill_the_gpu_only_when_rows_are_few():
    # A drafter step (8 KV heads, one row tile each) over 64K keys on a 132-SM GPU: ~2
    # programs per SM in whole 64-key tiles; a prefill already has programs to spare.
    splits, per_split = triton_kernel.key_splits(8, 65536, 64, 132)
    assert splits * 8 >= 132 and per_split % 64 == 0 and splits * per_split >= 65536
    assert triton_kernel.key_splits(8, 65536, 64, 132) == (32, 2048)
    assert triton_kernel.key_splits(512, 65536, 64, 132) == (1, 65536)
    assert triton_kernel.key_splits(8, 300, 64, 132) == (1, 320)  # too short to be worth slicing


def test_kernel_matches_reference_with_paper_defaults_at_16k_keys():
    # The seed's worked example: a DFlash block of 16 at N = 16,416, beta = 1.419.
    q, k, v, _ = make_case(7, 1, 1, 2, 16, 16416, 32)
    visible = torch.full((1, 16), 16416)
    assert max_error(q, k, v, visible, QueryScaling()) <= FP32_TOLERANCE
    q16, k16, v16 = q.half(), k.half(), v.half()
    assert max_error(q16, k16, v16, visible, QueryScaling(), splits=8) <= FP16_TOLERANCE


def test_in_kernel_beta_equals_scaling_beta():
    counts = torch.tensor([0, 1, 8, 9, 63, 64, 65, 100, 1000, 1442, 1443, 2048, 2049, 16416,
                           51694, 51695, 10**6])
    for scaling in (SMALL, QueryScaling(), QueryScaling(ref_keys=8192, slope=3.0, max_log_scale=0.25)):
        got = triton_kernel.kernel_beta(counts, scaling)
        want = scaling.beta(counts.double())
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=0), scaling
    assert triton_kernel.kernel_beta(torch.tensor([2_000]), QueryScaling()).item() == 1.0
    assert torch.equal(triton_kernel.kernel_beta(counts, None), torch.ones(len(counts)))


def test_output_follows_beta_where_beta_dominates():
    # Past the cap the scaled and plain outputs differ by far more than the tolerance, so
    # matching the scaled reference means the kernel really applied beta (and per row).
    q, k, v, _ = make_case(11, 1, 2, 2, 4, 2000, 32)
    q = q * 3  # sharper scores make beta's effect large
    visible = torch.tensor([[40, 700, 1500, 2000]])
    scaled = reference_attention(q, k, v, visible, None, SMALL)
    plain = reference_attention(q, k, v, visible, None, None)
    got = triton_kernel.attention(q, k, v, visible, SMALL)
    assert (scaled - plain)[:, :, 1:].abs().amax() > 0.1
    assert torch.equal(scaled[:, :, 0], plain[:, :, 0])  # 40 keys: beta is exactly 1
    assert (got - scaled).abs().max() <= FP32_TOLERANCE


def test_scaling_none_is_plain_attention():
    q, k, v, _ = make_case(3, 2, 2, 2, 5, 90, 64)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = triton_kernel.attention(q, k, v, torch.full((2, 5), 90), None)
    assert (got - plain).abs().max() <= FP32_TOLERANCE


@pytest.mark.parametrize("head_dim", [1, 8, 24, 96, 256])
def test_head_dims_off_the_power_of_two_grid_match_reference(head_dim):
    q, k, v, g = make_case(head_dim, 1, 1, 2, 5, 70, head_dim)
    visible = visibility("random", 1, 5, 70, g)
    assert max_error(q, k, v, visible, SMALL) <= FP32_TOLERANCE


def test_strided_views_match_contiguous_inputs():
    # Projections come out as [b, t, h, d] and are viewed as [b, h, t, d]: no copy needed.
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 9, 4, 32, generator=g).transpose(1, 2)
    k = torch.randn(2, 50, 2, 32, generator=g).transpose(1, 2)
    v = torch.randn(2, 50, 2, 32, generator=g).transpose(1, 2)
    visible = torch.randint(1, 51, (2, 9), generator=g)
    assert not q.is_contiguous()
    want = reference_attention(q, k, v, visible, None, SMALL)
    assert (triton_kernel.attention(q, k, v, visible, SMALL) - want).abs().max() <= FP32_TOLERANCE


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), group=st.integers(1, 4), q_len=st.integers(1, 17),
       extra=st.integers(0, 600), splits=st.integers(2, 12), kind=st.sampled_from(["block", "causal", "random"]),
       half=st.booleans())
def test_single_launch_slices_merge_to_the_reference(seed, group, q_len, extra, splits, kind, half):
    # What the TensorRT plugin runs: the key slices merged inside the same launch by the
    # last program of each row tile to arrive.
    kv_len = q_len + extra
    dtype = torch.float16 if half else torch.float32
    q, k, v, g = make_case(seed, 2, 2, group, q_len, kv_len, 32, dtype)
    visible = visibility(kind, 2, q_len, kv_len, g)
    error = max_error(q, k, v, visible, SMALL, block_n=16, splits=splits, variant="single")
    assert error <= (FP16_TOLERANCE if half else FP32_TOLERANCE)


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), group=st.integers(1, 8), q_len=st.integers(1, 3), extra=st.integers(0, 400),
       splits=st.sampled_from([None, 1, 4]), variant=st.sampled_from(["split", "single"]), half=st.booleans())
def test_exact_row_tile_for_small_steps_matches_the_reference(seed, group, q_len, extra, splits, variant, half):
    # One-row decode with a small GQA group: a tile of exactly the rows (1..8, the CUDA-core
    # path) instead of a 16-row tensor-core tile that is mostly padding.
    rows = q_len * group
    block_m = triton_kernel.exact_row_tile(rows)
    if block_m is None:  # 9 or more rows already fill a 16-row tile at least half
        assert rows >= 9
        return
    kv_len = q_len + extra
    dtype = torch.float16 if half else torch.float32
    q, k, v, g = make_case(seed, 2, 2, group, q_len, kv_len, 32, dtype)
    visible = visibility("random", 2, q_len, kv_len, g)
    assert block_m == triton.next_power_of_2(rows) and block_m < 16
    error = max_error(q, k, v, visible, SMALL, block_n=16, block_m=block_m, splits=splits, variant=variant)
    assert error <= (FP16_TOLERANCE if half else FP32_TOLERANCE)


def run_single_launch(q, k, v, visible, scaling, splits, **plan_changes):
    plan = triton_kernel.plan_for(q, k, v, visible, scaling, block_n=16, splits=splits, variant="single",
                                  reversed_slices=plan_changes.pop("reversed_slices", False))
    plan = dataclasses.replace(plan, **plan_changes)
    out = torch.empty_like(q)
    plan.run(q, k, v, visible, out)
    return out, plan


def test_single_launch_result_does_not_depend_on_which_program_merges():
    # The interpreter runs programs in order, so slice S-1 arrives last and merges; with the
    # slice order reversed slice 0's program merges. The merge reads every partial from
    # scratch in slice order, so the two must agree bit for bit, and each launch must leave
    # its counters at 0 for the next (the kernel resets them; nothing else does).
    q, k, v, g = make_case(3, 2, 2, 4, 5, 700, 32)
    visible = visibility("random", 2, 5, 700, g)
    first, plan = run_single_launch(q, k, v, visible, SMALL, 6)
    assert plan.splits == 6 and torch.equal(plan.arrivals, torch.zeros_like(plan.arrivals))
    again, _ = run_single_launch(q, k, v, visible, SMALL, 6)
    turned, turned_plan = run_single_launch(q, k, v, visible, SMALL, 6, reversed_slices=True)
    assert turned_plan is not plan and torch.equal(turned_plan.arrivals, torch.zeros_like(plan.arrivals))
    assert torch.equal(first, again) and torch.equal(first, turned)
    want = reference_attention(q, k, v, visible, None, SMALL)
    assert (first - want).abs().max() <= FP32_TOLERANCE


@pytest.mark.parametrize("scratch_rows, counters", [(0, 10**6), (10**6, 0), (2 * 16 * 4, 10**6)])
def test_single_launch_takes_fewer_slices_when_scratch_is_short(scratch_rows, counters):
    # TensorRT's plugin has fixed scratch (plugins/tensorrt.py): a launch that would not fit
    # must cut its slices (down to the single pass), not write past the scratch.
    q, k, v, g = make_case(4, 2, 2, 2, 3, 500, 16)
    visible = visibility("random", 2, 3, 500, g)
    _, plan = run_single_launch(q, k, v, visible, SMALL, 8)
    fill, min_keys = plan.extra[:2]
    out, _ = run_single_launch(q, k, v, visible, SMALL, 8, extra=(fill, min_keys, scratch_rows, counters),
                               partial_out=plan.partial_out[:scratch_rows], partial_lse=plan.partial_lse[:scratch_rows])
    want = reference_attention(q, k, v, visible, None, SMALL)
    assert (out - want).abs().max() <= FP32_TOLERANCE
    assert torch.equal(plan.arrivals, torch.zeros_like(plan.arrivals))


@triton.jit
def _slice_plan_probe(OUT, programs, slices, kv_len, fill, min_keys, scratch_rows, counters,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    active, per_slice = triton_kernel._slice_plan(programs, slices, kv_len, fill, min_keys, scratch_rows,
                                                  counters, BLOCK_M, BLOCK_N)
    tl.store(OUT, active)
    tl.store(OUT + 1, per_slice)


@pytest.mark.parametrize("programs, kv_len", [(8, 65536), (8, 8192), (64, 32768), (256, 65536), (8, 300),
                                              (1, 4096), (130, 1 << 16)])
def test_single_launch_slices_follow_key_splits(programs, kv_len):
    # The single-launch kernel works its slices out on the device (TensorRT hands it
    # symbolic shapes); with room to spare it must agree with the host rule.
    got = torch.zeros(2, dtype=torch.int32)
    _slice_plan_probe[(1,)](got, programs, 64, kv_len, 132, triton_kernel.MIN_KEYS_PER_SPLIT, 1 << 30, 1 << 30,
                            BLOCK_M=16, BLOCK_N=64)
    assert tuple(got.tolist()) == triton_kernel.key_splits(programs, kv_len, 64, 132)


def test_launch_plans_are_cached_per_layout():
    # Nothing per call beyond the launch: the second call with the same layout reuses the
    # plan (grid, constants, scratch), a new shape gets its own.
    q, k, v, g = make_case(6, 1, 2, 2, 4, 100, 16)
    visible = visibility("block", 1, 4, 100, g)
    first = triton_kernel.plan_for(q, k, v, visible, SMALL, splits=3, variant="single")
    assert triton_kernel.plan_for(q, k, v, visible, SMALL, splits=3, variant="single") is first
    assert triton_kernel.plan_for(q[:, :, :2], k, v, visible[:, :2], SMALL, splits=3, variant="single") is not first
    assert triton_kernel.plan_for(q, k, v, visible, None, splits=3, variant="single") is not first


@pytest.mark.parametrize("splits, variant", [(1, "split"), (3, "split"), (3, "single")])
def test_visible_counts_outside_the_cache_are_clamped_not_read(splits, variant):
    # The op refuses such counts on the host; the kernel itself (what TensorRT's plugin
    # launches, with no host check) must stay in bounds anyway.
    q, k, v, _ = make_case(9, 1, 1, 1, 2, 300, 16)
    clamped = triton_kernel.launch(q, k, v, torch.tensor([[300, 300]]), SMALL, splits=splits, variant=variant)
    beyond = triton_kernel.launch(q, k, v, torch.tensor([[301, 10**9]]), SMALL, splits=splits, variant=variant)
    assert torch.equal(clamped, beyond)
    nothing = triton_kernel.launch(q, k, v, torch.tensor([[0, 300]]), SMALL, splits=splits, variant=variant)
    assert torch.equal(nothing[:, :, 0], torch.zeros(1, 1, 16))


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v, vis: (q, k, v, vis.int()), "int64"),
    (lambda q, k, v, vis: (q.double(), k.double(), v.double(), vis), "float32/float16/bfloat16"),
    (lambda q, k, v, vis: (q, k.half(), v, vis), "one dtype"),
    (lambda q, k, v, vis: (q[:, :3], k, v, vis), "grouped heads"),
    (lambda q, k, v, vis: (q, k, v[:, :, :5], vis), "expected q"),
    (lambda q, k, v, vis: (q, k, v, vis + 1), r"visible counts must lie in \[1, kv_len=10\]"),
    (lambda q, k, v, vis: (q, k, v, vis * 0), r"visible counts must lie in \[1, kv_len=10\]"),
])
def test_bad_inputs_are_refused_with_a_reason(change, message):
    q, k, v, _ = make_case(1, 1, 2, 2, 3, 10, 16)
    with pytest.raises(ValueError, match=message):
        triton_kernel.attention(*change(q, k, v, torch.full((1, 3), 10)), SMALL)


def test_head_dim_above_the_limit_is_refused():
    q, k, v, _ = make_case(1, 1, 1, 1, 1, 4, triton_kernel.MAX_HEAD_DIM + 1)
    with pytest.raises(ValueError, match="head_dim"):
        triton_kernel.attention(q, k, v, torch.full((1, 1), 4), SMALL)


def test_contiguous_scalars_equal_what_the_torch_launcher_passes():
    # The TensorRT plugin derives the kernel's int32 arguments from shapes alone; for
    # contiguous tensors they must be exactly what attention() passes from real strides.
    q, k, v, _ = make_case(2, 3, 2, 4, 7, 33, 48)
    visible = torch.ones(3, 7, dtype=torch.int64)
    out = torch.empty_like(q)
    assert triton_kernel.contiguous_scalars(8, 7, 2, 33, 48) == triton_kernel.launch_scalars(q, k, visible, out, v)
    assert len(triton_kernel.SCALAR_ARGS) == len(triton_kernel.contiguous_scalars(8, 7, 2, 33, 48))
    assert triton_kernel.launch_grid(3, 7, 2, 4, 16) == (math.ceil(7 * 4 / 16), 6)


def test_plugins_import_one_way_attention_kernel_contract():
    # plugins/attention.py -> plugins/triton_kernel.py -> plugins/op_inputs.py, never back
    # (issue 40: the two used to import each other, the kernel lazily inside attention()).
    import ast
    from pathlib import Path

    def ours(name):
        tree = ast.parse((Path(__file__).resolve().parent.parent / "plugins" / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "plugins":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plugins."):
                found.add(node.module.split(".")[1])
        return found

    assert "attention" not in ours("triton_kernel")
    assert not ours("op_inputs") & {"attention", "triton_kernel"}
    assert "op_inputs" in ours("attention") and "op_inputs" in ours("triton_kernel")
