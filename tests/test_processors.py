"""The request extensions vLLM's clients send (top_k, min_p, repetition / presence /
frequency penalties, min_tokens) and token log-probabilities, lossless under speculation:
greedy output equals target-only greedy output with the same option, token for token, for
DFlash blocks and PARD chains; sampling follows the processed target law (the penalties
applied at each position with the prefix at that position), checked against a reference
written here, independently of runtime/sampling.py; log-probabilities equal target-only
decoding's and a one-pass forward's."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, full, law_runs

import tiny
from plugins.scaling import QueryScaling
from runtime.backends import PrefillOnce
from runtime.backends.pytorch import TorchBatchPARD, TorchBatchTarget
from runtime.decode import Request
from runtime.sampling import Sampler, Sampling, apply_penalties, distribution, rejection_sample
from speculative import generate_block, generate_chain, generate_target_only, roles
from runtime.modes import Mode
from test_speculative import runners, tiny_pair

OPTIONS = {  # one option each (plus what it needs), greedy
    "top_k": dict(top_k=2),
    "min_p": dict(min_p=0.3),
    "repetition_penalty": dict(repetition_penalty=1.6),
    "presence_penalty": dict(presence_penalty=1.2),
    "frequency_penalty": dict(frequency_penalty=0.9),
    "min_tokens": dict(min_tokens=12),
}


def reference_probs(logits: list[float], prompt: list[int], output: list[int], s: Sampling) -> list[float]:
    """The processed law of one position, token by token, as vLLM documents its options
    (an expectation independent of runtime/sampling.py)."""
    x = list(logits)
    for t in range(len(x)):
        if s.repetition_penalty != 1 and (t in prompt or t in output):
            x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
        x[t] -= s.frequency_penalty * output.count(t) + s.presence_penalty * (t in output)
    e = [math.exp((v - max(x)) / s.temperature) for v in x]
    e = [v / sum(e) for v in e]
    if s.min_p:
        e = [v if v >= s.min_p * max(e) else 0.0 for v in e]
    if s.top_k:
        kth = sorted(e, reverse=True)[s.top_k - 1]
        e = [v if v >= kth else 0.0 for v in e]
    e = [v / sum(e) for v in e]
    if s.top_p < 1:
        order = sorted(range(len(e)), key=lambda t: -e[t])
        kept, mass = set(), 0.0
        for t in order:
            if mass < s.top_p:
                kept.add(t)
            mass += e[t]
        e = [v if t in kept else 0.0 for t, v in enumerate(e)]
        e = [v / sum(e) for v in e]
    return e


# ---- greedy: token for token ----------------------------------------------------------


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12]), block=st.integers(2, 6),
       prompt_len=st.integers(1, 16), max_new=st.integers(1, 30), option=st.sampled_from(sorted(OPTIONS)),
       chain=st.booleans())
def test_greedy_with_each_option_equals_target_only(seed, vocab, block, prompt_len, max_new, option, chain):
    """Greedy with an option: DFlash blocks (or PARD chains) commit target-only's tokens with
    the same option; stop token 0 (min_tokens holds it off)."""
    sampling = Sampling(**OPTIONS[option])
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    stop_ids = frozenset({0})
    if chain:
        target = tiny.float64_target(seed, vocab)
        t = TorchBatchTarget(target)
        d = TorchBatchPARD(tiny.pard_from_target(target, vocab - 1), vocab, block, None)
        got = generate_chain(t, d, prompt, max_new, Sampler(sampling), stop_ids)
    else:
        target, drafter = tiny_pair(seed, vocab, block)
        t, d = runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0))
        got = generate_block(t, d, prompt, max_new, Sampler(sampling), stop_ids)
    want = generate_target_only(t, prompt, max_new, Sampler(sampling), stop_ids)
    assert got.tokens == want.tokens
    if option == "min_tokens":
        assert 0 not in got.tokens[:sampling.min_tokens]


def test_the_greedy_check_sees_each_option_change_the_output():
    """Guard for the property test: each reordering option changes greedy output on a
    model that repeats itself, so equality above compares outputs that the option shaped."""
    target, drafter = tiny_pair(3, 6, 4)
    t, d = runners(target, drafter, None)
    prompt = [1, 2, 3, 1, 2, 3]
    plain = generate_target_only(t, prompt, 24, Sampler(), frozenset({0})).tokens
    for option in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens"):
        shaped = generate_block(t, d, prompt, 24, Sampler(Sampling(**OPTIONS[option])), frozenset({0}))
        assert shaped.tokens != plain, option


def test_a_tree_refuses_what_changes_the_argmax():
    from runtime.proposers import Tree
    from runtime.tree import TreeShape

    with pytest.raises(ValueError, match="penalties and min_tokens need a chain"):
        Tree(lambda: None, TreeShape()).check(Sampler(Sampling(repetition_penalty=1.2)))


# ---- sampling: the processed law -------------------------------------------------------

VOCAB, DRAFTS, ROWS = 6, 2, 100_000
PROMPT = [1, 2]
LAWS = {
    "top_k": Sampling(temperature=0.9, top_k=3),
    "min_p": Sampling(temperature=1.0, min_p=0.25),
    "repetition_penalty": Sampling(temperature=0.8, repetition_penalty=2.5),
}


@pytest.mark.parametrize("law", sorted(LAWS))
def test_speculative_sampling_follows_the_processed_target_law(law):
    """100,000 rows in one batched pass (as test_rejection_law): a position-only model
    (target logits LP[j], draft logits LQ[j]) whose processed law at position j depends on
    the drafts before it (repetition penalty); drafts drawn from processed q, verified
    against processed p. At every position, the committed token given the tokens before it
    follows the reference law there, each prefix a group of a chi-square test."""
    s = LAWS[law]
    g = torch.Generator().manual_seed(5)
    lp = torch.randn(DRAFTS + 1, VOCAB, generator=g, dtype=torch.float64) * 1.5
    lq = lp[:DRAFTS] + torch.randn(DRAFTS, VOCAB, generator=g, dtype=torch.float64)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[PROMPT] = True
    drafts = torch.zeros(ROWS, DRAFTS, dtype=torch.long)
    p, q = [], []
    for j in range(DRAFTS + 1):  # each position's laws after the drafts before it
        counts = torch.nn.functional.one_hot(drafts[:, :j], VOCAB).sum(1).double()
        p.append(distribution(apply_penalties(lp[j].expand(ROWS, -1), seen, counts, s), s))
        if j < DRAFTS:
            q.append(distribution(apply_penalties(lq[j].expand(ROWS, -1), seen, counts, s), s))
            drafts[:, j] = torch.multinomial(q[-1], 1, generator=g)[:, 0]
    accepted, following = rejection_sample(drafts, torch.stack(p, 1), torch.stack(q, 1), g)
    tokens = torch.cat([drafts, torch.full((ROWS, 1), -1)], 1)
    tokens[torch.arange(ROWS), accepted] = following
    stat, dof = 0.0, 0
    for j in range(DRAFTS + 1):
        reached = accepted >= j
        assert reached.double().mean() > 0.02, j
        for prefix in {tuple(r) for r in tokens[reached, :j].tolist()}:
            rows = reached & (tokens[:, :j] == torch.tensor(prefix, dtype=torch.long)).all(1)
            if rows.sum() < 200:
                continue
            want = torch.tensor(reference_probs(lp[j].tolist(), PROMPT, list(prefix), s)) * rows.sum()
            counts = torch.bincount(tokens[rows, j], minlength=VOCAB).double()
            assert counts[want == 0].sum() == 0, (j, prefix)  # processed away: never committed
            keep = want > 0
            stat += float(((counts[keep] - want[keep]) ** 2 / want[keep]).sum())
            dof += int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (stat, dof)


def test_the_block_loop_samples_the_processed_law_with_a_penalty():
    """Loop level: seeded DFlash runs with a repetition penalty and top_k against the
    reference law of the first three tokens (the prefill's token, then a step drafting up
    to 2), each position processed after the tokens before it."""
    from itertools import product

    # the fast tier's few runs check the wiring (the law itself: the batched test above)
    vocab, draws = 4, law_runs(20_000) if full() else 300
    s = Sampling(temperature=0.9, top_k=3, repetition_penalty=2.0, seed=99)
    target, drafter = tiny_pair(11, vocab, block=4, sharpness=1.5)
    t, d = runners(target, drafter, QueryScaling(ref_keys=8, top_k=2, slope=2.0))
    prompt = [1, 2, 1]
    expected = torch.zeros(vocab ** 3, dtype=torch.float64)
    with torch.no_grad():
        for t1, t2 in product(range(vocab), repeat=2):
            logits, _ = target(torch.tensor([prompt + [t1, t2]]), target.new_cache(len(prompt) + 2))
            rows = logits[0, -3:].tolist()
            p1 = reference_probs(rows[0], prompt, [], s)[t1]
            p2 = reference_probs(rows[1], prompt, [t1], s)[t2]
            p3 = reference_probs(rows[2], prompt, [t1, t2], s)
            for t3 in range(vocab):
                expected[(t1 * vocab + t2) * vocab + t3] = p1 * p2 * p3[t3]
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    once = PrefillOnce(t, prompt, len(prompt) + 4)
    sampler = Sampler(s)
    for _ in range(draws):
        gen = generate_block(once, d, prompt, 4, sampler)
        t1, t2, t3 = gen.tokens[:3]
        counts[(t1 * vocab + t2) * vocab + t3] += 1
    keep = expected > 0
    assert counts[~keep].sum() == 0
    stat = float(((counts[keep] - expected[keep] * draws) ** 2 / (expected[keep] * draws)).sum())
    dof = int(keep.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2))) > 1e-3


# ---- log-probabilities ----------------------------------------------------------------


@pytest.mark.parametrize("chain", [False, True], ids=["block", "chain"])
def test_logprobs_equal_target_only_and_a_one_pass_forward(chain):
    """Greedy speculative decoding with logprobs=3: each committed token's log-probability
    and top 3 equal target-only decoding's, and a single forward pass over prompt + output
    (log_softmax of the target's raw logits at each position)."""
    vocab, prompt, new = 12, [3, 1, 4, 1, 5], 20
    if chain:
        target = tiny.float64_target(7, vocab)
        t = TorchBatchTarget(target)
        style, d = "chain", TorchBatchPARD(tiny.pard_from_target(target, vocab - 1), vocab, 3, None)
    else:
        target, drafter = tiny_pair(7, vocab, 4)
        t, d = runners(target, drafter, None)
        style = "block"
    spec = _decode(roles(t, style, d), Mode.FROZEN, t, prompt, new)
    alone = _decode(roles(t), Mode.TARGET, t, prompt, new)
    assert spec.tokens == alone.tokens and spec.mean_accepted_length > 1.0  # drafts were accepted
    assert len(spec.logprobs) == len(spec.tokens) == new
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt + spec.tokens]), target.new_cache(len(prompt) + new))
    forward = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
    for i, ((token, lp, top), (token_, lp_, top_)) in enumerate(zip(spec.logprobs, alone.logprobs)):
        assert token == token_ == spec.tokens[i]
        assert abs(lp - lp_) < 1e-9 and abs(lp - float(forward[i, token])) < 1e-9
        assert [k for k, _ in top] == [k for k, _ in top_] == forward[i].topk(3).indices.tolist()
        assert max(abs(a - b) for (_, a), (_, b) in zip(top, top_)) < 1e-9


