"""One small interface, several engines (torch, onnxruntime, tensorrt).

The speculative loops in runtime/speculative.py only see these two roles:

  Target:  prefill(ids, capacity) -> (last logits [vocab], features [t, F])
           verify(ids)            -> (logits [t, vocab], features [t, F])
           rollback(length)       -- keep the first `length` tokens of the KV cache
  Block drafter (DFlash):
           reset(capacity)
           draft(context [c, F], bonus) -> (logits [block - 1, vocab], visible keys N)
           scaling                -- the QueryScaling it applies, or None (frozen)
"""

from __future__ import annotations

from typing import Protocol

import torch

from plugins.scaling import QueryScaling


class Target(Protocol):
    context_limit: int

    def prefill(self, ids: list[int], capacity: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def verify(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollback(self, length: int) -> None: ...


class BlockDrafter(Protocol):
    block_size: int
    scaling: QueryScaling | None

    def reset(self, capacity: int) -> None: ...

    def draft(self, context: torch.Tensor, bonus: int) -> tuple[torch.Tensor, int]: ...
