"""Decoding on bare backend roles (a batch target and a drafter object in hand, no engine
directory), for tests: each helper describes its roles to runtime/assembly.py, the factory
Engine builds every decoder with, so tests run the production shape (its proposers, its
slack rule). A drafter is a batch drafter (blocks, chains) or a tree drafter (trees)."""

from __future__ import annotations

from runtime import assembly
from runtime.decode import Decoder, OnTokens, Request
from runtime.metrics import Generation
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape


def roles(target, style=None, drafter=None, lookup=None, tree_shape=None) -> assembly.Roles:
    """Roles over a batch `target` (and one `drafter`, of `style`)."""
    block_size = 1
    if style == "block":
        block_size = drafter.block_size
    elif style == "chain":
        block_size = drafter.max_drafts + 1
    return assembly.Roles(style, lambda: target,
                          drafter=(lambda s: drafter) if style is not None else None,
                          lookup=(lambda: lookup) if lookup is not None else NGramProposer,
                          tree_shape=tree_shape, block_size=block_size)


def decode_one(roles_: assembly.Roles, mode: Mode, target, prompt: list[int], max_new_tokens: int,
               sampler: Sampler, stop_ids=frozenset(), on_tokens: OnTokens = None,
               costs: StepCosts | None = None) -> Generation:
    """One sequence on `target` (a batch of one)."""
    decoder = assembly.decoder(roles_, mode, target, costs)
    return decoder.generate(Request(prompt=prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                    on_tokens=on_tokens, sampler=sampler))


def generate_target_only(target, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                         on_tokens=None) -> Generation:
    return decode_one(roles(target), Mode.TARGET, target, prompt, max_new_tokens, sampler,
                      stop_ids, on_tokens)


def generate_block(target, drafter, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                   on_tokens=None, costs=None, proposer: NGramProposer | None = None) -> Generation:
    """DFlash blocks; with `proposer`, assisted by n-gram lookup (hybrid)."""
    mode = Mode.FROZEN_HYBRID if proposer else Mode.FROZEN
    return decode_one(roles(target, "block", drafter, proposer), mode, target, prompt,
                      max_new_tokens, sampler, stop_ids, on_tokens, costs)


def generate_chain(target, drafter, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                   on_tokens=None, costs=None) -> Generation:
    return decode_one(roles(target, "chain", drafter), Mode.FROZEN, target, prompt,
                      max_new_tokens, sampler, stop_ids, on_tokens, costs)


def generate_tree(target, drafter, prompt, max_new_tokens, sampler, shape: TreeShape = TreeShape(),
                  stop_ids=frozenset(), on_tokens=None) -> Generation:
    return decode_one(roles(target, "tree", drafter, tree_shape=shape), Mode.FROZEN, target,
                      prompt, max_new_tokens, sampler, stop_ids, on_tokens)


def generate_ngram(target, proposer: NGramProposer, prompt, max_new_tokens, sampler,
                   stop_ids=frozenset(), on_tokens=None) -> Generation:
    return decode_one(roles(target, lookup=proposer), Mode.NGRAM, target, prompt,
                      max_new_tokens, sampler, stop_ids, on_tokens)


def batch_decoder(target, drafter=None, costs: StepCosts | None = None) -> Decoder:
    """Target-only (no drafter) or DFlash blocks over batched roles (BatchTarget,
    BatchBlockDrafter); requests join with add() and step together."""
    batched = roles(target, "block" if drafter is not None else None, drafter)
    return assembly.decoder(batched, Mode.FROZEN if drafter is not None else Mode.TARGET,
                            costs=costs)


def generate_batch(target, drafter, requests: list[Request], costs: StepCosts | None = None,
                   max_batch: int | None = None, join_at: list[int] | None = None):
    return batch_decoder(target, drafter, costs).run(requests, max_batch, join_at)


def chain_batch_decoder(target, drafter, costs: StepCosts | None = None) -> Decoder:
    """Chains over batched roles (BatchTarget, BatchChainDrafter); requests join with
    add() and step together."""
    return assembly.decoder(roles(target, "chain", drafter), Mode.FROZEN, costs=costs)


# the ONNX Runtime sessions a batch drafter runs (EAGLE-3's: its step and tree graphs)
DRAFTER_SESSIONS = ("session", "step_session", "tree_session")


def drafter_passes(decoder: Decoder, monkeypatch) -> list[int]:
    """From now on, count the passes of a decoder's batch drafter (its torch model's
    forward, or the runs of its ONNX Runtime sessions) in the returned one-item list."""
    counts = [0]
    drafter = decoder.proposer.drafter
    sessions = [name for name in DRAFTER_SESSIONS if hasattr(drafter, name)]

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def run(self, *args, **kwargs):
            counts[0] += 1
            return self.inner.run(*args, **kwargs)

    for name in sessions:
        monkeypatch.setattr(drafter, name, Counting(getattr(drafter, name)))
    if not sessions:
        inner = drafter.drafter.forward

        def counting(*args, **kwargs):
            counts[0] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(drafter.drafter, "forward", counting)
    return counts


def run_counting_passes(decoder: Decoder, counts: list[int]) -> list[int]:
    """Step the decoder until its rows finish: the drafter passes of each step."""
    per_step = []
    while decoder.active:
        before = counts[0]
        decoder.step()
        per_step.append(counts[0] - before)
    return per_step


def assert_batched_as_alone(together: list, alone: Generation, target, other: list[int],
                            max_new_tokens: int) -> None:
    """A sequence decoded beside `other` (a row at another length, joining a step later):
    the same tokens, per-step N and beta as alone; `other` gets the target's tokens."""
    assert together[0].gen.tokens == alone.tokens
    assert together[0].gen.visible_per_step == alone.visible_per_step
    assert together[0].gen.beta_per_step == alone.beta_per_step
    assert together[1].gen.tokens == generate_target_only(target, other, max_new_tokens, Sampler()).tokens


