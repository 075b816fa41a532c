"""Every TensorRT-LLM name SharpDraft relies on, in one place, with where it was read.

TensorRT-LLM cannot be installed or imported on our machines, so each name below was read
from its source (GitHub NVIDIA/TensorRT-LLM; the commit of the stored copy we read) or,
for LLM-API field names, from the API reference generated from `llmapi/llm_args.py` for
the pinned release. Compatibility is judged by these names alone, never by a version
number: our launchers read the installed source files (plugins/trtllm/structure.py) and
refuse, in one line naming what moved, a release that lacks one (drafter classes, their
constructor signatures, the metadata fields the count reads, the DFlash kernel of the
attention backend the launch uses), and accept any release that has them all, with one
line on stderr naming it untested when it is outside READ_RANGE. When a SharpDraft drafter
is built the hook checks the same names on the loaded modules and stops the build, in one
line, where one is missing (plugins/trtllm/hook.py). The
configuration writers (plugins/trtllm/config.py) emit only LLM_API_FIELDS.

To support another release: read the same files at its tag, update the names and
commits here, widen the range, and run `python -m plugins.trtllm check` on a machine
where it imports.

Which release the names come from: NOT one. Re-reading every name from a single tagged
release was not possible here: the repository's snapshot (2.5 GB) is larger than what
can be fetched to this machine, and the source store keeps each file at the commits
where it changed, not whole releases. So every Source below names the exact commit of
the copy each name was read from, and the copies span two layouts: the older one
(`_torch/modules/attention.py`, `MLA` beside `Attention`, modeling_speculative.py holding
DFlash) and the newer one (`_torch/attention/attention.py`, `_torch/attention/mla.py`,
`_torch/attention/backends/interface.py`, `_torch/attention/qk_norm_attention.py`,
modeling_dflash.py importing `..attention.*`). The hook accepts both layouts and checks
each name when the module loads (a missing one disables it, recorded); nothing here has
run against an installed TensorRT-LLM.
"""

from __future__ import annotations

import dataclasses

# The release the configuration writers target. DFlash arrived in the 1.3.0rc line
# (PR #12794); the 1.3.0rc27 and 1.4.0rc1 API references list DFlashDecodingConfig.
# attention_backend in {VANILLA, TRTLLM, FA4}, Eagle3DecodingConfig and PARDDecodingConfig
# with the fields below. The stored source copies we read are not tied to a tag (see
# SOURCES): the hook re-checks every name when a drafter is built.
PINNED = "1.4.0rc1"
# The releases whose sources and docs we read, compared as versions (plugins/trtllm/
# versions.py). Neither a floor nor a ceiling: a release outside it is accepted, with one
# line on stderr naming it untested, when every name below is present, and one inside it is
# refused when one is missing. The older layout (the stored copies that import ..modules.* and
# ..attention_backend.*, as the 1.3.0rc line's DFlash PR did) differs in where DFlash lives
# (DFlashForCausalLM inside modeling_speculative.py, kernels VANILLA and TRTLLM only:
# SOURCES["modeling_speculative_dflash_1_3"]) and where AttentionMetadata lives
# (METADATA_MODULES); the 1.3.0rc27 docs already list FA4, so which layout a given 1.3.0rc
# build has is not known from here: both layouts are handled, by structure.
READ_RANGE = ("1.3.0rc27", "1.4.0rc4")

REPO = "https://github.com/NVIDIA/TensorRT-LLM"
DOCS = "https://nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference"


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    commit: str  # the stored copy we read (blob of that path at this commit)
    read_for: str


