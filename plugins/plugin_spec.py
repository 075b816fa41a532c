"""The SharpDraftAttention plugin's identity and fields, shared by the ONNX exporter (which
writes the plugin node) and the TensorRT plugin (which TensorRT's ONNX parser finds by
these names). No tensorrt import here: the exporter runs on machines without it.

The ONNX node: op_type PLUGIN_NAME, inputs INPUTS, one output, attributes
`onnx_attributes(scaling)`. TensorRT's parser looks the plugin up by op_type (the node's
domain is ignored), `plugin_version` and `plugin_namespace`; the remaining attributes
become plugin fields.
"""

from __future__ import annotations

from plugins.scaling import QueryScaling

PLUGIN_NAME = "SharpDraftAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "sharpdraft"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"  # the form tensorrt.plugin registers

INPUTS = ("q", "k", "v", "visible")  # q [b,h,t,d], k/v [b,kvh,s,d], visible int64 [b,t]
OUTPUTS = ("out",)  # [b,h,t,d], q's dtype

# Field name -> Python type. ONNX stores float attributes as float32 and TensorRT's parser
# hands them on as FLOAT32 fields, so a field read back may be float32-rounded.
FIELD_TYPES = {"ref_keys": int, "top_k": int, "slope": float, "max_log_scale": float}


def plugin_fields(scaling: QueryScaling) -> dict:
    """The plugin fields (= QueryScaling's parameters) for one drafter's beta rule."""
    if not isinstance(scaling, QueryScaling):
        raise ValueError(f"plugin fields come from a QueryScaling, got {type(scaling).__name__}; "
                         "a drafter without SharpDraft needs no plugin")
    return {name: kind(getattr(scaling, name)) for name, kind in FIELD_TYPES.items()}


def scaling_from_fields(fields: dict) -> QueryScaling:
    """The QueryScaling a plugin instance was created with (fields as TensorRT gives them:
    Python numbers, numpy scalars or one-element arrays)."""
    missing = set(FIELD_TYPES) - set(fields)
    if missing:
        raise ValueError(f"{PLUGIN_NAME} plugin is missing field(s): {', '.join(sorted(missing))}")
    values = {}
    for name, kind in FIELD_TYPES.items():
        value = fields[name]
        value = value.reshape(-1)[0] if hasattr(value, "reshape") else value  # numpy field data
        if kind is int and float(value) != int(value):
            raise ValueError(f"{PLUGIN_NAME} field {name} must be a whole number, got {value!r}")
        values[name] = kind(value)
    return QueryScaling(**values)


def onnx_attributes(scaling: QueryScaling) -> dict:
    """Every attribute of the ONNX plugin node: the lookup keys plus the plugin fields."""
    return {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE,
            **plugin_fields(scaling)}
