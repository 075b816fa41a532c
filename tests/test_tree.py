"""Draft trees: what grow_trees keeps (a batch's rows each as today's per-row growth), the mask and visible-key counts a tree step hands
the attention op, the target's one-pass tree verification against plain causal passes,
a batch's trees packed in one pass against each row's own pass, and cache compaction to
the accepted path against caches built from scratch."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

from runtime.backends.roles import TokenRows
from plugins.attention import visible_counts
from runtime.backends.pytorch import TorchBatchTarget
from runtime.models.layers import KVCache
from runtime.sampling import Sampler
from speculative import generate_target_only
from runtime.step_metadata import StepMetadata
from runtime.tree import DraftTree, TreeShape, grow_trees

from tiny import float64_target
from tree_oracle import grow_tree as per_row_tree


def ancestors(parents, i):
    """Node i and its ancestors, by walking the parent links (the test's own count)."""
    out = []
    while i != -1:
        out.append(i)
        i = parents[i]
    return out


def random_tree(seed: int, size: int, vocab: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, size)]
    tokens = torch.randint(0, vocab, (size,), generator=g).tolist()
    return DraftTree(tuple(tokens), tuple(parents))


def test_ancestor_mask_marks_each_node_and_its_ancestors():
    tree = random_tree(0, 12, 5)
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(ancestors(tree.parents, i))
    assert tree.depths == [len(ancestors(tree.parents, i)) - 1 for i in range(len(tree))]


def test_greedy_path_follows_the_targets_choice():
    #        0:a
    #     1:b    2:c
    #   3:d  4:e    5:d
    tree = DraftTree((9, 1, 2, 3, 4, 3), (-1, 0, 0, 1, 1, 2))
    assert tree.greedy_path([2, 0, 3, 0, 0, 7]) == ([0, 2, 5], 7)
    assert tree.greedy_path([1, 4, 0, 0, 8, 0]) == ([0, 1, 4], 8)
    assert tree.greedy_path([5, 0, 0, 0, 0, 0]) == ([0], 5)  # no child matches: the target's token


