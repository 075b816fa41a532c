"""Batched steps pay for each row's own length, not the batch's longest: rows are grouped
by capacity bucket (step_metadata.capacity_bucket), one pass per group, on both CPU
backends; outputs stay those of each sequence alone, with rows joining, leaving from
the middle of a group and skipping a draft (an empty context)."""

import pytest
import torch

from runtime.backends.roles import TokenRows
from runtime.backends.onnxruntime import FIRST_SLOTS
from runtime.backends.pytorch import TorchBatchDFlash, TorchBatchTarget
from runtime.decode import Request
from runtime.models.layers import KVCache
from runtime.step_metadata import SHARED_CAPACITY, capacity_bucket, row_group

from test_batched import SCALING
from test_speculative import tiny_pair


def test_capacity_buckets_are_powers_of_two():
    assert [capacity_bucket(n) for n in (1, 2, 3, 4, 5, 512, 513, 1024, 4176)] == \
        [0, 1, 2, 2, 3, 9, 10, 10, 13]


def test_rows_up_to_the_shared_capacity_share_a_group_and_longer_ones_group_by_power_of_two():
    assert SHARED_CAPACITY == 1024
    assert {row_group(n) for n in (1, 20, 300, 513, 1024)} == {10}
    assert [row_group(n) for n in (1025, 2048, 2049, 4176)] == [11, 11, 12, 13]


def test_torch_short_rows_attend_over_their_own_group_only(monkeypatch):
    """Rows at 5 and 1,100 tokens (past the capacity short rows share: SHARED_CAPACITY):
    the short row's pass hands the op keys up to its own length, not the long row's, and
    both rows' logits equal each one's alone (a batch of one)."""
    target, drafter = tiny_pair(2, vocab=12, block=3, context=2048)
    batch = TorchBatchTarget(target, ())
    prompts = [[1, 2, 3, 4, 5], list(range(1, 11)) * 110]
    for p in prompts:
        batch.add(p, len(p) + 8)
    handed = []
    attend = KVCache.attend

    def recording(self, layer, start, q, k, v, visible, mask=None):
        handed.append((q.shape[0], int(torch.as_tensor(start).max()) + k.shape[2]))  # rows, reach
        return attend(self, layer, start, q, k, v, visible, mask)

    monkeypatch.setattr(KVCache, "attend", recording)
    logits, _ = batch.verify(TokenRows.of([[7], [8, 9]]))
    assert sorted(set(handed)) == [(1, 5 + 1), (1, 1100 + 2)]
    for i, (p, row) in enumerate(zip(prompts, ([7], [8, 9]))):
        alone = TorchBatchTarget(target, ())
        alone.add(p, len(p) + 8)
        want, _ = alone.verify(TokenRows.of([row]))
        torch.testing.assert_close(logits[i, :len(row)], want[0], atol=1e-12, rtol=0)


def test_torch_drafter_rows_in_two_groups_with_an_empty_context():
    """Drafter rows at 3 and 1,100 cached features (two buckets), the first with an empty
    context (a row that does not draft this step): each equals its own call alone (a batch
    of one)."""
    target, drafter = tiny_pair(5, vocab=40, block=4, context=2048)
    batch = TorchBatchDFlash(drafter, target, SCALING)
    g = torch.Generator().manual_seed(0)
    features = [torch.randn(n, drafter.fc.in_features, generator=g, dtype=torch.float64)
                for n in (3, 1100)]
    news = [features[0][:0], torch.randn(2, drafter.fc.in_features, generator=g,
                                         dtype=torch.float64)]
    want = []
    for f, new, bonus in zip(features, news, (5, 6)):
        alone = TorchBatchDFlash(drafter, target, SCALING)
        alone.add(len(f) + 8, f, 0)
        want.append(alone.draft([new], [bonus]))
        batch.add(len(f) + 8, f, 0)
    assert len(batch.caches.groups) == 2
    logits, visible = batch.draft(news, [5, 6])
    assert visible.tolist() == [int(w[1][0]) for w in want] == [3 + 0 + 4, 1100 + 2 + 4]
    for i, (w, _) in enumerate(want):
        torch.testing.assert_close(logits[i], w[0], atol=1e-12, rtol=0)


