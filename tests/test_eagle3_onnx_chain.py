"""EAGLE-3 chains (top_k 1) and trees batched on ONNX Runtime (OnnxBatchEagle3): the drafter's two
graphs take each sequence's committed length, past_lens [batch] (build/export.py:
Eagle3Step, Eagle3TreeStep, PARD's form), so one run of the step graph ingests every
row's new entries and one run of the tree graph per chain link grows every row's chain,
each row at its own length, N and beta: it drafts what each row drafts alone and what
torch drafts; greedy batched decoding is target-only's, and speculative sampling through
it keeps the target's law. Trees grow one tree-graph run per level for every row, as
today's per-row drafting grew them (tests/tree_oracle.py). The graphs are exported here from a tiny drafter, without
building an engine; the engine-level checks are tests/test_eagle3_onnx.py's."""

import copy

import pytest
import torch
from tiers import law_runs

from build import export
from runtime.backends.roles import TokenRows
from plugins.scaling import QueryScaling
from runtime.backends.onnxruntime import (OnnxBatchEagle3, open_session,
                                          takes_lengths)
from runtime.backends.pytorch import TorchBatchEagle3, TorchBatchTarget
from runtime.decode import Request
from runtime.sampling import Sampler
from runtime.tree import TreeShape
from speculative import (assert_batched_as_alone, assert_trees_draft_as_per_row,
                         chain_batch_decoder, drafter_passes, generate_chain,
                         generate_target_only, run_counting_passes)

from exact_law import assert_batched_chains_keep_the_law
from test_eagle3 import eagle_pair

# The full tier (make test-all): two more exports, ~9 s. The fast tier's cover: EAGLE-3
# chains and trees on torch, batched and alone, greedy and sampled (test_eagle3_chain.py,
# test_eagle3.py) and on compiled steps (test_compiled_batched.py's tree batch).
pytestmark = pytest.mark.slow

K = 2  # drafts per chain: the law test's step of up to 2 drafts
SCALING = QueryScaling(ref_keys=8, top_k=2, slope=2.0)  # beta > 1 past 8 keys
CHAIN = TreeShape(top_k=1, depth=K, total_tokens=K + 1)


@pytest.fixture(scope="module")
def pair():
    """A float64 target with its EAGLE-3 drafter (a draft vocabulary of 3 of its 4 tokens,
    near enough to the target that drafts are accepted and rejected), and the drafter in
    float32, the precision its graphs run in."""
    target, drafter = eagle_pair(11, 4, 3, sharpness=1.5)
    return target, drafter, copy.deepcopy(drafter).float()


@pytest.fixture(scope="module")
def graphs(pair, tmp_path_factory):
    """The SharpDraft step and tree graphs of the drafter, native form."""
    out = tmp_path_factory.mktemp("eagle3-graphs")
    drafter = pair[2]
    export.export_eagle3(drafter, SCALING, "native", out / "drafter.onnx")
    export.export_eagle3_tree(drafter, SCALING, out / "drafter-tree.onnx")
    return open_session(out / "drafter.onnx"), open_session(out / "drafter-tree.onnx")


def onnx_batch(graphs):
    return OnnxBatchEagle3(*graphs, SCALING, CHAIN, K)


class Recorded:
    """A session whose runs are recorded by name."""

    def __init__(self, name, session, runs):
        self.name, self.session, self.runs = name, session, runs

    def run(self, *args, **kwargs):
        self.runs.append(self.name)
        return self.session.run(*args, **kwargs)


def layers_of(target, drafter):
    return drafter.config.feature_layers(target.config.num_layers)


def test_the_graphs_take_each_sequences_committed_length(graphs):
    step, tree = graphs
    assert takes_lengths(step) and takes_lengths(tree)
    assert "context_lens" in [i.name for i in step.get_inputs()]


def test_one_run_per_chain_link_drafts_what_each_row_drafts_alone_and_on_torch(pair, graphs,
                                                                                monkeypatch):
    """Three rows at 20, 7 and 33 committed entries reading 3, 1 and 4 new ones, chains of
    2, 1 and 2 drafts: one step-graph run and one tree-graph run for the second link,
    and each row's drafts, logits and N are its own alone (a batch of one) on ONNX Runtime
    and on torch; the
    rows' entries stay committed, their chains' keys do not."""
    _, _, drafter = pair
    g = torch.Generator().manual_seed(0)
    lengths, news, ks = [20, 7, 33], [3, 1, 4], [2, 1, 2]
    features = [torch.randn(n + c, drafter.fc.in_features, generator=g)
                for n, c in zip(lengths, news)]
    ids = [torch.randint(0, 4, (n + c + 1,), generator=g).tolist() for n, c in zip(lengths, news)]
    batch = onnx_batch(graphs)
    for f, i, n in zip(features, ids, lengths):
        batch.add(80, i[:n + 1], f[:n])
    runs = []
    for name in ("step_session", "tree_session"):
        monkeypatch.setattr(batch, name, Recorded(name, getattr(batch, name), runs))
    got = batch.draft(TokenRows.of(ids), [f[n:] for f, n in zip(features, lengths)], ks, [Sampler()] * 3)
    assert runs == ["step_session", "tree_session"]  # not one per row
    assert batch.lengths == [n + c for n, c in zip(lengths, news)]
    for r, (f, i, n, k) in enumerate(zip(features, ids, lengths, ks)):
        single, reference = onnx_batch(graphs), TorchBatchEagle3(drafter, SCALING, K)
        for d in (single, reference):
            d.add(80, i[:n + 1], f[:n])
        want, = single.draft(TokenRows.of([i]), [f[n:]], [k], [Sampler()])
        theirs, = reference.draft(TokenRows.of([i]), [f[n:]], [k], [Sampler()])
        assert got[r].tokens == want.tokens == theirs.tokens
        assert got[r].visible.tolist() == want.visible.tolist() == theirs.visible.tolist() \
            == list(range(len(i) - 1, len(i) - 1 + k))  # N = entries + link + 1
        torch.testing.assert_close(got[r].logits, want.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[r].logits, theirs.logits, atol=1e-4, rtol=1e-4)
    assert len({SCALING.beta(int(d.visible[0])) for d in got}) == 3  # each row its own beta


