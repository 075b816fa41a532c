"""The input contract of `sharpdraft::attention`, shared by the reference op
(plugins/attention.py) and the fused kernel (plugins/triton_kernel.py); neither imports
the other for it, so plugins import one way: attention -> triton_kernel -> op_inputs.

Shapes and dtypes are checked everywhere (metadata, no sync). The visible counts' VALUES
are read on the host only off CUDA: a host read would sync the stream and break CUDA-graph
capture, so on the GPU the counts are validated where they are made
(runtime/step_metadata.py) and the kernel clamps what it is handed (no out-of-bounds read).
"""

from __future__ import annotations

import torch

__all__ = ["check_shapes", "check_counts", "check_inputs", "reads_counts_on_host"]


def check_shapes(q, k, v, visible, mask=None) -> None:
    """Ranks, grouped heads, dtypes: metadata only, never a tensor's values."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [b,h,q,d] and k/v [b,kvh,kv,d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} (grouped heads)")
    if visible.shape != q.shape[:1] + q.shape[2:3] or visible.dtype != torch.int64:
        raise ValueError(f"visible must be int64 [batch, q_len], got {visible.dtype} {tuple(visible.shape)}")
    if mask is not None and mask.shape != (q.shape[0], q.shape[2], k.shape[2]):
        raise ValueError(f"mask must be [batch, q_len, kv_len], got {tuple(mask.shape)}")


def check_counts(visible: torch.Tensor, kv_len: int) -> None:
    """Every count in [1, kv_len] (one host read of the range: CPU tensors only)."""
    if visible.numel():
        low, high = (int(x) for x in torch.aminmax(visible))
        if low < 1 or high > kv_len:
            raise ValueError(f"visible counts must lie in [1, kv_len={kv_len}], got {low}..{high}")


def reads_counts_on_host(visible: torch.Tensor) -> bool:
    """Whether the op reads the counts' values here: never for CUDA (or fake/meta) tensors."""
    return visible.device.type == "cpu"


def check_inputs(q, k, v, visible, mask=None) -> None:
    """The op's contract, checked before dispatch: shapes always; count values where that
    costs no sync (see the module note)."""
    check_shapes(q, k, v, visible, mask)
    if reads_counts_on_host(visible):
        check_counts(visible, k.shape[2])
