"""N-gram (prompt-lookup) drafting: the proposer finds what a brute-force search finds,
and speculation with its drafts is lossless -- greedy output equals target-only output
token for token, and sampling keeps the target's exact law."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, law_runs

from runtime.backends import PrefillOnce
from runtime import assembly
from runtime.backends.pytorch import TorchBatchTarget
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling
from speculative import generate_ngram, generate_target_only

from exact_law import chi_square_p, exact_first_tokens
from tiny import float64_target


def lookup_by_scanning(tokens, max_ngram, min_ngram, k):
    """The reference: for the longest n that matches, list every earlier start of the last
    n tokens that has a follower, take the latest, return up to k of what followed."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s: s + n] == tokens[-n:]]
        if starts:
            return tokens[max(starts) + n: max(starts) + n + k]
    return []


ngram_shapes = st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(1, 6)).map(
    lambda t: (t[0] + t[1], t[0], t[2]))  # (max_ngram, min_ngram, k)
small_alphabet_tokens = st.integers(1, 5).flatmap(
    lambda a: st.lists(st.integers(0, a - 1), max_size=60))


@settings(max_examples=examples(300), deadline=None)
@given(tokens=small_alphabet_tokens, shape=ngram_shapes)
def test_proposal_equals_a_brute_force_search(tokens, shape):
    max_ngram, min_ngram, k = shape
    assert NGramProposer(max_ngram, min_ngram, k).propose(tokens) == \
        lookup_by_scanning(tokens, max_ngram, min_ngram, k)


@settings(max_examples=examples(100), deadline=None)
@given(tokens=small_alphabet_tokens, other=small_alphabet_tokens, shape=ngram_shapes,
       cuts=st.lists(st.integers(0, 60), max_size=8))
def test_incremental_index_equals_a_fresh_search(tokens, other, shape, cuts):
    """One proposer over a growing context (as in decoding), then over an unrelated one."""
    proposer = NGramProposer(*shape)
    for end in sorted(cuts) + [len(tokens)]:
        assert proposer.propose(tokens[:end]) == lookup_by_scanning(tokens[:end], *shape)
    assert proposer.propose(other) == lookup_by_scanning(other, *shape)


@pytest.mark.parametrize("tokens, shape, drafts", [
    ([], (3, 1, 4), []),                                   # nothing to look up
    ([1, 2, 3, 4], (3, 1, 4), []),                         # the last token never occurred
    ([1, 2, 3, 1], (3, 1, 4), [2, 3, 1]),                  # the follower may be the suffix
    ([1, 2, 3, 1], (3, 2, 4), []),                         # min_ngram 2: a 1-gram is too short
    ([1, 2, 1, 2, 1], (3, 1, 4), [2, 1]),                  # overlapping an earlier match
    ([7, 7, 7, 7], (3, 1, 4), [7]),                        # a run matches itself shifted
    ([5, 1, 5, 2, 5], (1, 1, 1), [2]),                     # the most recent occurrence wins
    ([1, 2, 9, 3, 2, 8, 1, 2], (2, 1, 2), [9, 3]),         # the longer n wins over recency
    ([1, 2, 9, 3, 2, 8, 1, 2], (1, 1, 2), [8, 1]),         # max_ngram 1: only recency
    ([1, 2, 3, 4, 5, 1], (3, 1, 2), [2, 3]),               # k truncates
    ([4, 4], (5, 1, 3), [4]),                              # max_ngram longer than the context
])
def test_proposal_examples(tokens, shape, drafts):
    assert NGramProposer(*shape).propose(tokens) == drafts
    assert lookup_by_scanning(tokens, *shape) == drafts