SOURCES = {
    "modeling_dflash": Source(
        "tensorrt_llm/_torch/models/modeling_dflash.py", "7c7504c08f1f4e389e0e4312ef947f72a87cbcfb",
        "DFlashForCausalLM(draft_config, *, dflash_attention_backend='VANILLA'): __init__ stores the "
        "kernel on the instance (_dflash_flash_attention | _dflash_trtllm_gen_ops | _dflash_fa4_fwd "
        "(+ _dflash_paged_append) by dflash_attention_backend; the others None); newer layout "
        "(imports ..attention.rotary_embedding); per-layer sliding windows (use_swa) are passed to "
        "the kernel as window_size. Same names in the earlier copy @ 009d8fa4"),
    "modeling_dflash_laguna": Source(
        "tensorrt_llm/_torch/models/modeling_dflash.py", "7c7504c08f1f4e389e0e4312ef947f72a87cbcfb",
        "DFlashLagunaForCausalLM(DFlashForCausalLM) overrides only __init__ (sets "
        "pretrained_config.architectures, _context_input_layernorm, _sliding_layers_causal -- the "
        "latter reaches the kernel as its causal argument, which the wrapper reads), _normalize_config, "
        "load_weights, project_target_hidden (target features) and _post_attention_gate (after "
        "attention); _build_dflash_draft(model_config, draft_config, ...) registered for DFLASH picks "
        "it when an architecture name holds 'Laguna', else DFlashForCausalLM(draft_config, "
        "dflash_attention_backend=spec_config.attention_backend)"),
    "draft_config": Source(
        "tensorrt_llm/_torch/models/modeling_speculative.py",
        "(stored copy of 80,662 characters with the registry-based get_draft_model; the store does "
        "not show its commit)",
        "SpecDecOneEngineForCausalLM.__init__: draft_config = ModelConfig.from_pretrained("
        "spec_config.speculative_model, attn_backend=model_config.attn_backend, mapping=..., ...) "
        "(external drafters: external_drafter_config_kwargs, the same attn_backend); get_draft_model "
        "-> the mode's registered builder: Eagle3ForCausalLM(draft_config, num_hidden_layers), "
        "PARDForCausalLM(draft_config), DFlash: modeling_dflash._build_dflash_draft"),
    "model_config": Source(
        "tensorrt_llm/_torch/pyexecutor/config_utils.py",
        "(stored copy with load_pretrained_config and _CONFIG_REGISTRY {deepseek_v32, kimi_k2, "
        "glm_moe_dsa, laguna}; the store does not show its commit)",
        "load_pretrained_config(dir): transformers.PretrainedConfig.get_config_dict, then the "
        "registered config class or transformers.AutoConfig.from_pretrained -- keys a config class "
        "does not know become attributes of pretrained_config; an unknown model_type raises there"),
    "attention_flashinfer": Source(
        "tensorrt_llm/_torch/attention/backends/flashinfer.py", "9eabd2dfcf9bdf76301406e5f9461b6c1abd1951",
        "FlashInferAttentionMetadata: the drafter runs on a draft-metadata view (_sync_draft_view) "
        "whose lengths are _draft_kv_runtime_lens; kv_lens_cuda is aliased only for the separate-KV "
        "view -- so the count the TRTLLM metadata gives is not the draft view's: refused"),
    "spec_dec_slots": Source(
        "tensorrt_llm/_torch/attention/backends/interface.py",
        "(stored copy whose update_spec_dec_param takes num_contexts; the store does not show its commit)",
        "update_spec_dec_param(..., num_contexts): 'num_contexts is the number of context (prefill) "
        "requests in the mixed batch, occupying the leading rows of slot-storage buffers. Backends "
        "that consume gen-only slots (e.g. dynamic tree) must skip these rows'"),
    "modeling_dflash_fa4": Source(
        "tensorrt_llm/_torch/models/modeling_dflash.py", "(stored copy with FA4; the store does not show its commit)",
        "FA4 path: fa4_fwd(Q_bshd, k_pages, v_pages, seqused_k=ctx+block, page_table, "
        "softmax_scale, causal, window_size_left/right); VANILLA writes the block first "
        "and passes cache_seqlens=ctx+block"),
    "dflash_attention": Source(
        "tensorrt_llm/_torch/speculative/dflash_attention.py", "0352547de78ebe7ff7657f801631ca5ce04d888c",
        "DFlashTrtllmGenOps (frozen dataclass): batch_decode_with_kv_cache = flashinfer "
        "trtllm_batch_decode_with_kv_cache, batch_context_with_kv_cache = flashinfer "
        "trtllm_batch_context_with_kv_cache; get_dflash_flash_attention -> flash_attn_with_kvcache"),
    "modeling_speculative_dflash_1_3": Source(
        "tensorrt_llm/_torch/models/modeling_speculative.py",
        "(stored copy of 125,596 characters, DFlash and DSpark helpers inside; the store does not show "
        "its commit)",
        "DFlashForCausalLM(draft_config, *, dflash_attention_backend='VANILLA') defined here: VANILLA -> "
        "_dflash_flash_attention, TRTLLM -> _dflash_trtllm_gen_ops, anything else ValueError (no FA4); "
        "dflash_forward loops `for layer_idx, layer in enumerate(self.model.layers)`, calls "
        "layer.self_attn.qkv_proj(...) on the block, then the kernel: flash_attention(q=Q_bshd, "
        "k_cache=ctx_k_cache[:, layer_idx], v_cache=..., k=k_noise, v=v_noise, cache_seqlens=ctx, "
        "cache_batch_idx=..., causal=..., window_size=...) or trtllm_gen_ops.batch_decode_with_kv_cache("
        "query=..., seq_lens=ctx+block, q_len_per_req=block, window_left=...) / "
        "batch_context_with_kv_cache(..., causal=False)"),
    "modeling_speculative": Source(
        "tensorrt_llm/_torch/models/modeling_speculative.py", "00679c66c3e38f6d2651ad0a5bef0f94d862e36c",
        "Eagle3ForCausalLM (registered also as Eagle3DeepSeekV3ForCausalLM; _use_mla when the "
        "config has kv_lora_rank: MLA layers instead of Attention), MistralLarge3EagleForCausalLM "
        "(DeepseekV3DecoderLayer: MLA), PARDForCausalLM (wraps an ordinary architecture class, "
        "the same classes the target uses), each built by get_draft_model"),
    "modeling_speculative_dflash": Source(
        "tensorrt_llm/_torch/models/modeling_speculative.py",
        "(stored copy of 69,587 characters; the store does not show its commit)",
        "an older layout: DFlashForCausalLM(nn.Module) defined here, its dflash_forward importing "
        "flash_attn_with_kvcache from flash_attn at call time (q [B, block, H, D], "
        "cache_seqlens = ctx + block, causal=False), no instance attribute holding the kernel"),
    "attention": Source(
        "tensorrt_llm/_torch/modules/attention.py", "00547a25ac61d28d1dabb2e47383a1af605ebb59",
        "Attention.forward(position_ids, hidden_states, attn_metadata, attention_mask, ..., "
        "attention_window_size, ...): qkv_proj -> (dynamic tree with unfused RoPE only: "
        "_adjust_position_ids_for_spec_dec, past = kv_lens_cuda - seq_lens, + "
        "spec_decoding_position_offsets) -> self.apply_rope(q, k, v, position_ids) -> attn; "
        "_adjust_position_ids_for_spec_dec: gen_len = seq_lens[num_contexts], past = "
        "kv_lens_cuda[num_contexts:num_contexts + num_gens] - gen_len, offsets = "
        "spec_decoding_position_offsets[:num_gens * gen_len].view(num_gens, gen_len) (the draft loop "
        "writes them from row 0, row stride gen_len), applied to rows num_ctx_tokens on; "
        "apply_rope returns (q, k, v), or its inputs unrotated when rope_fusion (fused qkv: "
        "(qkv, None, None)); q_size = num_heads * head_dim; attention_chunk_size on the layer; "
        "class MLA(nn.Module) beside it (not an Attention)"),
    "attention_moved": Source(
        "tensorrt_llm/_torch/attention/attention.py", "930bd1a7cc5173721fd6bb3a34b5b3074eeb0c39",
        "a later home of the same Attention module (both paths are accepted)"),
    "attention_interface": Source(
        "tensorrt_llm/_torch/attention/backends/interface.py", "b386a7fff981548964f58eb5f7e2a8e015c661bb",
        "AttentionMetadata: seq_lens is a host tensor (setter: maybe_pin_memory; under CUDA graphs "
        "_seq_lens_cuda.copy_(seq_lens) in place, else a new .cuda() copy); seq_lens_cuda property; "
        "num_seqs = seq_lens.shape[0]; num_tokens / num_ctx_tokens Python ints set on update; "
        "create_cuda_graph_metadata: seq_lens = ones(max_batch_size) * (1 + max_draft_tokens), "
        "num_contexts = 0 (padded dummy requests counted). Older path "
        "_torch/attention_backend/interface.py @ 51ea5c96: the same"),
    "qk_norm_attention": Source(
        "tensorrt_llm/_torch/attention/qk_norm_attention.py", "a15d889071654fe453ba9d826d98f6c6398310ab",
        "QKNormRoPEAttention(Attention) overrides preprocess_qkv: fused gemma-norm + RoPE + gate "
        "(never apply_rope) when _fuse_qk_norm_rope_gate, else super().preprocess_qkv; apply_rope "
        "overridden (q/k norm, then super().apply_rope or the fused qk_norm_rope op). Older copy "
        "_torch/modules/qk_norm_attention.py @ a98a9061: apply_rope override only"),
    "dflash_hybrid_attn": Source(
        "tensorrt_llm/_torch/speculative/dflash_hybrid_attn.py",
        "2fc997219d69cbbdfb92bd6e04b53ecbf2440d49 (and a newer split-K copy, commit not shown: same signature)",
        "dflash_ctx_paged_attention(q [B, Q, NH, D], k_cache, v_cache [pages, TPB, NKV, D], block_idx [B, W], "
        "ctx_lens [B] (device), k_noise, v_noise [B, Q, NKV, D]) -> [B, Q, NH, D]: every row attends to "
        "ctx_lens[b] paged context tokens plus the Q noise keys, unmasked, sm_scale = 1/sqrt(D); "
        "dflash_ctx_paged_attention_ref: a plain-torch reference 'for parity tests'"),
    "mapping": Source(
        "tensorrt_llm/mapping.py", "(stored copies; the store does not show their commit)",
        "Mapping: pp_rank (rank // (tp_size * cp_size)), pp_size, is_last_pp_rank(): pp_rank == pp_size - 1"),
    "model_loader": Source(
        "tensorrt_llm/_torch/pyexecutor/model_loader.py", "(stored copies; the store does not show their commit)",
        "ModelLoader.load: `with MetaInitMode(): model = AutoModelForCausalLM.from_config(config_copy)`; on "
        "any exception logs 'Fallback to regular model init' and builds the model again (newest copy: "
        "is_meta_init flag). MetaInitMode (_torch/models/modeling_utils.py) puts empty/empty_like on the "
        "meta device and raises MetaInitException on other ops over meta tensors"),
    "cuda_graph_runner": Source(
        "tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py", "(stored copies; the store does not show their commit)",
        "CUDAGraphRunner.maybe_get_cuda_graph(batch, ...) decides per batch whether a graph is used; graphs "
        "for a new key are captured on demand while serving, through torch.cuda.CUDAGraph"),
    "openengine": Source(
        "(newer copies than 1.4.0rc4: the OpenEngine gRPC server module; its path was not pinned)",
        "(FACTS 2026-12-07)",
        "imports `from tensorrt_llm import LLM as PyTorchLLM` at import time and builds from that name"),
    "mla": Source(
        "tensorrt_llm/_torch/attention/mla.py", "99734c04e159095649e7a9add6d4f4425fc15ff9",
        "where MLA lives in the newer layout (location only: the file's contents were not read)"),
    "model_engine": Source(
        "tensorrt_llm/_torch/pyexecutor/model_engine.py", "(stored copies; the store does not show their commit)",
        "PyTorchModelEngine warm-up: forward passes (autotuner warm-up; _run_cuda_graph_warmup "
        "captures generation graphs for each batch size and draft length) before the LLM serves — "
        "where the launcher's counts after construction come from (with CUDA graphs: the warm-up's "
        "eager run moves each drafter's device counter to the GPU before any capture)"),
    "mpi_session": Source(
        "tensorrt_llm/llmapi/mpi_session.py", "00a1352a7d4888da341e92fc5b19cdfe3e532210",
        "MpiPoolSession._start_mpi_pool: MPIPoolExecutor(max_workers=n_workers, path=sys.path, "
        "env={only TRTLLM*/TLLM* variables} + env_overrides); older copies (re-read 2026-12-07, several) pass "
        "no env= at all (TensorRT-LLM's own tests patch _start_mpi_pool to add one): so nothing of ours "
        "travels in the environment -- the proof directory is in the drafter view's config; workers run "
        "worker_main; their COMM_WORLD is the spawned world (_worker_identity_barrier), whose rank "
        "TensorRT-LLM's mpi_rank() reads"),
    "executor": Source(
        "tensorrt_llm/executor/executor.py", "005bc848893f575ec14b45d6b13139360d67c790",
        "GenerationExecutor.create: world size > 1 -> proxy + MPI workers; TP1 with "
        "TLLM_WORKER_USE_SINGLE_PROCESS (enable_worker_single_process_for_tp1) -> the worker in "
        "this process; otherwise TP1 also -> proxy + one spawned MPI worker"),
    "proxy": Source(
        "tensorrt_llm/executor/proxy.py", "b93e14ca093e446615f3009cae6ca5a33c4f2f56",
        "GenerationExecutorProxy: MpiPoolSession(n_workers=model_world_size) unless a session is "
        "given; mpi_session.submit(worker_main, ..., _torch_model_class_mapping=MODEL_CLASS_MAPPING)"),
    "serve": Source(
        "tensorrt_llm/commands/serve.py", "4c05a74891e4df8066f08ed4ce14b0972abe4e25",
        "launch_server: llm = PyTorchLLM(**llm_args) (PyTorchLLM = tensorrt_llm.LLM, a module "
        "global bound at import) then OpenAIServer(llm=llm, ...); options --tp_size, --pp_size, --ep_size, "
        "--extra_llm_api_options (later releases: --config). Re-read 2026-12-07: the same binding, and "
        "the same `from tensorrt_llm import LLM as PyTorchLLM` in the gRPC / SMG / OpenEngine server "
        "modules and the older Triton llmapi model.py: one class object, gated in place (LLM_CLASS)"),
    "llmapi_model": Source(
        "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py", "044a90d209e380c95e23e8ae42f3583fa05ada78",
        "TritonPythonModel; imports tensorrt_llm in initialize(), which builds LLM(**model.yaml "
        "less triton_config) and returns once the engine started; _create_response sends "
        "finish_reason / acceptance_rate / total_* with text_output's dtype; helpers.py beside it"),
    "llmapi_helpers": Source(
        "triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py", "0df60f9ad779c4dc4f55da07e08b969fc4684e56",
        "request inputs return_finish_reason, sampling_param_return_perf_metrics (gate the "
        "optional outputs), sampling_param_{temperature,top_k,top_p,max_tokens,seed}, streaming"),
    "llmapi_yaml": Source(
        "triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml", "0ebb1536ac12bbe27201185de960df3ab00bcecc",
        "model, backend, tensor_parallel_size, pipeline_parallel_size, "
        "triton_config {max_batch_size, decoupled}"),
    "setup": Source(
        "setup.py", "(stored copy; the store does not show its commit)",
        "console script trtllm-serve = tensorrt_llm.commands.serve:main"),
}


