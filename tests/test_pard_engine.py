"""PARD engines end to end on tiny checkpoints: build_engine.py --drafter pard for torch
and onnxruntime (the drafter graph carries the SharpDraftAttention node, counts from its
past_lens input), the same tokens and drafts on both backends and in both attention
forms, and the commands (generate, bench, calibrate, diagnose) on a PARD engine."""

import json

import pytest
import torch

import tiny
import speculative
from build.calibrate import main as calibrate_main
from runtime.backends.roles import TokenRows
from runtime.__main__ import main as runtime_main
from plugins.scaling import QueryScaling
from runtime.backends.onnxruntime import OnnxBatchPARD, open_session
from runtime.cli import run
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.sampling import Sampler

NEW_TOKENS = 24


def build(*args) -> int:
    import build_engine

    return run(build_engine.main, list(args))


@pytest.fixture(scope="module")
def pard_checkpoint(tmp_path_factory, long_target):
    return tiny.make_pard(tmp_path_factory.mktemp("pard"), long_target)


@pytest.fixture(scope="module")
def pard_onnx_engine(tmp_path_factory, long_target, pard_checkpoint, export_cache):
    """ONNX graphs, plugin form; ref_keys 64 puts beta > 1 from ~70 keys on. The target
    graphs are the n-gram engine's (tests/test_ngram_engine.py), exported once."""
    out = tmp_path_factory.mktemp("engines") / "pard-onnx"
    with tiny.shared_exports(export_cache):
        assert build("--drafter", "pard", "--sharpdraft", "--target", str(long_target),
                     "--drafter-checkpoint", str(pard_checkpoint), "--ref-keys", "64", "--top-k",
                     "8", "--num-draft-tokens", "3", "--backend", "onnxruntime", "--attention",
                     "plugin", "--step-costs", "fixed", "--output", str(out)) == 0
    return out


