"""EAGLE-3 engines on ONNX Runtime, built by build_engine.py itself over the long-context
tiny target: the tree engine (native form) and the chain engine (plugin form) draft the
same trees and chains, with the same per-row N, and decode the same tokens as the torch
backend running the same checkpoints, SharpDraft on and off; a batch grows its chains
in one drafter run per chain link (an engine exported before the graphs took past_lens
is refused; one whose tree levels give target-vocabulary logits drafts the same trees); a tree level's N is the keys its mask leaves unmasked; calibrate re-exports
the tree graph with its choice. (The batched chain drafter on graphs exported without an
engine, in the fast tier: tests/test_eagle3_onnx_chain.py.)"""

import json
import shutil

import numpy as np
import pytest
import torch

import tiny
import speculative
from runtime.backends.roles import TokenRows
from runtime.cli import run
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.sampling import Sampler

NEW_TOKENS = 20
PROMPT = 300  # tokens: past ref_keys 64, so SharpDraft's rows scale by beta > 1


# Slow (each build exports EAGLE-3's tree graphs, ~30 s on 2 cores), as is every test that
# reads graphs exported this run (tests/conftest.py); EAGLE-3's greedy losslessness runs on
# torch in the fast tier (test_eagle3.py).
pytestmark = pytest.mark.slow


def build(*args) -> int:
    import build_engine

    return run(build_engine.main, list(args))


@pytest.fixture(scope="module")
def eagle3_checkpoint(tmp_path_factory, long_target):
    return tiny.make_eagle3(tmp_path_factory.mktemp("eagle3"), long_target, draft_vocab=200)


@pytest.fixture(scope="module")
def tree_engine(tmp_path_factory, long_target, eagle3_checkpoint):
    out = tmp_path_factory.mktemp("engines") / "eagle3-tree-onnx"
    assert build("--drafter", "eagle3", "--sharpdraft", "--target", str(long_target),
                 "--drafter-checkpoint", str(eagle3_checkpoint), "--ref-keys", "64", "--top-k", "8",
                 "--tree-top-k", "3", "--tree-depth", "3", "--tree-total-tokens", "8",
                 "--backend", "onnxruntime", "--max-seq-len", "512", "--output", str(out)) == 0
    return out


@pytest.fixture(scope="module")
def chain_engine(tmp_path_factory, long_target, eagle3_checkpoint):
    out = tmp_path_factory.mktemp("engines") / "eagle3-chain-onnx"
    assert build("--drafter", "eagle3", "--sharpdraft", "--target", str(long_target),
                 "--drafter-checkpoint", str(eagle3_checkpoint), "--ref-keys", "64", "--top-k", "8",
                 "--tree-top-k", "1", "--num-draft-tokens", "3", "--backend", "onnxruntime",
                 "--attention", "plugin", "--max-seq-len", "512", "--output", str(out)) == 0
    return out


class RecordedTrees:
    """Passes a batch tree drafter through, keeping every tree and N it proposed."""

    def __init__(self, inner):
        self.inner = inner
        self.trees = []

    def __getattr__(self, name):  # add, prefill, prefill_more, join_prefilled, remove, scaling
        return getattr(self.inner, name)

    def draft_trees(self, ids, features, shapes):
        grown = self.inner.draft_trees(ids, features, shapes)
        self.trees.extend(grown)
        return grown


def test_the_engine_records_the_tree_graphs(tree_engine, chain_engine):
    manifest = json.loads((tree_engine / "engine.json").read_text())
    assert manifest["drafter"] == "eagle3" and manifest["backend"] == "onnxruntime"
    graphs = manifest["extra"]["onnx"]["graphs"]
    assert set(graphs) == {"target", "target_kv", "target_tree", "drafter", "drafter_frozen",
                           "drafter_tree", "drafter_frozen_tree"}
    names = {name: [i["name"] for i in g["inputs"]] for name, g in graphs.items()}
    assert names["target_tree"][:4] == ["ids", "positions", "tree_mask", "past_len"]
    assert "ancestors" in names["drafter_tree"] and "visible" in [
        o["name"] for o in graphs["drafter_tree"]["outputs"]]
    # each sequence's committed length, so one run steps a batch (PARD's form)
    assert all("past_lens" in names[g] for g in ("drafter", "drafter_frozen", "drafter_tree",
                                                  "drafter_frozen_tree"))
    assert graphs["drafter_tree"]["attention"] == "native"
    assert manifest["extra"]["step_costs"]["onnxruntime"]["draft"] is not None
    plugin = json.loads((chain_engine / "engine.json").read_text())["extra"]["onnx"]
    assert plugin["graphs"]["drafter"]["plugin_nodes"] == 1  # the causal step: one layer
    assert plugin["graphs"]["drafter_frozen"]["plugin_nodes"] == 0
    assert plugin["graphs"]["drafter_tree"]["plugin_nodes"] == 0  # a mask: native form