def _decode(roles_, mode, target, prompt, new):
    from runtime import assembly

    seen = []
    decoder = assembly.decoder(roles_, mode, target)
    gen = decoder.generate(Request(prompt=prompt, max_new_tokens=new, sampler=Sampler(), logprobs=3,
                                   on_tokens=lambda ids, entries: seen.extend(entries)))
    assert seen == gen.logprobs  # streamed as committed
    return gen


def test_prompt_scoring_equals_a_one_pass_forward():
    """Decoder.score (OpenAI's echo, lm-eval's loglikelihood): each prompt token's
    log-probability after the ones before it, the first None, as a single forward pass
    gives them; the scoring row leaves no row behind."""
    from runtime import assembly

    target, drafter = tiny_pair(9, 12, 4)
    t, _ = runners(target, drafter, None)
    decoder = assembly.decoder(roles(t), Mode.TARGET, t)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    entries = decoder.score(prompt, 2)
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), target.new_cache(len(prompt)))
    forward = torch.log_softmax(logits[0], -1)
    assert entries[0] == (3, None, [])
    for i, (token, lp, top) in enumerate(entries[1:]):
        assert token == prompt[i + 1] and abs(lp - float(forward[i, token])) < 1e-9
        assert [k for k, _ in top] == forward[i].topk(2).indices.tolist()
    assert decoder.score([7], 2) == [(7, None, [])]
    assert not decoder.active and decoder.generate(Request(prompt=prompt, max_new_tokens=3, sampler=Sampler())).tokens  # still usable
