"""Token ids of several rows cross the roles flat (runtime/backends/roles.py: TokenRows),
and a batch's plain greedy rows are verified in one comparison (runtime/sampling.py:
greedy_verify), which must give every row exactly what its own Sampler gives it."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.backends.roles import TokenRows
from runtime.decode import Decoder, DraftKind, Proposal
from runtime.sampling import Sampler, Sampling, greedy_choice, greedy_verify
from tiers import examples

rows_of_ids = st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=5)


@settings(max_examples=examples(100), deadline=None)
@given(rows=rows_of_ids)
def test_token_rows_round_trip(rows):
    flat = TokenRows.of(rows)
    assert len(flat) == len(rows)
    assert flat.ids.dtype == flat.cu.dtype == torch.long
    assert flat.cu.tolist()[0] == 0 and flat.cu.tolist()[-1] == sum(map(len, rows))
    assert flat.lengths.tolist() == [len(r) for r in rows]
    assert flat.width == max(map(len, rows), default=0)
    assert [flat.row(r).tolist() for r in range(len(rows))] == rows
    if rows:
        assert flat.padded().tolist() == [r + [0] * (flat.width - len(r)) for r in rows]
        assert flat.last.tolist() == [r[-1] for r in rows] if all(rows) else True


@settings(max_examples=examples(100), deadline=None)
@given(rows=rows_of_ids.filter(bool), data=st.data())
def test_padded_takes_the_members_in_their_order(rows, data):
    flat = TokenRows.of(rows)
    members = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=4))
    widest = max(len(rows[r]) for r in members)
    width = data.draw(st.integers(widest, widest + 3))
    fill = data.draw(st.integers(-2, 99))
    got = flat.padded(members, width, fill)
    assert got.shape == (len(members), width) and got.dtype == torch.long
    assert got.tolist() == [rows[r] + [fill] * (width - len(rows[r])) for r in members]
    assert flat.padded(members).shape == (len(members), widest)


def test_empty_rows_and_no_rows():
    none = TokenRows.of([])
    assert len(none) == 0 and none.width == 0 and none.padded().shape == (0, 0)
    empty = TokenRows.of([[], [], []])
    assert empty.lengths.tolist() == [0, 0, 0] and empty.width == 0
    assert empty.padded(width=2, fill=7).tolist() == [[7, 7]] * 3
    mixed = TokenRows.of([[], [4, 5], []])
    assert mixed.padded().tolist() == [[0, 0], [4, 5], [0, 0]]
    assert mixed.row(0).tolist() == [] and mixed.row(1).tolist() == [4, 5]


@settings(max_examples=examples(100), deadline=None)
@given(rows=rows_of_ids, data=st.data())
def test_tails_and_extended(rows, data):
    flat = TokenRows.of(rows)
    counts = [data.draw(st.integers(0, len(r))) for r in rows]
    tails = flat.tails(torch.tensor(counts, dtype=torch.long))
    assert [tails.row(r).tolist() for r in range(len(rows))] == [r[len(r) - c:] for r, c in
                                                                 zip(rows, counts)]
    more = [data.draw(st.integers(0, 3)) for _ in rows]
    extended = flat.extended(torch.tensor(more, dtype=torch.long), 99)
    assert [extended.row(r).tolist() for r in range(len(rows))] == [r + [99] * m for r, m in
                                                                    zip(rows, more)]


def one_by_one(drafts: list[list[int]], logits: torch.Tensor) -> list[tuple[int, int]]:
    """Each row's verdict from its own greedy Sampler, as the loop gave it before."""
    out = []
    for i, d in enumerate(drafts):
        sampler = Sampler()
        if d:
            out.append(sampler.verify(d, logits[i, :len(d) + 1], None))
        else:
            out.append((0, sampler.pick(logits[i, 0])))
    return out


@settings(max_examples=examples(200), deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 6), vocab=st.integers(2, 7),
       ties=st.booleans())
