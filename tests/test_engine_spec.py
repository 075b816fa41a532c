"""What an Engine is: the spec (engine.json, read once and handed down), the loaded roles
and the tokenizer; a mode becomes its drafting configuration (assembly.DraftSetting) once,
where it enters, and nothing below calls back up for it."""

import ast
from pathlib import Path

import pytest

import tiny
from plugins.scaling import QueryScaling
from runtime import engine as engine_module
from runtime.assembly import DraftSetting
from runtime.decode import Request
from runtime.engine import Engine
from runtime.manifest import read_manifest
from runtime.modes import Mode

REPO = Path(__file__).resolve().parent.parent


def test_an_engine_opened_with_its_spec_reads_no_engine_json(tiny_engine, monkeypatch):
    spec = read_manifest(tiny_engine)
    assert spec.dir == tiny_engine and "dir" not in spec.to_json()
    want = Engine(tiny_engine).generate([5, 6, 7, 8], 12, mode="sharpdraft", stop=False).tokens

    def no_read(*args, **kwargs):
        raise AssertionError("engine.json read again")

    monkeypatch.setattr(engine_module, "read_manifest", no_read)
    engine = Engine(spec)
    assert engine.manifest is spec and engine.dir == tiny_engine
    assert engine.generate([5, 6, 7, 8], 12, mode="sharpdraft", stop=False).tokens == want


def test_each_mode_resolves_to_its_draft_setting(tiny_engine):
    engine = Engine(tiny_engine)
    assert engine.setting(Mode.SHARPDRAFT) == DraftSetting(engine.scaling, None, False, True)
    assert engine.setting(Mode.FROZEN) == DraftSetting(None, None, False, True)
    assert engine.setting(Mode.PRESET).scaling == engine.family_preset != engine.scaling
    assert engine.setting(Mode.TARGET).scaling is None
    for mode in engine.modes:
        assert engine.setting(mode).ngram_assist == mode.ngram_assist


@pytest.fixture(scope="module")
def tree_engine(tmp_path_factory, tiny_target):
    import build_engine

    root = tmp_path_factory.mktemp("tree-engine")
    eagle3 = tiny.make_eagle3(root / "eagle3", tiny_target, draft_vocab=200)
    out = root / "engine"
    assert build_engine.main(["--drafter", "eagle3", "--sharpdraft", "--ref-keys", "64", "--top-k",
                              "8", "--target", str(tiny_target), "--drafter-checkpoint", str(eagle3),
                              "--tree-top-k", "3", "--tree-depth", "3", "--tree-total-tokens", "8",
                              "--backend", "torch", "--step-costs", "fixed", "--output", str(out)]) == 0
    return out


def test_rows_joining_a_decoder_never_call_back_into_the_engine(tree_engine, monkeypatch):
    """Trees draft one drafter per row, made as each row joins: the decoder holds the
    mode's setting it was built with, so the engine's mode policy is not asked again
    (it used to be: roles.drafter(mode) -> Engine.drafter_for, per row)."""
    engine = Engine(tree_engine)
    decoder = engine.batch_decoder("sharpdraft", adaptive=False)

    def asked(*args, **kwargs):
        raise AssertionError("the decoder called back into Engine")

    for name in ("setting", "drafter", "check_mode", "refusal"):
        monkeypatch.setattr(Engine, name, asked)
    requests = [Request([4 + i] * (10 + 3 * i), 8) for i in range(3)]
    seqs = decoder.run(requests, join_at=[0, 1, 2])
    assert all(s.error is None and len(s.gen.tokens) == 8 for s in seqs)


def test_a_swapped_scaling_is_the_drafters_keyword(tiny_engine):
    engine = Engine(tiny_engine)
    other = QueryScaling(ref_keys=16, top_k=4)
    assert engine.drafter(scaling=other).scaling == other
    assert engine.drafter(scaled=False).scaling is None


def test_engine_keeps_at_most_fifteen_methods():
    tree = ast.parse((REPO / "runtime" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = [n.name for n in engine.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) <= 15, methods
