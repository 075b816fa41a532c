"""SharpDraftAttention as a TensorRT plugin, defined with TensorRT's Python plugin API
(`tensorrt.plugin`): a shape/type description plus an ahead-of-time implementation whose
PTX is the Triton kernel of plugins/triton_kernel.py. The PTX is baked into the engine, so
the engine later runs without Python (trtexec, C++ runtimes, Triton Inference Server).

Only build/tensorrt.py needs this, on a GPU host; tensorrt is imported inside functions.
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the decorated functions'
# annotations as real classes (TensorDesc, int, float ...), not strings.

from plugins import plugin_spec

TENSORRT_MISSING = "TensorRT is not installed (it needs an NVIDIA GPU host); use --backend onnxruntime"


class TensorRTUnavailable(ImportError):
    """TensorRT cannot be imported here; the message is one line saying what to do."""


def import_tensorrt():
    """The tensorrt module, or TensorRTUnavailable with TENSORRT_MISSING."""
    try:
        import tensorrt
    # Not only ImportError: the PyPI placeholder and a missing libnvinfer fail differently.
    except Exception:
        raise TensorRTUnavailable(TENSORRT_MISSING) from None
    return tensorrt


_registered = False


def register_plugin() -> str:
    """Register SharpDraftAttention with TensorRT's plugin registry (once per process) so
    the ONNX parser finds the node by op_type / plugin_version / plugin_namespace.
    Returns the plugin id ("sharpdraft::SharpDraftAttention")."""
    global _registered
    if _registered:
        return plugin_spec.PLUGIN_ID
    trt = import_tensorrt()
    try:
        import tensorrt.plugin as trtp
    except Exception:
        raise TensorRTUnavailable("this TensorRT has no tensorrt.plugin module (Python plugins need "
                                  "TensorRT >= 10.7, AOT plugins in ONNX >= 10.9)") from None
    if not hasattr(trtp, "aot_impl"):
        raise TensorRTUnavailable("this TensorRT's tensorrt.plugin has no aot_impl (needs TensorRT >= 10.9)")
    _define_plugin(trt, trtp)
    _registered = True
    return plugin_spec.PLUGIN_ID


def _define_plugin(trt, trtp) -> None:
    from typing import Tuple, Union

    kernel_dtypes = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}

    # The attribute parameters are the plugin fields, named and typed as plugin_spec says
    # (checked by tests/test_tensorrt.py against plugin_spec.FIELD_TYPES).
    @trtp.register(plugin_spec.PLUGIN_ID)
    def describe(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, visible: trtp.TensorDesc,
                 ref_keys: int, top_k: int, slope: float, max_log_scale: float) -> trtp.TensorDesc:
        # Fail the build with a reason rather than launch a kernel on the wrong bytes.
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or visible.ndim != 2:
            raise ValueError(f"{plugin_spec.PLUGIN_NAME}: expected q/k/v of rank 4 and visible of "
                             f"rank 2, got {q.ndim}, {k.ndim}, {v.ndim}, {visible.ndim}")
        if q.dtype not in kernel_dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{plugin_spec.PLUGIN_NAME}: q, k, v must share one of float32/"
                             f"float16/bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
        if visible.dtype != trt.int64:
            raise ValueError(f"{plugin_spec.PLUGIN_NAME}: visible must be int64, got {visible.dtype}")
        return q.like()

    @trtp.aot_impl(plugin_spec.PLUGIN_ID)
    def compile_kernel(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc,
                       visible: trtp.TensorDesc, ref_keys: int, top_k: int, slope: float,
                       max_log_scale: float, outputs: Tuple[trtp.TensorDesc], tactic: int
                       ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        scaling = plugin_spec.scaling_from_fields(dict(ref_keys=ref_keys, top_k=top_k, slope=slope,
                                                       max_log_scale=max_log_scale))
        launch = aot_launch(q, k, kernel_dtypes[q.dtype], scaling, build_arch())
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = launch["grid"]
        params.block_x = launch["threads"]
        params.shared_mem = launch["shared_mem"]
        # TensorRT passes these int32s between the input and output pointers, in this order.
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in launch["scalars"]])
        return launch["name"], launch["ptx"], params, scalars


def aot_launch(q, k, dtype: str, scaling, arch: int) -> dict:
    """Kernel and launch description for one plugin instance, from tensor descriptors with
    `.shape` (ints, -1 where dynamic) and `.shape_expr` (TensorRT symbolic dims; plain
    ints work too, which is how tests drive this without TensorRT)."""
    from plugins import triton_kernel

    head_dim = q.shape[3]
    if head_dim < 0:
        raise ValueError(f"{plugin_spec.PLUGIN_NAME}: head_dim must be static in the ONNX graph")
    batch, heads, q_len = q.shape_expr[0], q.shape_expr[1], q.shape_expr[2]
    kv_heads, kv_len = k.shape_expr[1], k.shape_expr[2]
    # BLOCK_M is fixed at build time: size it for the rows a step has when they are static
    # (a DFlash block: 16 queries x group), else for a prefill-sized tile.
    static = q.shape[1] > 0 and q.shape[2] > 0 and k.shape[1] > 0
    rows_hint = q.shape[2] * (q.shape[1] // k.shape[1]) if static else 64
    compiled = triton_kernel.aot_compile(dtype, head_dim, scaling, arch, rows_hint)
    return dict(name=compiled.name, ptx=compiled.ptx, threads=compiled.num_warps * 32,
                shared_mem=compiled.shared_mem,
                grid=triton_kernel.launch_grid(batch, q_len, kv_heads, heads // kv_heads, compiled.block_m),
                scalars=triton_kernel.contiguous_scalars(heads, q_len, kv_heads, kv_len, head_dim))


def build_arch() -> int:
    """The compute capability of the GPU the engine is being built on, e.g. 90."""
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("building a TensorRT engine needs a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
