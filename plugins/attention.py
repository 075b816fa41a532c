"""The reference SharpDraft attention op, `sharpdraft::attention`.

Every attention in the runtime goes through here: the target's (scaling=None) and the
drafter's (scaling=QueryScaling). Row (b, i) attends to keys [0, visible[b, i]) -- and,
with a tree `mask`, only to its unmasked ones -- and its query is multiplied by
beta(keys it can see), after q_norm/RoPE, which equals multiplying the softmax scale.
The Triton kernel, the ONNX plugin node and the TensorRT plugin are tested against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plugins.op_inputs import check_inputs
from plugins.row_invariant import KEYS, REDUCED, ROWS
from plugins.scaling import QueryScaling, _tracing

__all__ = ["sharpdraft_attention", "reference_attention", "scaled_query", "visible_counts",
           "check_inputs", "register"]


def visible_counts(visible: torch.Tensor, kv_len: int, mask: torch.Tensor | None = None):
    """Keys each query row may see: [batch, q_len] counts and the [batch, q_len, kv_len] map."""
    allowed = torch.arange(kv_len, device=visible.device) < visible[..., None]
    if mask is None:
        return visible, allowed
    allowed = allowed & mask
    return allowed.sum(-1), allowed


def scaled_query(q, n, scaling: QueryScaling | None):
    """q [b, heads, q_len, d] with row (b, i) multiplied by beta(n[b, i]), its visible-key
    count (q as it is without scaling). The reference, and so the native ONNX form, scale
    this way; build/export.py's in-place drafter graph does too."""
    if scaling is None:
        return q
    return q * scaling.beta(n.to(q.dtype))[:, None, :, None]


def row_invariant_attention(q, k, v, visible, mask=None, scaling: QueryScaling | None = None):
    """The attention of a bfloat16/float16 model (plugins/row_invariant.py): a row's result
    does not depend on the rows beside it, the keys past its own, or the batch. Each key
    head's query rows (its heads' positions, head-major as SDPA groups them) run ROWS at a
    time over keys zero-padded to a multiple of KEYS and masked out; products in q's dtype,
    as transformers' eager attention computes them, softmax in float32. One block at a
    time, so a long prefill holds one block's scores, not every row's."""
    b, heads, t, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    n, allowed = visible_counts(visible, kv_len, mask)
    qs = (scaled_query(q.float(), n, scaling) * (1.0 / math.sqrt(d))).to(q.dtype)
    pad, rows = -kv_len % KEYS, heads // kv_heads * t
    keys_t, values = F.pad(k, (0, 0, 0, pad)).transpose(-1, -2), F.pad(v, (0, 0, 0, pad))
    allowed = allowed[:, None].expand(b, heads // kv_heads, t, kv_len).reshape(b, rows, kv_len)
    # padded query rows see every key (their results are dropped); padded keys none
    allowed = F.pad(F.pad(allowed, (0, pad), value=False), (0, 0, 0, -rows % ROWS), value=True)
    queries = F.pad(qs.reshape(b, kv_heads, rows, d), (0, 0, 0, -rows % ROWS))
    out = []
    for start in range(0, queries.shape[2], ROWS):
        scores = (queries[:, :, start:start + ROWS] @ keys_t).float()
        scores = scores.masked_fill(~allowed[:, None, start:start + ROWS], float("-inf"))
        out.append(torch.softmax(scores, -1).to(q.dtype) @ values)
    return torch.cat(out, 2)[:, :, :rows].reshape(b, heads, t, d)


def reference_attention(q, k, v, visible, mask=None, scaling: QueryScaling | None = None):
    """Differentiable reference; computes in float32 at least and returns q's dtype
    (bfloat16 and float16: row_invariant_attention)."""
    if q.dtype in REDUCED:
        return row_invariant_attention(q, k, v, visible, mask, scaling)
    compute = torch.promote_types(q.dtype, torch.float32)
    n, allowed = visible_counts(visible, k.shape[2], mask)
    qc = scaled_query(q.to(compute), n, scaling)
    # A plain causal prefill can use SDPA's causal path: same result, half the time.
    # (Not while tracing for export: the test reads data, and the graph must be general.)
    causal = not _tracing() and mask is None and q.shape[2] == k.shape[2] and torch.equal(
        visible, torch.arange(1, k.shape[2] + 1, device=visible.device).expand_as(visible))
    out = F.scaled_dot_product_attention(
        qc, k.to(compute), v.to(compute), attn_mask=None if causal else allowed[:, None],
        is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), enable_gqa=q.shape[1] != k.shape[1])
    return out.to(q.dtype)


