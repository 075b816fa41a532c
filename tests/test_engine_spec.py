"""What an Engine is: the spec (engine.json, read once and handed down), the loaded roles
and the tokenizer; a mode becomes its drafting configuration (assembly.DraftSetting) once,
where it enters, and nothing below calls back up for it."""

import ast
from pathlib import Path

import pytest

import tiny
from test_layering import parsed
from plugins.scaling import QueryScaling
from runtime import spec as spec_module
from runtime.assembly import DraftSetting
from runtime.decode import Request
from runtime.engine import Engine
from runtime.manifest import EngineError
from runtime.modes import Mode
from runtime.spec import EngineSpec, open_spec

REPO = Path(__file__).resolve().parent.parent


def test_an_engine_opened_with_its_spec_reads_no_engine_json(tiny_engine, monkeypatch):
    spec = open_spec(tiny_engine)
    assert spec.dir == tiny_engine and "dir" not in spec.manifest.to_json()
    want = Engine(open_spec(tiny_engine)).generate([5, 6, 7, 8], 12, mode="sharpdraft", stop=False).tokens

    def no_read(*args, **kwargs):
        raise AssertionError("engine.json read again")

    monkeypatch.setattr(spec_module, "read_manifest", no_read)
    engine = Engine(spec)
    assert engine.spec is spec and engine.manifest is spec.manifest and engine.dir == tiny_engine
    assert engine.generate([5, 6, 7, 8], 12, mode="sharpdraft", stop=False).tokens == want


def test_the_spec_answers_what_an_engine_runs_without_loading_it(tiny_engine, monkeypatch):
    """open_spec loads no model: the modes, their refusals, the defaults and the settings
    are answered from engine.json and the registry, the same as the loaded engine's."""
    from runtime.backends.pytorch import loader as torch_loader

    loaded = Engine(open_spec(tiny_engine))

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(torch_loader, "TorchLoaded", no_load)
    spec = open_spec(tiny_engine)
    assert spec.modes == loaded.spec.modes and Mode.SHARPDRAFT in spec.modes
    assert spec.default_mode == loaded.spec.default_mode and not spec.own_loop
    assert spec.rule_default(False) == Mode.FROZEN and spec.refusals == ()
    assert spec.setting(Mode.SHARPDRAFT) == loaded.spec.setting(Mode.SHARPDRAFT)
    assert spec.placement == {"backend": "torch", "device": "cpu", "dtype": "float32", "steps": None}
    # an option the backend does not take is a refusal of the spec, raised by Engine
    refused = open_spec(tiny_engine, prefill_dtype="bfloat16")
    assert len(refused.refusals) == 1 and "--prefill-dtype" in refused.refusals[0]
    with pytest.raises(EngineError, match="prefill"):
        Engine(refused)


def test_a_backend_with_its_own_loop_is_a_capability_not_a_name(tiny_engine):
    """TensorRT-LLM is a backend in the registry: its spec says it runs its own loop, runs
    only the plain modes, and Engine refuses to load it in our loop in one line."""
    spec = open_spec(tiny_engine, "trtllm")
    assert spec.own_loop and spec.can.own_loop
    assert Mode.WINDOW not in spec.modes and Mode.NGRAM not in spec.modes
    assert spec.refusals and "was built for backend 'torch'" in spec.refusals[0]
    with pytest.raises(EngineError, match="is configuration for TensorRT-LLM"):
        Engine(spec)


def test_each_mode_resolves_to_its_draft_setting(tiny_engine):
    engine = Engine(open_spec(tiny_engine))
    assert engine.spec.setting(Mode.SHARPDRAFT) == DraftSetting(engine.scaling, None, False)
    assert engine.spec.setting(Mode.FROZEN) == DraftSetting(None, None, False)
    assert engine.spec.setting(Mode.PRESET).scaling == engine.spec.family_preset != engine.scaling
    assert engine.spec.setting(Mode.TARGET).scaling is None
    for mode in engine.spec.modes:
        assert engine.spec.setting(mode).ngram_assist == mode.ngram_assist


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
    engine = Engine(open_spec(tree_engine))
    decoder = engine.decoder("sharpdraft", adaptive=False)

    def asked(*args, **kwargs):
        raise AssertionError("the decoder called back into Engine")

    monkeypatch.setattr(Engine, "drafter", asked)
    for name in ("setting", "check_mode", "refusal"):
        monkeypatch.setattr(EngineSpec, name, asked)
    requests = [Request(prompt=[4 + i] * (10 + 3 * i), max_new_tokens=8) for i in range(3)]
    seqs = decoder.run(requests, join_at=[0, 1, 2])
    assert all(s.error is None and len(s.gen.tokens) == 8 for s in seqs)


def test_a_swapped_scaling_is_the_drafters_keyword(tiny_engine):
    engine = Engine(open_spec(tiny_engine))
    other = QueryScaling(ref_keys=16, top_k=4)
    assert engine.drafter(scaling=other).scaling == other
    assert engine.drafter(scaled=False).scaling is None


def shipped_calls(name: str) -> dict[str, int]:
    """Shipped file -> how many calls to `name` (a bare name or an attribute) it makes."""
    from test_layering import shipped

    found = {}
    for path in shipped():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == name:
                    rel = str(path.relative_to(REPO))
                    found[rel] = found.get(rel, 0) + 1
    return found