@pytest.mark.parametrize("sharpdraft", [True, False], ids=["sharpdraft", "frozen"])
def test_onnxruntime_drafts_trees_and_decodes_like_torch(tree_engine, sharpdraft):
    runs = []
    for backend in ("onnxruntime", "torch"):
        engine = Engine(open_spec(tree_engine, backend=backend))
        prompt = engine.encode(tiny.stdlib_text())[:PROMPT]
        drafter = RecordedTrees(engine.drafter(scaled=sharpdraft))
        gen = speculative.generate_tree(engine.loaded.batch_target(), drafter, prompt, NEW_TOKENS, Sampler(),
                                        engine.tree_shape)
        runs.append((gen.tokens, gen.committed_per_step, drafter.trees))
        want = engine.generate(prompt, NEW_TOKENS, mode="target", stop=False).tokens
        assert gen.tokens == want, backend
    (ours, our_steps, our_trees), (theirs, their_steps, their_trees) = runs
    assert ours == theirs and our_steps == their_steps and len(ours) == NEW_TOKENS
    assert our_trees == their_trees  # the same trees, and the same largest N per step
    if sharpdraft:
        scaling = Engine(open_spec(tree_engine)).scaling
        assert scaling.beta(our_trees[0][1]) > 1.0  # the comparison covers scaled rows


def export_target_vocabulary_levels(engine_dir, monkeypatch):
    """Re-export an EAGLE-3 engine's SharpDraft step and tree graphs in the form engines
    had before a tree level's logits left the target's vocabulary: the step graph without
    draft_ids, each level's logits mapped onto the target's vocabulary in-graph."""
    from build import export
    from runtime.manifest import engine_files, read_manifest

    class StepBefore(export.Eagle3Step):
        def forward(self, ids, features, context_lens, past_keys, past_values, past_lens):
            return super().forward(ids, features, context_lens, past_keys, past_values,
                                   past_lens)[:-1]

    class TreeBefore(export.Eagle3TreeStep):
        def forward(self, ids, hidden, ancestors, offsets, past_keys, past_values, scratch_keys,
                    scratch_values, past_lens):
            logits, *rest = super().forward(ids, hidden, ancestors, offsets, past_keys, past_values,
                                            scratch_keys, scratch_values, past_lens)
            return (self.vocab.target_logits(logits), *rest)

    monkeypatch.setattr(export, "Eagle3Step", StepBefore)
    monkeypatch.setattr(export, "Eagle3TreeStep", TreeBefore)
    monkeypatch.setattr(export, "EAGLE3_OUTPUTS", export.EAGLE3_OUTPUTS[:-1])
    monkeypatch.setattr(export, "EAGLE3_TREE_OUTPUTS", ("logits",) + export.EAGLE3_TREE_OUTPUTS[1:])
    torch_side = Engine(open_spec(engine_dir, backend="torch"))
    manifest = read_manifest(engine_dir)
    graphs = manifest.extra["onnx"]["graphs"]
    graphs["drafter"] = export.export_eagle3(torch_side.drafter_model, torch_side.scaling,
                                             graphs["drafter"]["attention"],
                                             engine_dir / graphs["drafter"]["file"])
    graphs["drafter_tree"] = export.export_eagle3_tree(torch_side.drafter_model, torch_side.scaling,
                                                       engine_dir / graphs["drafter_tree"]["file"])
    manifest.artifacts = engine_files(engine_dir)
    manifest.write(engine_dir)