# What changed in this file when every pin was re-read against the newest stored sources
# (issue 69, 2026-12-07):
# - modeling_dflash.py @ 7c7504c0 (newest stored): DFlashForCausalLM(draft_config, *,
#   dflash_attention_backend), the kernels on the instance (_dflash_flash_attention /
#   _dflash_trtllm_gen_ops / _dflash_fa4_fwd + _dflash_paged_append) from dflash_attention's
#   get_dflash_* loaders: unchanged. It does not import dflash_hybrid_attn.
# - modeling_dflash.py, a DFlash 2 copy (78,299 characters, commit not shown; older
#   ..modules layout, VANILLA / TRTLLM): block convolutions around each sublayer
#   (attention_convs / mlp_convs, on hidden states before qkv_proj and after o_proj) and a
#   candidate selector after the logits -- both outside the query path; each layer still
#   calls self_attn.qkv_proj right before its kernel, VANILLA passes k/v to append with
#   cache_seqlens = ctx (the wrapper adds k.shape[1]), TRTLLM calls append_paged_kv_cache
#   (kept) then batch_decode / batch_context with seq_lens = ctx + block: unchanged.
# - dflash_attention.py (newest stored: get_dflash_flash_attention, get_dflash_paged_append,
#   get_dflash_trtllm_gen_ops, get_dflash_fa4_fwd): unchanged names.
# - NEW dflash_hybrid_attn.py (SOURCES["dflash_hybrid_attn"]): dflash_ctx_paged_attention,
#   wrapped (KERNEL_PARAMETERS["HYBRID"], DFLASH_HYBRID_*); any other public function there
#   refused by name.
# - model_loader.py (SOURCES["model_loader"]): the MetaInitMode build and its fallback build
#   -- the proof now asks for one fully counting drafter per process, not every record's.
# - SpecDecOneEngineForCausalLM.__init__ (SOURCES["draft_config"]): draft_config carries
#   mapping=model_config.mapping; every pipeline stage builds the drafter: MAPPING_FIELD,
#   MAPPING_STAGE, MAPPING_MODULE (SOURCES["mapping"]) are new.
# - mpi_session.py: older copies pass no env= (SOURCES["mpi_session"]): PROOF_KEY is new, the
#   proof directory rides in the drafter view's config.
# - commands/serve.py and the OpenEngine server (SOURCES["serve"], ["openengine"]): LLM is
#   bound at import under other names: LLM_BINDINGS (a list of names) is replaced by
#   LLM_CLASS (the class, gated in place); SERVE_LLM is gone.
# - cuda_graph_runner.py (SOURCES["cuda_graph_runner"]): captures while serving through
#   torch.cuda.CUDAGraph: proof.CAPTURE_METHODS (torch's, not TensorRT-LLM's) is what the
#   count reader waits on.


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """A module-level class whose constructor the hook wraps; checked when the module loads."""

    module: str
    attribute: str  # dotted inside the module
    source: str  # key of SOURCES
    role: str
    family: str  # dflash | eagle3 | pard: what prepare_drafter wraps; "mla": refused when built
    required: bool = True  # False: present in some layouts only (absent: nothing to patch)


