"""EAGLE-3 engines, built by build_engine.py itself over the tiny target: a tree engine and
a chain engine (--tree-top-k 1) decode exactly what target-only decoding does, through
Engine and the generate command; what they cannot do is refused in one line. (The
onnxruntime backend's EAGLE-3 engines: tests/test_eagle3_onnx.py.)"""

import json

import pytest

import build_engine
import speculative
import tiny
from plugins.scaling import QueryScaling
from build.calibrate import main as calibrate_main
from runtime.__main__ import main as runtime_main
from runtime.cli import run
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError


def build(*args) -> int:
    return run(build_engine.main, list(args))


@pytest.fixture(scope="module")
def eagle3_checkpoint(tmp_path_factory, tiny_target):
    return tiny.make_eagle3(tmp_path_factory.mktemp("eagle3"), tiny_target, draft_vocab=200)


@pytest.fixture(scope="module")
def tree_engine(tmp_path_factory, tiny_target, eagle3_checkpoint):
    out = tmp_path_factory.mktemp("engines") / "eagle3-tree"
    assert build("--drafter", "eagle3", "--sharpdraft", "--target", str(tiny_target),
                 "--drafter-checkpoint", str(eagle3_checkpoint), "--ref-keys", "64", "--top-k", "8",
                 "--tree-top-k", "3", "--tree-depth", "3", "--tree-total-tokens", "8",
                 "--backend", "torch", "--step-costs", "fixed", "--output", str(out)) == 0
    return out


@pytest.fixture(scope="module")
def chain_engine(tmp_path_factory, tiny_target, eagle3_checkpoint):
    out = tmp_path_factory.mktemp("engines") / "eagle3-chain"
    assert build("--drafter", "eagle3", "--sharpdraft", "--target", str(tiny_target),
                 "--drafter-checkpoint", str(eagle3_checkpoint), "--ref-keys", "64", "--top-k", "8",
                 "--tree-top-k", "1", "--num-draft-tokens", "3", "--backend", "torch",
                 "--step-costs", "fixed", "--output", str(out)) == 0
    return out


def test_tree_engine_records_its_tree_and_decodes_like_the_target(tree_engine, eagle3_checkpoint):
    manifest = json.loads((tree_engine / "engine.json").read_text())
    assert manifest["drafter"] == "eagle3" and manifest["backend"] == "torch"
    assert manifest["extra"]["eagle3"] == {"top_k": 3, "depth": 3, "total_tokens": 8}
    assert manifest["block_size"] == 4  # a path commits at most depth + 1 tokens
    assert set(manifest["drafter_checkpoint"]["files"]) == {"config.json", "model.safetensors"}
    engine = Engine(open_spec(tree_engine))
    assert engine.style == "tree" and engine.spec.modes == ("target", "ngram", "frozen", "sharpdraft")
    prompt = engine.encode("def fibonacci(n):\n    ")
    want = engine.generate(prompt, 24, mode="target", stop=False).tokens
    for mode in ("frozen", "sharpdraft"):
        gen = engine.generate(prompt, 24, mode=mode, stop=False)
        assert gen.tokens == want, mode
        assert all(1 <= n <= 4 for n in gen.committed_per_step)


def test_chain_engine_decodes_like_the_target_and_samples(chain_engine):
    from runtime.sampling import Sampling

    engine = Engine(open_spec(chain_engine))
    assert engine.style == "chain" and engine.spec.drafting.max_drafts == 3
    prompt = engine.encode("import os\n")
    want = engine.generate(prompt, 20, mode="target", stop=False).tokens
    assert engine.generate(prompt, 20, mode="sharpdraft", stop=False).tokens == want
    sampled = engine.generate(prompt, 20, mode="sharpdraft", stop=False,
                              sampling=Sampling(temperature=0.8, seed=3))
    assert len(sampled.tokens) == 20


# The preset, recorded with 32 reference keys: its beta (> 1 at these lengths, unlike the
# paper's 2,048) differs from SharpDraft's calibrated one.
TINY_PRESET = QueryScaling(ref_keys=32, top_k=4, slope=3.0)


@pytest.mark.parametrize("mode", ["sharpdraft", "preset"])
def test_a_batch_grows_its_chains_in_one_pass_per_link_as_each_would_alone(chain_engine, mode,
                                                                            monkeypatch):
    """Three sequences at different lengths, beta > 1 (one drafter cache bucket): a step ingests
    every row's new entries in one drafter pass and grows every row's chain in one pass
    per link (K passes, not K per row), and each sequence decodes the tokens, per-step N
    and beta of its own single-sequence run (greedy: target-only's), under the
    calibrated scaling and under the family preset."""
    engine = Engine(open_spec(chain_engine))
    engine.manifest.extra["family_preset"] = TINY_PRESET.to_dict()
    text = engine.encode(tiny.stdlib_text())
    prompts = [text[:70], text[100:190], text[200:310]]  # beta > 1 (ref_keys 64, or 32)
    decoder = engine.decoder(mode, adaptive=False)
    assert decoder.proposer.drafter.fused
    assert decoder.proposer.drafter.scaling == (TINY_PRESET if mode == "preset" else engine.scaling)
    seqs = [decoder.add(Request(prompt=p, max_new_tokens=10)) for p in prompts]
    passes = speculative.run_counting_passes(decoder, speculative.drafter_passes(decoder, monkeypatch))
    assert passes[0] == engine.spec.drafting.max_drafts == max(passes) == 3, passes
    speculative.assert_engine_rows_decode_as_alone(engine, prompts, seqs, 10, mode)


