"""Lossless means lossless: greedy speculative output equals target-only greedy output
token for token, and speculative sampling leaves the target's distribution unchanged --
for the drafter's blocks alone and with n-gram lookup assisting it (hybrid)."""

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, law_runs

from plugins.scaling import QueryScaling
from runtime.backends import PrefillOnce
from runtime.backends.pytorch import TorchBatchDFlash, TorchBatchTarget
from runtime.models.dflash import DFlashConfig, DFlashDrafter
from runtime.models.target import TargetConfig, TargetModel
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling
from speculative import generate_block, generate_target_only
from runtime.step_costs import StepCosts

from exact_law import chi_square_p, exact_first_tokens
from test_ngram import CheckedTarget, ngram_shapes, repetitive_prompt


def tiny_pair(seed: int, vocab: int, block: int, layers: int = 2, context: int = 128,
              sharpness: float = 3.0, draft_vocab: int | None = None):
    """draft_vocab: the drafter proposes only that many (random) tokens of the vocabulary."""
    torch.manual_seed(seed)
    tc = TargetConfig("llama", vocab, 16, 32, layers, 4, 2, 4, 1e-6, 10000.0, context,
                      False, False, False)
    target = TargetModel(tc).double().eval()
    dc = DFlashConfig(16, 32, 1, 4, 2, 4, 1e-6, 10000.0, vocab, block, vocab - 1,
                      tuple(range(layers)), layers, draft_vocab_size=draft_vocab)
    drafter = DFlashDrafter(dc).double().eval()
    if draft_vocab:
        ids = torch.randperm(vocab)[:draft_vocab].sort().values
        drafter.d2t.copy_(ids - torch.arange(draft_vocab))
    with torch.no_grad():  # peakier models: acceptances happen, ties do not
        for p in itertools.chain(target.parameters(), drafter.parameters()):
            if p.dim() == 2:
                p.mul_(sharpness)
    return target, drafter


def runners(target, drafter, scaling, window=None):
    return (TorchBatchTarget(target, drafter.config.target_layer_ids),
            TorchBatchDFlash(drafter, target, scaling, window))


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]),
       block=st.integers(2, 7), prompt_len=st.integers(1, 24), max_new=st.integers(1, 40),
       scaled=st.booleans(), stop=st.booleans(),
       per_token=st.one_of(st.none(), st.floats(0.0, 2.0)), reduced_vocab=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 20)))
def test_greedy_speculative_equals_target_only(seed, vocab, block, prompt_len, max_new,
                                               scaled, stop, per_token, reduced_vocab, window):
    """window: the drafter's blocks see only the last `window` context keys (window mode)."""
    target, drafter = tiny_pair(seed, vocab, block,
                                draft_vocab=vocab // 2 if reduced_vocab else None)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if scaled else None
    t, d = runners(target, drafter, scaling, window)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    stop_ids = frozenset({0}) if stop else frozenset()
    # per_token: adaptive draft length under a verify cost of 1 + per_token * tokens
    costs = None if per_token is None else StepCosts((1.0, per_token, 0.0, 0.0), (0.2, 0.0))
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_block(t, d, prompt, max_new, Sampler(), stop_ids, costs=costs)
    assert got.tokens == want.tokens
    if got.stopped_by == "length":  # a stop token may cut the last step's block short
        assert sum(got.committed_per_step) + 1 == len(got.tokens)
    # a step commits its accepted drafts and the target's token: at most one more than it checked
    assert all(1 <= c <= v + 1 <= block
               for v, c in zip(got.verified_per_step, got.committed_per_step, strict=True))


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]),
       block=st.integers(2, 7), repetitive=st.booleans(), prompt_len=st.integers(1, 24),
       max_new=st.integers(1, 40), shape=ngram_shapes, stop=st.booleans(),
       per_token=st.one_of(st.none(), st.floats(0.0, 2.0)),
       window=st.one_of(st.none(), st.integers(1, 20)))
