"""Batching changes nothing a request sees: in-flight batched decoding gives every
sequence its own single-sequence output (greedy: token for token; sampling: the same
tokens for the same seed, and the target's law), with its own beta per row."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, law_runs

from plugins.scaling import QueryScaling
from runtime.backends.pytorch import TorchBatchDFlash, TorchBatchTarget
from runtime.decode import DraftKind, Request
from runtime.sampling import Sampler, Sampling
from speculative import batch_decoder, generate_batch, generate_block, generate_target_only
from runtime.step_costs import StepCosts

from exact_law import chi_square_p, exact_first_tokens
from test_speculative import runners, tiny_pair

SCALING = QueryScaling(ref_keys=12, top_k=4, slope=2.0)


def batched(target, drafter, scaling, window=None):
    return (TorchBatchTarget(target, drafter.config.target_layer_ids),
            TorchBatchDFlash(drafter, target, scaling, window))


def alone(target, drafter, scaling, request, costs=None, window=None):
    t, d = runners(target, drafter, scaling, window)
    return generate_block(t, d, request.prompt, request.max_new_tokens,
                          Sampler(request.sampling), request.stop_ids, costs=costs)


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([6, 12, 40]), block=st.integers(2, 6),
       shapes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30), st.booleans(),
                                 st.integers(0, 6)), min_size=1, max_size=5),
       scaled=st.booleans(), max_batch=st.sampled_from([None, 1, 2, 3]),
       adaptive=st.booleans(), window=st.sampled_from([None, 1, 4, 12]))
def test_batched_greedy_equals_each_sequence_alone(seed, vocab, block, shapes, scaled,
                                                   max_batch, adaptive, window):
    """Different prompt lengths, budgets, stop tokens and join steps; sequences leave as
    they finish and wait for a free row under max_batch; with a draft window, one batched
    drafter pass gives each row the last `window` of its own context keys (the window
    modes, fused), the per-row windowed drafter's tokens, N and beta."""
    target, drafter = tiny_pair(seed, vocab, block)
    scaling = SCALING if scaled else None
    g = torch.Generator().manual_seed(seed)
    requests = [Request(prompt=torch.randint(0, vocab, (n,), generator=g).tolist(), max_new_tokens=new,
                        stop_ids=frozenset({0}) if stop else frozenset())
                for n, new, stop, _ in shapes]
    join_at = [j for *_, j in shapes]
    costs = StepCosts((1.0, 0.5, 0.0, 0.0), (0.2, 0.0)) if adaptive else None
    got = generate_batch(*batched(target, drafter, scaling, window), requests, costs, max_batch,
                         join_at)
    for request, seq in zip(requests, got):
        want = alone(target, drafter, scaling, request, costs, window)
        assert seq.gen.tokens == want.tokens
        assert seq.gen.committed_per_step == want.committed_per_step
        assert seq.gen.visible_per_step == want.visible_per_step
        assert seq.gen.beta_per_step == want.beta_per_step