@pytest.mark.parametrize("batch", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_tree_engine_drafts_a_batch_as_per_row_drafting_did(tree_engine, batch, monkeypatch):
    """The engine's SharpDraft tree drafter (float32, beta > 1 past 64 keys) over rows at
    different lengths and budgets: one drafter pass to ingest and one per level for every
    row, and each row's tokens, accepted counts, N and beta per step those of today's
    per-row drafting (tests/tree_oracle.py) on the same weights."""
    from tree_oracle import PerRowTrees

    engine = Engine(open_spec(tree_engine))
    text = engine.encode(tiny.stdlib_text())
    requests = [Request(prompt=text[37 * i:37 * i + 70 + 13 * i], max_new_tokens=8 + 3 * i) for i in range(batch)]
    drafter = engine.drafter()
    assert type(drafter).__name__ == "TorchBatchEagle3"
    oracle = PerRowTrees(engine.loaded.drafter_model, engine.scaling, engine.tree_shape)
    got = speculative.assert_trees_draft_as_per_row(engine.loaded.batch_target, drafter, oracle,
                                                    engine.tree_shape, requests, monkeypatch,
                                                    join_at=[i // 3 for i in range(batch)])
    assert min(g[3][0] for g in got) > 1.0  # scaled rows


def test_the_step_cost_tool_times_a_batch_of_trees_in_one_pass_per_level(tree_engine, monkeypatch):
    """runtime/step_costs.py's drafter step for 4 rows: one drafter pass ingests the 4
    rows' new entries, then one pass per tree level expands all 4 rows' frontiers."""
    from runtime import step_costs

    engine = Engine(open_spec(tree_engine))
    ids = engine.encode(tiny.stdlib_text())[:80]
    _, features = engine.loaded.batch_target().add(ids[:60], 80)
    step = step_costs._drafter_step(engine, ids, features, 60, 3, batch=4)
    model, shapes = engine.loaded.drafter_model, []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k: shapes.append(tuple(ids.shape))
                        or forward(ids, *a, **k))
    step()
    top_k = engine.tree_shape.top_k
    assert shapes == [(4, 1)] + [(4, top_k)] * (engine.tree_shape.depth - 1)


def test_generate_command_runs_a_tree_engine_and_refuses_to_sample_it(tree_engine, capsys):
    assert run(runtime_main, ["generate", "--engine-dir", str(tree_engine), "--prompt", "x = ",
                              "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "sharpdraft" and result["backend"] == "torch"
    code = run(runtime_main, ["generate", "--engine-dir", str(tree_engine), "--prompt", "x = ",
                              "--max-new-tokens", "8", "--temperature", "0.8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and "--tree-top-k 1" in err[-1]


def test_what_eagle3_engines_cannot_do_is_refused_in_one_line(tree_engine, tiny_target,
                                                               eagle3_checkpoint, tmp_path, capsys):
    with pytest.raises(EngineError) as err:  # built for torch: no graphs to run
        Engine(open_spec(tree_engine, backend="onnxruntime"))
    assert "holds no ONNX graphs" in str(err.value) and "\n" not in str(err.value)
    capsys.readouterr()
    assert build("--drafter", "eagle3", "--target", str(tiny_target), "--drafter-checkpoint",
                 str(eagle3_checkpoint), "--backend", "tensorrt", "--output", str(tmp_path / "o")) == 2
    assert build("--drafter", "eagle3", "--target", str(tiny_target), "--drafter-checkpoint",
                 str(eagle3_checkpoint), "--tree-top-k", "0", "--output", str(tmp_path / "z")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines)
    assert "drafts trees, which the tensorrt backend" in lines[0] and "--backend onnxruntime" in lines[0]
    assert "invalid EAGLE-3 tree" in lines[1]


def test_the_commands_loop_replays_one_prefill_on_a_tree_engine(tree_engine):
    """bench runs Engine.generate over a PrefillOnce target: a tree
    verified there (near the end of its budget too) decodes what target-only does."""
    from runtime.backends import PrefillOnce
    from runtime.sampling import Sampler
    from speculative import generate_target_only

    engine = Engine(open_spec(tree_engine))
    prompt = engine.encode("class Node:\n    def __init__(self")
    once = PrefillOnce(engine.loaded.batch_target(), prompt)
    want = generate_target_only(once, prompt, 16, Sampler()).tokens
    got = engine.generate(prompt, 16, engine.spec.rule_default(), stop=False, target=once)
    assert got.tokens == want and got.verify_steps < 16


def test_calibrate_scores_tree_and_chain_engines(tree_engine, chain_engine, tmp_path, capsys):
    """calibrate's teacher-forced sweep drafts a tree (or a chain) at every anchor."""
    doc = tmp_path / "doc.txt"
    doc.write_text(tiny.stdlib_text(30_000))
    for engine in (tree_engine, chain_engine):
        out = tmp_path / f"{engine.name}.json"
        code = run(calibrate_main, ["--engine-dir", str(engine), "--ref-keys", "32", "128",
                                  "--slopes", "2", "--lengths", "150", "--short", "40",
                                  "--new-tokens", "6", "--docs", str(doc), "--dry-run",
                                  "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        record = json.loads(out.read_text())
        assert record["anchors"] == {"40": 6, "150": 6} and len(record["grid"]) == 2
        # a step commits at most 3 drafts (both engines' depth / chain) + the target's token
        assert all(1 <= r["mal_long"] <= 4 for r in [record["frozen"], *record["grid"]])