def test_greedy_hybrid_equals_target_only(seed, vocab, block, repetitive, prompt_len, max_new,
                                          shape, stop, per_token, window):
    """n-gram-assisted blocks: each step verifies the lookup's drafts or the drafter's, and
    the drafter reads the features of every committed token either way. window: the
    window-hybrid mode's drafter (frozen, seeing only the last `window` context keys)."""
    target, drafter = tiny_pair(seed, vocab, block)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if window is None else None
    t, d = runners(target, drafter, scaling, window)
    t = CheckedTarget(t)  # refuses a verify pass past the budget
    g = torch.Generator().manual_seed(seed)
    prompt = (repetitive_prompt(seed, vocab, prompt_len) if repetitive
              else torch.randint(0, vocab, (prompt_len,), generator=g).tolist())
    stop_ids = frozenset({0}) if stop else frozenset()
    costs = None if per_token is None else StepCosts((1.0, per_token, 0.0, 0.0), (0.2, 0.0))
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_block(t, d, prompt, max_new, Sampler(), stop_ids, costs=costs,
                         proposer=NGramProposer(*shape))
    assert got.tokens == want.tokens
    if got.stopped_by == "length":
        assert sum(got.committed_per_step) + 1 == len(got.tokens)
    assert all(1 <= c <= v + 1 <= max(block, shape[2] + 1)
               for v, c in zip(got.verified_per_step, got.committed_per_step, strict=True))
    assert 0 <= got.ngram_steps <= got.verify_steps


def test_the_hybrid_lossless_check_exercises_both_proposers():
    """Guard for the property test above: steps verify n-gram drafts and drafter blocks,
    and both get drafts accepted."""
    ngram_steps, drafter_steps, mals = 0, 0, []
    for seed in range(6):
        target, drafter = tiny_pair(seed, vocab=6, block=5)
        t, d = runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0))
        gen = generate_block(t, d, [1, 2, 3, 4], 40, Sampler(), proposer=NGramProposer(3, 1, 4))
        ngram_steps += gen.ngram_steps
        drafter_steps += gen.verify_steps - gen.ngram_steps
        mals.append(gen.mean_accepted_length)
    assert ngram_steps > 0 and drafter_steps > 0, (ngram_steps, drafter_steps)
    assert max(mals) > 1.5, mals


@pytest.mark.parametrize("lookup", [True, False], ids=["hybrid", "sharpdraft"])
def test_with_costs_a_drafter_that_does_not_pay_sits_out(lookup):
    """Guard for the property tests above (their per_token cases run HybridChoice): a tiny
    drafter over 40 tokens rarely lands a draft, so with measured costs the steps try it,
    then mostly decode plainly (or verify 1-token lookups, as n-gram drafting would) --
    with the target-only tokens either way."""
    target, drafter = tiny_pair(1, vocab=40, block=5)
    t, d = runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0))
    prompt = torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    want = generate_target_only(t, prompt, 60, Sampler())
    drafter_steps = {}
    for name, costs in (("always", None), ("priced", StepCosts((1.0, 0.2, 0.0, 0.0), (0.2, 0.0)))):
        gen = generate_block(t, d, prompt, 60, Sampler(), costs=costs,
                             proposer=NGramProposer(3, 1, 4) if lookup else None)
        assert gen.tokens == want.tokens
        drafter_steps[name] = gen.verify_steps - gen.ngram_steps
        assert drafter_steps[name] == len(gen.visible_per_step)
    assert 0 < drafter_steps["priced"] < drafter_steps["always"] / 4, drafter_steps


def test_the_lossless_check_exercises_acceptance():
    """Guard for the property test above: on these tiny pairs drafts do get accepted."""
    accepted = []
    for seed in range(8):
        target, drafter = tiny_pair(seed, vocab=4, block=6)
        t, d = runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0))
        gen = generate_block(t, d, [1, 2, 3], 40, Sampler())
        accepted.append(gen.mean_accepted_length)
    assert max(accepted) > 1.5


def test_stats_report_the_visible_keys_and_beta_the_op_was_given(monkeypatch):
    from runtime.models.layers import KVCache

    handed = []  # (visible counts, scaling) of every drafter attention call
    attend_block = KVCache.attend_block  # hands both to the op as they are

    def recording(self, layer, start, q, k, v, visible, scaling, probe=None, window=None):
        handed.append((visible.clone(), scaling))
        return attend_block(self, layer, start, q, k, v, visible, scaling, probe, window)

    monkeypatch.setattr(KVCache, "attend_block", recording)
    target, drafter = tiny_pair(3, vocab=8, block=4)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0)
    t, d = runners(target, drafter, scaling)
    gen = generate_block(t, d, list(range(1, 8)), 30, Sampler())
    layers = drafter.config.num_layers
    # the drafter's prefill pass (the prompt's rows, its block scratch), then one pass a step
    assert len(handed) == layers * (gen.verify_steps + 1)
    assert handed[0][0].unique().tolist() == [7 + 4]
    committed = 7
    for step, (visible, b, c) in enumerate(zip(gen.visible_per_step, gen.beta_per_step,
                                               gen.committed_per_step)):
        counts, applied = handed[(step + 1) * layers]
        # every block row sees the committed context plus the whole block (bidirectional)
        assert counts.unique().tolist() == [committed + 4] == [visible]
        assert applied is scaling and b == applied.beta(int(counts[0, 0]))
        committed += c
    assert gen.mean_accepted_length == sum(gen.committed_per_step) / gen.verify_steps
    assert max(gen.beta_per_step) > 1.0  # the trace covers scaled steps, not only beta = 1


