"""One slot manager for every backend's batch: a batch's rows grouped by capacity bucket
(runtime/step_metadata.py: row_group, capacity_bucket), so a step runs one pass per group
and a row attends over its group's reach, not the batch's. A group's `members` are its
rows in the batch's order, `slots` each one's buffer row; a sequence joins as the batch's
last row (its prefilled keys put into a slot of its bucket's group, or prefilled in place
in one: ONNX Runtime's reserved rows) and leaves from any row, the rows after it moving
up one. What a group's buffers are is the backend's (a subclass's hooks):

  TorchSlots   (eager torch)    a per-sequence KVCache per group, member i in row i; a
                                join concatenates, a leave drops the row
  FixedSlots   (compiled torch) leased fixed-shape buffers (a power of two of keys and
                                of slots), host lengths per slot: a join copies into a
                                free slot, a leave idles it; the group moves only when it
                                outgrows its slots or drops to a quarter of them
  BoundSlots   (ONNX Runtime, runtime/backends/onnxruntime/bound_rows.py) bound host buffers with
                                spare rows, member i in row i; a leave moves the last
                                member into its place
"""

from __future__ import annotations

import torch

from runtime.step_metadata import capacity_bucket, row_group


class Group:
    """One bucket's rows: `cache` their buffers, `members` the batch rows in it, `slots`
    each member's buffer row; `lengths`: every buffer row's committed length on the host
    (fixed buffers: no step reads one back), `lease` gives leased buffers back."""

    def __init__(self, bucket: int, cache, lease=None):
        self.bucket, self.cache, self.lease = bucket, cache, lease
        self.members: list[int] = []
        self.slots: list[int] = []
        self.lengths: list[int] = []

    def sync(self) -> None:
        """The host lengths to the device (a copy in, never a read back)."""
        self.cache.lengths.copy_(torch.tensor(self.lengths, dtype=torch.long))


class Slots:
    """The bookkeeping every backend shares: which group holds which batch row, joins as
    the last row, leaves from any row. Subclasses store (`_leave`: a member other than
    the group's last leaves; `_release`: the group's last member left)."""

    def __init__(self):
        self.groups: list[Group] = []
        self.rows = 0

    def find(self, bucket: int) -> Group | None:
        return next((g for g in self.groups if g.bucket == bucket), None)

    def each(self):
        """(cache, members) of every group, as a step runs them."""
        return [(g.cache, g.members) for g in self.groups]

    def group_of(self, row: int) -> Group:
        return next(g for g in self.groups if row in g.members)

    def _admit(self, group: Group, slot: int) -> None:
        """The sequence in `group`'s buffer row `slot` becomes the batch's last row."""
        if group not in self.groups:  # new, or emptied while this row prefilled
            self.groups.append(group)
        group.members.append(self.rows)
        group.slots.append(slot)
        self.rows += 1

    def drop(self, row: int) -> None:
        group = self.group_of(row)
        if len(group.members) == 1:
            group.members.clear()
            group.slots.clear()
            self._release(group)
            self.groups.remove(group)
        else:
            self._leave(group, group.members.index(row))
        for g in self.groups:  # the rows after it move up one
            g.members[:] = [r - (r > row) for r in g.members]
        self.rows -= 1

    def _leave(self, group: Group, at: int) -> None:
        raise NotImplementedError

    def _release(self, group: Group) -> None:
        if group.lease is not None:
            group.lease()


class TorchSlots(Slots):
    """Eager torch: a group's cache is one per-sequence KVCache (`new_cache()`: an empty
    one), member i in its row i; a sequence joins by concatenation (KVCache.join)."""

    def __init__(self, new_cache):
        super().__init__()
        self.new_cache = new_cache

    def join(self, joining) -> None:
        """A sequence's own cache (`joining`, one sequence) in as the batch's last row."""
        bucket = row_group(joining.capacity)
        group = self.find(bucket) or Group(bucket, self.new_cache())
        group.cache.join(joining)
        self._admit(group, len(group.members))

    def _leave(self, group: Group, at: int) -> None:
        group.cache.drop(at)
        group.members.pop(at)
        group.slots.pop()  # member i stays in row i

    def rollback(self, lengths: list[int]) -> None:
        for group in self.groups:
            group.cache.lengths = torch.tensor([lengths[r] for r in group.members],
                                               dtype=torch.long, device=group.cache.k.device)


