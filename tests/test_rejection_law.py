"""The verifier's sampling law, checked as vLLM checks its rejection sampler: 100,000 draft
rows through runtime.sampling.rejection_sample in one batched call on a vocabulary of 10,
each committed position's tokens against the target's distribution there (chi-square).
Every sampling loop verifies through that function (Sampler.verify hands it a batch of
one), so this is the law at 100,000 draws in about a second; the loop-level law tests
(test_speculative, test_pard, test_eagle3_chain, test_ngram, test_batched) check that
each loop feeds it the right distributions.

A verifier that draws the correction from p instead of the residual max(p - q, 0), or
that accepts too often, fails here (checked by hand when this test was written)."""

import pytest
import torch

from exact_law import chi_square_p
from runtime.sampling import Sampler, Sampling, rejection_sample

VOCAB, DRAFTS, ROWS = 10, 3, 100_000


def distributions(seed: int, rows: int, zero: list[int]) -> torch.Tensor:
    """rows random distributions over VOCAB, with the tokens in `zero` impossible."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, VOCAB, generator=g, dtype=torch.float64) ** 4  # peaked: drafts land
    probs[:, zero] = 0.0
    return probs / probs.sum(-1, keepdim=True)


# p gives token 0 nothing (a draft of 0 must always be rejected); q gives tokens 8 and 9
# nothing (they can only come from the residual), as a draft vocabulary or top-p leaves them.
P = distributions(1, DRAFTS + 1, zero=[0])
Q = distributions(2, DRAFTS, zero=[8, 9])


def committed_tokens(drafts, accepted, following):
    """Column j: the j-th token committed by each row's step (-1 past the step's end)."""
    tokens = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1)
    tokens[torch.arange(len(tokens)), accepted] = following
    past = torch.arange(tokens.shape[1]).unsqueeze(0) > accepted.unsqueeze(1)
    return tokens.masked_fill(past, -1)


def assert_target_law(tokens, reached=0.02):
    """Each position's committed tokens follow P there (rows that reach it)."""
    for j in range(DRAFTS + 1):
        column = tokens[:, j][tokens[:, j] >= 0]
        assert len(column) > reached * ROWS, (j, len(column))  # each position is checked
        counts = torch.bincount(column, minlength=VOCAB).double()
        p = chi_square_p(counts, P[j] * len(column))
        assert p > 1e-3, (j, p, counts.tolist(), (P[j] * len(column)).tolist())


def test_rejection_sampling_commits_the_target_law_sampled_drafts():
    """Drafts drawn from q: every committed position is distributed as p, and draft 1 is
    accepted with probability sum(min(p, q)) (Leviathan et al., 2023, Theorem 3.5)."""
    g = torch.Generator().manual_seed(7)
    drafts = torch.stack([torch.multinomial(Q[i], ROWS, replacement=True, generator=g)
                          for i in range(DRAFTS)], dim=1)
    accepted, following = rejection_sample(drafts, P.expand(ROWS, -1, -1), Q.expand(ROWS, -1, -1), g)
    assert_target_law(committed_tokens(drafts, accepted, following))
    alpha = float(torch.minimum(P[0], Q[0]).sum())
    rate = float((accepted >= 1).double().mean())
    assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / ROWS) ** 0.5, (rate, alpha)
    assert set(accepted.tolist()) == set(range(DRAFTS + 1))  # every outcome happened


def test_rejection_sampling_commits_the_target_law_deterministic_drafts():
    """Drafts chosen without sampling (n-gram lookup: q one-hot, as verify_deterministic
    passes it): p's likeliest token in 3 of 4 rows (a lookup that guessed well), any token
    in the rest (token 0 among them, impossible under p). The committed tokens are still
    distributed as p, and draft 1 is kept with probability p(d)."""
    g = torch.Generator().manual_seed(8)
    guessed = torch.rand(ROWS, DRAFTS, generator=g) < 0.75
    drafts = torch.where(guessed, P[:DRAFTS].argmax(-1), torch.randint(0, VOCAB, (ROWS, DRAFTS), generator=g))
    one_hot = torch.nn.functional.one_hot(drafts, VOCAB).double()
    accepted, following = rejection_sample(drafts, P.expand(ROWS, -1, -1), one_hot, g)
    assert_target_law(committed_tokens(drafts, accepted, following), reached=0.01)
    alpha = float(0.75 * P[0].max() + 0.25 / VOCAB)
    rate = float((accepted >= 1).double().mean())
    assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / ROWS) ** 0.5, (rate, alpha)


@pytest.mark.parametrize("deterministic", [False, True], ids=["verify", "verify_deterministic"])
def test_sampler_verify_hands_the_verifier_its_distributions(deterministic):
    """Sampler.verify / verify_deterministic (what the loops call, one row at a time, from
    logits with temperature and top-p) against the target's law of the first committed
    token, at 4,000 calls: the sampler's own p and q reach rejection_sample intact."""
    vocab, calls = 5, 4_000
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, vocab, generator=g, dtype=torch.float64) * 2
    draft_logits = torch.randn(2, vocab, generator=g, dtype=torch.float64) * 2
    sampler = Sampler(Sampling(temperature=0.8, top_p=0.8, seed=11))
    p = sampler.probs(target_logits)
    assert (p[0] == 0).any()  # top-p removed tokens the drafts may still propose
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(calls):
        if deterministic:
            drafts = torch.randint(0, vocab, (2,), generator=g).tolist()
            accepted, following = sampler.verify_deterministic(drafts, target_logits)
        else:
            drafts, q = sampler.propose(draft_logits)
            accepted, following = sampler.verify(drafts, target_logits, q)
        counts[drafts[0] if accepted else following] += 1
    assert chi_square_p(counts, p[0] * calls) > 1e-3