# slow: the fast tier keeps the block loop's law in test_processors.py
# (test_the_block_loop_samples_the_processed_law_with_a_penalty); test_rejection_law checks
# the verifier itself, a q with zeros included, at 100,000 draws
@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", [None, 3])
def test_speculative_sampling_preserves_the_target_distribution(draft_vocab):
    """20k speculative runs (temperature 0.8, top-p 0.9) against the exact target law of
    the first three tokens: the prefill's token, then a step that drafts up to 2. With a
    draft vocabulary of 3 of the 4 tokens, the fourth has draft probability 0 and must
    still come out at its target rate (from the residual distribution)."""
    vocab, draws = 4, law_runs(20_000)
    target, drafter = tiny_pair(11, vocab, block=4, sharpness=1.5, draft_vocab=draft_vocab)
    t, d = runners(target, drafter, QueryScaling(ref_keys=8, top_k=2, slope=2.0))
    prompt = [1, 2, 0]
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.9, seed=1234))
    expected = exact_first_tokens(target, prompt, sampler, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    first_step = Counter()
    once = PrefillOnce(t, prompt, len(prompt) + 4)  # the prefill is deterministic
    for _ in range(draws):
        gen = generate_block(once, d, prompt, 4, sampler)
        t1, t2, t3 = gen.tokens[:3]
        counts[(t1 * vocab + t2) * vocab + t3] += 1
        first_step[gen.committed_per_step[0]] += 1
    # rejection at draft 1, rejection at draft 2, and both drafts accepted all happened
    assert all(first_step[n] > 0.02 * draws for n in (1, 2, 3)), first_step
    assert chi_square_p(counts, expected) > 0.001


class CountingTarget:
    """A target that records how many tokens each verify pass checks."""

    def __init__(self, target):
        self.target, self.context_limit, self.passes = target, target.context_limit, []

    def add(self, ids, capacity):
        return self.target.add(ids, capacity)

    def verify(self, rows):
        self.passes.append(len(rows.row(0)))
        return self.target.verify(rows)

    def rollback(self, lengths):
        self.target.rollback(lengths)

    def remove(self, row):
        self.target.remove(row)


@pytest.mark.slow  # the block loop's law: test_speculative_sampling_preserves_the_target_distribution
def test_adaptive_draft_length_sampling_preserves_the_target_distribution():
    """As above with the number of drafts verified chosen from the drafter's confidence:
    under a steep per-token verify cost the first step verifies 1 of its 2 drafts."""
    vocab, draws = 4, law_runs(10_000)
    target, drafter = tiny_pair(11, vocab, block=4, sharpness=1.5)
    t, d = runners(target, drafter, QueryScaling(ref_keys=8, top_k=2, slope=2.0))
    prompt = [1, 2, 0]
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.9, seed=99))
    costs = StepCosts((0.2, 0.8, 0.0, 0.0), (0.0, 0.0))  # verify(n tokens) = 0.2 + 0.8 n
    expected = exact_first_tokens(target, prompt, sampler, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    counting = CountingTarget(PrefillOnce(t, prompt, len(prompt) + 4))
    first_pass, first_step = Counter(), Counter()
    for _ in range(draws):
        counting.passes.clear()
        gen = generate_block(counting, d, prompt, 4, sampler, costs=costs)
        t1, t2, t3 = gen.tokens[:3]
        counts[(t1 * vocab + t2) * vocab + t3] += 1
        first_pass[counting.passes[0]] += 1
        first_step[gen.committed_per_step[0]] += 1
    assert first_pass == Counter({2: draws})  # bonus + 1 draft, not the 2 there was room for
    assert all(first_step[n] > 0.02 * draws for n in (1, 2)), first_step  # reject and accept
    assert chi_square_p(counts, expected) > 0.001


@pytest.mark.slow  # the block loop's law: test_speculative_sampling_preserves_the_target_distribution
@pytest.mark.parametrize("costs", [None, StepCosts((0.2, 0.8, 0.0, 0.0), (0.0, 0.0))],
                         ids=["full", "adaptive"])
def test_hybrid_sampling_preserves_the_target_distribution(costs):
    """As above with n-gram lookup assisting the drafter. After the prefill's token 0 or 1
    the context ends in a 2-gram seen before (0 0, 0 1), so the first step verifies the
    lookup's one-hot drafts (1 3, 3 0); after a 2 or a 3 only a 1-gram matches and the
    drafter's block is verified. Either way the law must be the target's."""
    vocab, draws = 4, law_runs(10_000)
    target, drafter = tiny_pair(11, vocab, block=4, sharpness=1.5)
    t, d = runners(target, drafter, QueryScaling(ref_keys=8, top_k=2, slope=2.0))
    prompt = [2, 0, 0, 1, 3, 0]
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.9, seed=5))
    expected = exact_first_tokens(target, prompt, sampler, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    for t1 in range(vocab):  # the docstring's reading of the rule, as the lookup sees it
        lookup = NGramProposer(max_ngram=3, min_ngram=1, num_draft_tokens=2)
        lookup.propose(prompt + [t1])
        assert (lookup.matched >= 2) == (t1 in (0, 1))
    first_step = Counter()
    once = PrefillOnce(t, prompt, len(prompt) + 4)
    for _ in range(draws):
        gen = generate_block(once, d, prompt, 4, sampler, costs=costs,
                             proposer=NGramProposer(max_ngram=3, min_ngram=1, num_draft_tokens=2))
        t1, t2, t3 = gen.tokens[:3]
        counts[(t1 * vocab + t2) * vocab + t3] += 1
        first_step[("ngram" if t1 in (0, 1) else "drafter", gen.committed_per_step[0])] += 1
    # both proposers ran first steps, and the lookup's drafts were rejected and accepted
    assert sum(n for (who, _), n in first_step.items() if who == "drafter") > 0.02 * draws
    assert all(first_step[("ngram", n)] > 0.02 * draws for n in (1, 2)), first_step
    assert chi_square_p(counts, expected) > 0.001


def test_greedy_reductions_match_torch_ties_included():
    """The greedy sampler's argmax and confidence run in numpy (greedy_choice: torch's
    threads would spin on the cores ONNX Runtime's next step needs). They must choose as
    torch does: ties go to the first maximum, for every dtype the backends hand over."""
    from runtime.sampling import Sampler, greedy_choice

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (5, 300), generator=g).float()  # many ties per row
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        y = x.to(dtype)
        assert greedy_choice(y).tolist() == y.argmax(-1).tolist()
        assert int(greedy_choice(y[2])) == int(y[2].argmax())
    logits = torch.randn(6, 8192, generator=g) * 4
    want = torch.softmax(logits.double(), -1).max(-1).values
    assert Sampler().confidence(logits, None) == pytest.approx(want.tolist(), rel=1e-12)
    drafts, probs = Sampler().propose(logits, None)
    assert drafts == logits.argmax(-1).tolist() and probs is None