def test_a_chunked_prompt_is_read_a_part_at_a_time(pair, graphs):
    """OnnxBatchEagle3 under a chunked join: the drafter reads each chunk right after the
    target's (each chunk's newest feature row held for the next), none in the join's last
    part, and drafts as after one read (float32 graphs: within 1e-5)."""
    from runtime.sampling import Sampling
    from speculative import assert_chunked_join_drafts_as_whole

    target = pair[0]
    layers = layers_of(target, pair[1])
    prompt = [(3 * i + i // 5) % 4 for i in range(40)]
    assert_chunked_join_drafts_as_whole(
        lambda: chain_batch_decoder(TorchBatchTarget(target, layers), onnx_batch(graphs)), prompt,
        8, Sampling(1.0, 1.0, seed=3), 1e-5, OnnxBatchEagle3)


def test_greedy_batched_chains_decode_as_alone_and_as_the_target(pair, graphs, monkeypatch):
    """A sequence beside one at another length that joins a step later (and a one-token
    prompt, whose drafter has read nothing, two steps later): the batch grows every chain
    in K drafter runs a step (the step graph, then a tree-graph run per later link), and
    the sequence decodes its tokens, N and beta alone (greedy: target-only's)."""
    target, _, _ = pair
    layers = layers_of(target, pair[1])
    prompt, other = [1, 2, 0, 3, 1, 1, 2, 0, 3, 2], [3, 1, 2, 2, 1, 0, 3, 3, 0, 1, 2, 1, 0, 2]
    alone = generate_chain(TorchBatchTarget(target, layers), onnx_batch(graphs), prompt, 30, Sampler())
    decoder = chain_batch_decoder(TorchBatchTarget(target, layers), onnx_batch(graphs))
    assert decoder.proposer.drafter.fused
    seqs = [decoder.add(Request(prompt=prompt, max_new_tokens=30))]
    counts = drafter_passes(decoder, monkeypatch)
    decoder.step()
    seqs.append(decoder.add(Request(prompt=other, max_new_tokens=30)))
    decoder.step()
    short = decoder.add(Request(prompt=[2], max_new_tokens=20))
    passes = run_counting_passes(decoder, counts)
    assert max(passes) == K and passes.count(K) > 3, passes
    assert_batched_as_alone(seqs, alone, TorchBatchTarget(target, layers), other, 30)
    assert short.gen.tokens == generate_target_only(TorchBatchTarget(target, layers), [2], 20,
                                                    Sampler()).tokens
    assert max(alone.committed_per_step) > 1  # drafts were accepted


def test_speculative_sampling_through_batched_onnx_chains_preserves_the_target_distribution(
        pair, graphs):
    """Runs (temperature 0.8, top-p 0.9) against the exact law of the first three tokens:
    the prefill's token, then a step drafting 2 tokens autoregressively on ONNX Runtime,
    each drawn from the drafter's own distribution (the fourth token, outside the draft
    vocabulary, still comes out at its target rate), each outcome of the step exercised.
    Eight sequences under test share every drafter run with one at another length."""
    target, drafter, _ = pair
    vocab, draws = 4, law_runs(20_000)
    layers = layers_of(target, drafter)
    assert_batched_chains_keep_the_law(target, lambda: chain_batch_decoder(TorchBatchTarget(target, layers), onnx_batch(graphs)), draws, vocab)


TREE = TreeShape(top_k=3, depth=4, total_tokens=12)


@pytest.mark.parametrize("batch", [1, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_batch_of_trees_drafts_one_run_per_level_as_per_row_drafting_did(pair, graphs, batch,
                                                                           monkeypatch):
    """Rows at different lengths (some joining a step later), each with its own budget (so
    its trees shorten near its end): one step-graph run and one tree-graph run per level
    for every row, and every row's tokens, accepted counts, N and beta per step are
    today's per-row drafting's on the same float32 weights in torch."""
    from tree_oracle import PerRowTrees

    target, _, drafter = pair
    layers = layers_of(target, pair[1])
    g = torch.Generator().manual_seed(batch)
    requests = [Request(prompt=torch.randint(0, 4, (int(n),), generator=g).tolist(), max_new_tokens=int(budget))
                for n, budget in zip(torch.randint(1, 40, (batch,), generator=g),
                                     torch.randint(4, 24, (batch,), generator=g))]
    got = assert_trees_draft_as_per_row(lambda: TorchBatchTarget(target, layers),
                                        OnnxBatchEagle3(*graphs, SCALING, TREE, K),
                                        PerRowTrees(drafter, SCALING, TREE), TREE, requests,
                                        monkeypatch, join_at=[i % 2 for i in range(batch)])
    assert max(max(accepted) for _, accepted, _, _ in got) > 2  # whole paths accepted
    assert max(beta for *_, betas in got for beta in betas) > 1.0  # scaled rows