DFLASH_MODULE = "tensorrt_llm._torch.models.modeling_dflash"
SPECULATIVE_MODULE = "tensorrt_llm._torch.models.modeling_speculative"
DFLASH_ATTENTION_MODULE = "tensorrt_llm._torch.speculative.dflash_attention"
# Attention.apply_rope/forward are wrapped per drafter *instance* (never on the class:
# PARD's drafter shares its classes with the target); the class is looked up, once a
# drafter is built, in whichever of these modules is loaded.
ATTENTION_MODULES = ("tensorrt_llm._torch.modules.attention", "tensorrt_llm._torch.attention.attention")
ATTENTION_CLASS = "Attention"
MLA_CLASS = "MLA"  # DeepSeek-style latent attention: its query path is not wrapped (refused)
ATTENTION_METHOD = "apply_rope"
ATTENTION_FORWARD = "forward"
VERSION_MODULE = "tensorrt_llm.version"
DISTRIBUTION = "tensorrt_llm"  # importlib.metadata name: read at launch without importing it

_WRAP_ROPE = "wrapped: after construction, forward/apply_rope of each Attention instance inside"
PATCH_POINTS = (
    # DFlash lives in modeling_dflash.py, or (older layout) in modeling_speculative.py: one of
    # the two is required (structure.py; FAMILIES)
    PatchPoint(DFLASH_MODULE, "DFlashForCausalLM.__init__", "modeling_dflash",
               "wrapped: after construction, the instance's attention kernel is wrapped", "dflash",
               required=False),
    PatchPoint(SPECULATIVE_MODULE, "Eagle3ForCausalLM.__init__", "modeling_speculative", _WRAP_ROPE,
               "eagle3"),
    PatchPoint(SPECULATIVE_MODULE, "PARDForCausalLM.__init__", "modeling_speculative", _WRAP_ROPE, "pard"),
    PatchPoint(DFLASH_MODULE, "DFlashLagunaForCausalLM.__init__", "modeling_dflash_laguna",
               "wrapped like DFlash when it overrides only DFLASH_AUDITED_OVERRIDES", "dflash", required=False),
    PatchPoint(SPECULATIVE_MODULE, "DFlashForCausalLM.__init__", "modeling_speculative_dflash_1_3",
               "wrapped like modeling_dflash's (older layout), or, in the oldest copies, "
               "dflash_forward's flash_attn_with_kvcache", "dflash", required=False),
    PatchPoint(SPECULATIVE_MODULE, "MistralLarge3EagleForCausalLM.__init__", "modeling_speculative",
               "refused when built: MLA drafter layers", "mla", required=False),
)
# The drafter families a release must have, each in one of its layouts' patch points.
FAMILIES = {"dflash": "DFlashForCausalLM", "eagle3": "Eagle3ForCausalLM", "pard": "PARDForCausalLM"}
# Which module's PATCH_POINTS to check when it loads; the hook patches on load.
WATCHED = (DFLASH_MODULE, SPECULATIVE_MODULE)
# Any other class of a watched module whose name says it is a drafter gets a constructor
# that records a refusal: a drafter class we do not know never runs unscaled silently.
# (00679c6's comments name a newer `DFlashDrafter`; a drafter built in a module we do not
# watch leaves no proof at all, which our launchers refuse just the same.)
DRAFTER_CLASS_PATTERN = r"((Eagle|DFlash|PARD|Pard).*ForCausalLM|Drafter)$"

