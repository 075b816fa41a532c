"""The scaled attention call: beta(N) per query row, N from vLLM's own attention metadata.

`wrap(attention, scaling, causal, tally, index)` replaces one Attention layer's
`impl.forward` (an instance attribute: other layers and models keep the class's) with a
function that multiplies the query rows by beta of the keys each row sees and then calls
the original. Everything it does is tensor ops on the metadata's device tensors -- no
value is read back on the host, no Python branch depends on one -- so a CUDA graph that
captures the drafter captures the scaling and its count, and each replay repeats both.
"""

from __future__ import annotations

import torch

from ..scaling import QueryScaling


def visible_keys(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_rows: int,
                 causal: bool) -> torch.Tensor:
    """N for each of `num_rows` query rows [num_rows], on the metadata's device: the row's
    request r (query_start_loc[r] <= row < query_start_loc[r + 1]) sees seq_lens[r] keys,
    or, in a causal layer, seq_lens[r] - (rows of r after this one). Rows past the last
    request (padding for a captured batch size) read the last request's count; their
    output is discarded by vLLM."""
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    last = seq_lens.shape[0] - 1
    request = torch.searchsorted(query_start_loc[1:last + 2].contiguous(), rows, right=True).clamp(max=last)
    n = seq_lens[request]
    if causal:
        n = n - (query_start_loc[request + 1] - 1 - rows).clamp(min=0)
    return n


def wrap(attention, scaling: QueryScaling, causal: bool, tally, index: int) -> None:
    """Scale `attention`'s queries by beta(N) from now on (idempotent per layer)."""
    impl = attention.impl
    if getattr(impl.forward, "_sharpdraft", False):
        return
    original = impl.forward

    def forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:  # None: vLLM's profiling run, which attends to nothing
            n = visible_keys(attn_metadata.query_start_loc, attn_metadata.seq_lens, query.shape[0], causal)
            query = scaling.scale_rows(query, n)  # the rule's one expression (plugins/scaling.py)
            tally.add(index, query)
        return original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    forward._sharpdraft = True
    forward.original = original
    impl.forward = forward
