"""plugins/row_invariant.py and row_invariant_attention: in bfloat16 and float16, a row's
result is bit for bit the same whatever rows are computed beside it -- other row counts,
a verify pass's other positions, a batch's other sequences, keys past its own -- and
close to the float32 reference. A bfloat16 target built from them decodes greedily
lossless: speculative == target-only, batched == alone (scripts/dtype_lossless.py)."""

import json

import pytest
import torch
from torch import nn

from plugins.attention import reference_attention, row_invariant_attention
from plugins.row_invariant import RowBlockedLinear, make_row_invariant

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(192, 576), (576, 576), (1536, 576), (4096, 64), (49152, 576)])
def test_a_linear_row_is_the_same_at_every_row_count(dtype, shape):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    blocked = RowBlockedLinear(linear)
    x = torch.randn(300, shape[1], dtype=dtype)
    alone = blocked(x[:1])
    for rows in (2, 9, 31, 32, 33, 72, 128, 300):
        assert torch.equal(blocked(x[:rows])[:1], alone), rows
    assert torch.equal(blocked(x[:128])[100:101], blocked(x[100:101]))
    torch.testing.assert_close(blocked(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)


def test_make_row_invariant_replaces_every_linear_and_keeps_ties():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    make_row_invariant(model)
    assert isinstance(model[1][0], RowBlockedLinear) and isinstance(model[2], RowBlockedLinear)
    assert model[2].weight is model[0].weight
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def attention_inputs(dtype, b=2, heads=9, kv_heads=3, t=9, kv_len=300, d=64):
    torch.manual_seed(1)
    q = torch.randn(b, heads, t, d, dtype=dtype)
    k = torch.randn(b, kv_heads, kv_len, d, dtype=dtype)
    v = torch.randn(b, kv_heads, kv_len, d, dtype=dtype)
    visible = torch.tensor([[kv_len - t + 1 + i for i in range(t)], [100 + i for i in range(t)]])
    return q, k, v, visible


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_attention_row_is_the_same_alone_in_a_pass_and_in_a_batch(dtype):
    q, k, v, visible = attention_inputs(dtype)
    together = row_invariant_attention(q, k, v, visible)
    for row in range(2):
        for i in range(q.shape[2]):
            n = int(visible[row, i])
            # the position alone, over exactly the keys it sees (a one-token decode step)
            alone = row_invariant_attention(q[row:row + 1, :, i:i + 1], k[row:row + 1, :, :n],
                                            v[row:row + 1, :, :n], visible[row:row + 1, i:i + 1])
            assert torch.equal(alone[0, :, 0], together[row, :, i]), (row, i)
    # the reference's value, to bfloat16/float16 rounding
    want = reference_attention(q.float(), k.float(), v.float(), visible)
    torch.testing.assert_close(together.float(), want, rtol=3e-2, atol=3e-2)


def test_row_invariant_attention_scales_and_masks_as_the_reference():
    from plugins.scaling import QueryScaling

    q, k, v, visible = attention_inputs(torch.bfloat16, t=4, kv_len=40)
    mask = torch.rand(2, 4, 40) > 0.3
    mask[..., 0] = True
    scaling = QueryScaling(16, 4, 2.5, 0.75)
    got = row_invariant_attention(q, k, v, visible, mask, scaling)
    want = reference_attention(q.float(), k.float(), v.float(), visible, mask, scaling)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_a_bfloat16_target_decodes_greedily_lossless(tiny_engine, tmp_path):
    from script_loader import load_script

    script = load_script("dtype_lossless")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                               ("def f(x):\n    return x", "import os\n" * 6, "class A:\n    pass\n" * 3)))
    out = tmp_path / "lossless.json"
    code = script.main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                        "--config", "torch:bfloat16", "--modes", "sharpdraft", "--requests", "3",
                        "--max-new-tokens", "12", "--concurrency", "3", "--threads", "1",
                        "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["configs"][0]["modes"]["sharpdraft"] == {"alone": [], "c3": [], "errors": []}
    assert code == 0 and report["lossless"]