def test_an_engine_whose_tree_levels_give_target_logits_drafts_the_same_trees(tree_engine, tmp_path,
                                                                             monkeypatch):
    """Engines exported before a tree level's logits were over the draft vocabulary (the
    step graph had no draft_ids) still load and draft the same trees, N and tokens as
    today's graphs, which score a level over the draft vocabulary."""
    engine_dir = tmp_path / "before"
    shutil.copytree(tree_engine, engine_dir)
    export_target_vocabulary_levels(engine_dir, monkeypatch)
    outputs = json.loads((engine_dir / "engine.json").read_text())["extra"]["onnx"]["graphs"]
    assert outputs["drafter_tree"]["outputs"][0]["name"] == "logits"
    runs = []
    for directory in (engine_dir, tree_engine):
        engine = Engine(open_spec(directory))
        prompt = engine.encode(tiny.stdlib_text())[:PROMPT]
        inner = engine.drafter(scaled=True)
        drafter = RecordedTrees(inner)
        gen = speculative.generate_tree(engine.loaded.batch_target(), drafter, prompt, NEW_TOKENS,
                                        Sampler(), engine.tree_shape)
        runs.append((inner.draft_vocab, gen.tokens, gen.committed_per_step, drafter.trees))
    (before_vocab, *before), (today_vocab, *today) = runs
    assert (before_vocab, today_vocab) == (False, True)  # each pair read by its outputs
    assert before == today and len(today[0]) == NEW_TOKENS


@pytest.mark.parametrize("sharpdraft", [True, False], ids=["sharpdraft", "frozen"])
def test_onnxruntime_drafts_chains_and_decodes_like_torch(chain_engine, sharpdraft):
    runs = []
    for backend in ("onnxruntime", "torch"):
        engine = Engine(open_spec(chain_engine, backend=backend))
        assert engine.style == "chain"
        prompt = engine.encode(tiny.stdlib_text())[:PROMPT]
        drafter = tiny.RecordedChain(engine.drafter(scaled=sharpdraft))
        gen = speculative.generate_chain(engine.loaded.batch_target(), drafter, prompt, NEW_TOKENS,
                                         Sampler())
        runs.append((gen.tokens, gen.committed_per_step, drafter.proposals))
    assert runs[0] == runs[1] and len(runs[0][0]) == NEW_TOKENS
    # a chain's rows see the committed entries and every earlier link: N = L, L + 1, ...
    for tokens, visible in runs[0][2]:
        assert visible == list(range(visible[0], visible[0] + len(tokens)))


@pytest.mark.parametrize("mode", ["sharpdraft", "frozen"])
def test_a_batch_grows_its_chains_in_one_run_per_link_as_each_would_alone(chain_engine, mode,
                                                                          monkeypatch):
    """Three sequences at different lengths, beta > 1: a step ingests every row's new
    entries in one run of the step graph and grows every row's chain in one tree-graph
    run per later link (K runs, not K per row), each sequence decoding the tokens, per-step
    N and beta of its own single-sequence run (greedy: target-only's), and the torch
    backend's batch the same tokens."""
    text = Engine(open_spec(chain_engine, backend="torch")).encode(tiny.stdlib_text())
    prompts = [text[:70], text[100:190], text[200:310]]  # beta > 1 (ref_keys 64)
    tokens = []
    for backend in ("onnxruntime", "torch"):
        engine = Engine(open_spec(chain_engine, backend=backend))
        decoder = engine.decoder(mode, adaptive=False)
        assert decoder.proposer.drafter.fused
        seqs = [decoder.add(Request(prompt=p, max_new_tokens=10)) for p in prompts]
        counts = speculative.drafter_passes(decoder, monkeypatch)
        passes = speculative.run_counting_passes(decoder, counts)
        assert passes[0] == engine.spec.drafting.max_drafts == max(passes) == 3, (backend, passes)
        if mode == "sharpdraft":
            speculative.assert_engine_rows_decode_as_alone(engine, prompts, seqs, 10)
        tokens.append([s.gen.tokens for s in seqs])
    assert tokens[0] == tokens[1]
    assert tokens[0] == [Engine(open_spec(chain_engine)).generate(p, 10, "target", stop=False).tokens
                         for p in prompts]