def test_engine_json_is_read_in_one_function_from_at_most_two_places():
    """read_manifest (the one reader of engine.json) is called from open_spec alone, the way
    in for the commands and the serving processes; no shipped file opens engine.json
    itself (a name it spells is only asked whether an engine is there)."""
    calls = shipped_calls("read_manifest")
    assert calls == {"runtime/spec.py": 1}, calls
    from test_layering import shipped

    spelled = {str(p.relative_to(REPO)) for p in shipped()
               if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith("engine.json")
                      for n in ast.walk(parsed(p)))}
    # manifest.py: MANIFEST; build_engine.py and served_ab.py: `(dir / "engine.json").is_file()`
    assert spelled <= {"runtime/manifest.py", "build_engine.py", "scripts/served_ab.py"}, spelled


# where a process enters: the commands (and build_engine.py / build.calibrate, which measure
# the engine they wrote), the served model, the scripts
ENTRY_POINTS = ("runtime/commands/", "runtime/serve/model.py", "build_engine.py",
                "build/calibrate.py", "scripts/")


def test_the_spec_is_opened_only_where_a_process_enters_and_handed_on():
    calls = shipped_calls("open_spec")
    assert calls and all(rel.startswith(ENTRY_POINTS) for rel in calls), calls
    assert {"runtime/commands/generate.py", "runtime/commands/serve.py",
            "runtime/serve/model.py"} <= set(calls)
    from test_layering import shipped

    # no function takes "a spec, or its directory": the spec is opened once and passed on
    loose = [f"{p.relative_to(REPO)}:{n.lineno}" for p in shipped()
             for n in ast.walk(parsed(p)) if isinstance(n, ast.arg) and n.annotation
             and "Manifest" in ast.unparse(n.annotation) and "Path" in ast.unparse(n.annotation)]
    assert loose == []


def test_serve_reads_engine_json_once_and_hands_the_spec_down(tiny_engine, tmp_path, monkeypatch, capsys):
    """`serve` opens the spec once and the repository writer, the HTTP body bound and the
    OpenAI endpoint's settings take it (before: four reads in the serve process)."""
    from runtime.__main__ import main as runtime_main
    from runtime.commands.serve import _http_max_input
    from runtime.serve.openai_api import Settings

    reads, real = [], spec_module.read_manifest

    def counted(*args, **kwargs):
        reads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(spec_module, "read_manifest", counted)
    assert runtime_main(["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                         str(tmp_path / "repo"), "--streaming", "--device", "cpu", "--json"]) == 0
    assert len(reads) == 1, reads
    spec = open_spec(tiny_engine)
    reads.clear()
    assert _http_max_input(spec) > 0
    settings = Settings(spec, "m", "m-stream", "127.0.0.1:1", 64)
    assert reads == [] and settings.modes == tuple(spec.modes) and settings.context


def class_methods(path: Path, name: str) -> list[str]:
    tree = parsed(path)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]


def test_engine_keeps_loading_and_running_in_at_most_eight_methods():
    """What an engine can run is its spec's to answer; Engine loads and runs."""
    methods = class_methods(REPO / "runtime" / "engine.py", "Engine")
    assert len(methods) <= 8, methods
    assert set(methods) == {"__init__", "decoder", "drafter", "generate", "encode", "decode"}
    tree = parsed(REPO / "runtime" / "engine.py")
    # no alias, no free function that takes an Engine first
    assert [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.Assign))] == []


def test_the_engine_and_its_assembly_hold_no_lambda_tables():
    for rel in ("runtime/engine.py", "runtime/assembly.py", "runtime/backends/pytorch/loader.py",
                "runtime/backends/onnxruntime/loader.py"):
        lambdas = [n.lineno for n in ast.walk(parsed(REPO / rel))
                   if isinstance(n, ast.Lambda)]
        assert lambdas == [], (rel, lambdas)


def compared_strings(path: Path) -> set[str]:
    """The string constants a file compares with (==, !=, in, not in a literal tuple)."""
    found = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
    return found


def test_no_entry_point_compares_a_backends_or_a_familys_name():
    """A backend's name is compared only in the registry (and TensorRT-LLM's own folder);
    a drafter family's only where its loader is registered. Everything else asks the spec
    or the table. (build_engine.py, build/ and plugins/trtllm/ write each family's own files.)"""
    from test_layering import shipped

    from runtime.modes import FAMILIES

    registry = ("runtime/backends/__init__.py", "runtime/modes.py", "plugins/trtllm/")
    for path in shipped():
        rel = str(path.relative_to(REPO))
        said = compared_strings(path)
        if not rel.startswith(registry):
            assert "trtllm" not in said, rel
        if rel.startswith("runtime/") and rel != "runtime/modes.py":
            assert not said & {f for f in FAMILIES if f != "ngram"}, (rel, said & set(FAMILIES))
    assert not (REPO / "runtime" / "trtllm.py").exists()


def test_a_tree_familys_trtllm_engine_opens_as_a_spec_of_its_own_loop(tmp_path, tiny_target):
    """An EAGLE-3 engine for TensorRT-LLM records no tree shape of ours (TensorRT-LLM grows
    its own trees): its spec still opens, runs its own loop and answers its modes."""
    import json

    import build_engine

    ckpt = tmp_path / "eagle3-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    out = tmp_path / "eagle3-trtllm"
    assert build_engine.main(["--drafter", "eagle3", "--sharpdraft", "--backend", "trtllm",
                              "--target", str(tiny_target), "--drafter-checkpoint", str(ckpt),
                              "--output", str(out)]) == 0
    spec = open_spec(out)
    assert spec.own_loop and spec.refusals == () and spec.style == "tree"
    assert spec.modes == (Mode.TARGET, Mode.FROZEN, Mode.SHARPDRAFT)
    assert spec.default_mode == Mode.SHARPDRAFT
    assert "is configuration for trtllm" in open_spec(out, "torch").refusals[0]
