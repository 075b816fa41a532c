"""The SharpDraftAttention plugin's identity and fields, as TensorRT's ONNX parser reads
them from a node: op_type = plugin name, attribute `plugin_version`, attribute
`plugin_namespace`, and the remaining attributes as plugin fields."""

from __future__ import annotations

from plugins.scaling import QueryScaling

PLUGIN_NAME = "SharpDraftAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "sharpdraft"


def plugin_fields(scaling: QueryScaling) -> dict:
    return {"ref_keys": scaling.ref_keys, "top_k": scaling.top_k, "slope": scaling.slope,
            "max_log_scale": scaling.max_log_scale}
