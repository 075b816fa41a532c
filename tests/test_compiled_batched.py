"""Compiled steps for every drafter family, batched (runtime/backends/pytorch/compiled.py): the torch
target, DFlash blocks, PARD chains and EAGLE-3 chains run fixed-shape steps per (slot
bucket, width bucket) -- CompiledBatchTarget, CompiledBatchDFlash, CompiledBatchPARD,
CompiledBatchEagle3 over FixedSlots -- and decode the eager engine's tokens for every mode
the engine runs (the fast tier: FAST_MODES), greedy and seeded sampling, alone (a batch of one) and as a batch of
four requests joining and leaving. The fast tier compiles with dynamo alone
(steps="eager"); inductor (CPU) is the slow variant, CUDA graphs per bucket the GPU one."""

import pytest
import torch

import tiny
from runtime.backends.roles import TokenRows
from plugins.scaling import QueryScaling
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.sampling import Sampler, Sampling

NEW_TOKENS = 12
SAMPLINGS = {"greedy": {}, "seeded": dict(temperature=0.8, top_p=0.95, seed=7)}
BUDGETS = (6, 12, 9, 12)  # rows leave at different steps, from the middle of the batch
JOIN_AT = [0, 0, 1, 3]  # a group grows from one slot to two, then four


def build(args) -> None:
    import build_engine

    assert build_engine.main(args + ["--step-costs", "fixed"]) == 0


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_target, tiny_engine) -> dict:
    """One torch engine per drafter family over the tiny target: DFlash (the session's),
    PARD, EAGLE-3 chains (top_k 1)."""
    root = tmp_path_factory.mktemp("compiled-batched")
    pard = tiny.make_pard(root / "pard", tiny_target)
    eagle3 = tiny.make_eagle3(root / "eagle3", tiny_target, draft_vocab=200)
    scaling = ["--sharpdraft", "--ref-keys", "64", "--top-k", "8", "--backend", "torch"]
    build(["--drafter", "pard", *scaling, "--target", str(tiny_target), "--drafter-checkpoint",
           str(pard), "--num-draft-tokens", "3", "--output", str(root / "pard-engine")])
    build(["--drafter", "eagle3", *scaling, "--target", str(tiny_target), "--drafter-checkpoint",
           str(eagle3), "--tree-top-k", "1", "--num-draft-tokens", "3",
           "--output", str(root / "eagle3-engine")])
    return {"dflash": tiny_engine, "pard": root / "pard-engine", "eagle3": root / "eagle3-engine"}