def export_before_past_lens(engine_dir):
    """Replace the SharpDraft drafter's step and tree graphs of an EAGLE-3 engine with
    the form engines were exported in before the graphs took past_lens: the past's length
    (a shape) is the run's one committed count, and the step returns the last row's
    logits. The frozen drafter keeps its graphs (each pair is read by its inputs)."""
    from build import export
    from runtime.manifest import engine_files, read_manifest

    class StepBefore(export.Eagle3Step):
        def forward(self, ids, features, past_keys, past_values):
            cache = export.ExportCache(past_keys, past_values)
            logits, hidden, visible = self.drafter(ids, self.drafter.project(features), cache,
                                                   self.scaling)
            return ((self.vocab.target_logits(logits[:, -1]), hidden[:, -1], visible)
                    + cache.present())

    class TreeBefore(export.Eagle3TreeStep):
        def forward(self, ids, hidden, ancestors, offsets, past_keys, past_values,
                    scratch_keys, scratch_values):
            return super().forward(ids, hidden, ancestors, offsets, past_keys, past_values,
                                   scratch_keys, scratch_values, None)

    torch_side = Engine(open_spec(engine_dir, backend="torch"))
    drafter, scaling = torch_side.drafter_model, torch_side.scaling
    d, g = export._dims(), torch.Generator().manual_seed(0)
    b, c, q, s = export.BATCH, export.CONTEXT, export.Q_LEN, export.SCRATCH
    rows, cache = {0: d["batch"], 1: d["context_len"]}, {0: d["past_len"], 2: d["batch"]}
    step = (torch.randint(0, drafter.config.vocab_size, (b, c), generator=g),
            torch.randn(b, c, drafter.fc.in_features, generator=g)) + export._eagle3_past(
                drafter, export.PAST)
    scratch = torch.export.Dim("scratch_len", min=0)
    q_rows = {0: d["batch"], 1: d["q_len"]}
    tree = ((torch.randint(0, drafter.config.vocab_size, (b, q), generator=g),
             torch.randn(b, q, drafter.config.hidden_size, generator=g),
             torch.rand(b, q, s, generator=g) < 0.5, torch.full((b, q), 2))
            + export._eagle3_past(drafter, export.PAST) + export._eagle3_past(drafter, s))
    manifest = read_manifest(engine_dir)
    graphs = manifest.extra["onnx"]["graphs"]
    for name, module, example, shapes, inputs, form in (
            ("drafter", StepBefore(drafter, scaling), step, (rows, rows, cache, cache),
             export.EAGLE3_INPUTS[:2] + ("past_keys", "past_values"), "plugin"),
            ("drafter_tree", TreeBefore(drafter, scaling), tree,
             (q_rows, q_rows, {0: d["batch"], 1: d["q_len"], 2: scratch}, q_rows, cache, cache,
              {0: scratch, 2: d["batch"]}, {0: scratch, 2: d["batch"]}),
             export.EAGLE3_TREE_INPUTS[:-1], "native")):
        path = engine_dir / graphs[name]["file"]
        export._export(module, example, shapes, inputs, export.EAGLE3_OUTPUTS, path, form)
        graphs[name] = export.graph_record(path, attention=form)
    manifest.artifacts = engine_files(engine_dir)
    manifest.write(engine_dir)


def test_an_engine_exported_before_past_lens_is_refused_in_one_line(chain_engine, tmp_path):
    """Graphs that take one committed length per run (no past_lens, read by their
    inputs: onnxruntime.takes_lengths) would draft a batch's chains row by row: the
    engine is refused when it loads, in one line naming its directory, the graphs and
    the rebuild (it used to load and draft row by row)."""
    from runtime.manifest import EngineError

    engine_dir = tmp_path / "before"
    shutil.copytree(chain_engine, engine_dir)
    export_before_past_lens(engine_dir)
    with pytest.raises(EngineError) as err:
        Engine(open_spec(engine_dir))
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(engine_dir))
    assert "(drafter, drafter_tree)" in message and "rebuild" in message


def test_a_tree_graph_fixed_to_one_sequence_is_refused_and_todays_takes_a_batch(tree_engine):
    """A target-tree.onnx whose batch dimension is fixed to one sequence would leave trees
    verifying row by row: check_batched refuses it in one line naming the engine
    directory; the graph build_engine.py writes today takes a batch, and its engine
    loads (its batch target packs trees)."""
    from types import SimpleNamespace

    from runtime.backends.onnxruntime import check_batched, takes_batch
    from runtime.manifest import EngineError

    def graph(batch):
        return SimpleNamespace(get_inputs=lambda: [SimpleNamespace(name="ids", shape=[batch, "q"])])

    with pytest.raises(EngineError) as err:
        check_batched(tree_engine, {"target_tree": graph(1)})
    assert str(err.value).startswith(str(tree_engine)) and "rebuild" in str(err.value)
    check_batched(tree_engine, {"target_tree": graph("batch")})
    engine = Engine(open_spec(tree_engine))
    assert takes_batch(engine.loaded.sessions["target_tree"])


