"""`sharpdraft::attention` in ONNX, in the two forms build/export.py writes:

- plugin: one `SharpDraftAttention` node per layer (inputs q, k, v, visible), the node
  TensorRT's ONNX parser turns into our plugin; its schema is registered here so
  onnx.checker accepts it, and an onnxruntime-extensions Python op runs it on CPU
  through the reference op, so ONNX Runtime executes the very file TensorRT parses.
- native: plain ONNX ops, obtained by tracing the reference op (beta included, traced
  from QueryScaling.beta) instead of restating it.
"""

from __future__ import annotations

import warnings

import onnx
import onnx.defs
import torch

from plugins.attention import _scaling_from_op_args, reference_attention, sharpdraft_attention
from plugins import plugin_spec
from plugins.plugin_spec import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, onnx_attributes
from plugins.scaling import QueryScaling

# onnxruntime-extensions serves Python ops from this one domain only. TensorRT's parser
# ignores a node's domain (it looks the plugin up by op_type, plugin_version and
# plugin_namespace), so using it keeps one file valid for both runtimes.
DOMAIN = "ai.onnx.contrib"
DOMAIN_VERSION = 1
ATTENTION_FORMS = ("plugin", "native")

_INT, _FLOAT, _STRING = (onnx.defs.OpSchema.AttrType.INT, onnx.defs.OpSchema.AttrType.FLOAT,
                         onnx.defs.OpSchema.AttrType.STRING)
# ONNX stores float attributes (and TensorRT float32 plugin fields) as float32: the
# slope and max_log_scale a plugin sees are the float32 roundings of QueryScaling's.
FIELD_TYPES = {name: _INT if kind is int else _FLOAT
               for name, kind in plugin_spec.FIELD_TYPES.items()}


def _schema() -> onnx.defs.OpSchema:
    S = onnx.defs.OpSchema
    attributes = [S.Attribute("plugin_version", _STRING, "TensorRT plugin version"),
                  S.Attribute("plugin_namespace", _STRING, "TensorRT plugin namespace")]
    attributes += [S.Attribute(name, kind, "QueryScaling." + name)
                   for name, kind in FIELD_TYPES.items()]
    schema = S(
        PLUGIN_NAME, DOMAIN, DOMAIN_VERSION,
        "Attention where row (b, i) sees keys [0, visible[b, i]) and its query is "
        "multiplied by SharpDraft's beta(visible[b, i]) (plugins/scaling.py).",
        inputs=[S.FormalParameter("q", "T", "[batch, heads, q_len, head_dim]"),
                S.FormalParameter("k", "T", "[batch, kv_heads, kv_len, head_dim]"),
                S.FormalParameter("v", "T", "[batch, kv_heads, kv_len, head_dim]"),
                S.FormalParameter("visible", "tensor(int64)", "[batch, q_len] visible-key counts")],
        outputs=[S.FormalParameter("out", "T", "[batch, heads, q_len, head_dim]")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
                           "floating point")],
        attributes=attributes)

    def infer(ctx):  # the output has q's type and shape
        ctx.set_output_type(0, ctx.get_input_type(0))

    schema.set_type_and_shape_inference_function(infer)
    return schema


def register_schema() -> None:
    """Make the plugin node known to onnx (checker, shape inference); idempotent."""
    try:
        onnx.defs.get_schema(PLUGIN_NAME, DOMAIN_VERSION, DOMAIN)
    except onnx.defs.SchemaError:
        onnx.defs.register_schema(_schema())


def plugin_translation(q, k, v, visible, mask=None, scaled: bool = True, ref_keys: int = 2048,
                       top_k: int = 32, slope: float = 5.0, max_log_scale: float = 0.5):
    """torch.onnx custom translation of sharpdraft::attention: the plugin node."""
    import onnxscript

    if mask is not None:
        raise ValueError(f"{PLUGIN_NAME} has no tree-mask input; export masked attention "
                         "in the native form")
    if not scaled:
        raise ValueError(f"{PLUGIN_NAME} always scales; export unscaled attention natively")
    op = getattr(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), PLUGIN_NAME)
    return op(q, k, v, visible, **onnx_attributes(QueryScaling(ref_keys, top_k, slope, max_log_scale)))


def native_decomposition(q, k, v, visible, mask, scaled, ref_keys, top_k, slope, max_log_scale):
    """Decomposition of sharpdraft::attention into ATen ops (then plain ONNX ops):
    the reference itself, traced, so beta comes from QueryScaling.beta."""
    return reference_attention(q, k, v, visible, mask,
                               _scaling_from_op_args(scaled, ref_keys, top_k, slope, max_log_scale))


_ort_op_registered = False


def register_onnxruntime_op() -> None:
    """Bind the plugin node to the reference op for ONNX Runtime (once per process)."""
    global _ort_op_registered
    if _ort_op_registered:
        return
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    kinds = {_INT: PyCustomOpDef.dt_int64, _FLOAT: PyCustomOpDef.dt_float}
    attrs = {"plugin_version": PyCustomOpDef.dt_string, "plugin_namespace": PyCustomOpDef.dt_string}
    attrs |= {name: kinds[kind] for name, kind in FIELD_TYPES.items()}

    @onnx_op(op_type=PLUGIN_NAME, inputs=[PyCustomOpDef.dt_float] * 3 + [PyCustomOpDef.dt_int64],
             outputs=[PyCustomOpDef.dt_float], attrs=attrs)
    def _sharpdraft_attention(q, k, v, visible, plugin_version, plugin_namespace, **fields):
        if (plugin_version, plugin_namespace) != (PLUGIN_VERSION, PLUGIN_NAMESPACE):
            raise ValueError(f"{PLUGIN_NAME} node asks for plugin {plugin_namespace}::"
                             f"{plugin_version}; this runtime provides {PLUGIN_NAMESPACE}::"
                             f"{PLUGIN_VERSION}")
        # ORT hands us read-only views of its buffers. The reference op only reads its
        # inputs, so torch may view them as they are: copying K/V here cost a full pass
        # over the drafter's cache per layer and step.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            q, k, v, visible = (torch.from_numpy(x) for x in (q, k, v, visible))
        with torch.inference_mode():
            return sharpdraft_attention(q, k, v, visible, QueryScaling(**fields)).numpy()

    _ort_op_registered = True


def onnxruntime_session_options():
    """SessionOptions that can run graphs holding the plugin node."""
    import onnxruntime
    from onnxruntime_extensions import get_library_path

    register_onnxruntime_op()
    options = onnxruntime.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return options