def test_tree_shapes_and_trees_refuse_bad_values_in_one_line():
    for kwargs in ({"top_k": 0}, {"depth": 0}, {"total_tokens": 1}, {"top_k": 2.5}):
        with pytest.raises(ValueError) as err:
            TreeShape(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        DraftTree((1, 2), (-1, 1))  # a node its own parent
    assert TreeShape(4, 6, 20).within(2) == TreeShape(4, 2, 20)


class FakeDrafter:
    """Seeded log-probabilities per (level, token) and a record of every expansion."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(3 * torch.randn(64, vocab, vocab, generator=g, dtype=torch.float64), -1)
        self.calls = []

    def logp(self, level: int, token: int):
        return self.table[level, token]

    def expand(self, tokens, hidden, scratch_mask, offset):
        """One row's frontier (today's per-row expansion)."""
        self.calls.append((list(tokens), scratch_mask.clone(), offset))
        # the "hidden" state carries each row's level so the next level's rows can be checked
        return torch.stack([self.logp(offset + 2, t) for t in tokens]), hidden + 1

    def expand_rows(self, tokens, hidden, scratch_mask, offset):
        """Every row's frontier at once (grow_trees'): each row's N, made up from its
        scratch mask (what the op would count past a row of 100 committed keys)."""
        self.calls.append((tokens, scratch_mask.clone(), offset))
        logp = torch.stack([torch.stack([self.logp(offset + 2, t) for t in row]) for row in tokens])
        return logp, hidden + 1, 100 + scratch_mask.sum(-1)


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 9), top_k=st.integers(1, 5),
       depth=st.integers(1, 5), total=st.integers(2, 40))
def test_grow_tree_keeps_the_best_paths_and_hands_each_row_its_ancestors(seed, vocab, top_k, depth, total):
    fake = FakeDrafter(vocab, seed)
    root = 0
    (tree, visible), = grow_trees([root], fake.logp(1, root)[None], torch.zeros(1, 3), [100],
                                  fake.expand_rows, [TreeShape(top_k, depth, total)], lambda i: i)
    fake.calls = [(tokens[0], mask[0], offset) for tokens, mask, offset in fake.calls]
    assert visible == 100 + max(depth - 1, 0)  # committed keys + its path's scratch keys
    k = min(top_k, vocab)
    # Every candidate the drafter offered, with its path score, computed here: level 1
    # from the root's distribution, then top-k children of each expanded row.
    candidates = {}  # path (tuple of tokens) -> score
    first = fake.logp(1, root)
    for t in first.topk(k).indices.tolist():
        candidates[(t,)] = float(first[t])
    frontier = sorted(candidates, key=candidates.get, reverse=True)[:k]
    rows_keys = {}  # path -> scratch key index of its row
    for level, (tokens, scratch_mask, offset) in enumerate(fake.calls, start=2):
        assert offset == level - 2
        # the rows expanded are the best k of the previous level, best first
        assert sorted(tokens) == sorted(p[-1] for p in frontier)
        paths = sorted(frontier, key=lambda p: (-candidates[p],))
        by_token = {}
        for p in paths:
            by_token.setdefault(p[-1], []).append(p)
        assert scratch_mask.shape == (len(tokens), (level - 1) * k)
        row_paths = []
        for row, token in enumerate(tokens):
            p = by_token[token].pop(0)
            row_paths.append(p)
            rows_keys[p] = (level - 2) * k + row
            # the row sees exactly its ancestors' rows written by earlier levels, and itself
            want = {rows_keys[p[:j]] for j in range(1, len(p) + 1) if p[:j] in rows_keys}
            assert set(torch.nonzero(scratch_mask[row]).flatten().tolist()) == want
        children = {}
        for p in row_paths:
            lp = fake.logp(level, p[-1])
            for t in lp.topk(k).indices.tolist():
                children[p + (t,)] = candidates[p] + float(lp[t])
        candidates.update(children)
        frontier = sorted(children, key=children.get, reverse=True)[:k]
    assert len(fake.calls) == max(0, depth - 1)
    # the tree: the root and the best total - 1 candidates (ties aside), parents first
    paths = [tuple(tree.tokens[j] for j in reversed(ancestors(tree.parents, i)))[1:]
             for i in range(1, len(tree))]
    assert len(tree) == 1 + min(total - 1, len(candidates))
    assert all(p in candidates for p in paths)
    kept = [candidates[p] for p in paths]
    dropped = [s for p, s in candidates.items() if p not in set(paths)]
    if kept and dropped:
        assert min(kept) >= max(dropped) - 1e-12
    assert max(tree.depths) <= depth


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 9), top_k=st.integers(1, 5),
       depths=st.lists(st.integers(1, 5), min_size=1, max_size=8), total=st.integers(2, 40))
def test_a_batch_grows_each_rows_tree_as_per_row_growth_did(seed, vocab, top_k, depths, total):
    """Rows of a batch, each at its own root and depth (TreeShape.within), grown together
    (one expansion per level for every row's frontier): each row's tree is the one
    today's per-row growth (tests/tree_oracle.py) makes alone, and its N the most of its
    own levels' (a row past its depth rides along unread)."""
    fake = FakeDrafter(vocab, seed)
    roots = [(seed + r) % vocab for r in range(len(depths))]
    shapes = [TreeShape(top_k, total_tokens=total, depth=d) for d in depths]
    got = grow_trees(roots, torch.stack([fake.logp(1, r) for r in roots]),
                     torch.zeros(len(roots), 3), [100] * len(roots), fake.expand_rows, shapes,
                     lambda i: i)
    assert len(fake.calls) == max(depths) - 1  # one pass per level, not one per row
    for root, shape, (tree, visible) in zip(roots, shapes, got):
        alone = per_row_tree(root, fake.logp(1, root), torch.zeros(3), fake.expand, shape,
                             lambda i: i)
        assert tree == alone
        assert visible == 100 + shape.depth - 1


def test_visible_count_equals_the_unmasked_keys_for_causal_block_and_tree_masks():
    """N per row from StepMetadata (and what the op computes from what it is handed)
    against counts of unmasked keys in masks the test builds itself, key by key."""
    def count(row_allows, kv):
        return sum(1 for key in range(kv) if row_allows(key))

    # causal: 7 cached, 4 new rows; the row at position p sees keys 0..p
    meta = StepMetadata(7, 4)
    got = meta.causal_visible(4, 1)[0].tolist()
    assert got == [count(lambda key, p=7 + i: key <= p, 11) for i in range(4)]
    # block (DFlash): 7 cached, 2 new context rows, a block of 5 sees all 14 keys
    meta = StepMetadata(7, 2)
    assert meta.block_visible(5, 1)[0].tolist() == [count(lambda key: True, 14)] * 5
    # tree: 9 committed keys, then a tree of 8 rows each seeing its ancestors and itself
    tree = random_tree(3, 8, 5)
    rows = StepMetadata(9, len(tree)).tree_rows(tree.ancestor_mask()[None],
                                                torch.tensor([tree.depths]))
    independent = [count(lambda key, i=i: key < 9 or key - 9 in ancestors(tree.parents, i), 9 + len(tree))
                   for i in range(len(tree))]
    assert StepMetadata.tree_visible(rows.mask)[0].tolist() == independent
    handed, _ = visible_counts(rows.bound, rows.mask.shape[-1], rows.mask)  # what the op scales by
    assert handed[0].tolist() == independent
    assert rows.positions[0].tolist() == [9 + d for d in tree.depths] and rows.write_at == 9


def test_keep_moves_the_accepted_rows_into_place():
    cache = KVCache(2, 1, 2, 20, 3, torch.float64)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.length = 6
    cache.keep([0, 3, 2, 7])
    assert cache.length == 10
    for i, row in enumerate([0, 3, 2, 7]):
        assert torch.equal(cache.k[:, :, :, 6 + i], before_k[:, :, :, 6 + row])
        assert torch.equal(cache.v[:, :, :, 6 + i], before_v[:, :, :, 6 + row])
    assert torch.equal(cache.k[:, :, :, :6], before_k[:, :, :, :6])
    with pytest.raises(ValueError):
        cache.keep([1, 1])


def one(model, layers, prompt, capacity):
    """A batch target holding one sequence, `prompt` prefilled; and the prefill's output."""
    target = TorchBatchTarget(model, layers)
    return target, target.add(prompt, capacity)


def row_cache(target):
    """(committed length, KV cache) of a one-sequence batch target's row."""
    cache = target.caches.groups[0].cache
    return int(cache.lengths[0]), cache


def fresh(target_model, ids, layers):
    """A target whose cache was built by one causal prefill over `ids`."""
    return one(target_model, layers, ids, len(ids) + 4)[0]


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10**6), size=st.integers(1, 12), prompt_len=st.integers(1, 12))
def test_one_tree_pass_equals_causal_passes_along_every_path(seed, size, prompt_len):
    model = float64_target(seed % 1000, vocab=7, layers=3)
    layers = (0, 2)
    prompt = torch.randint(0, 7, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    tree = random_tree(seed, size, 7)
    target, _ = one(model, layers, prompt, prompt_len + size)
    (logits, features), = target.verify_trees([tree])
    assert row_cache(target)[0] == prompt_len  # the tree's keys are scratch
    for i in range(size):
        path = [tree.tokens[j] for j in reversed(ancestors(tree.parents, i))]
        alone, _ = one(model, layers, prompt, prompt_len + size)
        want_logits, want_features = alone.verify(TokenRows.of([path]))
        torch.testing.assert_close(logits[i], want_logits[0, -1], atol=1e-9, rtol=0)
        torch.testing.assert_close(features[i], want_features[0, -1], atol=1e-9, rtol=0)


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10**6), size=st.integers(1, 10), distractors=st.integers(0, 12),
       prompt_len=st.integers(1, 12))
