"""The lengths of one decoding step, in one place (TensorRT-LLM's attention metadata,
vLLM's CommonAttentionMetadata): per sequence, the tokens already cached and the tokens
the step adds; from them, per query row, the positions and the visible-key count N that
the attention op scales by. Every model, exported graph, backend and command takes N from
here; tests/test_step_metadata.py checks that no other module derives it.

Rows of a batch may sit at different lengths; a step's tensors are padded to the widest
sequence, and a padding row's outputs are never read (its keys land past the sequence's
committed length, which the next write overwrites).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TreeRows(NamedTuple):
    """What the attention of one tree step is handed (StepMetadata.tree_rows)."""
    positions: torch.Tensor  # [b, t] RoPE positions
    bound: torch.Tensor  # [b, t] the op's `visible` argument: every key, so the mask decides
    mask: torch.Tensor  # [b, t, cached + s] committed keys, then the scratch keys allowed
    write_at: int  # where the step's own keys go in the cache


class StepMetadata:
    """cached: tokens in each sequence's cache before the step, an int (every sequence
    alike; a 0-d tensor while tracing) or int64 [batch]; new: tokens each sequence adds
    (context features for a DFlash drafter, ids for the target), the same kinds.
    past_width: with per-sequence `cached`, the width of the committed keys' axis when it
    is padded past the longest sequence's (an exported graph's past input, whose length is
    a shape while tracing, not a value); None: the longest cached."""

    def __init__(self, cached, new, past_width=None):
        _check_lengths(cached=cached, new=new)
        self.cached, self.new, self.past_width = cached, new, past_width

    @classmethod
    def of(cls, cache, new) -> "StepMetadata":
        """A step over `cache` (its per-sequence `lengths` when it has them, and the width
        its committed keys are padded to where it says: `past_width`)."""
        lengths = getattr(cache, "lengths", None)
        return cls(cache.length if lengths is None else lengths, new,
                   getattr(cache, "past_width", None))

    @property
    def per_sequence(self) -> bool:
        return torch.is_tensor(self.cached) and self.cached.dim() == 1

    def _column(self, value, device):
        if torch.is_tensor(value) and value.dim() == 1:
            return value.to(device)[:, None]
        return value

    def positions(self, width: int, batch: int, device=None, after_new: bool = False):
        """[batch, width] positions of the step's rows: cached + i, or, for a block that
        follows the new context (after_new), cached + new + i."""
        start = self._column(self.cached, device)
        if after_new:
            start = start + self._column(self.new, device)
        return (torch.arange(width, device=device) + start).expand(batch, width)

    def causal_visible(self, width: int, batch: int, device=None) -> torch.Tensor:
        """Causal rows (the target, chain drafters): row i sees past + i + 1 keys."""
        return self.positions(width, batch, device) + 1

    def block_visible(self, block: int, batch: int, device=None) -> torch.Tensor:
        """DFlash block rows (bidirectional): every row sees context + block keys."""
        return self.positions(1, batch, device, after_new=True).expand(batch, block) + block

    def block_keys(self, block: int):
        """N of each sequence's block rows, [batch] (or an int when every sequence is alike):
        what the stats report and beta(N) is computed from."""
        return self.cached + self.new + block

    @staticmethod
    def block_window(visible: torch.Tensor, block: int, window):
        """DFlash block rows under a draft window, each row's own range from its own
        `visible` (block_visible: a batch's rows at their own lengths): (lowest, counts),
        both [batch, block]. Row (b, i) sees keys [lowest, visible) -- its block and the
        last `window` context keys before it, the most a drafter trained on windows of
        `window` tokens ever saw -- counts = min(visible, window + block) of them, what
        beta reads where it applies. window: an int >= 1, or an exported graph's [1]
        tensor where 0 means no window (lowest 0, counts visible)."""
        if torch.is_tensor(window):
            on = window > 0
            return (torch.where(on, visible - block - window, 0),
                    torch.where(on, torch.minimum(visible, window + block), visible))
        return visible - block - window, visible.clamp(max=window + block)

    @staticmethod
    def tree_visible(mask: torch.Tensor) -> torch.Tensor:
        """Tree rows: the keys a [batch, q_len, kv_len] mask leaves unmasked."""
        return mask.sum(-1)

    def tree_rows(self, scratch_mask: torch.Tensor, offsets: torch.Tensor) -> "TreeRows":
        """A step of t tree rows (EAGLE-3 drafting, the target's one-pass tree verify)
        after `cached` committed keys and s >= t scratch keys past them, the step's own
        t keys last. scratch_mask [b, t, s]: the scratch keys each row may see (its tree
        ancestors and itself); offsets [b, t]: each row's position past the committed
        ones (its depth below the tree's root). `cached` an int: every sequence alike;
        [b] (a batch of trees packed in one pass): sequence i's scratch keys start at
        its own cached[i], so its rows see its committed keys and its own tree only."""
        if self.per_sequence:
            return self._packed_tree_rows(scratch_mask, offsets)
        b, t, s = scratch_mask.shape
        committed = scratch_mask.new_ones((b, t, self.cached))
        mask = torch.cat([committed, scratch_mask], -1)
        # The bound lets every key through, so the mask alone decides: the op's N for a
        # row is then the keys left unmasked (tree_visible), never the cache's length.
        bound = torch.full((b, t), self.cached + s, dtype=torch.long, device=mask.device)
        return TreeRows(offsets + self.cached, bound, mask, self.cached + s - t)

    def _packed_tree_rows(self, scratch_mask: torch.Tensor, offsets: torch.Tensor) -> "TreeRows":
        """tree_rows over per-sequence lengths: the keys run to the longest sequence's
        cached (or past_width) + s; key j of sequence i is committed below cached[i], its
        scratch key j - cached[i] up to cached[i] + s, and past that another sequence's room."""
        b, t, s = scratch_mask.shape
        device = scratch_mask.device
        cached = self.cached.to(device)
        width = int(cached.max()) if self.past_width is None else self.past_width
        relative = torch.arange(width + s, device=device) - cached[:, None]  # [b, keys]
        scratch = (relative >= 0) & (relative < s)
        picked = scratch_mask.gather(2, relative.clamp(0, s - 1)[:, None, :].expand(b, t, -1))
        mask = (relative < 0)[:, None, :] | (picked & scratch[:, None, :])
        bound = (cached + s)[:, None].expand(b, t)
        return TreeRows(offsets + cached[:, None], bound, mask, cached + s - t)

    def committed(self):
        """Each sequence's cache length after the step."""
        return self.cached + self.new


def _check_lengths(**lengths) -> None:
    """Counts are validated here, where they are made, so the attention op need not read
    them back on a GPU (a host read there breaks CUDA-graph capture): with cached >= 0 and
    new >= 0 every row's visible count is >= 1. Python ints and CPU tensors are checked;
    CUDA tensors (a captured step edits them in place) and traced values are not."""
    from plugins.scaling import _tracing

    for name, value in lengths.items():
        if isinstance(value, torch.SymInt):  # a symbolic size while exporting
            continue
        if torch.is_tensor(value):
            if value.device.type != "cpu" or _tracing() or not value.numel():
                continue
            if value.is_floating_point() or value.is_complex():
                raise ValueError(f"step lengths must be whole numbers, got {name} of {value.dtype}")
            if int(value.min()) < 0:
                raise ValueError(f"step lengths must be >= 0, got {name} = {value.tolist()}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"step lengths must be whole numbers >= 0, got {name} = {value!r}")


def capacity_bucket(capacity: int) -> int:
    """log2 of the power of two a capacity rounds up to: the compiled steps' static
    capacities (runtime/backends/pytorch/compiled.py) and, from SHARED_CAPACITY up, the batched backends'
    groups (row_group)."""
    return max(capacity - 1, 0).bit_length()


# Rows of capacities up to this share one group: below it a pass more costs more than the
# padded attention the shorter rows then pay. One step of 8 rows on the default engine
# (ONNX Runtime, SmolLM2-135M, 2 cores; scripts/row_groups_ab.py, medians of 15): prompts
# of 100-400 tokens 62.7 ms as groups of 256 and 512, 47.2 ms as one
# (results/row-groups.json); of 100-900 tokens 73.4 ms as groups of 512 and 1,024, 62.8
# as one (4 tokens a row: even; results/row-groups-long.json); of 200-1,900 tokens one
# group of 2,048 no longer pays (4 tokens a row: 167.5 ms against 156.3 as two;
# results/row-groups-2k.json).
SHARED_CAPACITY = 1024


def row_group(capacity: int) -> int:
    """The batched backends' rule for which rows share a cache and a pass of each step:
    those whose capacities round up to the same power of two, every capacity up to
    SHARED_CAPACITY in one group. A row in a pass pays for the pass's widest reach (the
    bound buffer's capacity in ONNX Runtime's graphs, the longest row's length in
    torch's), so a 512-token row beside a 4,096-token one would pay eight times its own
    attention; a pass more per group costs one more read of the weights."""
    return capacity_bucket(max(capacity, SHARED_CAPACITY))


def padded_context(contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Context features [c_i, F] of each sequence -> [b, C, F] (C >= 1) and c_i [b]."""
    width = max(1, max(c.shape[0] for c in contexts))
    batch = contexts[0].new_zeros((len(contexts), width, contexts[0].shape[-1]))
    for i, c in enumerate(contexts):
        batch[i, :c.shape[0]] = c
    return batch, torch.tensor([c.shape[0] for c in contexts], dtype=torch.long)
