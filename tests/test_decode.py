"""The one decode loop at batch > 1, for every drafting style: each sequence of a batch
(different prompts, budgets, stop tokens, join steps, some leaving early) decodes what it
decodes alone -- greedy: target-only's tokens; seeded sampling: the same tokens as its
own single-sequence run, whose law tests/test_speculative.py, test_pard.py and
test_ngram.py check -- so the lossless properties hold batched too."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

import tiny
from plugins.scaling import QueryScaling
from runtime.backends.pytorch import (TorchBatchDFlash, TorchBatchEagle3, TorchBatchPARD,
                                    TorchBatchTarget)
from runtime.decode import Decoder, Request, policy_for
from runtime.ngram import NGramProposer
from runtime.proposers import Block, Chain, Lookup, NoDrafts, Tree
from runtime.sampling import Sampler, Sampling
from speculative import generate_target_only
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape

from test_eagle3 import eagle_pair
from test_ngram import repetitive_prompt
from test_speculative import tiny_pair

SCALING = QueryScaling(ref_keys=12, top_k=4, slope=2.0)
STYLES = ["target", "ngram", "block", "hybrid", "window-hybrid", "pard", "eagle3-chain", "eagle3-tree"]
SHAPE = TreeShape(3, 3, 10)
COSTS = StepCosts((1.0, 0.5, 0.0, 0.0), (0.2, 0.0))


def alone(model, layers=()):
    """A batch target for a sequence decoded alone (a batch of one)."""
    target = TorchBatchTarget(model, layers)
    target.context_limit = model.config.max_position_embeddings
    return target


def setup(style: str, seed: int, vocab: int):
    """(maker of a target for a sequence alone, batch target, proposer maker, slack) of a
    style on tiny float64 models: the batch target is the fused one (trees packed in its
    pass); block and chain styles get the batched drafter (window-hybrid: each row under
    its own draft window), trees one drafter per row."""
    if style in ("target", "ngram", "block", "hybrid", "window-hybrid"):
        target, drafter = tiny_pair(seed, vocab, 4)
        layers = drafter.config.target_layer_ids
        single = lambda: alone(target, layers)  # noqa: E731
        ngram = lambda: NGramProposer(3, 1, 3)  # noqa: E731
        make = {"target": lambda: NoDrafts(), "ngram": lambda: Lookup(ngram),
                "block": lambda: Block(TorchBatchDFlash(drafter, target, SCALING)),
                "hybrid": lambda: Block(TorchBatchDFlash(drafter, target, SCALING), ngram),
                "window-hybrid": lambda: Block(TorchBatchDFlash(drafter, target, None, 6), ngram)}[style]
        batch = TorchBatchTarget(target, layers)
        batch.context_limit = target.config.max_position_embeddings
        return single, batch, make, 4
    if style == "pard":
        target, drafter = tiny.float64_target(seed, vocab), tiny.float64_pard(seed + 1, vocab)
        single = lambda: alone(target)  # noqa: E731
        make = lambda: Chain(TorchBatchPARD(drafter, vocab, 3, SCALING))  # noqa: E731
        batch = TorchBatchTarget(target)
        batch.context_limit = target.config.max_position_embeddings
        return single, batch, make, 4
    target, drafter = eagle_pair(seed, vocab)
    layers = drafter.config.feature_layers(target.config.num_layers)
    single = lambda: alone(target, layers)  # noqa: E731
    if style == "eagle3-chain":
        make = lambda: Chain(TorchBatchEagle3(drafter, SCALING, 3))  # noqa: E731
        batch = TorchBatchTarget(target, layers)
        batch.context_limit = target.config.max_position_embeddings
        return single, batch, make, 4
    make = lambda: Tree(TorchBatchEagle3(drafter, SCALING, SHAPE.depth, SHAPE), SHAPE)  # noqa: E731
    batch = TorchBatchTarget(target, layers)  # every row's tree in one packed pass
    batch.context_limit = target.config.max_position_embeddings
    return single, batch, make, SHAPE.total_tokens


def requests_from(shapes, vocab, seed, sampling=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, new, stop, repetitive) in enumerate(shapes):
        prompt = (repetitive_prompt(seed + i, vocab, n) if repetitive
                  else torch.randint(0, vocab, (n,), generator=g).tolist())
        out.append(Request(prompt=prompt, max_new_tokens=new, sampling=sampling or Sampling(),
                           stop_ids=frozenset({0}) if stop else frozenset()))
    return out


@settings(max_examples=examples(12), deadline=None)
@given(style=st.sampled_from(STYLES), seed=st.integers(0, 10**6), vocab=st.sampled_from([6, 12]),
       shapes=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 24), st.booleans(),
                                 st.booleans()), min_size=2, max_size=4),
       join=st.lists(st.integers(0, 4), min_size=4, max_size=4),
       max_batch=st.sampled_from([None, 2]), adaptive=st.booleans())
def test_every_style_batched_decodes_target_only_tokens(style, seed, vocab, shapes, join,
                                                        max_batch, adaptive):
    single, batch, make, slack = setup(style, seed, vocab)
    requests = requests_from(shapes, vocab, seed)
    decoder = Decoder(batch, make(), policy_for(COSTS if adaptive else None), slack)
    got = decoder.run(requests, max_batch, join[:len(requests)])
    for request, seq in zip(requests, got):
        want = generate_target_only(single(), request.prompt, request.max_new_tokens, Sampler(),
                                    request.stop_ids)
        assert seq.gen.tokens == want.tokens, style


@pytest.mark.parametrize("style", [s for s in STYLES if s != "eagle3-tree"])
def test_seeded_sampling_is_the_same_batched_and_alone(style):
    """Each sequence draws from its own seeded sampler, so its tokens do not depend on the
    batch: the law tests of the single-sequence runs carry over."""
    vocab = 12
    single, batch, make, slack = setup(style, 5, vocab)
    shapes = [(5, 16, False, True), (17, 12, False, False), (2, 16, True, True)]
    requests = [Request(prompt=q.prompt, max_new_tokens=q.max_new_tokens, sampling=Sampling(0.8, 0.9, seed=i), stop_ids=q.stop_ids)
                for i, q in enumerate(requests_from(shapes, vocab, 5))]
    got = Decoder(batch, make(), policy_for(COSTS), slack).run(requests, join_at=[0, 1, 0])
    for request, seq in zip(requests, got):
        one = Decoder(single(), make(), policy_for(COSTS), slack).generate(
            Request(prompt=request.prompt, max_new_tokens=request.max_new_tokens, stop_ids=request.stop_ids,
                    sampler=Sampler(request.sampling)))
        assert seq.gen.tokens == one.tokens, style


def test_a_tree_style_refuses_sampling_for_that_request_alone():
    single, batch, make, _ = setup("eagle3-tree", 1, 12)
    requests = [Request(prompt=[1, 2, 3], max_new_tokens=8), Request(prompt=[1, 2], max_new_tokens=8, sampling=Sampling(0.7, 1.0, seed=1)), Request(prompt=[4], max_new_tokens=8)]
    got = Decoder(batch, make()).run(requests)
    assert "verifies greedily" in got[1].error and not got[1].gen.tokens
    for request, seq in zip([requests[0], requests[2]], [got[0], got[2]]):
        assert seq.gen.tokens == generate_target_only(single(), request.prompt, 8, Sampler()).tokens


def test_a_batch_of_trees_verifies_in_one_target_call(monkeypatch):
    """A batched tree decoder as runtime/assembly.py builds it, three rows whose
    capacities share a bucket (capacity_bucket): a step's verify is one call of the
    target model, not one per row, and the rows still decode target-only's tokens."""
    from runtime import assembly
    from runtime.modes import Mode

    target, drafter = eagle_pair(3, 12)
    layers = drafter.config.feature_layers(target.config.num_layers)
    roles = assembly.Roles("tree", lambda: TorchBatchTarget(target, layers),
                           drafter=lambda setting: TorchBatchEagle3(drafter, SCALING, SHAPE.depth, SHAPE),
                           tree_shape=SHAPE)
    decoder = assembly.decoder(roles, Mode.FROZEN)
    requests = [Request(prompt=[1, 2, 3], max_new_tokens=6), Request(prompt=[4, 5], max_new_tokens=6), Request(prompt=[7, 8, 9, 1], max_new_tokens=6)]
    seqs = [decoder.add(r) for r in requests]
    calls, forward = [], target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(k) or forward(*a, **k))
    decoder.step()
    assert len(calls) == 1 and calls[0]["tree"] is not None
    while decoder.active:
        decoder.step()
    for request, seq in zip(requests, seqs):
        assert seq.gen.tokens == generate_target_only(alone(target, layers), request.prompt,
                                                      6, Sampler()).tokens
