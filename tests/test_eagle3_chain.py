"""EAGLE-3 with top_k = 1 drafts a chain and runs in speculative.generate_chain (the
loop PARD shares): greedy output equals target-only output token for token, with and
without SharpDraft, and speculative sampling leaves the target's law unchanged."""


import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, law_runs

from runtime.backends.roles import TokenRows
import runtime.models.eagle3 as eagle3
from plugins.attention import sharpdraft_attention
from plugins.scaling import QueryScaling
from runtime.backends.pytorch import TorchBatchEagle3, TorchBatchTarget
from runtime.decode import Request
from runtime.sampling import Sampler, Sampling
from speculative import (assert_batched_as_alone, chain_batch_decoder, generate_chain,
                         generate_target_only)
from runtime.step_costs import StepCosts

from exact_law import assert_batched_chains_keep_the_law
from test_eagle3 import eagle_pair


def chain_runners(target, drafter, scaling, k):
    layers = drafter.config.feature_layers(target.config.num_layers)
    return TorchBatchTarget(target, layers), TorchBatchEagle3(drafter, scaling, k)


def batched(target, drafter, scaling, k, costs=None):
    """A decoder whose batch grows every row's chain in one drafter pass per link."""
    layers = drafter.config.feature_layers(target.config.num_layers)
    return chain_batch_decoder(TorchBatchTarget(target, layers),
                               TorchBatchEagle3(drafter, scaling, k), costs)


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]), k=st.integers(1, 6),
       prompt_len=st.integers(1, 24), max_new=st.integers(1, 40), scaled=st.booleans(),
       stop=st.booleans(), reduced_vocab=st.booleans(), eagle31=st.booleans(),
       per_token=st.one_of(st.none(), st.floats(0.0, 2.0)))
def test_greedy_chain_speculation_equals_target_only(seed, vocab, k, prompt_len, max_new, scaled,
                                                     stop, reduced_vocab, eagle31, per_token):
    target, drafter = eagle_pair(seed % 5000, vocab, vocab // 2 if reduced_vocab else None, eagle31)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if scaled else None
    t, d = chain_runners(target, drafter, scaling, k)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    stop_ids = frozenset({0}) if stop else frozenset()
    # per_token: adaptive draft length under a verify cost of 1 + per_token * tokens
    costs = None if per_token is None else StepCosts((1.0, per_token, 0.0, 0.0), (0.2, 0.0))
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_chain(t, d, prompt, max_new, Sampler(), stop_ids, costs=costs)
    assert got.tokens == want.tokens
    if got.stopped_by == "length":
        assert sum(got.committed_per_step) + 1 == len(got.tokens)
    assert all(1 <= c <= k + 1 for c in got.committed_per_step)
    # batched beside a sequence at another length that joins a step later
    other = [(seed + i) % vocab for i in range(prompt_len + 5)]
    together = batched(target, drafter, scaling, k, costs).run(
        [Request(prompt=prompt, max_new_tokens=max_new, stop_ids=stop_ids), Request(prompt=other, max_new_tokens=max_new)], join_at=[0, 1])
    assert_batched_as_alone(together, got, t, other, max_new)  # and so want's tokens


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch():
    target, drafter = eagle_pair(7, 12, 8, sharpness=1.5)
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    requests = [Request(prompt=p, max_new_tokens=30, sampling=Sampling(0.8, 0.9, seed=s))
                for s, p in enumerate([[1, 2], [3] * 9, [4, 5, 6, 7]], start=1)]
    got = batched(target, drafter, scaling, 3).run(requests, join_at=[0, 2, 1])
    for request, seq in zip(requests, got):
        t, d = chain_runners(target, drafter, scaling, 3)
        alone = generate_chain(t, d, request.prompt, 30, Sampler(request.sampling))
        assert seq.gen.tokens == alone.tokens
        assert seq.gen.committed_per_step == alone.committed_per_step
    assert len({tuple(s.gen.tokens) for s in got}) == 3
    assert max(max(s.gen.committed_per_step) for s in got) > 1  # drafts were accepted


def test_the_chain_check_exercises_acceptance():
    accepted = []
    for seed in range(8):
        target, drafter = eagle_pair(seed, vocab=4)
        t, d = chain_runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0), 5)
        accepted.append(generate_chain(t, d, [1, 2, 3], 40, Sampler()).mean_accepted_length)
    assert max(accepted) > 1.5, accepted


def test_chain_rows_are_causal_and_report_their_own_visible_keys(monkeypatch):
    """Recorded at the op: c context rows see 1..c keys, chain row i sees c + i + 1; the
    ChainDraft's visible counts are those of the rows each draft came from."""
    handed = []

    def recording(q, k, v, visible, scaling=None, mask=None):
        handed.append((visible.clone(), mask, scaling))
        return sharpdraft_attention(q, k, v, visible, scaling, mask)

    monkeypatch.setattr(eagle3, "sharpdraft_attention", recording)
    target, drafter = eagle_pair(3, vocab=12)
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    d = TorchBatchEagle3(drafter, scaling, 4)
    d.add(30, [], None)  # a row with nothing read yet
    c = 7
    features = torch.randn(c, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    draft, = d.draft(TokenRows.of([list(range(c + 1))]), [features], [4], [Sampler()])
    assert [h[1] for h in handed] == [None] * 4 and all(h[2] is scaling for h in handed)
    assert handed[0][0][0].tolist() == list(range(1, c + 1))
    assert [int(h[0][0, 0]) for h in handed[1:]] == [c + 1, c + 2, c + 3]
    assert draft.visible.tolist() == [c, c + 1, c + 2, c + 3]
    assert d.caches.groups[0].cache.lengths.tolist() == [c]  # the chain's rows are scratch
    assert len(draft.tokens) == 4 and draft.probs is None and draft.logits.shape == (4, 12)


# Slow: the chain loop's law stays in the fast tier through PARD's chain
# (test_pard.py), the verifier's with a q that has zeros through test_rejection_law.py.
@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", [None, 3])
def test_chain_sampling_preserves_the_target_distribution(draft_vocab):
    """20k runs (temperature 0.8, top-p 0.9) against the exact law of the first three
    tokens: the prefill's token, then a step drafting 2 tokens autoregressively, each
    drawn from the drafter's own distribution. With a draft vocabulary of 3 of the 4
    tokens, the fourth (draft probability 0) still comes out at its target rate. Through
    the batched chain drafter: eight sequences under test share every drafter pass with
    one at another length."""
    vocab, draws = 4, law_runs(20_000)
    target, drafter = eagle_pair(11, vocab, draft_vocab, sharpness=1.5)
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    assert_batched_chains_keep_the_law(target, lambda: batched(target, drafter, scaling, 2), draws, vocab)