# The older DFlash layout imports its kernel from this module inside dflash_forward.
FLASH_ATTN_MODULE = "flash_attn"
FLASH_ATTN_KERNEL = "flash_attn_with_kvcache"
DFLASH_FORWARD = "dflash_forward"

# AttentionMetadata fields the EAGLE-3/PARD count reads (SOURCES["attention"]:
# _adjust_position_ids_for_spec_dec reads the same): per sequence kv_lens_cuda (cached +
# new keys) and seq_lens_cuda (new tokens); num_contexts context requests come first;
# generation requests carry use_spec_decoding and spec_decoding_position_offsets (each draft
# token's depth: 1-D for a dynamic tree, written from row 0 with row stride gen_len, or
# [gens, >= gen_len]). Checked in the installed source before a launch (structure.py) and on
# the loaded class when a drafter is built (hook.py): a missing one is drift, refused.
METADATA = {"kv_lens": "kv_lens_cuda", "seq_lens_cuda": "seq_lens_cuda",
            "num_contexts": "num_contexts",
            "num_seqs": "num_seqs", "num_tokens": "num_tokens", "num_ctx_tokens": "num_ctx_tokens",
            "use_spec": "use_spec_decoding",
            "offsets": "spec_decoding_position_offsets"}
# Where the metadata classes live: AttentionMetadata in interface.py, TrtllmAttentionMetadata
# (kv_lens_cuda) in the TRTLLM backend's module; under _torch/attention_backend/ in the
# older layout (SOURCES["attention_interface"], older path), _torch/attention/backends/ later.
METADATA_MODULES = ("tensorrt_llm._torch.attention_backend.interface", "tensorrt_llm._torch.attention_backend.trtllm",
                    "tensorrt_llm._torch.attention.backends.interface",
                    "tensorrt_llm._torch.attention.backends.trtllm")