def test_greedy_verify_equals_each_rows_sampler(seed, batch, vocab, ties):
    """Random logits (with `ties`: small integers, so argmaxes tie and the first maximum
    must win, as greedy_choice's), rows of mixed draft counts, 0 included, padded to the
    widest; drafts that follow the argmax for a while, so every acceptance count occurs."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (batch,), generator=g).tolist()
    width = max(counts) + 1
    if ties:
        logits = torch.randint(0, 3, (batch, width, vocab), generator=g).float()
    else:
        logits = torch.randn(batch, width, vocab, generator=g)
    argmax = greedy_choice(logits)
    drafts = []
    for i, n in enumerate(counts):
        keep = int(torch.randint(0, n + 1, (), generator=g))
        row = [int(argmax[i, j]) for j in range(keep)]
        row += torch.randint(0, vocab, (n - keep,), generator=g).tolist()
        drafts.append(row)
    flat = TokenRows.of([[0] + d for d in drafts])
    # padding of the drafts: a token the argmax may well equal, which must not count
    padded = flat.padded(fill=int(argmax[0, -1]))[:, 1:]
    accepted, following = greedy_verify(padded.numpy(), flat.lengths.numpy() - 1, argmax)
    assert list(zip(accepted.tolist(), following.tolist())) == one_by_one(drafts, logits)


@dataclasses.dataclass
class Row:
    """What _verify_rows reads of a Sequence."""
    sampler: Sampler
    tokens: list
    committed: int = 10

    @property
    def gen(self):
        return self


class FixedTarget:
    """Returns the logits it was given for a verify pass of exactly those rows."""

    def __init__(self, logits):
        self.logits, self.rows = logits, None

    def verify(self, rows: TokenRows):
        self.rows = rows
        return self.logits[:, :rows.width], None

    def rollback(self, lengths):
        self.lengths = lengths


@pytest.mark.parametrize("seed", range(4))
def test_the_loop_verifies_greedy_rows_batched_and_the_others_as_before(seed):
    """A batch of greedy rows, seeded sampling rows and a greedy row with a penalty:
    Decoder._verify_rows commits what each row's own Sampler commits (the sampling rows
    drawing from their own generators, in the same order)."""
    g = torch.Generator().manual_seed(seed)
    vocab, counts = 6, [3, 0, 2, 4, 1, 0]
    laws = [Sampling(), Sampling(), Sampling(temperature=0.8, seed=seed), Sampling(),
            Sampling(repetition_penalty=1.3), Sampling(temperature=1.0, seed=seed + 1)]
    logits = torch.randint(0, 3, (len(counts), max(counts) + 1, vocab), generator=g).float()
    argmax = greedy_choice(logits)
    proposals = []
    for i, n in enumerate(counts):
        row = [int(argmax[i, j]) for j in range(n // 2)]
        row += torch.randint(0, vocab, (n - len(row),), generator=g).tolist()
        proposals.append(Proposal(row, DraftKind.GREEDY if laws[i].greedy else DraftKind.ONE_HOT))
    batch = [Row(Sampler(law), [1, 2, 3]) for law in laws]
    for row in batch:
        row.sampler.bind([], row.tokens)
    decoder = Decoder(FixedTarget(logits), None)
    got = decoder._verify_rows(batch, proposals)
    want = []
    for i, (law, p) in enumerate(zip(laws, proposals)):
        sampler = Sampler(law)
        sampler.bind([], [1, 2, 3])
        n = len(p.tokens)
        if not n:
            accepted, token = 0, sampler.pick(logits[i, 0])
        else:
            accepted, token = sampler.verify_deterministic(p.tokens, logits[i, :n + 1])
        want.append(p.tokens[:accepted] + [token])
    assert [new for new, _, _ in got] == want
    assert decoder.target.rows.padded().tolist() == TokenRows.of(
        [[3] + p.tokens for p in proposals]).padded().tolist()
    for (new, _, kept), i in zip(got, range(len(counts))):
        assert torch.equal(kept, logits[i, :len(new)])


def test_greedy_verify_with_no_drafts_anywhere():
    argmax = np.array([[4], [2]])
    accepted, following = greedy_verify(np.zeros((2, 0), dtype=np.int64), np.array([0, 0]), argmax)
    assert accepted.tolist() == [0, 0] and following.tolist() == [4, 2]