def _scaling_from_op_args(scaled, ref_keys, top_k, slope, max_log_scale):
    """The op's flat scalar arguments back into a QueryScaling (None: unscaled)."""
    return QueryScaling(ref_keys, top_k, slope, max_log_scale) if scaled else None


def _fused_kernel_applies(q, mask) -> bool:
    """CUDA tensors without a tree mask, in a dtype and head size the Triton kernel takes."""
    if not q.is_cuda or mask is not None:
        return False
    try:
        from plugins import triton_kernel
    except ImportError:
        return False
    return q.dtype in triton_kernel.DTYPES and q.shape[-1] <= triton_kernel.MAX_HEAD_DIM


def _attention(q, k, v, visible, mask, scaling):
    # No host read of a tensor's values on the CUDA path (plugins/op_inputs.py): the op
    # must survive CUDA-graph capture, as TensorRT-LLM, vLLM and SGLang replay decode steps.
    check_inputs(q, k, v, visible, mask)
    if _fused_kernel_applies(q, mask):
        from plugins import triton_kernel

        return triton_kernel.launch(q, k, v, visible, scaling)
    return reference_attention(q, k, v, visible, mask, scaling).contiguous()


# `sharpdraft::attention`'s schema: the tensors, then QueryScaling's fields flat (scaled
# False: plain attention), as graphs and plugins carry them.
SCHEMA = ("attention(Tensor q, Tensor k, Tensor v, Tensor visible, Tensor? mask, bool scaled, "
          "int ref_keys, int top_k, float slope, float max_log_scale) -> Tensor")

# Kept for the process's life: a torch Library drops its registrations when collected.
_library = None


def register() -> None:
    """Define the torch op `sharpdraft::attention` (idempotent). Called once when this
    module is imported, so the op exists before any compiled region can meet it: dynamo
    refuses to trace `Library.__init__`, and a `torch.compile(fullgraph=True)` step that
    was a process's first caller of a lazily registered op broke there.

    Defined through torch.library's Library, with the fake kernel and the autograd
    formula registered beside it: to torch.compile, torch.export and the ONNX exporter
    this is the op torch.library.custom_op would make, without custom_op's guard around
    the kernel, which imports torch._dynamo on the op's first eager call (~2 s of every
    eager process's start) and adds tens of microseconds to every call."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("sharpdraft", "DEF")
    library.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
    library.impl("attention", _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("sharpdraft::attention", _fake, lib=library)
    torch.library.register_autograd("sharpdraft::attention", _backward,
                                    setup_context=_setup_context, lib=library)
    _library = library


def _kernel(q, k, v, visible, mask, scaled, ref_keys, top_k, slope, max_log_scale):
    return _attention(q, k, v, visible, mask,
                      _scaling_from_op_args(scaled, ref_keys, top_k, slope, max_log_scale))


def _fake(q, k, v, visible, mask, scaled, ref_keys, top_k, slope, max_log_scale):
    # The kernel and the reference both return a contiguous tensor of q's shape.
    return q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.fields = inputs[5:]


def _backward(ctx, grad):
    # Recompute through the differentiable reference: training our drafter needs
    # gradients, and this keeps one definition of the forward math.
    q, k, v, visible, mask = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = reference_attention(*leaves, visible, mask, _scaling_from_op_args(*ctx.fields))
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq, dk, dv, None, None, None, None, None, None, None


def sharpdraft_attention(q, k, v, visible, scaling: QueryScaling | None = None, mask=None):
    """Attention over prefix-visible keys with SharpDraft's query scale (None: plain)."""
    s = scaling or QueryScaling()
    return torch.ops.sharpdraft.attention(q, k, v, visible, mask, scaling is not None,
                                          s.ref_keys, s.top_k, s.slope, s.max_log_scale)


# At import, not on first use: a compiled step may be the first caller (see register).
register()
