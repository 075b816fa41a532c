"""What an Engine is: the spec (engine.json, read once and handed down), the loaded roles
and the tokenizer; a mode becomes its drafting configuration (assembly.DraftSetting) once,
where it enters, and nothing below calls back up for it."""

import ast
from pathlib import Path

import pytest

import tiny
from plugins.scaling import QueryScaling
from runtime import manifest as manifest_module
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

    monkeypatch.setattr(manifest_module, "read_manifest", no_read)
    engine = Engine(spec)
    assert engine.manifest is spec and engine.dir == tiny_engine
    assert engine.generate([5, 6, 7, 8], 12, mode="sharpdraft", stop=False).tokens == want


def test_each_mode_resolves_to_its_draft_setting(tiny_engine):
    engine = Engine(tiny_engine)
    assert engine.setting(Mode.SHARPDRAFT) == DraftSetting(engine.scaling, None, False)
    assert engine.setting(Mode.FROZEN) == DraftSetting(None, None, False)
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
    """Rows joining a tree decoder (one batch tree drafter, made with the decoder): the
    decoder holds the mode's setting it was built with, so the engine's mode policy is
    not asked again (it used to be: roles.drafter(mode) -> Engine.drafter_for, per row)."""
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


def shipped_calls(name: str) -> dict[str, int]:
    """Shipped file -> how many calls to `name` (a bare name or an attribute) it makes."""
    from test_layering import shipped

    found = {}
    for path in shipped():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == name:
                    rel = str(path.relative_to(REPO))
                    found[rel] = found.get(rel, 0) + 1
    return found


def test_engine_json_is_read_in_one_function_from_at_most_two_places():
    """read_manifest (the one reader of engine.json) is called from open_spec alone, the way
    in for Engine, the commands and the serving processes; no shipped file opens
    engine.json itself (a name it spells is only asked whether an engine is there)."""
    calls = shipped_calls("read_manifest")
    assert set(calls) == {"runtime/manifest.py"}, calls
    assert calls["runtime/manifest.py"] == 1
    from test_layering import shipped

    spelled = {str(p.relative_to(REPO)) for p in shipped()
               if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith("engine.json")
                      for n in ast.walk(ast.parse(p.read_text())))}
    # manifest.py: MANIFEST; build_engine.py and served_ab.py: `(dir / "engine.json").is_file()`
    assert spelled <= {"runtime/manifest.py", "build_engine.py", "scripts/served_ab.py"}, spelled


def test_serve_reads_engine_json_once_and_hands_the_spec_down(tiny_engine, tmp_path, monkeypatch, capsys):
    """`serve` opens the spec once and the repository writer, the HTTP body bound and the
    OpenAI endpoint's settings take it (before: four reads in the serve process)."""
    from runtime.__main__ import main as runtime_main
    from runtime.commands.serve import _http_max_input
    from runtime.serve.openai_api import Settings

    reads, real = [], manifest_module.read_manifest

    def counted(*args, **kwargs):
        reads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(manifest_module, "read_manifest", counted)
    assert runtime_main(["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                         str(tmp_path / "repo"), "--streaming", "--device", "cpu", "--json"]) == 0
    assert len(reads) == 1, reads
    spec = manifest_module.open_spec(tiny_engine)
    reads.clear()
    assert _http_max_input(spec) == _http_max_input(tiny_engine) > 0
    assert len(reads) == 1  # the directory's call alone
    reads.clear()
    settings = Settings(spec, "m", "m-stream", "127.0.0.1:1", 64)
    assert reads == [] and settings.modes and settings.context


def test_engine_keeps_at_most_fifteen_methods():
    tree = ast.parse((REPO / "runtime" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = [n.name for n in engine.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) <= 15, methods
