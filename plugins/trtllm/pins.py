"""Every TensorRT-LLM name SharpDraft relies on, in one place, with where it was read.

TensorRT-LLM cannot be installed or imported on our machines, so each name below was read
from its source (GitHub NVIDIA/TensorRT-LLM; the commit of the stored copy we read) or,
for LLM-API field names, from the API reference generated from `llmapi/llm_args.py` for
the pinned release. The hook (plugins/trtllm/hook.py) refuses any other version, and any
installation where one of the PATCH_POINTS is missing, with one line naming both; the
configuration writers (runtime/trtllm.py) emit only LLM_API_FIELDS.

To support another release: read the same files at its tag, update the names and
commits here, add the version to VERSIONS, and run `python -m plugins.trtllm check`
on a machine where it imports.
"""

from __future__ import annotations

import dataclasses

# The release the hook and the configuration target. DFlash arrived in the 1.3.0rc line
# (PR #12794); 1.4.0rc1's API reference lists DFlashDecodingConfig.attention_backend
# in {VANILLA, TRTLLM, FA4}, Eagle3DecodingConfig and PARDDecodingConfig with the fields
# below. The stored source copies we read are not tied to a tag (see SOURCES): the hook
# re-checks every name at install time instead of trusting this list blindly.
PINNED = "1.4.0rc1"
VERSIONS = (PINNED,)

REPO = "https://github.com/NVIDIA/TensorRT-LLM"
DOCS = "https://nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference"


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    commit: str  # the stored copy we read (blob of that path at this commit)
    read_for: str


SOURCES = {
    "modeling_dflash": Source(
        "tensorrt_llm/_torch/models/modeling_dflash.py", "009d8fa431bd3de92245aab80f8b57dc70da1ac4",
        "DFlashForCausalLM: __init__ stores the kernel on the instance "
        "(_dflash_flash_attention | _dflash_trtllm_gen_ops | _dflash_fa4_fwd by "
        "dflash_attention_backend); dflash_forward calls it once per draft layer"),
    "modeling_dflash_fa4": Source(
        "tensorrt_llm/_torch/models/modeling_dflash.py", "(stored copy with FA4; commit not shown)",
        "FA4 path: fa4_fwd(Q_bshd, k_pages, v_pages, seqused_k=ctx+block, page_table, "
        "softmax_scale, causal, window_size_left/right); VANILLA writes the block first "
        "and passes cache_seqlens=ctx+block"),
    "dflash_attention": Source(
        "tensorrt_llm/_torch/speculative/dflash_attention.py", "0352547de78ebe7ff7657f801631ca5ce04d888c",
        "DFlashTrtllmGenOps (frozen dataclass): batch_decode_with_kv_cache = flashinfer "
        "trtllm_batch_decode_with_kv_cache, batch_context_with_kv_cache = flashinfer "
        "trtllm_batch_context_with_kv_cache; get_dflash_flash_attention -> flash_attn_with_kvcache"),
    "modeling_speculative": Source(
        "tensorrt_llm/_torch/models/modeling_speculative.py", "b35ac1b64368513d215c57d2ed01d62d910df8da",
        "Eagle3ForCausalLM and PARDForCausalLM (draft models built by get_draft_model; "
        "PARD wraps an ordinary architecture class, the same classes the target uses)"),
    "attention": Source(
        "tensorrt_llm/_torch/modules/attention.py", "c6d3bb2aae305e0b5ac1b97b7954dcf87d653322",
        "Attention.forward: qkv_proj -> self.apply_rope(q, k, v, position_ids) -> attn; "
        "apply_rope returns (q, k, v) or (fused qkv, None, None) when RoPE is fused into "
        "the kernel; q_size = num_heads * head_dim; subclasses (Qwen3, Llama4) override "
        "apply_rope and call super()"),
    "attention_moved": Source(
        "tensorrt_llm/_torch/attention/attention.py", "930bd1a7cc5173721fd6bb3a34b5b3074eeb0c39",
        "a later home of the same Attention module (both paths are accepted)"),
    "llmapi_model": Source(
        "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py", "044a90d209e380c95e23e8ae42f3583fa05ada78",
        "TritonPythonModel; imports tensorrt_llm in initialize(); every model.yaml key but "
        "triton_config goes to LLM(); helpers.py sits beside it"),
    "llmapi_yaml": Source(
        "triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml", "0ebb1536ac12bbe27201185de960df3ab00bcecc",
        "model, backend, tensor_parallel_size, pipeline_parallel_size, "
        "triton_config {max_batch_size, decoupled}"),
    "setup": Source(
        "setup.py", "(stored copy; commit not shown)",
        "console script trtllm-serve = tensorrt_llm.commands.serve:main"),
}


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """A module-level name the hook replaces or reads; checked when the module loads."""

    module: str
    attribute: str  # dotted inside the module
    source: str  # key of SOURCES
    role: str