@settings(max_examples=examples(10), deadline=None)
@given(seed=st.integers(0, 10**6), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_batched_target_only_equals_target_only(seed, lengths):
    target, drafter = tiny_pair(seed, 12, 3)
    g = torch.Generator().manual_seed(seed)
    requests = [Request(prompt=torch.randint(0, 12, (n,), generator=g).tolist(), max_new_tokens=25 - n) for n in lengths]
    got = generate_batch(TorchBatchTarget(target, ()), None, requests)
    for request, seq in zip(requests, got):
        t, _ = runners(target, drafter, None)
        assert seq.gen.tokens == generate_target_only(t, request.prompt, request.max_new_tokens,
                                                      Sampler()).tokens


def test_each_sequence_of_one_drafter_call_gets_its_own_beta(monkeypatch):
    """One batched call: the op is handed each sequence's N on its rows (not the longest);
    the prompts' capacities share a bucket (capacity_bucket), so one pass holds all three."""
    from runtime.models.layers import KVCache

    handed = []
    attend_block = KVCache.attend_block  # hands the counts to the op as they are

    def recording(self, layer, start, q, k, v, visible, scaling, probe=None, window=None):
        handed.append(visible.clone())
        return attend_block(self, layer, start, q, k, v, visible, scaling, probe, window)

    target, drafter = tiny_pair(3, vocab=12, block=4)
    t, d = batched(target, drafter, SCALING)
    prompts = [[1, 2] * 7, list(range(1, 12)) * 2, [5] * 30]
    decoder = batch_decoder(t, d)
    for p in prompts:
        decoder.add(Request(prompt=p, max_new_tokens=20))
    monkeypatch.setattr(KVCache, "attend_block", recording)
    decoder.step()
    rows = handed[0]
    assert rows.shape == (3, 4)
    for i, p in enumerate(prompts):  # context (the prompt) + the block, bidirectional
        assert rows[i].tolist() == [len(p) + 4] * 4
    betas = [s.gen.beta_per_step[0] for s in decoder.active]
    assert betas == [SCALING.beta(len(p) + 4) for p in prompts] and len(set(betas)) == 3


@pytest.mark.parametrize("window", [None, 10])
def test_batched_drafter_call_equals_separate_single_sequence_calls(window):
    """Logits of each row of one batched drafter step (torch op) equal that sequence's own
    step alone (a batch of one), at three different cached lengths and context lengths;
    under a draft window of 10 the first row sees all its context and the others only
    their own last 10 keys, each row's N (what it reports alone) unchanged."""
    target, drafter = tiny_pair(5, vocab=40, block=4)
    _, batch = batched(target, drafter, SCALING, window)
    g = torch.Generator().manual_seed(0)
    features = [torch.randn(n, drafter.fc.in_features, generator=g, dtype=torch.float64)
                for n in (3, 17, 40)]
    news = [torch.randn(c, drafter.fc.in_features, generator=g, dtype=torch.float64)
            for c in (1, 4, 2)]
    want = []
    for f, new, bonus in zip(features, news, (5, 6, 7)):
        _, alone = batched(target, drafter, SCALING, window)
        alone.add(64, f, 0)
        logits, visible = alone.draft([new], [bonus])
        want.append((logits[0], int(visible[0])))
        batch.add(64, f, 0)
    logits, visible = batch.draft(news, [5, 6, 7])
    assert visible.tolist() == [w[1] for w in want] == [3 + 1 + 4, 17 + 4 + 4, 40 + 2 + 4]
    for i, (w, _) in enumerate(want):
        torch.testing.assert_close(logits[i], w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [None, 6])
def test_a_drafter_set_aside_does_not_run_and_reads_what_it_missed_when_it_drafts_again(window):
    """Steps that set the drafter's drafts aside (the served default under load,
    Decoder.step's aside) run no drafter pass; the first step that drafts again has
    its rows read the features they missed first, a block at a time, and then drafts
    what a drafter that ran every step (its drafts dropped) drafts: same N, same logits
    (float64), same tokens committed."""
    target, drafter = tiny_pair(11, vocab=40, block=4)
    g = torch.Generator().manual_seed(3)
    requests = [Request(prompt=torch.randint(0, 40, (n,), generator=g).tolist(), max_new_tokens=30)
                for n in (5, 20, 9)]
    aside = frozenset({DraftKind.GREEDY, DraftKind.SAMPLED, DraftKind.ONE_HOT})

    def run(drafter_ignores_aside: bool):
        batch_target, batch_drafter = batched(target, drafter, SCALING, window)
        decoder = batch_decoder(batch_target, batch_drafter)
        if drafter_ignores_aside:  # as before: it drafts every step, the step drops them
            propose = decoder.proposer.propose
            decoder.proposer.propose = lambda batch, aside=frozenset(): propose(batch)
        for request in requests:
            decoder.add(request)
        passes, draft = [], batch_drafter.draft
        batch_drafter.draft = lambda *a: passes.append(draft(*a)) or passes[-1]
        for _ in range(7):  # 7 plain decode steps: 7 unread feature rows per row (> a block)
            decoder.step(aside)
        set_aside = len(passes)
        decoder.step()
        return set_aside, passes[set_aside:], [s.gen.tokens for s in decoder.active]

    skipped, every_step = run(False), run(True)
    assert skipped[0] == 0 and every_step[0] == 7
    assert len(skipped[1]) == 2 and len(every_step[1]) == 1  # a block of catch-up, then the draft
    (logits, visible), (want_logits, want_visible) = skipped[1][-1], every_step[1][0]
    assert visible.tolist() == want_visible.tolist()
    torch.testing.assert_close(logits, want_logits, atol=1e-10, rtol=0)
    assert skipped[2] == every_step[2]


@pytest.mark.parametrize("family", ["pard", "eagle3"])
def test_a_chain_drafter_set_aside_only_reads(family):
    """A chain drafter under a step that sets its drafts aside still reads every row's
    new tokens (its cache follows them) but drafts one token, not K; the step after
    drafts as a drafter that drafted K every step does (same N, float64 logits equal),
    and the tokens are the same."""
    from runtime.backends.pytorch import TorchBatchEagle3, TorchBatchPARD
    from speculative import chain_batch_decoder
    from test_eagle3 import eagle_pair
    from tiny import float64_pard, float64_target

    if family == "pard":
        target, drafter = float64_target(4, 40, context=256), float64_pard(5, 40, context=256)
        roles = lambda: (TorchBatchTarget(target, ()), TorchBatchPARD(drafter, 40, 3, SCALING))
    else:
        target, drafter = eagle_pair(6, 40)
        layers = drafter.config.feature_layers(target.config.num_layers)
        roles = lambda: (TorchBatchTarget(target, layers), TorchBatchEagle3(drafter, SCALING, 3))
    g = torch.Generator().manual_seed(4)
    requests = [Request(prompt=torch.randint(0, 40, (n,), generator=g).tolist(), max_new_tokens=30) for n in (6, 17)]
    aside = frozenset({DraftKind.GREEDY, DraftKind.SAMPLED, DraftKind.ONE_HOT})
    runs = []
    for drafter_ignores_aside in (False, True):
        decoder = chain_batch_decoder(*roles())
        if drafter_ignores_aside:
            propose = decoder.proposer.propose
            decoder.proposer.propose = lambda batch, aside=frozenset(), p=propose: p(batch)
        for request in requests:
            decoder.add(request)
        batch_drafter, ks, drafts = decoder.proposer.drafter, [], []
        draft = batch_drafter.draft

        def counting(ids, features, k, samplers, draft=draft):
            ks.append(list(k))
            drafts.append(draft(ids, features, k, samplers))
            return drafts[-1]

        batch_drafter.draft = counting
        for _ in range(5):
            decoder.step(aside)
        decoder.step()
        runs.append((ks, drafts[-1], [s.gen.tokens for s in decoder.active]))
    (ks, last, tokens), (want_ks, want_last, want_tokens) = runs
    assert ks == [[1, 1]] * 5 + [[3, 3]] and want_ks == [[3, 3]] * 6
    for got, want in zip(last, want_last):
        assert got.tokens == want.tokens and got.visible.tolist() == want.visible.tolist()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-10, rtol=0)
    assert tokens == want_tokens


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch():
    target, drafter = tiny_pair(7, vocab=12, block=4, sharpness=1.5)
    sampling = [Sampling(0.8, 0.9, seed=s) for s in (1, 2, 3)]
    requests = [Request(prompt=p, max_new_tokens=30, sampling=s) for p, s in zip([[1, 2], [3] * 9, [4, 5, 6, 7]], sampling)]
    got = generate_batch(*batched(target, drafter, SCALING), requests, join_at=[0, 2, 1])
    for request, seq in zip(requests, got):
        assert seq.gen.tokens == alone(target, drafter, SCALING, request).tokens
    assert len({tuple(s.gen.tokens) for s in got}) == 3