def test_sampling_ops_run_on_one_torch_thread_and_give_it_back(monkeypatch):
    """Sampling-mode probabilities, rejection steps and EAGLE-3's tree scores run their
    torch ops on one thread (one_torch_thread: the pool's spinning workers slowed ONNX
    Runtime's next step), and the caller's thread count is restored after each -- also
    when the op raises."""
    from runtime import sampling

    monkeypatch.setattr(torch, "get_num_threads", lambda: counts[-1])
    counts = [2]
    monkeypatch.setattr(torch, "set_num_threads", counts.append)
    seen = []
    real_softmax = torch.softmax
    real_log_softmax = torch.log_softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: seen.append(counts[-1]) or real_softmax(*a, **k))
    monkeypatch.setattr(torch, "log_softmax",
                        lambda *a, **k: seen.append(("log", counts[-1])) or real_log_softmax(*a, **k))
    sampler = sampling.Sampler(sampling.Sampling(0.8, seed=0))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    drafts, q = sampler.propose(logits[:2])
    sampler.verify(drafts, logits, q)
    assert seen and set(seen) == {1} and counts[-1] == 2
    sampling.log_softmax(logits)
    assert seen[-1] == ("log", 1) and counts[-1] == 2
    with pytest.raises(RuntimeError):
        sampling.log_softmax(torch.tensor([1, 2]))  # log_softmax of an int tensor raises
    assert counts[-1] == 2