METADATA_CLASSES = ("AttentionMetadata", "TrtllmAttentionMetadata")
# Constructor parameters the hook reads (SOURCES["modeling_dflash"], ["draft_config"]): every
# drafter's first parameter is its ModelConfig (DRAFT_CONFIG_ARGUMENTS); DFlash's keyword
# picks the kernel the instance holds.
CONSTRUCTOR_PARAMETERS = {"dflash": ("dflash_attention_backend",), "eagle3": (), "pard": ()}
# What each DFlash kernel wrapper reads from the call it wraps (plugins/trtllm/kernels.py):
# checked on the held kernel's signature when the drafter is built.
KERNEL_PARAMETERS = {
    "VANILLA": ("q", "k_cache", "k", "cache_seqlens", "causal", "window_size"),
    "TRTLLM": ("query", "seq_lens", "window_left", "q_len_per_req", "cum_seq_lens_q"),
    "TRTLLM_CONTEXT": ("query", "seq_lens", "cum_seq_lens_q", "window_left", "causal"),
    "FA4": ("q", "k", "seqused_k", "page_table", "causal", "window_size_left", "window_size_right",
            "cu_seqlens_q"),
    "HYBRID": ("q", "ctx_lens", "k_noise"),
}
# The hybrid-context DFlash kernel (SOURCES["dflash_hybrid_attn"]): a Triton paged
# cross-attention over the target KV cache manager's pool, in its own module. No stored
# modeling_dflash.py calls it yet, so where a release binds it is not known: while a
# SharpDraft DFlash drafter's dflash_forward runs, the module's function and every DFlash
# module global bound to it hold our wrapper (kernels.wrap_dflash_hybrid), and a drafter
# instance attribute holding it is wrapped like the other kernels. Any other public
# function of that module is an unknown DFlash kernel: a SharpDraft drafter is refused,
# naming it, when built (and our launchers' check names it before).
DFLASH_HYBRID_MODULE = "tensorrt_llm._torch.speculative.dflash_hybrid_attn"
DFLASH_HYBRID_KERNEL = "dflash_ctx_paged_attention"
DFLASH_HYBRID_UNUSED = ("dflash_ctx_paged_attention_ref",)  # its docstring: "for parity tests"
# ModelConfig.mapping (tensorrt_llm.mapping.Mapping, SOURCES["mapping"]): the drafter's
# pipeline stage. SpecDecOneEngineForCausalLM hands the drafter a config with the target's
# mapping (SOURCES["draft_config"]); every stage builds a drafter, the last one runs it.
MAPPING_FIELD = "mapping"
MAPPING_STAGE = ("pp_rank", "pp_size", "is_last_pp_rank")
MAPPING_MODULE = "tensorrt_llm.mapping"
# Our own key beside the QueryScaling in a drafter view's config (never TensorRT-LLM's):
# the launch's proof directory (plugins/trtllm/proof.py), so it reaches the worker in the
# config it builds the drafter from, not in an environment MPI may not forward.
PROOF_KEY = "proof"
# DFlash draft layers are told apart by the layer object: dflash_forward calls each draft
# layer's self_attn.qkv_proj on the block right before that layer's kernel call
# (SOURCES["modeling_speculative_dflash_1_3"], ["modeling_dflash"]).
DFLASH_LAYER_QUERY = ("self_attn", "qkv_proj")
# Where a count cannot be derived exactly from those: refused, at launch or when built.
CHUNK_ATTRIBUTE = "attention_chunk_size"  # Attention.__init__ (Llama-4 chunked attention)
DRAFTER_MODEL_CONFIG = "model_config"
SPARSE_ATTENTION = "sparse_attention_config"  # KV compression / sparse attention (RocketKV, DSA, ...)

