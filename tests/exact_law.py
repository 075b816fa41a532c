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


def assert_batched_chains_keep_the_law(target, new_decoder, draws: int, vocab: int = 4) -> None:
    """The first three tokens of seeded chain decoding, batched, follow the target's law
    (temperature 0.8, top_p 0.9) and every outcome of the first step (1, 2 or 3 tokens
    committed) is exercised. Each of draws // 8 fresh decoders (`new_decoder()`) steps
    eight sequences under test beside one at another length, sharing every drafter run."""
    from collections import Counter

    from runtime.decode import Request
    from runtime.sampling import Sampler, Sampling

    prompt = [1, 2, 0]
    probe = Sampler(Sampling(temperature=0.8, top_p=0.9))
    expected = exact_first_tokens(target, prompt, probe, vocab).flatten() * draws
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    first_step = Counter()
    for i in range(draws // 8):
        decoder = new_decoder()
        seqs = [decoder.add(Request(prompt=p, max_new_tokens=4, sampling=Sampling(0.8, 0.9, seed=i * 9 + j)))
                for j, p in enumerate([prompt, [3, 1, 2, 2, 1, 0, 3]] + [prompt] * 7)]
        while decoder.active:
            decoder.step()
        for seq in seqs[:1] + seqs[2:]:
            t1, t2, t3 = seq.gen.tokens[:3]
            counts[(t1 * vocab + t2) * vocab + t3] += 1
            first_step[seq.gen.committed_per_step[0]] += 1
    assert all(first_step[n] > 0.02 * draws for n in (1, 2, 3)), first_step
    assert chi_square_p(counts, expected) > 0.001
