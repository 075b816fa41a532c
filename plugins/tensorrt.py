"""SharpDraftAttention as a TensorRT plugin, defined with TensorRT's Python plugin API
(`tensorrt.plugin`): a shape/type description plus an ahead-of-time implementation whose
PTX is the Triton kernel of plugins/triton_kernel.py. The PTX is baked into the engine, so
the engine later runs without Python (trtexec, C++ runtimes, Triton Inference Server).

Only build/tensorrt_build.py needs this, on a GPU host; tensorrt is imported inside functions.
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the decorated functions'
# annotations as real classes (TensorDesc, numpy NDArray ...), not strings.

import re

import numpy as np
import numpy.typing as npt

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


# Plugin fields are one-element numpy arrays, not `int` / `float`: the ONNX parser hands
# every field over as a numpy array, and TensorRT 10.x's creator converts a builtin-typed
# field with `int(f.data)`, which numpy 2 refuses for a 1-d array ("only 0-dimensional
# arrays can be converted"); an NDArray-typed field is `f.data.astype(dtype)` on 10.x and
# 11.x alike (tensorrt/plugin/_lib.py, _TemplatePluginCreator.create_plugin). int32 and
# float32 are what ONNX INT / FLOAT attributes become as TensorRT plugin fields.
IntField = npt.NDArray[np.int32]
FloatField = npt.NDArray[np.float32]
FIELD_ANNOTATIONS = {int: IntField, float: FloatField}


_registered = False

# TensorRT's own test for AOT Python plugins (tensorrt/plugin/_export.py: IS_AOT_ENABLED):
# KernelLaunchParams and aot_impl's plugin class exist only where this does (TensorRT >= 10.9).
AOT_MARKER = "QuickPluginCreationRequest"


def register_plugin() -> str:
    """Register SharpDraftAttention with TensorRT's plugin registry (once per process) so
    the ONNX parser finds the node by op_type / plugin_version / plugin_namespace.
    Returns the plugin id ("sharpdraft::SharpDraftAttention").

    Refuses a TensorRT without AOT plugins BEFORE `@trtp.register` runs: registering first
    would leave a half-defined plugin that a retry could not redefine. Idempotent across
    module reloads too: a plugin tensorrt.plugin already defines is not defined again."""
    global _registered
    if _registered:
        return plugin_spec.PLUGIN_ID
    trt = import_tensorrt()
    if not hasattr(trt, AOT_MARKER):
        raise TensorRTUnavailable(f"TensorRT {getattr(trt, '__version__', '?')} has no ahead-of-time "
                                  "Python plugins (they need TensorRT >= 10.9); use --attention native")
    try:
        import tensorrt.plugin as trtp
    except Exception:
        raise TensorRTUnavailable("this TensorRT has no tensorrt.plugin module (AOT Python plugins "
                                  "need TensorRT >= 10.9); use --attention native") from None
    namespace = getattr(getattr(trtp, "op", None), plugin_spec.PLUGIN_NAMESPACE, None)
    if not hasattr(namespace, plugin_spec.PLUGIN_NAME):
        _define_plugin(trt, trtp)
    _registered = True
    return plugin_spec.PLUGIN_ID


def _define_plugin(trt, trtp) -> None:
    from typing import Tuple, Union

    kernel_dtypes = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}

    # The attribute parameters are the plugin fields, named as plugin_spec says and typed
    # as FIELD_ANNOTATIONS (checked by tests/test_tensorrt.py against both creators).
    @trtp.register(plugin_spec.PLUGIN_ID)
    def describe(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, visible: trtp.TensorDesc,
                 ref_keys: IntField, top_k: IntField, slope: FloatField, max_log_scale: FloatField
                 ) -> trtp.TensorDesc:
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
                       visible: trtp.TensorDesc, ref_keys: IntField, top_k: IntField,
                       slope: FloatField, max_log_scale: FloatField, outputs: Tuple[trtp.TensorDesc],
                       tactic: int
                       ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        scaling = plugin_spec.scaling_from_fields(dict(ref_keys=ref_keys, top_k=top_k, slope=slope,
                                                       max_log_scale=max_log_scale))
        launch = aot_launch(q, k, kernel_dtypes[q.dtype], scaling, build_arch())
        ptx = tensorrt_ptx(launch["ptx"], launch["name"], len(plugin_spec.INPUTS)
                           + len(launch["scalars"]) + len(plugin_spec.OUTPUTS), launch.get("scratch", ()))
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = launch["grid"][:2]
        if len(launch["grid"]) > 2:  # the key slices of the single-launch kernel
            params.grid_z = launch["grid"][2]
        params.block_x = launch["threads"]
        params.shared_mem = launch["shared_mem"]
        # TensorRT passes these int32s between the input and output pointers, in this order.
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in launch["scalars"]])
        return launch["name"], ptx, params, scalars


def aot_launch(q, k, dtype: str, scaling, arch: int) -> dict:
    """Kernel and launch description for one plugin instance, from tensor descriptors with
    `.shape` (ints, -1 where dynamic) and `.shape_expr` (TensorRT symbolic dims; plain
    ints work too, which is how tests drive this without TensorRT).

    The kernel is the single-launch split kernel (plugins/triton_kernel.py): key slices
    for a short step over a long context, merged inside the same launch, since an AOT
    plugin launches exactly one kernel and gets no workspace. Its scratch (partials and
    arrival counters) is compiled into the PTX as module globals (tensorrt_ptx), zeroed
    when TensorRT loads the module and left at zero by every launch."""
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
    sm_count = build_sm_count()
    tiles_at_batch_1 = (triton_kernel.launch_grid(1, q.shape[2], k.shape[1], q.shape[1] // k.shape[1],
                                                  compiled.block_m)
                        if static else (1, max(1, k.shape[1])))
    slices = triton_kernel.aot_slices(tiles_at_batch_1[0] * tiles_at_batch_1[1], sm_count)
    return dict(name=compiled.name, ptx=compiled.ptx, threads=compiled.num_warps * 32,
                shared_mem=compiled.shared_mem,
                grid=triton_kernel.launch_grid(batch, q_len, kv_heads, heads // kv_heads, compiled.block_m)
                + (slices,),
                scalars=triton_kernel.contiguous_scalars(heads, q_len, kv_heads, kv_len, head_dim)
                + triton_kernel.aot_slice_scalars(sm_count),
                scratch=tuple(size for _, size in compiled.scratch))


def build_arch() -> int:
    """The compute capability of the GPU the engine is being built on, e.g. 90."""
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("building a TensorRT engine needs a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def build_sm_count() -> int:
    """Streaming multiprocessors of the GPU the engine is built on (the key-slice rule)."""
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("building a TensorRT engine needs a CUDA GPU; none is visible")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def tensorrt_ptx(ptx: str, name: str, launched: int, scratch: tuple = ()) -> str:
    """The PTX with exactly the `launched` parameters TensorRT passes: input pointers, the
    int32 extra arguments, output pointers (aot_impl's contract in tensorrt/plugin/_lib.py:
    "scalar inputs ... located after the tensor inputs and before the tensor outputs").

    Triton appends two pointers of its own after those (global and profile scratch, filled
    by Triton's launcher). Nothing says TensorRT's launcher passes them, and a kernel that
    declares more parameters than the launch supplies reads past the argument array. The
    kernel needs no scratch memory (aot_compile refuses one that does), so the trailing
    parameters are dropped here, after checking that no instruction reads them; a launch
    that passes more arguments than the kernel declares is harmless.

    `scratch` (bytes each) names the pointer parameters right after the launched ones that
    the kernel does use (the single-launch kernel's partials and arrival counters): each
    becomes a module global of that size -- PTX zero-initialises .global variables -- and
    the kernel's load of the parameter becomes the global's address."""
    head = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if head is None:
        raise RuntimeError(f"no .entry {name} in the compiled PTX")
    params = [p.strip() for p in head.group(1).split(",") if p.strip()]
    if len(params) < launched + len(scratch):
        raise RuntimeError(f"{name} declares {len(params)} parameters, TensorRT launches {launched}"
                           + (f" and {len(scratch)} become globals" if scratch else ""))
    body = ptx[head.end():]
    declarations = []
    for i, size in enumerate(scratch):
        param, symbol = params[launched + i].split()[-1], f"{name}_scratch_{i}"
        body, loads = re.subn(r"ld\.param\.[bu]64\s+(%rd\d+),\s*\[" + re.escape(param) + r"\];",
                              lambda m: f"mov.u64 {m.group(1)}, {symbol};", body)
        if re.search(r"\b" + re.escape(param) + r"\b", body):
            raise RuntimeError(f"{name} uses parameter {param} other than by one 64-bit load")
        declarations.append(f".global .align 16 .b8 {symbol}[{size}];\n")
    extra = [p.split()[-1] for p in params[launched + len(scratch):]]
    used = [p for p in extra if re.search(r"\[" + re.escape(p) + r"\b", body)]
    if used:
        raise RuntimeError(f"{name} reads parameter(s) {', '.join(used)} that TensorRT does not pass")
    kept = ",\n".join("\t" + p for p in params[:launched])
    line = ptx.rfind("\n", 0, head.start()) + 1  # module scope, just before the entry
    return (ptx[:line] + "".join(declarations) + ptx[line:head.start(1)] + "\n" + kept + "\n"
            + ptx[head.end(1):head.end()] + body)
