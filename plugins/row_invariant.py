"""Arithmetic whose result for a row does not depend on the rows computed beside it, for
targets in bfloat16 or float16 (batch invariance, as in SGLang's and vLLM's deterministic
modes).

Speculative decoding is lossless only if the target gives a position the same logits
whether that position is computed alone (target-only decoding), among the drafts of a
verify pass, in a batch of other sequences or in a prefill chunk. A kernel may pick its
blocking by the shape it is handed, so the same row can come out with other rounding at
another row count. In float32 that moves logits by about 1e-6 and no greedy token here
changed; in bfloat16 one rounding step is 0.4%, and greedy tokens differed on 5-7 of 16
prompts within 32 tokens (`scripts/dtype_lossless.py`, `results/lossless-dtype-c3cab1e.json`;
after this, none: `results/lossless-dtype.json`).
Measured on this CPU's bfloat16 kernels: the 576-to-192 projection gave other bits
between a 300-row and a 128-row call, the LM head from 33 rows on, and attention for a
row among 9 query rows other bits than alone.

So every matrix multiply of such a target runs on exactly ROWS rows at a time (the last
block zero-padded), and attention (plugins/attention.py: row_invariant_attention) runs
its query rows in blocks of ROWS over keys padded to a multiple of KEYS: every call has a
shape that depends on nothing but the weights, and a row's result depends on its own
inputs only. It costs a padded block per call, which the decode steps of a small batch
pay in full (an 8-row step computes 32 rows); float32 targets do not use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS = 32  # rows of every matrix multiply (the first count at which a kernel here varied was 33)
KEYS = 64  # attention's keys are padded to a multiple of this
REDUCED = (torch.bfloat16, torch.float16)


def blocks_of_rows(x: torch.Tensor):
    """x [..., k] as zero-padded [ROWS, k] blocks, and the row count to trim back to."""
    rows = x.reshape(-1, x.shape[-1])
    padded = F.pad(rows, (0, 0, 0, -rows.shape[0] % ROWS))
    return padded.split(ROWS), rows.shape[0]


class RowBlockedLinear(nn.Module):
    """An nn.Linear whose matrix multiplies each take exactly ROWS rows. It holds the
    linear's own parameters, so a tied weight (an LM head sharing the embedding) stays
    tied."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks, n = blocks_of_rows(x)
        out = torch.cat([F.linear(block, self.weight, self.bias) for block in blocks])
        return out[:n].reshape(*x.shape[:-1], self.out_features)


def make_row_invariant(model: nn.Module) -> nn.Module:
    """Every nn.Linear inside `model` replaced by a RowBlockedLinear, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, RowBlockedLinear(child))
        else:
            make_row_invariant(child)
    return model
