"""Lengths have one source (runtime/step_metadata.py), and in one batched call every
sequence's rows get beta of its own N: on the torch op, the ONNX drafter graphs in ONNX
Runtime (plugin and native forms, and the native one over cache buffers) and the Triton
kernel under the interpreter."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.backends.onnxruntime import BoundBatchDFlash, OnnxBatchDFlash, open_session
from runtime.step_metadata import StepMetadata

REPO = Path(__file__).resolve().parent.parent
ATOL = 1e-4  # fp32


def test_step_metadata_counts_match_a_mask_built_from_positions():
    """Independent expectation: count the keys a [b, q, kv] mask allows, built from where
    each key and query sits, and compare with the derived counts."""
    cached, new, block = torch.tensor([0, 5, 17]), torch.tensor([3, 1, 4]), 4
    meta = StepMetadata(cached, new)
    key = torch.arange(40)
    # DFlash: a block row sees every key cached or new, and every block key (bidirectional)
    sees = key[None, None, :] < (cached + new + block)[:, None, None].expand(3, block, 1)
    assert torch.equal(meta.block_visible(block, 3), StepMetadata.tree_visible(sees.expand(3, block, 40)))
    assert meta.block_keys(block).tolist() == [7, 10, 25]
    # causal: the row at position p sees keys 0..p
    positions = meta.positions(5, 3)
    causal = key[None, None, :] <= positions[..., None]
    assert torch.equal(meta.causal_visible(5, 3), StepMetadata.tree_visible(causal))
    assert StepMetadata(9, 3).causal_visible(3, 1).tolist() == [[10, 11, 12]]


# What deriving a visible-key count looks like: a count named visible/n_keys computed
# from a length and a block or step size, or positions + 1.
DERIVES = re.compile(r"(visible\w*\s*=\s*(?!.*(StepMetadata|meta\b|\.draft\(|drafter\())[^=].*[+]"
                     r"|(length|context|len\w*)\s*\+\s*(self\.)?(block_size|bs)\b"
                     r"|positions\s*\+\s*1\b)")


def test_no_module_but_step_metadata_derives_a_visible_key_count():
    offenders = []
    files = [p for d in ("runtime", "build") for p in (REPO / d).rglob("*.py")]
    files += [REPO / "build_engine.py"]
    for path in files:
        if path.name == "step_metadata.py":
            continue
        in_docstring = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            quotes = line.count('"""')
            prose = in_docstring or quotes
            in_docstring ^= quotes % 2 == 1
            code = line.split("#")[0]
            if not prose and DERIVES.search(code):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_guard_recognises_a_derived_count():
    for line in ("visible = cache.length + self.block_size", "n = context + bs",
                 "visible = positions + 1"):
        assert DERIVES.search(line), line
    assert not DERIVES.search("visible = meta.block_visible(block, b, dev)")


def _batch_and_singles(session, engine, scaling, lengths, news, in_place=False):
    """Drafter logits of one batched graph call and of each sequence's own calls (a batch
    of one each)."""
    config = engine.drafter_model.config
    features = [torch.randn(n + c, engine.drafter_model.fc.in_features,
                            generator=torch.Generator().manual_seed(n)) for n, c in zip(lengths, news)]
    batch_class = BoundBatchDFlash if in_place else OnnxBatchDFlash
    batch = batch_class(session, config.block_size, config.mask_token_id, scaling)
    want = []
    for f, n in zip(features, lengths):
        alone = batch_class(session, config.block_size, config.mask_token_id, scaling)
        alone.add(n + 8, f[:n], 0)
        logits, visible = alone.draft([f[n:]], [5])
        want.append((logits[0], int(visible[0])))
        batch.add(n + 8, f[:n], 0)
    got = batch.draft([f[n:] for f, n in zip(features, lengths)], [5] * len(lengths))
    return got, want


@pytest.mark.parametrize("form", ["plugin", "native", "in place"])
def test_onnx_drafter_graph_gives_each_sequence_its_own_beta(form, onnx_engine, torch_engine,
                                                             native_drafter_graph, native_engine):
    """Three sequences at 10, 70 and 300 cached tokens (beta 1, just above, well above
    with ref_keys 64) in one call of the exported graph equal three separate calls; in
    place: the graph over cache buffers (drafter-kv.onnx), the rows' contexts of
    different lengths padded in one step."""
    path = {"plugin": onnx_engine / "drafter.onnx", "native": native_drafter_graph,
            "in place": native_engine / "drafter-kv.onnx"}[form]
    session = open_session(path, python_ops=form == "plugin")
    scaling = torch_engine.scaling
    (logits, visible), want = _batch_and_singles(session, torch_engine, scaling, [10, 70, 300],
                                                 [1, 3, 2], in_place=form == "in place")
    assert visible.tolist() == [w[1] for w in want] == [10 + 1 + 4, 70 + 3 + 4, 300 + 2 + 4]
    assert len({round(scaling.beta(int(n)), 6) for n in visible}) == 3
    for i, (w, _) in enumerate(want):
        torch.testing.assert_close(logits[i], w, atol=ATOL, rtol=0)


def test_triton_kernel_gives_each_sequence_its_own_beta():
    """One kernel launch over a batch at different visible counts equals one launch per
    sequence, and the reference op (TRITON_INTERPRET=1 on CPU)."""
    from plugins.attention import reference_attention
    from plugins.scaling import QueryScaling
    from plugins import triton_kernel

    scaling = QueryScaling(ref_keys=16, top_k=4, slope=2.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 4, 16, generator=g)
    k, v = (torch.randn(3, 2, 96, 16, generator=g) for _ in range(2))
    meta = StepMetadata(torch.tensor([3, 40, 85]), torch.tensor([1, 2, 3]))
    visible = meta.block_visible(4, 3)
    got = triton_kernel.attention(q, k, v, visible, scaling)
    for i in range(3):
        alone = triton_kernel.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], visible[i:i + 1], scaling)
        torch.testing.assert_close(got[i:i + 1], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, reference_attention(q, k, v, visible, None, scaling), atol=1e-4, rtol=0)
    # and the rows of different sequences really are scaled differently
    assert len({round(float(b), 5) for b in scaling.beta(visible[:, 0].double())}) == 3


def test_torch_op_gives_each_sequence_its_own_beta():
    from plugins.attention import sharpdraft_attention
    from plugins.scaling import QueryScaling

    scaling = QueryScaling(ref_keys=16, top_k=4, slope=2.0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 90, 8, generator=g, dtype=torch.float64) for _ in range(2))
    visible = StepMetadata(torch.tensor([3, 40, 80]), torch.tensor([1, 2, 3])).block_visible(4, 3)
    got = sharpdraft_attention(q, k, v, visible, scaling)
    for i in range(3):
        n = int(visible[i, 0])
        alone = sharpdraft_attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                                     visible[i:i + 1], scaling)
        torch.testing.assert_close(got[i:i + 1], alone, atol=1e-12, rtol=0)