# The drafter's own config (SOURCES["draft_config"], ["model_config"]): the constructor's
# first argument (or these keywords) is a ModelConfig whose pretrained_config is the drafter
# directory's config.json; SharpDraft's parameters ride in it under SHARPDRAFT_KEY.
DRAFT_CONFIG_ARGUMENTS = ("draft_config", "model_config")
PRETRAINED_CONFIG = "pretrained_config"
SHARPDRAFT_KEY = "sharpdraft"
# Beside the QueryScaling fields there: what to do when the hook cannot scale this drafter.
# Absent: its build stops (plugins/trtllm/hook.py UnscalableDrafter); "frozen": it runs
# frozen, said by a startup line, a `frozen` proof record and the sharpdraft_frozen_drafters metric.
IF_UNSCALABLE = "if_unscalable"
# ModelConfig.attn_backend: the generic Attention path (EAGLE-3, PARD) is audited on the
# TRTLLM backend's metadata only; FLASHINFER drafts on its own draft view
# (SOURCES["attention_flashinfer"]) and VANILLA / others were not read: refused.
ATTN_BACKEND_FIELD = "attn_backend"
AUDITED_ATTN_BACKENDS = ("TRTLLM",)
DRAFTER_FORWARD = "forward"
# DFlash subclasses: methods a subclass may override and still be wrapped
# (SOURCES["modeling_dflash_laguna"]); any other override is refused when built.
DFLASH_CLASS = "DFlashForCausalLM"
DFLASH_AUDITED_OVERRIDES = ("__init__", "_normalize_config", "load_weights", "project_target_hidden",
                            "_post_attention_gate")