DFLASH_MODULE = "tensorrt_llm._torch.models.modeling_dflash"
SPECULATIVE_MODULE = "tensorrt_llm._torch.models.modeling_speculative"
DFLASH_ATTENTION_MODULE = "tensorrt_llm._torch.speculative.dflash_attention"
# Attention.apply_rope is wrapped per drafter *instance* (never on the class: PARD's
# drafter shares its classes with the target); the class is looked up, once a drafter is
# built, in whichever of these modules is loaded.
ATTENTION_MODULES = ("tensorrt_llm._torch.modules.attention", "tensorrt_llm._torch.attention.attention")
ATTENTION_CLASS = "Attention"
ATTENTION_METHOD = "apply_rope"
VERSION_MODULE = "tensorrt_llm.version"

PATCH_POINTS = (
    PatchPoint(DFLASH_MODULE, "DFlashForCausalLM.__init__", "modeling_dflash",
               "wrapped: after construction, the instance's attention kernel is wrapped"),
    PatchPoint(SPECULATIVE_MODULE, "Eagle3ForCausalLM.__init__", "modeling_speculative",
               "wrapped: after construction, apply_rope of each Attention instance inside"),
    PatchPoint(SPECULATIVE_MODULE, "PARDForCausalLM.__init__", "modeling_speculative",
               "wrapped: after construction, apply_rope of each Attention instance inside"),
)
# Which module's PATCH_POINTS to check when it loads; the hook patches on load.
WATCHED = (DFLASH_MODULE, SPECULATIVE_MODULE)

# Names read from instances at wrap time (they exist only once a model is built).
DFLASH_BACKEND_ATTRIBUTE = "dflash_attention_backend"
DFLASH_KERNELS = {  # attention_backend -> instance attribute holding the kernel
    "VANILLA": "_dflash_flash_attention",
    "TRTLLM": "_dflash_trtllm_gen_ops",
    "FA4": "_dflash_fa4_fwd",
}
TRTLLM_GEN_FIELDS = ("batch_decode_with_kv_cache", "batch_context_with_kv_cache")
ATTENTION_Q_SIZE = "q_size"

# trtllm-serve's entry point (console script), and the switch that keeps the LLM API's
# executor in the calling process for one GPU (no MPI worker): TensorRT-LLM's own tests
# set it (e.g. tests/unittest/_torch/speculative/*: monkeypatch TLLM_WORKER_USE_SINGLE_PROCESS).
SERVE_ENTRY = ("tensorrt_llm.commands.serve", "main")
SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


# --- LLM-API configuration: the only field names our writers may emit -------------------
# Source: tensorrt_llm/llmapi/llm_args.py at the pinned release, as its API reference
# renders it: {DOCS}/DFlashDecodingConfig.html, Eagle3DecodingConfig.html,
# PARDDecodingConfig.html (DecodingBaseConfig fields max_draft_len, speculative_model;
# each family's decoding_type literal), and LLM arguments (model, backend,
# tensor_parallel_size, pipeline_parallel_size, max_seq_len, speculative_config) as in
# the stock llmapi model.yaml (SOURCES["llmapi_yaml"]).
LLM_API_FIELDS = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size",
                  "max_seq_len", "speculative_config")
SPECULATIVE_FIELDS = {
    "dflash": ("decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
               "target_layer_ids", "attention_backend"),
    "eagle3": ("decoding_type", "max_draft_len", "speculative_model",
               "eagle3_layers_to_capture", "use_dynamic_tree"),
    "pard": ("decoding_type", "max_draft_len", "speculative_model", "mask_token_id"),
}
DECODING_TYPES = {"dflash": "DFlash", "eagle3": "Eagle3", "pard": "PARD"}
DFLASH_ATTENTION_BACKENDS = ("VANILLA", "TRTLLM", "FA4")
# model.yaml's own section, read by the llmapi model (not passed to LLM()).
TRITON_CONFIG_FIELDS = ("max_batch_size", "decoupled")
