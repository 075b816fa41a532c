"""few_rows_linear (runtime/models/layers.py): a decode or verify step's few rows through a
float32 linear layer on CPU computed as weight @ x.T, which the BLAS here reads at about
twice the speed; the result is F.linear's up to float32 rounding, in F.linear's layout."""

import pytest
import torch
import torch.nn.functional as F

from runtime.models import layers
from runtime.models.layers import FEW_ROWS, Linear, few_rows_linear


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 1), (2, 4), (1, FEW_ROWS), (1, FEW_ROWS + 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_give_f_linear_in_its_layout(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 48, generator=gen)
    weight, b = torch.randn(320, 48, generator=gen), torch.randn(320, generator=gen)
    got = few_rows_linear(x, weight, b if bias else None)
    want = F.linear(x, weight, b if bias else None)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_few_rows_path_is_taken_and_others_keep_f_linear(monkeypatch):
    """The transposed product runs for 1..FEW_ROWS float32 CPU rows only (F.linear is
    counted, not trusted to differ): more rows, float64 and traced graphs keep F.linear."""
    calls = []
    real = F.linear
    monkeypatch.setattr(layers.F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    weight = torch.randn(64, 16)
    few_rows_linear(torch.randn(1, 3, 16), weight)
    assert calls == []
    few_rows_linear(torch.randn(1, FEW_ROWS + 1, 16), weight)
    few_rows_linear(torch.randn(1, 2, 16, dtype=torch.float64), weight.double())
    assert len(calls) == 2
    layer = Linear(16, 64, bias=False)
    layer.weight.data.copy_(weight)
    program = torch.export.export(layer, (torch.randn(1, 2, 16),),
                                  dynamic_shapes=({1: torch.export.Dim("t", min=1)},), strict=False)
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("linear" in op for op in ops), ops  # no branch on the symbolic row count


def test_linear_keeps_nn_linears_state_keys():
    assert set(Linear(8, 4).state_dict()) == set(torch.nn.Linear(8, 4).state_dict())
    assert set(Linear(8, 4, bias=False).state_dict()) == {"weight"}