@pytest.mark.parametrize("kwargs, message", [
    ({"min_ngram": 0}, "min_ngram must be an integer >= 1, got 0"),
    ({"max_ngram": 1, "min_ngram": 2}, "max_ngram must be an integer >= 2, got 1"),
    ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1, got 0"),
    ({"max_ngram": 2.5}, "max_ngram must be an integer >= 1, got 2.5"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        NGramProposer(**kwargs)
    assert str(err.value) == message


def test_settings_round_trip():
    proposer = NGramProposer(max_ngram=4, min_ngram=2, num_draft_tokens=5)
    settings_ = proposer.settings()
    assert settings_ == {"method": "ngram", "max_ngram": 4, "min_ngram": 2, "num_draft_tokens": 5}
    assert NGramProposer.from_settings(settings_).settings() == settings_
    with pytest.raises(ValueError, match="not n-gram drafting settings"):
        NGramProposer.from_settings({"method": "dflash"})


class CheckedTarget:
    """A batch target of one row that records each verify pass and refuses a write past
    the budget the loop asked for at its join (its capacity less the roles' slack, the
    room a padded batch row may write): drafting past the budget would show up here."""

    def __init__(self, target):
        self.target, self.context_limit, self.passes = target, target.context_limit, []
        self.slack = assembly.Roles(None, None).slack  # speculative.roles' (no drafter)

    def add(self, ids, capacity):
        self.length, self.capacity = len(ids), capacity - self.slack
        return self.target.add(ids, capacity)

    def verify(self, rows):
        assert self.length + len(rows.row(0)) <= self.capacity, "a verify pass past the budget"
        self.passes.append(len(rows.row(0)))
        self.length += len(rows.row(0))
        return self.target.verify(rows)

    def rollback(self, lengths):
        self.length = lengths[0]
        self.target.rollback(lengths)

    def remove(self, row):
        self.target.remove(row)


def repetitive_prompt(seed, vocab, length):
    """A short random pattern repeated: the proposer drafts from the start."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, vocab, (1 + seed % 4,), generator=g).tolist()
    return (pattern * length)[:length]


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]),
       repetitive=st.booleans(), prompt_len=st.integers(1, 24), max_new=st.integers(1, 40),
       shape=ngram_shapes, stop=st.booleans())
def test_greedy_ngram_equals_target_only(seed, vocab, repetitive, prompt_len, max_new,
                                         shape, stop):
    t = CheckedTarget(TorchBatchTarget(float64_target(seed, vocab)))
    g = torch.Generator().manual_seed(seed)
    prompt = (repetitive_prompt(seed, vocab, prompt_len) if repetitive
              else torch.randint(0, vocab, (prompt_len,), generator=g).tolist())
    stop_ids = frozenset({0}) if stop else frozenset()
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_ngram(t, NGramProposer(*shape), prompt, max_new, Sampler(), stop_ids)
    assert got.tokens == want.tokens
    if got.stopped_by == "length":  # a stop token may cut the last step's drafts short
        assert sum(got.committed_per_step) + 1 == len(got.tokens) == max_new
    assert all(1 <= c <= v + 1 <= shape[2] + 1
               for v, c in zip(got.verified_per_step, got.committed_per_step, strict=True))
    assert got.visible_per_step == got.beta_per_step == []  # no drafter attention


def test_the_ngram_lossless_check_exercises_acceptance():
    """Guard for the property test above: on repetitive prompts, drafts do get accepted."""
    mals = []
    for seed in range(6):
        t = TorchBatchTarget(float64_target(seed, vocab=6))
        gen = generate_ngram(t, NGramProposer(3, 1, 4), repetitive_prompt(seed, 6, 16), 40,
                             Sampler())
        mals.append(gen.mean_accepted_length)
    assert max(mals) > 1.5, mals


def test_no_drafts_is_a_plain_decode_step():
    """A proposer that finds nothing: every step verifies one token, as target-only."""
    class NothingFound:
        def propose(self, tokens):
            return []

    t = CheckedTarget(TorchBatchTarget(float64_target(5, vocab=40)))
    prompt = list(range(1, 5))
    got = generate_ngram(t, NothingFound(), prompt, 8, Sampler())
    assert got.tokens == generate_target_only(t, prompt, 8, Sampler()).tokens
    assert got.committed_per_step == [1] * 7 and t.passes[:7] == [1] * 7


@pytest.mark.slow  # the fast tier: test_rejection_law (one-hot q, 100,000 draws in one call)
def test_one_hot_verification_keeps_the_target_law():
    """One position, one fixed draft d (likely, unlikely, and outside top-p): the committed
    token (d if accepted, else the residual draw) is distributed as the target's p."""
    vocab, draws = 6, law_runs(10_000)
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.9, seed=7))
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = sampler.probs(logits[0])
    order = p.argsort(descending=True).tolist()
    assert p[order[-1]] == 0  # top-p cut it: such a draft must always be rejected
    for d in (order[0], order[2], order[-1]):
        counts, accepted = torch.zeros(vocab, dtype=torch.float64), 0
        for _ in range(draws):
            n, following = sampler.verify_deterministic([d], logits)
            counts[d if n == 1 else following] += 1
            accepted += n
        assert chi_square_p(counts, p * draws) > 0.001, (d, counts)
        # acceptance is p(d), within 4 standard errors (0.02 at 10,000 draws)
        assert abs(accepted / draws - float(p[d])) <= 4 * (float(p[d] * (1 - p[d])) / draws) ** 0.5 + 1e-12


@pytest.mark.slow  # the fast tier: test_rejection_law.py (the verifier n-gram drafts
# go through, a deterministic q included) and test_pard.py's law through batched chains
def test_ngram_sampling_preserves_the_target_distribution():
    """Speculative sampling runs (temperature 0.8, top-p 0.9) against the exact target law
    of the first three tokens. Every token occurs in the prompt, so whatever the prefill
    picks, the first step drafts (two tokens, or one after a 3)."""
    vocab, draws = 4, law_runs(10_000)
    model = float64_target(5, vocab, sharpness=1.5)  # the three outcomes at 36/35/29%
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.9, seed=1234))
    proposer = NGramProposer(max_ngram=3, min_ngram=1, num_draft_tokens=2)
    expected = exact_first_tokens(model, prompt, sampler, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    first_step = Counter()
    once = PrefillOnce(TorchBatchTarget(model), prompt, len(prompt) + 4)  # deterministic prefill
    for _ in range(draws):
        gen = generate_ngram(once, proposer, prompt, 4, sampler)
        t1, t2, t3 = gen.tokens[:3]
        counts[(t1 * vocab + t2) * vocab + t3] += 1
        first_step[gen.committed_per_step[0]] += 1
    # rejection at draft 1, rejection at draft 2, and both drafts accepted all happened
    assert all(first_step[n] > 0.02 * draws for n in (1, 2, 3)), first_step
    assert chi_square_p(counts, expected) > 0.001