def test_accepted_path_is_greedy_and_its_compacted_cache_equals_one_built_from_scratch(
        seed, size, distractors, prompt_len):
    vocab = 5
    model = float64_target(seed % 1000, vocab=vocab, layers=3)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    greedy = generate_target_only(TorchBatchTarget(model), prompt, size + 1, Sampler()).tokens
    # the greedy continuation as a chain below the root, then distractor children hung
    # on random nodes (never a second child with a sibling's token, nor the target's
    # next token under the chain's end: the path is then exactly the chain)
    tokens, parents = greedy[:size], [-1] + list(range(size - 1))
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(distractors):
        parent = int(torch.randint(0, len(tokens), (), generator=g))
        token = int(torch.randint(0, vocab, (), generator=g))
        siblings = [tokens[j] for j in range(len(tokens)) if parents[j] == parent]
        if token not in siblings and (parent, token) != (size - 1, greedy[size]):
            tokens.append(token)
            parents.append(parent)
    tree = DraftTree(tuple(tokens), tuple(parents))
    target, (logits, _) = one(model, (1,), prompt, prompt_len + len(tree) + 4)
    assert int(logits.argmax()) == greedy[0]
    (out, _), = target.verify_trees([tree])
    path, following = tree.greedy_path(out.argmax(-1).tolist())
    accepted = [tree.tokens[i] for i in path]
    assert path == list(range(size)) and accepted + [following] == greedy
    target.keep_paths(TokenRows.of([path]))
    n, cache = row_cache(target)
    assert n == prompt_len + size
    m, scratch = row_cache(fresh(model, prompt + accepted, (1,)))
    assert m == n
    torch.testing.assert_close(cache.k[:, :, :, :n], scratch.k[:, :, :, :n], atol=1e-9, rtol=0)
    torch.testing.assert_close(cache.v[:, :, :, :n], scratch.v[:, :, :, :n], atol=1e-9, rtol=0)