def prompts(engine, lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def outcome(gen) -> tuple:
    """The tokens and what the drafts did each step (greedy tokens alone would hide a
    wrong draft: verification keeps them lossless whatever is drafted)."""
    return gen.tokens, gen.committed_per_step, gen.visible_per_step


def decode(engine, mode, how, alone, batched):
    """(a batch of one's outcome, each of the four batched requests' outcomes)."""
    one = engine.generate(alone, NEW_TOKENS, mode=mode, stop=False, adaptive=False,
                          sampling=Sampling(**SAMPLINGS[how]))
    requests = [Request(prompt=p, max_new_tokens=n, sampler=Sampler(Sampling(**SAMPLINGS[how])))
                for p, n in zip(batched, BUDGETS)]
    seqs = engine.decoder(mode, adaptive=False).run(requests, join_at=JOIN_AT)
    assert all(s.error is None for s in seqs)
    return outcome(one), [outcome(s.gen) for s in seqs]


BATCH_ROLES = {"dflash": "CompiledBatchDFlash", "pard": "CompiledBatchPARD",
               "eagle3": "CompiledBatchEagle3"}


# The fast tier's modes: target-only, the drafter scaled and unscaled through the same
# steps (SharpDraft, window: DFlash's windowed block step) and with n-gram assist (hybrid);
# the slow tier (inductor) runs every mode the engine runs.
FAST_MODES = ("target", "sharpdraft", "window", "hybrid")


def check_family(engines, family, steps, device="cpu", only=None):
    eager = Engine(open_spec(engines[family], device=device))
    compiled = Engine(open_spec(engines[family], device=device, steps=steps))
    drafter = compiled.loaded.batch_drafter(compiled.scaling)
    assert type(drafter).__name__ == BATCH_ROLES[family]
    assert type(compiled.loaded.batch_target()).__name__ == "CompiledBatchTarget"
    alone, *batched = prompts(eager, [40, 70, 30, 90, 50])
    ran = 0
    for mode in compiled.spec.modes:
        if only is not None and mode not in only:
            continue
        for how in SAMPLINGS:
            if compiled.spec.batch_refusal(mode):
                continue
            try:
                want = decode(eager, mode, how, alone, batched)
            except ValueError:  # a mode that refuses to sample (a tree) refuses on both
                with pytest.raises(ValueError):
                    decode(compiled, mode, how, alone, batched)
                continue
            assert decode(compiled, mode, how, alone, batched) == want, (family, mode, how)
            ran += 1
    assert ran >= 4  # target-only and at least one drafter mode, greedy and seeded


@pytest.mark.parametrize("family", ["dflash", "pard", "eagle3"])
def test_compiled_batched_steps_decode_the_eager_tokens(engines, family):
    check_family(engines, family, "eager", only=FAST_MODES)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dflash", "pard", "eagle3"])
def test_inductor_batched_steps_decode_the_eager_tokens(engines, family):
    check_family(engines, family, "inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["dflash", "pard", "eagle3"])
def test_cuda_graphs_per_bucket_decode_the_eager_tokens(engines, family):
    check_family(engines, family, "cudagraph", device="cuda")


def test_the_batched_chain_steps_run_compiled_per_slot_and_width_bucket(engines, monkeypatch):
    """The PARD and EAGLE-3 batched drafters call their compiled steps (not the eager
    module) with slot counts 1, 2 and 4 as rows join: a graph per batch bucket."""
    from runtime.backends.pytorch import compiled

    calls, real = [], compiled.compile_step

    def recording(eager, static, device, backend="inductor"):
        step = real(eager, static, device, backend)

        def call(*args):
            calls.append((eager.__name__, tuple(args[0].shape)))
            return step(*args)
        return call

    monkeypatch.setattr(compiled, "compile_step", recording)
    for family, names in (("pard", {"pard_chain"}), ("eagle3", {"eagle3_ingest", "eagle3_link"})):
        engine = Engine(open_spec(engines[family], steps="eager"))
        batched = prompts(engine, [70, 30, 90, 50])
        requests = [Request(prompt=p, max_new_tokens=n) for p, n in zip(batched, BUDGETS)]
        engine.decoder("sharpdraft", adaptive=False).run(requests, join_at=JOIN_AT)
        for name in names:  # EAGLE-3: the ingest and the links, both compiled
            slots = {shape[0] for made_by, shape in calls if made_by == name}
            assert slots == {1, 2, 4}, (family, name, calls)
        calls.clear()


# -- trees packed over the slotted buffers (CompiledBatchTarget.verify_trees) ----------------

def random_tree(g: torch.Generator, vocab: int, size: int):
    """A draft tree of `size` nodes, each under a random earlier node, random tokens."""
    from runtime.tree import DraftTree

    tokens = torch.randint(0, vocab, (size,), generator=g).tolist()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, size)]
    return DraftTree(tuple(tokens), tuple(parents))


