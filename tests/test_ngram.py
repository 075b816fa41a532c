"""N-gram (prompt-lookup) drafting: the proposer finds what a brute-force search finds,
and verifying its drafts (one-hot draft distributions) keeps the target's exact law."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling

from exact_law import chi_square_p


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


@settings(max_examples=300, deadline=None)
@given(tokens=small_alphabet_tokens, shape=ngram_shapes)
def test_proposal_equals_a_brute_force_search(tokens, shape):
    max_ngram, min_ngram, k = shape
    assert NGramProposer(max_ngram, min_ngram, k).propose(tokens) == \
        lookup_by_scanning(tokens, max_ngram, min_ngram, k)


@settings(max_examples=100, deadline=None)
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


def test_one_hot_verification_keeps_the_target_law():
    """One position, one fixed draft d (likely, unlikely, and outside top-p): the committed
    token (d if accepted, else the residual draw) is distributed as the target's p."""
    vocab, draws = 6, 10_000
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
        assert abs(accepted / draws - float(p[d])) < 0.02  # acceptance is p(d)