def test_reserve_grows_the_cache_and_keeps_what_it_held():
    cache = KVCache(2, 1, 2, 8, 3, torch.float64)
    cache.k.copy_(torch.randn_like(cache.k))
    before = cache.k.clone()
    cache.length = 5
    cache.reserve(6)  # already room: nothing changes
    assert cache.capacity == 8 and torch.equal(cache.k, before)
    cache.reserve(13)
    assert cache.capacity == 13 and cache.k.shape[3] == 13 and cache.length == 5
    assert torch.equal(cache.k[:, :, :, :8], before)
    cache.write(0, 5, torch.ones(1, 2, 8, 3, dtype=torch.float64), torch.ones(1, 2, 8, 3, dtype=torch.float64))


def test_packed_tree_rows_see_their_own_committed_keys_and_ancestors_only():
    """Three sequences at 4, 9 and 1 committed keys, each with its own tree padded to the
    widest (runtime/tree.py: pack): the mask StepMetadata hands the op against one the
    test builds key by key from where each sequence's keys lie (committed, then its
    tree's nodes at its own length), and the op's N against the ancestor count."""
    from runtime.tree import pack

    trees = [random_tree(1, 5, 6), DraftTree.root_only(3), random_tree(2, 7, 6)]
    cached = [4, 9, 1]
    ids, mask, depths = pack(trees)
    rows = StepMetadata(torch.tensor(cached), ids.shape[1]).tree_rows(mask, depths)
    kv = max(cached) + 7
    assert rows.mask.shape == (3, 7, kv) and rows.write_at.tolist() == cached
    for b, (tree, c) in enumerate(zip(trees, cached)):
        for i in range(len(tree)):
            want = [key < c or key - c in ancestors(tree.parents, i) for key in range(kv)]
            assert rows.mask[b, i].tolist() == want, (b, i)
            assert int(rows.positions[b, i]) == c + tree.depths[i]
        handed, _ = visible_counts(rows.bound, kv, rows.mask)
        assert handed[b, :len(tree)].tolist() == [c + len(ancestors(tree.parents, i))
                                                  for i in range(len(tree))]
    # the committed keys padded wider than the longest (an exported graph's past input,
    # past_width): each sequence's keys lie where they did, and the extra room is nobody's
    wider = StepMetadata(torch.tensor(cached), ids.shape[1], past_width=12).tree_rows(mask, depths)
    assert wider.mask.shape == (3, 7, 12 + 7)
    assert torch.equal(wider.mask[..., :kv], rows.mask) and not wider.mask[..., kv:].any()
    assert torch.equal(wider.bound, rows.bound) and torch.equal(wider.write_at, rows.write_at)


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8),
                                                           st.sampled_from([0, 40])),
                                                 min_size=1, max_size=4))
