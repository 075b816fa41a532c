"""The target's exact sampling law, by enumeration, and a chi-square test against it:
the independent expectation every speculative-sampling test checks its counts against."""

from __future__ import annotations

import itertools

import torch


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target never produces was produced"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def exact_first_tokens(target, prompt, sampler, vocab):
    """P(t1, t2, t3) under the target's own sampler, by enumeration."""
    probs = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    with torch.no_grad():
        for t1, t2 in itertools.product(range(vocab), repeat=2):
            cache = target.new_cache(len(prompt) + 2)
            logits, _ = target(torch.tensor([prompt + [t1, t2]]), cache)
            p = sampler.probs(logits[0])
            probs[t1, t2] = p[-3, t1] * p[-2, t2] * p[-1]
    return probs
