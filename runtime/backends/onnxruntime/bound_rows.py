"""A batch's rows in buffers bound to a graph: BoundSlots, the slot manager
(runtime/backends/slots.py) over BoundKVCaches, which also keeps each row's committed
length; check_room and store, how a pass over a group's rows writes them."""

from __future__ import annotations

import numpy as np

from runtime.backends.slots import Group, Slots
from runtime.step_metadata import row_group
from runtime.backends.onnxruntime.buffers import BoundKVCache, buffer_dims

# Buffer rows of a new group: serve's default --max-batch, so a batch of up to 8 rows in
# one bucket never moves its rows into a bigger buffer (a regrowth copies every row's keys:
# at 4,096 tokens, 4 rows' worth in the turn that joined the fifth). Spare rows cost no
# memory until written.
FIRST_SLOTS = 8


class BoundSlots(Slots):
    """The slot manager (runtime/backends/slots.py) over BoundKVCaches bound to `session`
    (and `tree_session`, a graph that also reads the groups' buffers: target-tree.onnx):
    a group's cache has room for more rows than it holds, member i in buffer row i, and
    the first len(members) buffer rows are what the session's binding holds. A row joins
    into the next free buffer row -- prefilled there in place (reserve: joining copies
    nothing) or copied in -- and leaves by the last member moving into its place: one
    copy of one row's committed keys each. (Rebuilding the batch's buffer at every join
    and leave, as before, took 46 s of bench --batch 8's 320 at 512 / 4,096 tokens,
    beside 84 s of steps.) Spare rows cost no memory until written: a cache_buffer maps
    its pages as they are written. `lengths`: each batch row's committed length, in the
    batch's order (a step runs one pass per group, so each row reads a buffer near its
    own capacity rather than the batch's largest)."""

    def __init__(self, session, tree_session=None):
        super().__init__()
        self.session, self.tree_session = session, tree_session
        self.dims = buffer_dims(session)  # layers, kv_heads, head_dim
        self.lengths: list[int] = []

    def lengths_of(self, group: Group) -> list[int]:
        return [self.lengths[r] for r in group.members]

    def _new(self, capacity: int, slots: int) -> Group:
        return Group(row_group(capacity), BoundKVCache(capacity, *self.dims, batch=slots))

    def group_for(self, capacity: int) -> Group:
        """The group a row of `capacity` joins, with a free buffer row that holds it: its
        bucket's group, remade larger if full or too short (a larger buffer, or twice the
        rows; the members copied in), or a new group -- which joins self.groups only with
        its first row (a step must not meet an empty group)."""
        old = self.find(row_group(capacity))
        if old is None:
            return self._new(capacity, FIRST_SLOTS)
        slots = old.cache.k.shape[1]
        if len(old.members) < slots and capacity <= old.cache.capacity:
            return old
        group = self._new(max(old.cache.capacity, capacity),
                          2 * slots if len(old.members) == slots else slots)
        for i, r in enumerate(old.members):
            self._put(group, old.cache.k[:, i], old.cache.v[:, i], self.lengths[r], i)
        group.members, group.slots = list(old.members), list(old.slots)
        self._bind(group)
        self.groups[self.groups.index(old)] = group
        return group

    def reserve(self, capacity: int) -> BoundKVCache:
        """The cache a sequence about to join prefills into: the next free row of its
        group's buffer (BoundKVCache.row_of), so that joining copies nothing. A
        4,096-token row is about 190 MB of keys and values; copied in at the join, into
        a buffer row never touched before, it took up to 1.4 s of one turn on our VM
        (results/chunked-prefill-ab-128-base-pages.json), every running stream waiting."""
        group = self.group_for(capacity)
        return BoundKVCache.row_of(group, len(group.members))

    def join(self, new: BoundKVCache) -> None:
        """`new` becomes the batch's last row: a cache reserved in a group's buffer
        (reserve) is that buffer row already, unless members left while it prefilled
        (then it moves down, into rows touched before); any other is copied in."""
        group = getattr(new, "group", None)
        at = None if group is None else len(group.members)
        if group is None:
            group = self.group_for(new.capacity)
            at = len(group.members)
            self._put(group, new.k[:, 0], new.v[:, 0], new.length, at)
        elif new.slot != at:
            n = new.length
            group.cache.k[:, at, :, :n] = group.cache.k[:, new.slot, :, :n]
            group.cache.v[:, at, :, :n] = group.cache.v[:, new.slot, :, :n]
        self._admit(group, at)
        self._bind(group)
        self.lengths.append(new.length)

    def drop(self, row: int) -> None:
        super().drop(row)
        del self.lengths[row]

    @staticmethod
    def _put(group: Group, k: np.ndarray, v: np.ndarray, length: int, at: int) -> None:
        """Committed keys/values ([layers, kv_heads, >= length, head_dim]) into buffer row
        `at`."""
        group.cache.k[:, at, :, :length] = k[:, :, :length]
        group.cache.v[:, at, :, :length] = v[:, :, :length]

    def _leave(self, group: Group, at: int) -> None:
        """Member `at` leaves; the last member moves into its buffer row."""
        last = len(group.members) - 1
        if at != last:
            n = self.lengths[group.members[last]]
            group.cache.k[:, at, :, :n] = group.cache.k[:, last, :, :n]
            group.cache.v[:, at, :, :n] = group.cache.v[:, last, :, :n]
            group.members[at] = group.members[last]
        group.members.pop()
        group.slots.pop()
        self._bind(group)

    def _bind(self, group: Group) -> None:
        """Bind the members' buffer rows (a contiguous view of each layer: no copy), to
        the step graph and, where there is one, the tree graph."""
        import onnxruntime

        wrap, n = onnxruntime.OrtValue.ortvalue_from_numpy, len(group.members)
        values = [(f"cache_{name}_{i}", wrap(buffer[i, :n])) for name, buffer in
                  (("keys", group.cache.k), ("values", group.cache.v))
                  for i in range(self.dims[0])]
        group.binding = self.session.io_binding()
        group.tree_binding = self.tree_session.io_binding() if self.tree_session else None
        for binding in filter(None, (group.binding, group.tree_binding)):
            for name, value in values:
                binding.bind_ortvalue_input(name, value)


def check_room(cache: BoundKVCache, ends) -> None:
    """Refuse a pass whose rows would write up to `ends` past the cache's buffer."""
    end = int(max(ends))
    if end > cache.capacity:
        raise ValueError(f"KV cache holds {cache.capacity} tokens; asked to write up to {end}")


def store(cache: BoundKVCache, lengths: list[int], keys: np.ndarray, values: np.ndarray,
          counts: list[int]) -> None:
    """A pass's new keys/values [layers, g, kv_heads, t, head_dim]: the first counts[i] of
    the cache's row i at its committed length lengths[i]."""
    for i, (start, c) in enumerate(zip(lengths, counts)):
        cache.k[:, i, :, start:start + c] = keys[:, i, :, :c]
        cache.v[:, i, :, start:start + c] = values[:, i, :, :c]
