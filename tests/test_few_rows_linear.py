"""few_rows_linear (runtime/models/layers.py): a step's few rows through a float32 linear
layer on CPU computed as weight @ x.T for the row counts measured faster that way on this
machine (step_costs.choose_transposed_rows), F.linear otherwise; the result is F.linear's
up to float32 rounding, in F.linear's layout. The torch loader applies the row counts an
engine recorded where they were measured, and only there."""

import json

import pytest
import torch
import torch.nn.functional as F

from runtime.models import layers
from runtime.models.layers import FEW_ROWS, Linear, few_rows_linear, transpose_rows

ALL = frozenset(range(1, FEW_ROWS + 1))


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 1), (2, 4), (1, FEW_ROWS), (1, FEW_ROWS + 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_give_f_linear_in_its_layout(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 48, generator=gen)
    weight, b = torch.randn(320, 48, generator=gen), torch.randn(320, generator=gen)
    got = few_rows_linear(x, weight, b if bias else None, ALL)
    want = F.linear(x, weight, b if bias else None)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_the_chosen_row_counts_are_transposed(monkeypatch):
    """The transposed product runs for the chosen float32 CPU row counts only (F.linear is
    counted, not trusted to differ): none chosen (the default), other row counts, float64
    and traced graphs keep F.linear."""
    calls = []
    real = F.linear
    monkeypatch.setattr(layers.F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    weight = torch.randn(64, 16)
    few_rows_linear(torch.randn(1, 3, 16), weight, transposed_rows=frozenset({1, 3}))
    few_rows_linear(torch.randn(1, 16), weight, transposed_rows=frozenset({1, 3}))
    assert calls == []
    few_rows_linear(torch.randn(1, 3, 16), weight)  # none chosen
    few_rows_linear(torch.randn(1, 2, 16), weight, transposed_rows=frozenset({1, 3}))
    few_rows_linear(torch.randn(1, 3, 16, dtype=torch.float64), weight.double(), transposed_rows=ALL)
    assert len(calls) == 3
    layer = Linear(16, 64, bias=False)
    layer.weight.data.copy_(weight)
    transpose_rows(layer, ALL)
    program = torch.export.export(layer, (torch.randn(1, 2, 16),),
                                  dynamic_shapes=({1: torch.export.Dim("t", min=1)},), strict=False)
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("linear" in op for op in ops), ops  # no branch on the symbolic row count


def test_linear_keeps_nn_linears_state_keys():
    assert set(Linear(8, 4).state_dict()) == set(torch.nn.Linear(8, 4).state_dict())
    assert set(Linear(8, 4, bias=False).state_dict()) == {"weight"}


def test_the_loader_applies_the_recorded_rows_where_they_were_measured(tiny_engine, tmp_path):
    """An engine whose step costs record transposed rows: the torch loader gives every
    linear layer of the target and the drafter (and the DFlash draft head) those rows on
    the placement they were measured on (cpu, engine.json's dtype), none elsewhere; and
    decoding gives the same tokens either way (greedy, on the tiny pair)."""
    import shutil

    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine_dir, symlinks=True)
    manifest = json.loads((engine_dir / "engine.json").read_text())
    manifest["extra"]["step_costs"]["torch"]["transposed_rows"] = [1, 2]
    (engine_dir / "engine.json").write_text(json.dumps(manifest))

    def rows_of(engine):
        found = {m.transposed_rows for model in (engine.model, engine.drafter_model)
                 for m in model.modules() if isinstance(m, Linear)}
        return found

    measured = Engine(open_spec(engine_dir))
    assert rows_of(measured) == {frozenset({1, 2})}
    head = measured.loaded.batch_dflash(measured.scaling).head
    assert head.transposed_rows == frozenset({1, 2})
    elsewhere = Engine(open_spec(engine_dir, dtype="float64"))  # not where they were measured
    assert rows_of(elsewhere) == {frozenset()}
    plain = Engine(open_spec(tiny_engine))
    assert rows_of(plain) == {frozenset()}
    prompt = plain.encode("def fib(n):")
    assert (measured.generate(prompt, 24, mode="sharpdraft", stop=False).tokens
            == plain.generate(prompt, 24, mode="sharpdraft", stop=False).tokens)