def deepest_path(tree) -> list[int]:
    """Root-first node indices down to the deepest node (what keep_paths may commit)."""
    node = max(range(len(tree)), key=lambda i: tree.depths[i])
    path = [node]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_batch_target_verifies_packed_trees_as_the_eager_one(batch):
    """Float64: CompiledBatchTarget's packed trees (each row's tree in its slot, idle
    slots padding) give TorchBatchTarget.verify_trees' logits and features and so the same
    accepted paths, step after step; the kept paths leave the keys a plain verify then
    reads (a third row joining between steps)."""
    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.backends.pytorch.compiled import CompiledBatchTarget, EngineSteps

    vocab, layers = 40, (0, 1)
    target = tiny.float64_target(seed=5, vocab=vocab, layers=2, context=256)
    eager = TorchBatchTarget(target, layers)
    # widths (1,): the two-token verify below runs the step eagerly (no graph to make)
    compiled = CompiledBatchTarget(EngineSteps(target, layers, widths=(1,), backend="eager"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (20, 37, 9)[:batch]]
    close = dict(rtol=0, atol=1e-10)
    joined = 0
    for step in range(3):
        while joined < len(prompts) and joined <= step:  # the rows join a step apart
            for role in (eager, compiled):
                role.add(prompts[joined], len(prompts[joined]) + 30)
            joined += 1
        trees = [random_tree(g, vocab, size) for size in (7, 3, 5)[:joined]]
        want, got = eager.verify_trees(trees), compiled.verify_trees(trees)
        for (wl, wf), (gl, gf), tree in zip(want, got, trees):
            torch.testing.assert_close(gl, wl, **close)
            torch.testing.assert_close(gf, wf, **close)
            assert tree.greedy_path(gl.argmax(-1).tolist()) == tree.greedy_path(wl.argmax(-1).tolist())
        paths = [deepest_path(tree) for tree in trees]
        eager.keep_paths(TokenRows.of(paths)), compiled.keep_paths(TokenRows.of(paths))
    rows = [[3, 4], [5, 6], [6, 7]][:batch]
    (wl, wf), (gl, gf) = eager.verify(TokenRows.of(rows)), compiled.verify(TokenRows.of(rows))
    for r, row in enumerate(rows):
        torch.testing.assert_close(gl[r, :len(row)], wl[r, :len(row)], **close)
        torch.testing.assert_close(gf[r, :len(row)], wf[r, :len(row)], **close)


@pytest.mark.parametrize("backend, batch", [("eager", 4), pytest.param("eager", 8, marks=pytest.mark.slow),
                                            pytest.param("inductor", 4, marks=pytest.mark.slow)])
def test_an_eagle3_tree_batch_drafts_and_decodes_on_the_compiled_steps(backend, batch, monkeypatch):
    """Float64 EAGLE-3 trees, rows joining and leaving, drafted on the compiled steps (the
    ingest, then one level step per tree level for every slot: CompiledBatchEagle3) and
    verified packed on CompiledBatchTarget: each row's tokens, accepted counts, N and
    beta per step are today's per-row drafting's (tests/tree_oracle.py on the eager
    batch target), and the tokens target-only's. Every level is one drafter call for
    the whole group, none per row."""
    from runtime import assembly
    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.backends.pytorch.compiled import CompiledBatchTarget, EngineSteps
    from runtime.modes import Mode
    from runtime.tree import TreeShape
    from tiny import float64_eagle3
    from tree_oracle import PerRowTrees

    target = tiny.float64_target(6, 40, layers=4, context=256)
    drafter = float64_eagle3(target, 7, (1, 2, 3))
    layers = drafter.config.feature_layers(target.config.num_layers)
    shape = TreeShape(2, 3, 6)
    scaling = QueryScaling(ref_keys=10, top_k=2, slope=2.0)
    steps = EngineSteps(target, layers, widths=(1, 4), backend=backend, drafter=drafter)
    g = torch.Generator().manual_seed(2)
    requests = [Request(prompt=torch.randint(0, 39, (int(n),), generator=g).tolist(), max_new_tokens=int(budget))
                for n, budget in zip(torch.randint(3, 40, (batch,), generator=g),
                                     torch.randint(8, 24, (batch,), generator=g))]
    join_at = [i // 2 for i in range(batch)]

    def run(batch_target, tree_drafter):
        roles = assembly.Roles("tree", batch_target, drafter=lambda setting: tree_drafter,
                               tree_shape=shape)
        decoder = assembly.decoder(roles, Mode.FROZEN)
        seqs = decoder.run(requests, join_at=join_at)
        return [(s.gen.tokens, s.gen.committed_per_step, s.gen.visible_per_step,
                 s.gen.beta_per_step) for s in seqs]

    want = run(lambda: TorchBatchTarget(target, layers), PerRowTrees(drafter, scaling, shape))
    compiled = steps.batch_eagle3(scaling, shape.depth, shape)
    levels = []
    level = compiled.level
    monkeypatch.setattr(compiled, "level", lambda *a: levels.append(a[0].shape) or level(*a))
    got = run(lambda: CompiledBatchTarget(steps), compiled)
    assert got == want
    assert max(max(s[1]) for s in got) > 1  # trees accepted drafts
    assert levels and all(s[1] == shape.top_k for s in levels)  # [slots, top_k]: every row at once
    assert max(s[0] for s in levels) >= batch // 2  # several rows in one level call
    plain, _ = run_target_only(target, requests)
    assert [s[0] for s in got] == plain


def run_target_only(target, requests):
    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.decode import Decoder
    from runtime.proposers import NoDrafts

    seqs = Decoder(TorchBatchTarget(target, ()), NoDrafts()).run(
        [Request(prompt=r.prompt, max_new_tokens=r.max_new_tokens) for r in requests])
    return [s.gen.tokens for s in seqs], None


# -- the joining sequence held aside: prefill in parts, snapshot, restore, join -----------

@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_held_prefill_joins_whole_or_restored_from_its_snapshot_as_often_as_asked(compiled):
    """TorchBatchTarget / CompiledBatchTarget (float64): a prompt prefilled in two parts
    (prefill, prefill_more) gives the last logits and features of one add(); its snapshot,
    taken before it joins, restores into two more rows (a step of the batch between them),
    and all three rows verify as a row that joined whole."""
    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.backends.pytorch.compiled import CompiledBatchTarget, EngineSteps

    target = tiny.float64_target(seed=8, vocab=40, layers=2, context=256)
    layers = (0, 1)

    def make():  # widths (1,): the verifies below, two tokens or more, make no graph
        if compiled:
            return CompiledBatchTarget(EngineSteps(target, layers, widths=(1,), backend="eager"))
        return TorchBatchTarget(target, layers)

    prompt = [(5 * i + 3) % 40 for i in range(30)]
    whole, held = make(), make()
    want_logits, want_features = whole.add(prompt, 60)
    first_logits, first_features = held.prefill(prompt[:12], 60)
    logits, features = held.prefill_more(prompt[12:])
    close = dict(rtol=0, atol=1e-10)
    torch.testing.assert_close(logits, want_logits, **close)
    torch.testing.assert_close(torch.cat([first_features, features]), want_features, **close)
    snap = held.snapshot()
    held.join_prefilled()
    held.verify(TokenRows.of([[7, 8]]))  # the batch steps: the snapshot stays as taken
    for _ in range(2):
        held.restore(snap)
        held.join_prefilled()
    rows = [[9, 10]] * 3
    got, _ = held.verify(TokenRows.of(rows))
    want, _ = whole.verify(TokenRows.of([[9, 10]]))
    torch.testing.assert_close(got[1], want[0], **close)
    torch.testing.assert_close(got[2], want[0], **close)
    # the first row stepped once more: it verifies [7, 8, 9, 10] as the whole one would
    again = make()
    again.add(prompt, 60)
    want, _ = again.verify(TokenRows.of([[7, 8, 9, 10]]))
    held.rollback([32, 30, 30])
    got, _ = held.verify(TokenRows.of([[9, 10], [9, 10], [9, 10]]))
    torch.testing.assert_close(got[0], want[0, 2:], **close)


@pytest.mark.slow  # an engine of its own to build (the fast tier: the float64 tree tests above)
def test_an_eagle3_tree_engine_with_steps_verifies_its_trees_packed_on_the_compiled_batch_target(
        tmp_path, tiny_target):
    """An EAGLE-3 tree engine loaded with steps: its batch decoder verifies trees on
    CompiledBatchTarget itself (no target per row), four requests joining and leaving
    decode the eager engine's tokens and accepted counts."""
    from runtime.backends.pytorch.compiled import CompiledBatchTarget

    eagle3 = tiny.make_eagle3(tmp_path / "eagle3", tiny_target, draft_vocab=200)
    build(["--drafter", "eagle3", "--sharpdraft", "--ref-keys", "64", "--top-k", "8",
           "--backend", "torch", "--target", str(tiny_target), "--drafter-checkpoint", str(eagle3),
           "--tree-top-k", "2", "--tree-depth", "3", "--tree-total-tokens", "8",
           "--output", str(tmp_path / "engine")])
    eager, compiled = Engine(open_spec(tmp_path / "engine")), Engine(open_spec(tmp_path / "engine", steps="eager"))
    decoder = compiled.decoder("sharpdraft", adaptive=False)
    assert type(decoder.target) is CompiledBatchTarget
    batched = prompts(eager, [70, 30, 90, 50])
    got = decoder.run([Request(prompt=p, max_new_tokens=n) for p, n in zip(batched, BUDGETS)], join_at=JOIN_AT)
    want = eager.decoder("sharpdraft", adaptive=False).run(
        [Request(prompt=p, max_new_tokens=n) for p, n in zip(batched, BUDGETS)], join_at=JOIN_AT)
    assert [outcome(s.gen) for s in got] == [outcome(s.gen) for s in want]
