"""`build_engine.py --drafter ngram`: an engine with no drafter model that speculates by
n-gram lookup, on both CPU backends, through the same commands as a DFlash engine."""

import json

import pytest

import build_engine
from runtime.__main__ import main as runtime_main
from runtime.cli import run

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def ngram_engine(request, tmp_path_factory, tiny_target, export_cache):
    """On ONNX Runtime over the long-context target: the target graphs (no features read)
    are then the PARD engine's (tests/test_pard_engine.py), exported once (tiny.shared_exports)."""
    import tiny

    target = tiny_target if request.param == "torch" else request.getfixturevalue("long_target")
    out = tmp_path_factory.mktemp("engines") / f"ngram-{request.param}"
    with tiny.shared_exports(export_cache):
        assert build_engine.main(["--drafter", "ngram", "--num-draft-tokens", "3", "--target",
                                  str(target), "--backend", request.param, "--step-costs", "fixed",
                                  "--output", str(out)]) == 0
    return out


def generate(engine_dir, capsys, *extra):
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", PROMPT,
                              "--max-new-tokens", "24", "--ignore-eos", "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_ngram_engine_records_its_settings_and_no_drafter(ngram_engine):
    manifest = json.loads((ngram_engine / "engine.json").read_text())
    assert manifest["drafter"] == "ngram" and manifest["drafter_checkpoint"] is None
    assert manifest["extra"]["ngram"] == {"method": "ngram", "max_ngram": 3, "min_ngram": 1,
                                          "num_draft_tokens": 3}
    assert manifest["block_size"] == 4 and manifest["query_scaling"] is None


def test_ngram_engine_generates_the_target_only_tokens(ngram_engine, capsys):
    speculative = generate(ngram_engine, capsys)
    plain = generate(ngram_engine, capsys, "--target-only")
    assert speculative["mode"] == "ngram" and plain["mode"] == "target"
    assert speculative["tokens"] == plain["tokens"]
    assert speculative["verify_steps"] <= plain["verify_steps"]


def test_ngram_engine_refuses_drafter_modes_in_one_line(ngram_engine, capsys):
    code = run(runtime_main, ["generate", "--engine-dir", str(ngram_engine), "--prompt", "x",
                              "--no-sharpdraft"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run 'frozen'" in err and err.count("\n") == 1


def test_ngram_drafting_runs_on_a_dflash_engine_too(tiny_engine, capsys):
    speculative = generate(tiny_engine, capsys, "--ngram")
    plain = generate(tiny_engine, capsys, "--target-only")
    assert speculative["mode"] == "ngram" and speculative["tokens"] == plain["tokens"]


def test_hybrid_runs_on_a_dflash_engine_with_the_target_only_tokens(tiny_engine, capsys):
    hybrid = generate(tiny_engine, capsys, "--hybrid")
    plain = generate(tiny_engine, capsys, "--target-only")
    assert hybrid["mode"] == "hybrid" and hybrid["tokens"] == plain["tokens"]
    assert hybrid["sharpdraft"] is not None  # the drafter it runs is SharpDraft's
    assert 0 < hybrid["steps_without_drafter"] <= hybrid["verify_steps"]  # this prompt repeats itself


def test_ngram_engine_refuses_hybrid_in_one_line(ngram_engine, capsys):
    code = run(runtime_main, ["generate", "--engine-dir", str(ngram_engine), "--prompt", "x",
                              "--hybrid"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run 'hybrid'" in err and err.count("\n") == 1


def test_sharpdraft_with_ngram_is_a_usage_error(tiny_target, tmp_path, capsys):
    code = run(build_engine.main, ["--drafter", "ngram", "--sharpdraft", "--target",
                                   str(tiny_target), "--output", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and "n-gram drafting has none" in err and err.count("\n") == 1