@pytest.mark.slow  # the fast tier: test_pard.py's law through batched chains
# (test_speculative_sampling_through_batched_chains_preserves_the_target_distribution)
def test_batched_speculative_sampling_preserves_the_target_distribution():
    """The chi-square check of tests/test_speculative.py through the batched executor:
    the sequence under test shares every step with two others at other lengths. The
    drafter is the batched windowed one (a window of 2 keys cuts every row's context,
    each at its own length) under beta: the window modes' fused drafter, at no extra run."""
    vocab, draws = 4, law_runs(4_000)
    target, drafter = tiny_pair(11, vocab, block=4, sharpness=1.5)
    prompt = [1, 2, 0]
    probe = Sampler(Sampling(temperature=0.8, top_p=0.9))
    expected = exact_first_tokens(target, prompt, probe, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    first_step = Counter()
    t, d = batched(target, drafter, QueryScaling(ref_keys=8, top_k=2, slope=2.0), window=2)
    for i in range(draws // 4):
        decoder = batch_decoder(t, d)
        seqs = [decoder.add(Request(prompt=p, max_new_tokens=4, sampling=Sampling(0.8, 0.9, seed=i * 8 + j)))
                for j, p in enumerate([prompt, [3, 1, 2, 2, 1, 0, 3], prompt, [2], prompt, prompt])]
        while decoder.active:
            decoder.step()
        for seq in (seqs[0], seqs[2], seqs[4], seqs[5]):
            t1, t2, t3 = seq.gen.tokens[:3]
            counts[(t1 * vocab + t2) * vocab + t3] += 1
            first_step[seq.gen.committed_per_step[0]] += 1
    assert all(first_step[n] > 0.02 * draws for n in (1, 2, 3)), first_step
    assert chi_square_p(counts, expected) > 0.001


@pytest.mark.parametrize("bad", ["empty", "long", "budget"])
def test_bad_input_in_a_batch_fails_that_request_alone(bad):
    target, drafter = tiny_pair(2, vocab=12, block=4)  # context 128
    prompt = {"empty": [], "long": [1] * 200, "budget": [1, 2]}[bad]
    requests = [Request(prompt=[1, 2, 3], max_new_tokens=20), Request(prompt=prompt, max_new_tokens=0 if bad == "budget" else 5),
                Request(prompt=[4, 5], max_new_tokens=20)]
    got = generate_batch(*batched(target, drafter, SCALING), requests, join_at=[0, 1, 1])
    assert got[1].error and not got[1].gen.tokens
    for i in (0, 2):
        assert got[i].error is None
        assert got[i].gen.tokens == alone(target, drafter, SCALING, requests[i]).tokens


def test_a_drafter_the_step_costs_sit_out_runs_no_pass(monkeypatch):
    """Where the measured costs say the drafter loses at every context (here a drafter
    pass costs 100 verify passes), every row sits it out and the fused drafter runs no pass
    at all (it did before, paying for drafts nobody verified: why the demo's drafter modes
    ran below target-only); the tokens are target-only's."""
    target, drafter = tiny_pair(3, 12, block=4)
    passes = []
    draft = TorchBatchDFlash.draft
    monkeypatch.setattr(TorchBatchDFlash, "draft", lambda self, contexts, bonuses: passes.append(
        len(contexts)) or draft(self, contexts, bonuses))
    costs = StepCosts((1.0, 0.0, 0.0, 0.0), (100.0, 0.0))
    requests = [Request(prompt=[1, 2, 3], max_new_tokens=12), Request(prompt=[4, 5], max_new_tokens=9)]
    got = generate_batch(*batched(target, drafter, SCALING), requests, costs=costs)
    assert passes == []
    for seq, request in zip(got, requests):
        only = TorchBatchTarget(target, drafter.config.target_layer_ids)
        assert seq.gen.tokens == generate_target_only(only, request.prompt, request.max_new_tokens,
                                                      Sampler()).tokens
        assert seq.gen.drafted_steps == 0 and seq.gen.ngram_steps == seq.gen.verify_steps
    # and where drafting is free, the drafter drafts
    generate_batch(*batched(target, drafter, SCALING), requests,
                   costs=StepCosts((1.0, 0.0, 0.0, 0.0), (0.0, 0.0)))
    assert passes