def test_onnx_rows_get_buffers_near_their_own_capacity(native_ort_engine):
    """A 10-token and a 1,100-token row: two buffers, each at its own row's capacity (the
    graph reads a bound buffer to its capacity), and each row's verify logits equal its
    single-sequence ones; a 300-token row shares the short row's (SHARED_CAPACITY)."""
    engine = native_ort_engine
    batch = engine.loaded.batch_target()
    prompts = [list(range(4, 14)), [5, 6, 7] * 366 + [5, 6], [8, 9, 10] * 100]
    for p in prompts:
        batch.add(p, len(p) + 10)
    assert sorted(g.cache.capacity for g in batch.groups) == [310, 1110]
    assert sorted(len(g.members) for g in batch.groups) == [1, 2]
    assert_onnx_rows_verify_as_alone(engine, batch, prompts, [[7, 8, 9], [8], [9, 10]], room=10)


def assert_onnx_rows_verify_as_alone(engine, batch, prompts, rows, room: int) -> None:
    """One verify of `rows` on the batch target gives each row the logits and features
    of its prompt (capacity len + room) verified alone (a batch of one)."""
    logits, features = batch.verify(TokenRows.of(rows))
    for i, (p, row) in enumerate(zip(prompts, rows)):
        alone = engine.loaded.batch_target()
        alone.add(p, len(p) + room)
        want, want_features = alone.verify(TokenRows.of([row]))
        torch.testing.assert_close(logits[i, :len(row)], want[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(features[i, :len(row)], want_features[0], atol=1e-4, rtol=0)


def test_onnx_rows_move_to_a_bigger_buffer_only_when_theirs_is_full_or_short(native_ort_engine):
    """Rows of one capacity bucket share a buffer of FIRST_SLOTS rows: a row that needs
    more capacity moves them into a longer buffer of as many rows, a row past its last
    row into one of twice the rows; every row's verify logits still equal its
    single-sequence ones."""
    engine = native_ort_engine
    batch = engine.loaded.batch_target()
    prompts = [[4 + i] * (30 + i) for i in range(FIRST_SLOTS + 1)]  # capacities 35..43
    assert len({row_group(len(p) + 5) for p in prompts}) == 1
    for i, p in enumerate(prompts):
        batch.add(p, len(p) + 5)  # each longer than the buffer holds: a longer buffer
        group, = batch.groups
        assert group.cache.capacity == len(p) + 5
        assert group.cache.k.shape[1] == (FIRST_SLOTS if i < FIRST_SLOTS else 2 * FIRST_SLOTS)
    assert_onnx_rows_verify_as_alone(engine, batch, prompts, [[7, 8]] * len(prompts), room=5)


def test_onnx_target_rows_prefill_into_their_buffer_row_and_join_without_a_copy(native_ort_engine,
                                                                               monkeypatch):
    """A prompt prefills straight into the buffer row it will hold (BoundSlots.reserve):
    joining copies no keys; a row that left while a prompt prefilled in parts moves the
    joining row down one buffer row, a group emptied meanwhile comes back; every row
    verifies as alone."""
    from runtime.backends.onnxruntime import BoundSlots

    engine = native_ort_engine
    batch = engine.loaded.batch_target()
    puts, put = [], BoundSlots._put
    monkeypatch.setattr(BoundSlots, "_put", staticmethod(lambda *a: puts.append(a[0]) or put(*a)))
    prompts = [[4 + i] * (22 - i) for i in range(3)]  # the first sets the buffer's capacity
    for p in prompts:
        batch.add(p, len(p) + 5)
    group, = batch.groups
    late = [9] * 16
    batch.prefill(late[:8], len(late) + 5)  # into buffer row 3
    batch.remove(0)  # the last member moves into buffer row 0
    del prompts[0]
    batch.prefill_more(late[8:])
    batch.join_prefilled()  # buffer row 3 -> 2
    prompts.append(late)
    assert puts == [] and batch.groups == [group] and group.members == [1, 0, 2]
    assert_onnx_rows_verify_as_alone(engine, batch, prompts, [[7, 8]] * 3, room=5)

    alone = engine.loaded.batch_target()
    alone.add(prompts[0], len(prompts[0]) + 5)
    first, = alone.groups
    alone.prefill(late, len(late) + 5)  # into buffer row 1
    alone.remove(0)  # the group empties and leaves the batch
    assert alone.groups == []
    alone.join_prefilled()
    assert puts == [] and alone.groups == [first] and first.members == [0]
    assert_onnx_rows_verify_as_alone(engine, alone, [late], [[7, 8]], room=5)


def test_onnx_drafter_rows_in_two_groups_with_an_empty_context(native_ort_engine, monkeypatch):
    """Two drafter rows in two groups, each read straight into its buffer row (no copy
    at the join); one step with one row's context empty equals each alone."""
    from runtime.backends.onnxruntime import BoundSlots

    engine = native_ort_engine
    puts, put = [], BoundSlots._put
    monkeypatch.setattr(BoundSlots, "_put", staticmethod(lambda *a: puts.append(a[0]) or put(*a)))
    g = torch.Generator().manual_seed(1)
    size = engine.loaded.sessions["drafter_kv"].get_inputs()
    size = next(i.shape[-1] for i in size if i.name == "context")
    features = [torch.randn(n, size, generator=g) for n in (6, 1100)]
    news = [features[0][:0], torch.randn(3, size, generator=g)]
    want = []
    for f, new, bonus in zip(features, news, (5, 6)):
        alone = engine.loaded.batch_drafter(engine.scaling)  # a batch of one
        alone.add(len(f) + 8, f, 0)
        logits, visible = alone.draft([new], [bonus])
        want.append((logits[0], int(visible[0])))
    puts.clear()  # the batches of one above are not the batch watched
    batch = engine.loaded.batch_drafter(engine.scaling)
    for f in features:
        batch.add(len(f) + 8, f, 0)
    assert len(batch.groups) == 2 and puts == []
    logits, visible = batch.draft(news, [5, 6])
    assert visible.tolist() == [w[1] for w in want]
    for i, (w, _) in enumerate(want):
        torch.testing.assert_close(logits[i], w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["sharpdraft", "target"])
def test_onnx_rows_joining_and_leaving_one_group_decode_as_alone(mode, native_ort_engine):
    """Seven rows in one bucket (five at once: more than a group's first buffer holds)
    and one in another; short budgets make rows leave from the middle of their group
    (the last row moves into the freed buffer row), later joins reuse it."""
    engine = native_ort_engine
    g = torch.Generator().manual_seed(7)
    lengths, budgets = [30, 28, 35, 40, 1100, 33, 38, 31], [3, 12, 2, 10, 8, 12, 4, 6]
    join_at = [0, 0, 0, 0, 0, 0, 1, 4]
    requests = [Request(prompt=torch.randint(4, 320, (n,), generator=g).tolist(), max_new_tokens=b)
                for n, b in zip(lengths, budgets)]
    seqs = engine.decoder(mode, adaptive=False).run(requests, join_at=join_at)
    for request, seq in zip(requests, seqs):
        alone = engine.generate(request.prompt, request.max_new_tokens, mode, stop=False,
                                adaptive=False)
        assert seq.gen.tokens == alone.tokens


def test_row_groups_ab_times_both_groupings_and_finds_the_same_logits(native_engine, tmp_path,
                                                                       monkeypatch, capsys):
    """scripts/row_groups_ab.py on the tiny engine: rows of 10, 300 and 1,100 tokens group
    as two (shared up to 1,024) or three (up to 256) passes, each timed per repeat."""
    import json
    from pathlib import Path

    from runtime import step_metadata
    from runtime.cli import code_commit

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import row_groups_ab

    monkeypatch.setattr(step_metadata, "SHARED_CAPACITY", step_metadata.SHARED_CAPACITY)
    out = tmp_path / "groups.json"
    assert row_groups_ab.main(["--engine-dir", str(native_engine), "--lengths", "10", "300",
                               "1100", "--new-tokens", "4", "--repeats", "2", "--out",
                               str(out)]) == 0
    record = json.loads(out.read_text())
    groups = {(r["shared_capacity"], r["tokens_per_row"]): r for r in record["rows"]}
    assert set(groups) == {(s, w) for s in (256, 1024) for w in (1, 4)}
    for width in (1, 4):
        assert groups[256, width]["group_capacities"] == [14, 304, 1104]
        assert groups[1024, width]["group_capacities"] == [304, 1104]
        assert all(len(groups[s, width]["step_ms"]) == 2 for s in (256, 1024))
    assert record["command"].startswith("python -m scripts.row_groups_ab --engine-dir")
    assert record["commit"] == code_commit()
    capsys.readouterr()
    assert row_groups_ab.main(["--engine-dir", str(tmp_path / "no-engine"), "--out",
                               str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no-engine" in err
    assert row_groups_ab.main(["--engine-dir", str(native_engine), "--shared", "300", "--out",
                               str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == "error: --shared takes powers of two, got [300]\n"