def test_a_packed_tree_pass_gives_each_row_what_its_own_pass_gives(seed, rows):
    """Rows at different lengths (some in another capacity group), trees of different
    sizes (a root alone too) in one batch target's pass: each node's logits and features
    equal the row's own verify_trees alone (a batch of one); after keep_paths each row's
    cache holds its accepted path (its next verify equals the one alone's)."""
    model = float64_target(seed % 1000, vocab=7, layers=3)
    layers = (0, 2)
    g = torch.Generator().manual_seed(seed)
    batch, singles, trees = TorchBatchTarget(model, layers), [], []
    for i, (prompt_len, size, extra) in enumerate(rows):
        prompt = torch.randint(0, 7, (prompt_len,), generator=g).tolist()
        batch.add(prompt, prompt_len + size + 2 + extra)
        singles.append(one(model, layers, prompt, prompt_len + size + 2 + extra)[0])
        trees.append(random_tree(seed + i, size, 7))
    got = batch.verify_trees(trees)
    paths = []
    for single, tree, (logits, features) in zip(singles, trees, got):
        (want_logits, want_features), = single.verify_trees([tree])
        assert logits.shape == want_logits.shape
        torch.testing.assert_close(logits, want_logits, atol=1e-9, rtol=0)
        torch.testing.assert_close(features, want_features, atol=1e-9, rtol=0)
        end = int(torch.randint(0, len(tree), (), generator=g))
        paths.append(list(reversed(ancestors(tree.parents, end))))
    batch.keep_paths(TokenRows.of(paths))
    following = [[int(torch.randint(0, 7, (), generator=g))] for _ in rows]
    logits, _ = batch.verify(TokenRows.of(following))
    for i, (single, path) in enumerate(zip(singles, paths)):
        single.keep_paths(TokenRows.of([path]))
        want, _ = single.verify(TokenRows.of([following[i]]))
        torch.testing.assert_close(logits[i, :1], want[0], atol=1e-9, rtol=0)


def test_keep_each_moves_every_sequences_path_into_place():
    cache = KVCache(2, 3, 2, 20, 3, torch.float64, per_sequence=True)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.lengths = torch.tensor([6, 2, 9])
    paths = [[0, 3, 2, 7], [0], [0, 2]]
    cache.keep_each(paths)
    assert cache.lengths.tolist() == [10, 3, 11]
    for b, (start, path) in enumerate(zip([6, 2, 9], paths)):
        for i, row in enumerate(path):
            assert torch.equal(cache.k[:, b, :, start + i], before_k[:, b, :, start + row])
            assert torch.equal(cache.v[:, b, :, start + i], before_v[:, b, :, start + row])
        assert torch.equal(cache.k[:, b, :, :start], before_k[:, b, :, :start])
    with pytest.raises(ValueError):
        cache.keep_each([[1, 1], [0], [0]])