@pytest.fixture(scope="module")
def pard_torch_engine(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("engines") / "pard-torch"
    ckpt = tiny.make_pard(tmp_path_factory.mktemp("pard-small"), tiny_target)
    assert build("--drafter", "pard", "--sharpdraft", "--target", str(tiny_target),
                 "--drafter-checkpoint", str(ckpt), "--ref-keys", "64", "--top-k", "8",
                 "--backend", "torch", "--step-costs", "fixed", "--output", str(out)) == 0
    return out


def speculate(engine, drafter, prompt):
    recorded = tiny.RecordedChain(drafter)
    gen = speculative.generate_chain(engine.loaded.batch_target(), recorded, prompt, NEW_TOKENS, Sampler())
    return gen.tokens, gen.committed_per_step, gen.visible_per_step, recorded.proposals


def test_the_engine_records_a_pard_drafter(pard_onnx_engine):
    manifest = json.loads((pard_onnx_engine / "engine.json").read_text())
    assert manifest["drafter"] == "pard" and manifest["block_size"] == 4
    assert manifest["query_scaling"]["ref_keys"] == 64
    assert manifest["extra"]["family_preset"]["ref_keys"] == 8192  # the paper's PARD count
    assert set(manifest["drafter_checkpoint"]["files"]) == {"config.json", "model.safetensors"}
    graphs = manifest["extra"]["onnx"]["graphs"]
    assert graphs["drafter"]["plugin_nodes"] == 1  # one per drafter layer
    assert graphs["drafter_frozen"]["plugin_nodes"] == 0
    assert "past_lens" in [i["name"] for i in graphs["drafter"]["inputs"]]
    assert manifest["extra"]["onnx"]["mask_token_id"] == tiny.PARD_TOKEN
    assert manifest["extra"]["step_costs"]["onnxruntime"]["draft"] is not None


@pytest.mark.parametrize("length", (17, 600))  # 600: the drafter's first read is chunked
@pytest.mark.parametrize("sharpdraft", [True, False], ids=["sharpdraft", "frozen"])
def test_onnxruntime_drafts_and_generates_like_torch(pard_onnx_engine, length, sharpdraft):
    ort, torch_side = Engine(open_spec(pard_onnx_engine)), Engine(open_spec(pard_onnx_engine, backend="torch"))
    prompt = torch_side.encode(tiny.stdlib_text())[:length]
    ours = speculate(ort, ort.drafter(scaled=sharpdraft), prompt)
    theirs = speculate(torch_side, torch_side.drafter(scaled=sharpdraft), prompt)
    assert ours[:3] == theirs[:3]
    assert [p[0] for p in ours[3]] == [p[0] for p in theirs[3]]  # the same drafts
    assert [p[1] for p in ours[3]] == [p[1] for p in theirs[3]]  # and the same N per row
    assert len(ours[0]) == NEW_TOKENS
    if sharpdraft and length == 600:
        assert ort.scaling.beta(ours[2][0]) > 1.0  # the comparison covers scaled rows


# The preset runs on torch only (it swaps the drafter's scaling); recorded here with 32
# reference keys, so its beta (> 1 at these lengths, unlike the paper's 8,192) differs
# from SharpDraft's calibrated one.
TINY_PRESET = QueryScaling(ref_keys=32, top_k=4, slope=3.0)


@pytest.mark.parametrize("backend, mode", [("torch", "sharpdraft"), ("onnxruntime", "sharpdraft"),
                                           ("torch", "preset")])
def test_a_batch_drafts_its_chains_in_one_pass_per_step_as_each_would_alone(
        pard_onnx_engine, backend, mode, monkeypatch):
    """Three sequences at different lengths, beta > 1 (one drafter cache bucket on torch): every
    step drafts all their chains in ONE drafter pass, and each sequence decodes the
    tokens, per-step N and beta of its own single-sequence run (greedy: target-only's),
    under the calibrated scaling and under the family preset."""
    engine = Engine(open_spec(pard_onnx_engine, backend=backend))
    engine.manifest.extra["family_preset"] = TINY_PRESET.to_dict()
    text = engine.encode(tiny.stdlib_text())
    prompts = [text[:70], text[100:190], text[200:310]]  # beta > 1 (ref_keys 64, or 32)
    decoder = engine.decoder(mode, adaptive=False)
    assert decoder.proposer.drafter.fused
    assert decoder.proposer.drafter.scaling == (TINY_PRESET if mode == "preset" else engine.scaling)
    seqs = [decoder.add(Request(prompt=p, max_new_tokens=10)) for p in prompts]
    passes = speculative.run_counting_passes(decoder, speculative.drafter_passes(decoder, monkeypatch))
    assert passes[0] == 1 and max(passes) == 1, passes
    speculative.assert_engine_rows_decode_as_alone(engine, prompts, seqs, 10, mode)


def test_an_onnx_pard_drafter_reads_a_chunked_prompt_a_part_at_a_time(pard_onnx_engine):
    """OnnxBatchPARD under a chunked join (the engine's ONNX Runtime target, which has no
    features for a PARD drafter): the drafter reads each chunk right after the target's,
    none in the join's last part, and drafts as after one read (float32: within 1e-5)."""
    from runtime.sampling import Sampling

    engine = Engine(open_spec(pard_onnx_engine))
    assert type(engine.decoder("sharpdraft").proposer.drafter).__name__ == "OnnxBatchPARD"
    prompt = engine.encode(tiny.stdlib_text())[:150]
    speculative.assert_chunked_join_drafts_as_whole(
        lambda: engine.decoder("sharpdraft", adaptive=False), prompt, 64,
        Sampling(1.0, 1.0, seed=3), 1e-5, OnnxBatchPARD)


def test_native_form_drafts_like_the_plugin_node(pard_onnx_engine, tmp_path):
    """The drafter graph exported again with beta in plain ONNX ops gives the plugin
    node's logits, with the per-row counts read from past_lens."""
    from build import export

    engine = Engine(open_spec(pard_onnx_engine, backend="torch"))
    path = tmp_path / "drafter-native.onnx"
    export.export_drafter(engine.drafter_model, engine.model, engine.scaling, "native", path)
    plugin = Engine(open_spec(pard_onnx_engine)).drafter()
    native = OnnxBatchPARD(open_session(path), tiny.PARD_TOKEN, 3, engine.scaling)
    ids = engine.encode(tiny.stdlib_text())[:140]
    for drafter in (plugin, native):  # each a batch of one, nothing read yet
        drafter.add(200, [], None)
    for start, end in ((0, 120), (120, 121), (121, 140)):
        (a,), (b,) = (d.draft(TokenRows.of([ids[start:end]]), [None], [3], [Sampler()]) for d in (plugin, native))
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        assert a.visible.tolist() == b.visible.tolist()


def test_generate_runs_every_mode_with_the_same_greedy_tokens(pard_torch_engine, capsys):
    outputs = {}
    for mode in ([], ["--no-sharpdraft"], ["--target-only"]):
        code = run(runtime_main, ["generate", "--engine-dir", str(pard_torch_engine), "--prompt",
                                  "import os\n", "--max-new-tokens", "20", "--ignore-eos", "--json",
                                  *mode])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        result = json.loads(captured.out)
        outputs[result["mode"]] = result["tokens"]
    assert outputs["sharpdraft"] == outputs["frozen"] == outputs["target"]
    assert len(outputs["target"]) == 20


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "doc.txt"
    path.write_text(tiny.stdlib_text(30_000))
    return path


def test_bench_diagnose_and_calibrate_run_on_a_pard_engine(pard_torch_engine, doc, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = run(runtime_main, ["bench", "--engine-dir", str(pard_torch_engine), "--lengths", "16", "160",
                              "--new-tokens", "10", "--docs", str(doc), "--repeats", "1",
                              "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["drafter"] == "pard" and result["training_max_length"] == 64
    assert all(all(r["identical_to_target"]["sharpdraft"]) for r in result["rows"])

    code = run(runtime_main, ["diagnose", "--engine-dir", str(pard_torch_engine), "--lengths", "8", "300",
                              "--top-k", "8", "--docs", str(doc), "--json", str(tmp_path / "d.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert rows[0]["frozen"] == rows[0]["sharpdraft"]  # beta = 1 at 8 keys
    assert all(s > f for f, s in zip(rows[-1]["frozen"], rows[-1]["sharpdraft"]))

    code = run(calibrate_main, ["--engine-dir", str(pard_torch_engine), "--ref-keys", "32", "128",
                              "--slopes", "2", "--lengths", "150", "--short", "40", "--new-tokens", "6",
                              "--docs", str(doc), "--dry-run", "--json", str(tmp_path / "c.json")])
    assert code == 0, capsys.readouterr().err
    assert len(json.loads((tmp_path / "c.json").read_text())["grid"]) == 2


def test_pard_engines_batch_and_say_what_they_cannot_time(pard_torch_engine, capsys, tmp_path):
    out = tmp_path / "batch.json"
    code = run(runtime_main, ["bench", "--engine-dir", str(pard_torch_engine), "--lengths", "16",
                              "40", "--new-tokens", "4", "--batch", "2", "--docs", __file__,
                              "--repeats", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"target", "ngram", "frozen", "sharpdraft"}
    assert all(r["identical_to_one_at_a_time"] == [True, True] for r in rows)
    capsys.readouterr()
    code = run(runtime_main, ["overhead", "--engine-dir", str(pard_torch_engine)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not timed by it yet" in err[0]


def test_a_mismatched_drafter_is_refused_at_build_in_one_line(tmp_path, tiny_target, capsys):
    from runtime.models.pard import PARDDrafter, save_pard

    save_pard(PARDDrafter(tiny.pard_config(300, 512)), tmp_path / "small")
    code = build("--drafter", "pard", "--target", str(tiny_target), "--drafter-checkpoint",
                 str(tmp_path / "small"), "--backend", "torch", "--output", str(tmp_path / "e"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and "vocab_size 300 vs target 320" in err[-1]