# Names read from instances at wrap time (they exist only once a model is built).
DFLASH_BACKEND_ATTRIBUTE = "dflash_attention_backend"
DFLASH_KERNELS = {  # attention_backend -> instance attribute holding the kernel
    "VANILLA": "_dflash_flash_attention",
    "TRTLLM": "_dflash_trtllm_gen_ops",
    "FA4": "_dflash_fa4_fwd",
}
TRTLLM_GEN_FIELDS = ("batch_decode_with_kv_cache", "batch_context_with_kv_cache")
ATTENTION_Q_SIZE = "q_size"
# Attention methods through which a subclass could route the query around apply_rope
# (QKNormRoPEAttention.preprocess_qkv's fused norm + gate path in qk_norm_attention.py):
# a drafter whose layers' class overrides one of them in a subclass not listed in
# AUDITED_ATTENTION is refused when built. Overriding apply_rope itself is fine (Qwen3-style
# q_norm then super().apply_rope: our wrapper sits on the instance, outside it).
ATTENTION_BYPASSES = ("forward", "preprocess_qkv")
# Overrides read and found to keep the query on apply_rope, with the instance attribute
# that must be falsy for that to hold (SOURCES["qk_norm_attention"]: QKNormRoPEAttention.
# preprocess_qkv takes its fused gemma-norm + RoPE + gate kernel only when
# _fuse_qk_norm_rope_gate is set, else it defers to Attention.preprocess_qkv).
AUDITED_ATTENTION = {("QKNormRoPEAttention", "preprocess_qkv"): "_fuse_qk_norm_rope_gate"}
# Where the MLA class lives: beside Attention (older layout) or in its own module (newer).
MLA_MODULES = ("tensorrt_llm._torch.modules.attention", "tensorrt_llm._torch.attention.attention",
               "tensorrt_llm._torch.attention.mla")

# trtllm-serve's entry point (console script) (SOURCES["serve"]). And the switch that keeps the LLM API's
# executor in the calling process for one GPU (no MPI worker): TensorRT-LLM's own tests
# set it (e.g. tests/unittest/_torch/speculative/*: monkeypatch TLLM_WORKER_USE_SINGLE_PROCESS).
SERVE_ENTRY = ("tensorrt_llm.commands.serve", "main")
# The LLM class every server builds (llmapi/llm.py's LLM; tensorrt_llm.LLM,
# commands.serve.PyTorchLLM and the OpenEngine server's `from tensorrt_llm import LLM as
# PyTorchLLM` are all this one object, SOURCES["serve"], ["openengine"]): the proof gate
# wraps its __init__ in place (launch.Launch.gate), so no import order can go around it.
# `trtllm-serve` subcommands that build their servers otherwise are refused by our
# launcher (SERVE_SUBCOMMANDS).
LLM_CLASS = ("tensorrt_llm.llmapi.llm", "LLM")
SERVE_SUBCOMMANDS = ("disaggregated", "disaggregated_mpi_worker", "mm_embedding_serve", "grpc", "openengine")
SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


# --- LLM-API configuration: the only field names our writers may emit -------------------
# Source: tensorrt_llm/llmapi/llm_args.py at the pinned release, as its API reference
# renders it: {DOCS}/DFlashDecodingConfig.html, Eagle3DecodingConfig.html,
# PARDDecodingConfig.html (DecodingBaseConfig fields max_draft_len, speculative_model;
# each family's decoding_type literal), and LLM arguments (model, backend,
# tensor_parallel_size, pipeline_parallel_size, max_seq_len, speculative_config) as in
# the stock llmapi model.yaml (SOURCES["llmapi_yaml"]).
# Parallel sizes: trtllm-serve's options (every alias seen across releases) and the LLM-API
# fields (SOURCES["serve"], llm_args). TP and PP run the drafter in MPI workers, reached by
# the .pth lazy hook; CP splits a sequence's keys across ranks, so a rank's kv_lens is not the
# count a query sees: refused.
PARALLEL_FLAGS = {"tp": ("--tp_size", "--tensor_parallel_size"),
                  "pp": ("--pp_size", "--pipeline_parallel_size"),
                  "cp": ("--cp_size", "--context_parallel_size")}
PARALLEL_FIELDS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "cp": "context_parallel_size"}
SERVE_CONFIG_FLAGS = ("--config", "--extra_llm_api_options")

LLM_API_FIELDS = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size",
                  "max_seq_len", "speculative_config")
SPECULATIVE_FIELDS = {
    "dflash": ("decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
               "target_layer_ids", "attention_backend"),
    # use_dynamic_tree needs dynamic_tree_max_topK beside it (TensorRT-LLM rejects it alone;
    # plugins.trtllm.config.check_fields enforces the pair).
    "eagle3": ("decoding_type", "max_draft_len", "speculative_model",
               "eagle3_layers_to_capture", "use_dynamic_tree", "dynamic_tree_max_topK"),
    "pard": ("decoding_type", "max_draft_len", "speculative_model", "mask_token_id"),
}
DECODING_TYPES = {"dflash": "DFlash", "eagle3": "Eagle3", "pard": "PARD"}
# What our writer may emit as DFlashDecodingConfig.attention_backend. FA4 is left out: it
# is not in the stored llm_args copies we could read (the hook still wraps an FA4 kernel
# if a drafter holds one: DFLASH_KERNELS).
DFLASH_ATTENTION_BACKENDS = ("VANILLA", "TRTLLM")
# model.yaml's own section, read by the llmapi model (not passed to LLM()).
TRITON_CONFIG_FIELDS = ("max_batch_size", "decoupled")