def slots_for(rows: int) -> int:
    """Buffer rows for a group of `rows` sequences: the next power of two (few shapes, few
    graphs; idle slots run as padding)."""
    return 1 << max(rows - 1, 0).bit_length()


class FixedSlots(Slots):
    """Compiled torch: fixed shapes, so a group's step is one compiled graph. A group's
    buffers hold a power of two of keys (a sequence's capacity + `room`, rounded up:
    compiled.py's static_capacity) and of slots (slots_for), leased from the engine's `pool` (runtime/backends/pytorch/compiled.py: BufferPool).
    A sequence joins into a free slot (one copy: its own keys) and leaves its slot idle;
    the group moves to other buffers only when it outgrows its slots or drops to a
    quarter of them."""

    def __init__(self, pool, room: int = 0):
        super().__init__()
        self.pool, self.room = pool, room

    def _lease(self, bucket: int, slots: int):
        return self.pool.lease(self, 1 << bucket, slots)

    def _new(self, bucket: int) -> Group:
        group = Group(bucket, *self._lease(bucket, 1))
        group.lengths = [0]
        return group

    @torch.inference_mode()
    def join(self, joining) -> None:
        """A sequence's own cache (`joining`, one sequence) copied into a free slot of
        its bucket's group, as the batch's last row."""
        bucket = capacity_bucket(joining.capacity + self.room)
        group = self.find(bucket)
        if group is None:
            group = self._new(bucket)
        elif len(group.members) == len(group.lengths):
            self._move(group, 2 * len(group.lengths))
        slot = next(i for i in range(len(group.lengths)) if i not in group.slots)
        n = joining.length
        group.cache.k[:, slot, :, :n] = joining.k[:, 0, :, :n]
        group.cache.v[:, slot, :, :n] = joining.v[:, 0, :, :n]
        group.lengths[slot] = n
        group.sync()
        self._admit(group, slot)

    @torch.inference_mode()
    def drop(self, row: int) -> None:
        super().drop(row)

    def _leave(self, group: Group, at: int) -> None:
        group.members.pop(at)
        group.lengths[group.slots.pop(at)] = 0
        if len(group.members) <= len(group.lengths) // 4:
            self._move(group, slots_for(len(group.members)))

    @torch.inference_mode()
    def reserve(self, group: Group, keys: int) -> None:
        """Room for `keys` keys in each of `group`'s buffer rows (a step's scratch past its
        rows' lengths, like a packed tree's nodes): buffers of a bigger bucket where its
        own lack it (the decoder's slack makes that rare)."""
        if keys > group.cache.capacity:
            group.bucket = capacity_bucket(keys)
            self._move(group, len(group.lengths))

    def _move(self, group: Group, slots: int) -> None:
        """The group's sequences into `slots` new buffer rows of its bucket, in their
        order; the old buffers back to the pool."""
        cache, lease = self._lease(group.bucket, slots)
        n, keys = len(group.slots), group.cache.capacity
        cache.k[:, :n, :, :keys] = group.cache.k[:, group.slots]
        cache.v[:, :n, :, :keys] = group.cache.v[:, group.slots]
        lengths = [group.lengths[s] for s in group.slots]
        group.lease()
        group.cache, group.lease = cache, lease
        group.slots = list(range(len(lengths)))
        group.lengths = lengths + [0] * (slots - len(lengths))
        group.sync()

    @torch.inference_mode()
    def rollback(self, lengths: list[int]) -> None:
        for group in self.groups:
            for r, slot in zip(group.members, group.slots):
                group.lengths[slot] = lengths[r]
            group.sync()