def test_a_tree_levels_N_is_the_keys_its_mask_leaves_unmasked(tree_engine):
    """One tree level on the ONNX graph, with an irregular ancestry: each row's N (the
    graph's `visible`, what beta was computed from) is the count of a mask built here
    from the committed entries, the scratch keys it may see and itself; the logits (over
    the draft vocabulary) are the torch drafter's under the same mask."""
    ort, reference = Engine(open_spec(tree_engine)), Engine(open_spec(tree_engine, backend="torch"))
    drafter = ort.loaded.tree_drafter(ort.scaling)
    features = torch.randn(40, reference.drafter_model.fc.in_features,
                           generator=torch.Generator().manual_seed(5))
    following = reference.encode(tiny.stdlib_text())[1:41]
    drafter.add(64, [0] + following, features)  # 40 committed entries
    ancestors = np.array([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)
    first = torch.randn(5, reference.drafter_model.config.hidden_size,
                        generator=torch.Generator().manual_seed(7))
    hidden = torch.randn(3, reference.drafter_model.config.hidden_size,
                         generator=torch.Generator().manual_seed(6))
    run = drafter._scratch_run()
    run([[1, 2, 3, 4, 5]], first[None], np.zeros((1, 5, 0), dtype=bool), 0)  # scratch keys 40..44
    logits, _, visible = run([[7, 8, 9]], hidden[None], ancestors[None], 2)

    rows = []
    for i in range(3):  # committed entries, scratch keys 40..44, the level's own keys 45..47
        sees = [True] * 40 + list(ancestors[i]) + [j == i for j in range(3)]
        rows.append(sum(sees))
    assert visible[0].tolist() == rows == [43, 41, 46]

    torch_side = reference.loaded.tree_drafter(reference.scaling)
    torch_side.add(64, [0] + following, features)
    cache = torch_side.caches.groups[0].cache
    model = torch_side.drafter
    own = torch.eye(5, dtype=torch.bool)[None]
    mask = torch.cat([torch.from_numpy(ancestors), torch.eye(3, dtype=torch.bool)], -1)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4, 5]]), first[None], cache, torch_side.scaling,
              tree=(own, torch.zeros((1, 5), dtype=torch.long)))
        out, _, counts = model(torch.tensor([[7, 8, 9]]), hidden[None], cache, torch_side.scaling,
                               tree=(mask[None], torch.full((1, 3), 2)))
    assert counts[0].tolist() == rows
    # a level's logits are over the draft vocabulary (the runtime maps what it keeps)
    assert drafter.draft_vocab and logits.shape[-1] == reference.drafter_model.config.draft_vocab_size
    torch.testing.assert_close(logits[0], out[0], atol=1e-4, rtol=0)


def test_calibrate_re_exports_the_tree_graph(tree_engine, tmp_path):
    from plugins.scaling import QueryScaling
    from build.calibrate import apply

    engine_dir = tmp_path / "engine"
    shutil.copytree(tree_engine, engine_dir)
    chosen = QueryScaling(32, 8, 2.0, 0.5)
    apply(engine_dir, Engine(open_spec(engine_dir, backend="torch")), chosen, {"test": True})
    ort, reference = Engine(open_spec(engine_dir)), Engine(open_spec(engine_dir, backend="torch"))
    assert ort.scaling == chosen
    prompt = reference.encode(tiny.stdlib_text())[:PROMPT]
    trees = []
    for engine in (ort, reference):
        drafter = engine.drafter()
        drafter.add(PROMPT + 16, [], None)
        features = engine.loaded.batch_target().add(prompt, PROMPT + 16)[1]
        trees.append(drafter.draft_trees(TokenRows.of([prompt + [5]]), [features], [engine.tree_shape]))
    assert trees[0] == trees[1]