def assert_engine_rows_decode_as_alone(engine, prompts: list[list[int]], seqs: list,
                                       new_tokens: int, mode: str = "sharpdraft") -> None:
    """Each batched row of an engine's `mode` decoder (a scaled one): its own generate's
    tokens (and target-only's), N and beta per step; the rows' first betas differ, all
    above 1."""
    for prompt, seq in zip(prompts, seqs):
        alone = engine.generate(prompt, new_tokens, mode=mode, stop=False, adaptive=False)
        assert seq.gen.tokens == alone.tokens == engine.generate(prompt, new_tokens, mode="target",
                                                                 stop=False).tokens
        assert seq.gen.visible_per_step == alone.visible_per_step
        assert seq.gen.beta_per_step == alone.beta_per_step
    first = [seq.gen.beta_per_step[0] for seq in seqs]
    assert len(set(first)) == 3 and min(first) > 1.0  # each row its own beta, all scaled


def assert_chunked_join_drafts_as_whole(make_decoder, prompt: list[int], chunk: int, sampling,
                                        tolerance: float = 0.0, reader=None) -> None:
    """One request joined whole (Decoder.add) and in `chunk`-token parts (Decoder.join), each
    alone on its own decoder from make_decoder(): the first step's proposals agree (tokens,
    kind, visible keys, the draft distributions to `tolerance`, a tree's shape), so the
    drafter read the prompt in parts into the state one read leaves. With `reader` (a batch
    drafter's class, whose `_read_joining` reads a joining sequence's part, or a tree
    drafter's, whose `read` does), every read happens in the parts, none in the join's
    last part, and together they read the whole prompt."""
    import pytest
    import torch

    reads, turns = [], []
    whole_decoder, chunked_decoder = make_decoder(), make_decoder()
    with pytest.MonkeyPatch.context() as m:
        if reader is not None:
            name = "_read_joining" if hasattr(reader, "_read_joining") else "read"
            read = getattr(reader, name)

            def spy(self, part, more=None):  # (ids, features) of a chain, (context, last) of a block
                reads.append((len(turns), len(part)))
                return read(self, part, more)

            m.setattr(reader, name, spy)
        whole = whole_decoder.add(Request(prompt=prompt, max_new_tokens=8, sampling=sampling))
        reads.clear()
        joining = chunked_decoder.join(Request(prompt=prompt, max_new_tokens=8, sampling=sampling), chunk)
        while True:
            try:
                next(joining)
                turns.append(1)
            except StopIteration as joined:
                chunked = joined.value
                break
    assert len(turns) == -(-len(prompt) // chunk) > 1  # it joined in parts, then a last part
    if reader is not None:
        assert len(reads) > 1 and all(turn < len(turns) for turn, _ in reads), reads
        assert sum(n for _, n in reads) >= len(prompt) - 1
    (a,), (b,) = (d.proposer.propose([s]) for d, s in ((whole_decoder, whole), (chunked_decoder, chunked)))
    assert (a.tokens, a.kind, a.visible, a.tree) == (b.tokens, b.kind, b.visible, b.tree)
    if a.q is not None:
        torch.testing.assert_close(b.q, a.q, atol=tolerance, rtol=0)


def tree_batch_decoder(target, drafter, shape: TreeShape) -> Decoder:
    """EAGLE-3 trees over batched roles (BatchTarget, BatchTreeDrafter)."""
    return assembly.decoder(roles(target, "tree", drafter, tree_shape=shape), Mode.FROZEN)


def assert_trees_draft_as_per_row(make_target, drafter, oracle, shape: TreeShape,
                                  requests: list[Request], monkeypatch, join_at=None) -> list:
    """`requests` decoded as one batch on `drafter` (a batch tree drafter) and on `oracle`
    (today's per-row drafting: tests/tree_oracle.py), each on a batch target of its own
    from make_target(): every row's tokens, accepted counts, N and beta per step are the
    oracle's, and so is every tree it proposed, and a step of the batch is at most one
    drafter pass to ingest and one per level below the first, however many rows
    (`join_at`: the steps the rows join at). Returns each row's (tokens, accepted counts,
    N and beta per step)."""
    join_at = join_at or [0] * len(requests)

    def decode(tree_drafter, count: bool):
        decoder = tree_batch_decoder(make_target(), tree_drafter, shape)
        counts = drafter_passes(decoder, monkeypatch) if count else [0]
        seqs, passes, step, trees = [], [], 0, []
        propose = decoder.proposer.propose

        def recording(batch, aside=frozenset()):  # every step's trees, as proposed
            proposals = propose(batch, aside)
            trees.append([p.tree for p in proposals])
            return proposals

        decoder.proposer.propose = recording
        while len(seqs) < len(requests) or decoder.active:
            while len(seqs) < len(requests) and join_at[len(seqs)] <= step:
                seqs.append(decoder.add(requests[len(seqs)]))
            before = counts[0]
            if decoder.active:
                decoder.step()
                passes.append(counts[0] - before)
            step += 1
        return [(s.gen.tokens, s.gen.committed_per_step, s.gen.visible_per_step,
                 s.gen.beta_per_step) for s in seqs], passes, trees

    got, passes, got_trees = decode(drafter, True)
    want, _, want_trees = decode(oracle, False)
    assert got == want
    assert got_trees == want_trees  # the very trees, step by step
    assert max(passes) == shape.depth, passes  # not one per row
    return got
