"""Teacher-forced acceptance (runtime/acceptance.py) scores at every anchor exactly what a
greedy decoding run commits at the anchors it visits: for block (DFlash), chain (PARD)
and tree (EAGLE-3) drafters on tiny float64 pairs, scaled and frozen."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

import tiny
from plugins.scaling import QueryScaling
from runtime.acceptance import committed_per_anchor, greedy_continuation, max_drafts
from runtime.backends.pytorch import TorchBatchPARD, TorchBatchTarget
from runtime.sampling import Sampler
from speculative import generate_block, generate_chain, generate_tree
from runtime.tree import TreeShape

import test_eagle3
import test_speculative


def pair(style, seed, vocab, size):
    """(target runner, drafter runner, loop, tree shape) for one drafting style."""
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if seed % 2 else None
    if style == "block":
        t, d = test_speculative.runners(*test_speculative.tiny_pair(seed, vocab, size + 1), scaling)
        return t, d, generate_block, None
    if style == "chain":
        target = tiny.float64_target(seed, vocab)
        drafter = tiny.pard_from_target(target, vocab - 1) if seed % 3 else tiny.float64_pard(seed + 1, vocab)
        return TorchBatchTarget(target), TorchBatchPARD(drafter, vocab, size, scaling), generate_chain, None
    shape = TreeShape(3, size, 10)
    t, d = test_eagle3.runners(*test_eagle3.eagle_pair(seed % 5000, vocab), scaling, shape)
    return t, d, (lambda *a: generate_tree(*a, shape)), shape


@settings(max_examples=examples(30), deadline=None)
@given(style=st.sampled_from(["block", "chain", "tree"]), seed=st.integers(0, 10**6),
       vocab=st.sampled_from([4, 6, 12]), size=st.integers(1, 5), prompt_len=st.integers(2, 20),
       new=st.integers(1, 30))
def test_every_anchor_scores_what_decoding_commits_there(style, seed, vocab, size, prompt_len, new):
    t, d, loop, shape = pair(style, seed, vocab, size)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    cont = greedy_continuation(t, prompt, new + max_drafts(d, style, shape))
    scored = committed_per_anchor(d, cont, style, shape)
    assert len(scored) == new and all(1 <= c <= max_drafts(d, style, shape) + 1 for c in scored)
    # one token more: the loop's step at the last anchor also commits the target's token,
    # so only then does it have room for a whole step's drafts
    gen = loop(t, d, prompt, new + max_drafts(d, style, shape) + 1, Sampler())
    assert gen.tokens[:-1] == cont.tokens
    anchor = 0  # each step's bonus token: the last token committed before it
    for committed in gen.committed_per_step:
        if anchor >= new:
            break
        assert scored[anchor] == committed, (anchor, scored, gen.committed_per_step)
        anchor += committed


def test_the_anchor_check_sees_drafts_accepted():
    """Guard for the property test: on these pairs anchors do accept drafts."""
    for style in ("block", "chain", "tree"):
        best = 0.0
        for seed in range(6):
            t, d, _, shape = pair(style, seed, 6, 4)
            cont = greedy_continuation(t, [1, 2, 3], 40)
            scored = committed_per_anchor(d, cont, style, shape)
            best = max(best, sum(scored) / len(scored))
        assert best > 1.3, (style, best)


def test_a_continuation_too_short_for_one_step_is_refused():
    t, d, _, _ = pair("block", 0, 6, 4)
    cont = greedy_continuation(t, [1, 2, 3], 4)  # 4 drafts need 5 tokens
    with pytest.raises(ValueError, match="no anchor"):
        committed_per_anchor(d, cont, "block")