def test_what_eagle3_onnx_engines_cannot_do_is_one_line(tree_engine, long_target,
                                                        eagle3_checkpoint, tmp_path, capsys):
    from runtime.manifest import EngineError

    from runtime.decode import Request

    engine = Engine(open_spec(tree_engine))  # trees batch (one tree verify per row), as target-only decodes
    prompts = [engine.encode("def f(x):"), engine.encode(tiny.stdlib_text())[:40]]
    seqs = engine.decoder("sharpdraft").run([Request(prompt=p, max_new_tokens=8) for p in prompts])
    assert [s.gen.tokens for s in seqs] == [engine.generate(p, 8, "target", stop=False).tokens
                                            for p in prompts]
    with pytest.raises(EngineError) as err:
        Engine(open_spec(tree_engine, backend="tensorrt"))
    assert "\n" not in str(err.value)
    capsys.readouterr()
    assert build("--drafter", "eagle3", "--target", str(long_target), "--drafter-checkpoint",
                 str(eagle3_checkpoint), "--backend", "tensorrt", "--output", str(tmp_path / "t")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "onnxruntime" in lines[0]


def test_the_commands_loop_replays_one_prefill_on_a_tree_engine(tree_engine):
    """bench runs Engine.generate over a PrefillOnce over the batch target: on ONNX Runtime a tree
    verified near the end of the budget (its nodes in the decoder's slack past it) keeps
    the tokens target-only's."""
    from runtime.backends import PrefillOnce
    from speculative import generate_target_only

    engine = Engine(open_spec(tree_engine))
    prompt = engine.encode(tiny.stdlib_text())[:40]
    once = PrefillOnce(engine.loaded.batch_target(), prompt)
    want = generate_target_only(once, prompt, 16, Sampler()).tokens
    got = engine.generate(prompt, 16, engine.spec.rule_default(), stop=False, target=once)
    assert got.tokens == want and got.verify_steps < 16


def test_onnxruntime_packs_a_batch_of_trees_in_one_pass(tree_engine, monkeypatch):
    """Three rows at different lengths (capacities in one bucket), trees of different
    sizes: one target-tree.onnx run gives each node the logits and features of the row's
    tree verified in a batch of one (fp32), and after keep_paths each row's next verify
    equals its own."""
    import runtime.backends.onnxruntime.target as ort  # where the batch target runs its sessions
    from runtime.tree import DraftTree

    engine = Engine(open_spec(tree_engine))
    loaded = engine.loaded
    batch, alone = loaded.batch_target(), []
    text = engine.encode(tiny.stdlib_text())
    prompts = [text[:30], text[40:45], text[50:90]]
    for prompt in prompts:
        batch.add(prompt, 60)
        alone.append(loaded.batch_target())
        alone[-1].add(prompt, 60)
    trees = [DraftTree((5, 9, 11, 9, 3), (-1, 0, 0, 1, 3)), DraftTree.root_only(7),
             DraftTree((2, 4, 6), (-1, 0, 1))]
    runs, run_bound = [], ort.run_bound
    monkeypatch.setattr(ort, "run_bound", lambda *a: runs.append(a[0]) or run_bound(*a))
    got = batch.verify_trees(trees)
    assert runs == [loaded.sessions["target_tree"]]  # one pass for the three rows
    monkeypatch.undo()
    for one, tree, (logits, features) in zip(alone, trees, got):
        (want_logits, want_features), = one.verify_trees([tree])
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features, want_features, atol=1e-4, rtol=1e-4)
    paths = [[0, 1], [0], [0, 1, 2]]
    batch.keep_paths(TokenRows.of(paths))
    logits, _ = batch.verify(TokenRows.of([[1], [2], [3]]))
    for i, (one, path) in enumerate(zip(alone, paths)):
        one.keep_paths(TokenRows.of([path]))
        torch.testing.assert_close(logits[i, :1], one.verify(TokenRows.of([[i + 1]]))[0][0], atol=1e-4,
                                   rtol=1e-4)


def test_onnxruntime_batched_trees_decode_as_alone_and_as_the_target(tree_engine):
    engine = Engine(open_spec(tree_engine))
    text = engine.encode(tiny.stdlib_text())
    prompts, budgets = [text[:PROMPT], text[7:30], text[100:160]], [12, 8, 10]
    decoder = engine.decoder("sharpdraft")
    from runtime.decode import Request

    got = decoder.run([Request(prompt=p, max_new_tokens=n) for p, n in zip(prompts, budgets)], join_at=[0, 0, 2])
    for prompt, n, seq in zip(prompts, budgets, got):
        alone = engine.generate(prompt, n, mode="sharpdraft", stop=False).tokens
        assert seq.gen.tokens == alone == engine.generate(prompt, n, mode="target", stop=False).tokens
