"""A stand-in `tensorrt_llm` package, written to a folder and imported through the real
import machinery, whose names and process layout follow TensorRT-LLM's source (the files
and commits below; plugins/trtllm/pins.py cites the same):

- tensorrt_llm/llmapi/mpi_session.py @ 00a1352a: MpiPoolSession._start_mpi_pool starts
  workers with mpi4py's `MPIPoolExecutor(max_workers=n_workers, path=sys.path, ...)`; that
  copy adds `env=` holding only the parent's TRTLLM*/TLLM* variables, older copies pass no
  env= at all — here no env= (the harder case: the launch's nonce variable may not reach
  the workers; the activation file's liveness check must do). A worker's rank is its
  spawned COMM_WORLD's (`_worker_identity_barrier` pins one task per worker the same way).
- _torch/pyexecutor/model_engine.py (PyTorchModelEngine warm-up, `_run_cuda_graph_warmup`):
  forward passes run before the LLM serves; here one draft step at LLM() and per generate().
- tensorrt_llm/executor/executor.py @ 005bc848 (GenerationExecutor.create) and
  executor/proxy.py @ b93e14ca: world size > 1 -> proxy + MpiPoolSession(n_workers) +
  submit(worker_main, ...) on every worker; TP1 with TLLM_WORKER_USE_SINGLE_PROCESS=1 -> the
  worker in the calling process; TP1 otherwise -> proxy + one spawned MPI worker. The worker
  builds the model, the drafter included (get_draft_model in modeling_speculative).
- _torch/modules/attention.py @ 00547a25: Attention.forward(position_ids, hidden_states,
  attn_metadata, attention_mask, mrope_config, all_reduce_params, lora_params,
  attention_window_size, ...) -> qkv_proj -> (dynamic tree, unfused RoPE only: positions
  adjusted) -> apply_rope(q, k, v, position_ids) -> kernel; `MLA` beside it.
- _torch/models/modeling_speculative.py @ 00679c66: Eagle3ForCausalLM (MLA layers when the
  config has kv_lora_rank: _use_mla), MistralLarge3EagleForCausalLM (DeepseekV3 layers, MLA),
  PARDForCausalLM (draft_model_full: an ordinary architecture); optionally the older
  layout's DFlashForCausalLM (stored copy without a shown commit) whose dflash_forward
  imports flash_attn_with_kvcache from flash_attn at call time.
- _torch/models/modeling_dflash.py @ 009d8fa4 and _torch/speculative/dflash_attention.py
  @ 0352547d: the kernel held on the instance by dflash_attention_backend.
- tensorrt_llm/commands/serve.py @ 4c05a748: `from tensorrt_llm import LLM as PyTorchLLM`;
  launch_server builds PyTorchLLM(**llm_args), then serves; the click command `serve`
  (console script trtllm-serve -> main) merges the --extra_llm_api_options/--config YAML
  over its command-line options (the file wins).
- triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d2: initialize() imports
  tensorrt_llm and builds LLM(**model.yaml less triton_config); finalize() stops it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from plugins.trtllm import pins
from plugins.trtllm.standins import Metadata  # noqa: F401  (tests import it from here too)

CHECKOUT = Path(__file__).resolve().parents[1]

FILES = {
    "tensorrt_llm/__init__.py": """
        from .llmapi.llm import LLM, SamplingParams
        """,
    "tensorrt_llm/version.py": "__version__ = {version!r}\n",
    # tensorrt_llm/mapping.py (pins.SOURCES["mapping"]): pp_rank = rank // (tp * cp),
    # is_last_pp_rank(); ModelConfig.mapping is one of these
    "tensorrt_llm/mapping.py": """
        class Mapping:
            def __init__(self, world_size=1, rank=0, tp_size=1, pp_size=1, cp_size=1):
                self.world_size, self.rank = world_size, rank
                self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size

            @property
            def pp_rank(self):
                return self.rank // (self.tp_size * self.cp_size)

            def is_last_pp_rank(self):
                return self.pp_rank == self.pp_size - 1
        """,
    # a newer serving entry point (the OpenEngine gRPC server): binds LLM at import time and
    # builds from that name (pins.SOURCES["openengine"])
    "tensorrt_llm/serve/__init__.py": "",
    "tensorrt_llm/serve/openengine_server.py": """
        from tensorrt_llm import LLM as PyTorchLLM


        def serve(**llm_args):
            llm = PyTorchLLM(**llm_args)
            print(f"openengine serving with workers {{llm.worker_pids}}", flush=True)
            return llm
        """,
    # _torch/models/modeling_utils.py: MetaInitMode as its docstring and dispatch read: empty /
    # empty_like land on the meta device, any other op over a meta tensor raises
    # MetaInitException (then model_loader builds the model again, outside it)
    "tensorrt_llm/_torch/models/modeling_utils.py": """
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode


        class MetaInitException(RuntimeError):
            pass


        class MetaInitMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {{}})
                if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default):
                    kwargs["device"] = torch.device("meta")
                    return func(*args, **kwargs)
                # random and placeholder initialisers may run on meta tensors; nothing else
                if func in (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default,
                            torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                    return func(*args, **kwargs)
                metas = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_meta]
                if metas:
                    raise MetaInitException(f"Meta tensor used in unsupported function: {{func}}")
                return func(*args, **kwargs)
        """,
    "tensorrt_llm/llmapi/__init__.py": "",
    "tensorrt_llm/llmapi/mpi_session.py": """
        import os
        import sys

        from mpi4py.futures import MPIPoolExecutor

        FORWARD_ENV = {forward_env!r}


        class MpiPoolSession:
            def __init__(self, n_workers):
                self.n_workers = n_workers
                if FORWARD_ENV:
                    # @00a1352a: only TRTLLM*/TLLM* variables reach the workers, applied there after
                    # site (and every .pth) has run
                    env = {{k: v for k, v in os.environ.items() if k.startswith(("TRTLLM", "TLLM"))}}
                    self.mpi_pool = MPIPoolExecutor(max_workers=n_workers, path=sys.path, env=env)
                else:  # older copies: MPIPoolExecutor(max_workers, path=sys.path), no env=
                    self.mpi_pool = MPIPoolExecutor(max_workers=n_workers, path=sys.path)

            def submit(self, task, *args, **kwargs):
                return [self.mpi_pool.submit(task, *args, **kwargs) for _ in range(self.n_workers)]

            def shutdown(self, wait=True):
                self.mpi_pool.shutdown(wait=wait)
        """,
    "tensorrt_llm/llmapi/llm.py": """
        import os
        import types

        import torch

        UNHOOKED_RANK = {unhooked_rank!r}
        META_INIT_FAILS = {meta_init_fails!r}
        FORWARD_ENV = {forward_env!r}  # a rank whose hook is gone (started without the autoloader)
        _DRAFTER = {{}}


        def draft_config(speculative_model, attn_backend, mapping=None):
            # SpecDecOneEngineForCausalLM: ModelConfig.from_pretrained(speculative_model,
            # attn_backend=model_config.attn_backend, mapping=model_config.mapping, ...);
            # load_pretrained_config reads the directory's config.json through transformers:
            # unknown keys become attributes
            import json

            with open(os.path.join(speculative_model, "config.json")) as f:
                pretrained = types.SimpleNamespace(**json.load(f))
            return types.SimpleNamespace(pretrained_config=pretrained, attn_backend=attn_backend, mapping=mapping)


        def _rank(pool):
            if not pool:
                return 0
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()  # one task per worker (mpi_session._worker_identity_barrier)
            return MPI.COMM_WORLD.Get_rank()


        def _build_drafter(speculative_config, config):
            import importlib

            decoding = speculative_config.get("decoding_type")
            if decoding == "DFlash":
                try:
                    module = importlib.import_module("tensorrt_llm._torch.models.modeling_dflash")
                except ModuleNotFoundError:  # the older layout: DFlash beside EAGLE-3 and PARD
                    module = importlib.import_module("tensorrt_llm._torch.models.modeling_speculative")
                return module.build_dflash_draft(config, speculative_config.get("attention_backend", "VANILLA"))
            module = importlib.import_module("tensorrt_llm._torch.models.modeling_speculative")
            cls = module.Eagle3ForCausalLM if decoding == "Eagle3" else module.PARDForCausalLM
            return cls(config)


        def _load_model(speculative_config, config):
            # model_loader.py: the model (drafter included) is built under MetaInitMode and, on
            # any exception, built again ("Fallback to regular model init"); the first drafter
            # is dropped. META_INIT_FAILS: the target's construction raises under MetaInitMode.
            from tensorrt_llm._torch.models.modeling_utils import MetaInitMode

            try:
                with MetaInitMode():
                    drafter = _build_drafter(speculative_config, config)
                    if META_INIT_FAILS:
                        torch.empty(2).add_(1)  # a target op on a meta tensor: MetaInitException
                return drafter
            except Exception:
                return _build_drafter(speculative_config, config)


        def worker_main(speculative_config, attn_backend="TRTLLM", pool=False, tp=1, pp=1):
            # executor/worker.py: the worker builds the model, the drafter with it, on every
            # pipeline stage (SpecDecOneEngineForCausalLM.__init__ calls get_draft_model)
            import sys

            rank = _rank(pool)
            if pool and not FORWARD_ENV:  # a pool that forwards no environment: nothing of the launcher's
                for name in [n for n in os.environ if n.startswith("TRTLLM_SHARPDRAFT")]:
                    del os.environ[name]
            if rank == UNHOOKED_RANK:  # as if this rank's environment had no autoloader
                sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_sharpdraft_lazy", False)]
                for name in ("plugins.trtllm.hook", "_sharpdraft_plugins.trtllm.hook"):
                    if name in sys.modules:
                        sys.modules[name].uninstall()
            from tensorrt_llm.mapping import Mapping

            mapping = Mapping(world_size=tp * pp, rank=rank, tp_size=tp, pp_size=pp)
            _DRAFTER["last_stage"] = mapping.is_last_pp_rank()
            if (speculative_config or {{}}).get("decoding_type") in ("DFlash", "Eagle3", "PARD"):
                config = draft_config(speculative_config["speculative_model"], attn_backend, mapping)
                _DRAFTER["model"] = _load_model(speculative_config, config)
            return os.getpid()


        def worker_step(pool=False):
            # one speculative step: the drafter runs in the last stage's epilogue only (the
            # model engine's warm-up runs the same)
            _rank(pool)
            drafter = _DRAFTER.get("model")
            if drafter is not None and _DRAFTER.get("last_stage", True):
                drafter.draft_step()
            return os.getpid()


        class LLM:
            def __init__(self, model, backend="pytorch", tensor_parallel_size=1, pipeline_parallel_size=1,
                         speculative_config=None, max_seq_len=None, attn_backend="TRTLLM",
                         cuda_graph_config="CudaGraphConfig()", **kwargs):
                tp, pp = int(tensor_parallel_size), int(pipeline_parallel_size)
                world = tp * pp
                if world == 1 and os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1":
                    self.worker_pids = [worker_main(speculative_config, attn_backend)]
                    self._session = None
                else:
                    from .mpi_session import MpiPoolSession

                    self._session = MpiPoolSession(n_workers=world)
                    futures = self._session.submit(worker_main, speculative_config, attn_backend, pool=True, tp=tp,
                                                   pp=pp)
                    self.worker_pids = [f.result() for f in futures]
                if cuda_graph_config is not None:
                    # warm-up: _run_cuda_graph_warmup captures generation steps, the drafter's
                    # included; without CUDA graphs only _run_autotuner_warmup runs, context-only,
                    # and DFlash / PARD draft only when num_gens > 0: no drafter step before a request
                    self._step()

            def _step(self):
                if self._session is None:
                    worker_step()
                else:
                    [f.result() for f in self._session.submit(worker_step, pool=True)]

            def generate(self, prompts, params):
                self._step()
                completion = types.SimpleNamespace(text=" pass", token_ids=[1, 2])
                return [types.SimpleNamespace(outputs=[completion]) for _ in prompts]

            def shutdown(self):
                if self._session is not None:
                    self._session.shutdown()
                    self._session = None


        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
        """,
    "tensorrt_llm/commands/__init__.py": "",
    "tensorrt_llm/commands/serve.py": """
        import click
        import yaml

        from tensorrt_llm import LLM as PyTorchLLM


        def launch_server(host, port, llm_args):
            llm = PyTorchLLM(**llm_args)
            # OpenAIServer(llm=llm, ...) would serve from here on
            print(f"serving on {{host}}:{{port}} with workers {{llm.worker_pids}}", flush=True)
            llm.shutdown()


        @click.command("serve")
        @click.argument("model", type=str)
        @click.option("--host", type=str, default="localhost")
        @click.option("--port", type=int, default=8000)
        @click.option("--tp_size", type=int, default=1)
        @click.option("--pp_size", type=int, default=1)
        @click.option("--config", "--extra_llm_api_options", "config", type=str, default=None)
        def main(model, host, port, tp_size, pp_size, config):
            llm_args = {{"model": model, "tensor_parallel_size": tp_size, "pipeline_parallel_size": pp_size}}
            if config is not None:
                with open(config) as f:
                    llm_args.update(yaml.safe_load(f))  # update_llm_args_with_extra_dict: the file wins
            launch_server(host, port, llm_args)
        """,
    "tensorrt_llm/_torch/__init__.py": "",
    "tensorrt_llm/_torch/models/__init__.py": "",
    "tensorrt_llm/_torch/modules/__init__.py": "",
    "tensorrt_llm/_torch/attention_backend/__init__.py": "",
    # _torch/attention_backend/interface.py @ 51ea5c96 (the older layout's path): AttentionMetadata,
    # seq_lens a host tensor with its device copy seq_lens_cuda, num_seqs from seq_lens;
    # trtllm.py: TrtllmAttentionMetadata adds kv_lens_cuda. The fields as the count reads them
    # (plugins/trtllm/standins.py Metadata builds instances with the same names).
    "tensorrt_llm/_torch/attention_backend/interface.py": """
        from dataclasses import dataclass, field
        from typing import Optional

        import torch


        @dataclass
        class AttentionMetadata:
            num_contexts: int = 0
            num_ctx_tokens: int = 0
            num_tokens: int = 0
            use_spec_decoding: bool = False
            spec_decoding_position_offsets: Optional[torch.Tensor] = None
            _seq_lens: Optional[torch.Tensor] = field(default=None, repr=False)
            _seq_lens_cuda: Optional[torch.Tensor] = field(default=None, repr=False)

            @property
            def seq_lens(self):
                return self._seq_lens

            @property
            def seq_lens_cuda(self):
                return self._seq_lens_cuda

            @property
            def num_seqs(self):
                return self._seq_lens.shape[0]
        """,
    "tensorrt_llm/_torch/attention_backend/trtllm.py": """
        from dataclasses import dataclass
        from typing import Optional

        import torch

        from .interface import AttentionMetadata


        @dataclass
        class TrtllmAttentionMetadata(AttentionMetadata):
            kv_lens_cuda: Optional[torch.Tensor] = None
        """,
    "tensorrt_llm/_torch/speculative/__init__.py": "",
    "tensorrt_llm/_torch/speculative/dflash_attention.py": """
        from dataclasses import dataclass
        from typing import Callable
        from plugins.trtllm import standins as k

        @dataclass(frozen=True)
        class DFlashTrtllmGenOps:
            append_paged_kv_cache: Callable
            batch_context_with_kv_cache: Callable
            batch_decode_with_kv_cache: Callable

        def get_dflash_trtllm_gen_ops():
            return DFlashTrtllmGenOps(None, k.trtllm_batch_context_with_kv_cache,
                                      k.trtllm_batch_decode_with_kv_cache)
        """,
    "tensorrt_llm/_torch/modules/attention.py": """
        import torch
        from ..attention_backend.interface import AttentionMetadata  # noqa: F401  (as attention.py does)

        class Attention(torch.nn.Module):
            def __init__(self, heads=4, head_dim=8, rope_fusion=True, attention_chunk_size=None):
                super().__init__()
                self.q_size = heads * head_dim
                self.rope_fusion = rope_fusion
                self.attention_chunk_size = attention_chunk_size
                self.seen = None  # what apply_rope returned, for the tests

            def forward(self, position_ids, hidden_states, attn_metadata, attention_mask=None,
                        mrope_config=None, all_reduce_params=None, lora_params=None,
                        attention_window_size=None, attention_mask_data=None, attention_sinks=None,
                        **kwargs):
                q, k, v = hidden_states, None, None  # fused qkv
                q, k, v = self.apply_rope(q, k, v, position_ids)
                self.seen = q
                return q

            def apply_rope(self, q, k, v, position_ids):
                return q, k, v

        class QKNormRoPEAttention(Attention):
            # _torch/attention/qk_norm_attention.py @ a15d8890: preprocess_qkv takes a fused
            # gemma-norm + RoPE + gate kernel (never calling apply_rope) when
            # _fuse_qk_norm_rope_gate is set, else defers to Attention's
            def __init__(self, fuse_gate=False, **attention):
                super().__init__(**attention)
                self._fuse_qk_norm_rope_gate = fuse_gate

            def preprocess_qkv(self, qkv, position_ids):
                return qkv

        class MLA(torch.nn.Module):
            pass

        def run_attention(drafter, skip=()):
            # every Attention layer's forward on one small batch, as a draft step does
            from plugins.trtllm.standins import Metadata

            for i, layer in enumerate(m for m in drafter.modules() if isinstance(m, Attention)):
                if i not in skip:
                    layer(torch.tensor([[0, 1]]), torch.ones(2, layer.q_size + 16), Metadata([1, 1], [1, 100], 2))
        """,
    "tensorrt_llm/_torch/models/modeling_dflash.py": """
        import torch
        from plugins.trtllm import standins as k
        from ..speculative.dflash_attention import get_dflash_trtllm_gen_ops

        class DraftAttention(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv_proj = torch.nn.Identity()

        class DraftLayer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = DraftAttention()

        class DFlashForCausalLM(torch.nn.Module):
            def __init__(self, draft_config=None, *, dflash_attention_backend="VANILLA"):
                super().__init__()
                self.config = getattr(draft_config, "pretrained_config", None)
                self.model = torch.nn.Module()
                self.model.layers = torch.nn.ModuleList([DraftLayer() for _ in range({dflash_layers})])
                self.dflash_attention_backend = dflash_attention_backend
                self.pooled_cache()
                if dflash_attention_backend == "VANILLA":
                    self._dflash_flash_attention = k.flash_attn_with_kvcache
                elif dflash_attention_backend == "TRTLLM":
                    self._dflash_trtllm_gen_ops = get_dflash_trtllm_gen_ops()
                elif dflash_attention_backend == "FA4":
                    self._dflash_fa4_fwd = k._flash_attn_fwd
                else:
                    raise ValueError(f"DFlash attention backend {{dflash_attention_backend!r}}")

            def forward(self, noise=None):
                return self.dflash_forward(noise)

            def dflash_forward(self, noise=None):
                # the block decode (modeling_dflash.py / the older layout's modeling_speculative.py):
                # for layer_idx, layer in enumerate(self.model.layers): qkv_proj on the block, then
                # the kernel over that layer's slice of the pooled context cache
                q = torch.ones(1, 2, 4, 8) if noise is None else noise
                ctx_k_cache, ctx_v_cache = self.pooled_cache()
                outs = []
                for layer_idx, layer in enumerate(self.model.layers):
                    Q = layer.self_attn.qkv_proj(q)
                    outs.append(self.layer_kernel(Q, ctx_k_cache[:, layer_idx], ctx_v_cache[:, layer_idx]))
                return outs

            def draft_step(self):
                return self.forward()

            def pooled_cache(self):
                # the pooled context K/V [pool, layers, max_ctx + block, kv_heads, head_dim], preallocated
                if "_ctx_cache" not in vars(self):
                    g = torch.Generator().manual_seed(11)
                    self._ctx_cache = tuple(torch.randn(1, len(self.model.layers), 8, 2, 8, generator=g)
                                            for _ in range(2))
                return self._ctx_cache

            def _post_attention_gate(self, attn_output, *args):
                return attn_output

            def layer_kernel(self, q, k_cache, v_cache):
                # one block of 2 queries over 5 + 2 keys
                if self.dflash_attention_backend == "VANILLA":
                    return self._dflash_flash_attention(q=q, k_cache=k_cache, v_cache=v_cache,
                                                        cache_seqlens=torch.tensor([7], dtype=torch.int32),
                                                        causal=False, window_size=(-1, -1))
                if self.dflash_attention_backend == "FA4":
                    return self._dflash_fa4_fwd(q, k_cache, v_cache, seqused_k=torch.tensor([7]),
                                                page_table=torch.zeros(1, 1, dtype=torch.int32))
                pages = torch.zeros(1, 2, 8, 8)
                return self._dflash_trtllm_gen_ops.batch_decode_with_kv_cache(
                    query=q.reshape(2, 4, 8), kv_cache=(pages, pages.clone()), workspace_buffer=None,
                    block_tables=torch.zeros(1, 1, dtype=torch.int32),
                    seq_lens=torch.tensor([7], dtype=torch.int32), max_seq_len=8, q_len_per_req=2)

        class DFlashLagunaForCausalLM(DFlashForCausalLM):
            # modeling_dflash.py @ 7c7504c0: overrides __init__, _normalize_config, load_weights,
            # project_target_hidden, _post_attention_gate -- outside the query path
            @staticmethod
            def _normalize_config(config):
                return config

            def __init__(self, draft_config, *, dflash_attention_backend="VANILLA"):
                super().__init__(draft_config, dflash_attention_backend=dflash_attention_backend)
                self._sliding_layers_causal = True

            def _post_attention_gate(self, attn_output, *args):
                return attn_output
        {laguna_extra}

        def build_dflash_draft(draft_config, attention_backend):
            # _build_dflash_draft: the Laguna variant when an architecture name holds "Laguna"
            arches = getattr(draft_config.pretrained_config, "architectures", None) or []
            cls = DFlashLagunaForCausalLM if any("Laguna" in a for a in arches) else DFlashForCausalLM
            return cls(draft_config, dflash_attention_backend=attention_backend)
        """,
    "tensorrt_llm/_torch/models/modeling_speculative.py": """
        import types

        import torch
        from ..modules.attention import MLA, Attention

        from ..modules.attention import QKNormRoPEAttention, run_attention

        class Layer(torch.nn.Module):
            def __init__(self, mla=False, qk_norm=False, **attention):
                super().__init__()
                if mla:
                    self.self_attn = MLA()
                elif qk_norm:
                    self.self_attn = QKNormRoPEAttention(fuse_gate=qk_norm == "gate", **attention)
                else:
                    self.self_attn = Attention(**attention)

        class Drafting:
            def draft_step(self):
                run_attention(self)

        class Eagle3ForCausalLM(Drafting, torch.nn.Module):
            def __init__(self, draft_config=None, num_layers=0, kv_lora_rank=None, qk_norm=False, **attention):
                super().__init__()
                self._use_mla = bool(kv_lora_rank)
                self.layers = torch.nn.ModuleList([Layer(mla=self._use_mla, qk_norm=qk_norm, **attention)])

        class MistralLarge3EagleForCausalLM(torch.nn.Module):
            def __init__(self, draft_config=None):
                super().__init__()
                self.layers = torch.nn.ModuleList([Layer(mla=True)])

        class PARDForCausalLM(Drafting, torch.nn.Module):
            def __init__(self, draft_config=None, sparse_attention_config=None, **attention):
                super().__init__()
                self.draft_model_full = torch.nn.ModuleList([Layer(**attention), Layer(**attention)])
                self.model_config = types.SimpleNamespace(sparse_attention_config=sparse_attention_config)

        class Target(torch.nn.Module):  # built from the same classes as PARD's drafter
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([Layer()])
        {dflash}""",
}

# The older layout (stored modeling_speculative.py without a shown commit): DFlash defined
# beside Eagle3/PARD, its kernel imported from flash_attn inside dflash_forward.
OLD_DFLASH = """
class DFlashForCausalLM(torch.nn.Module):
    def __init__(self, draft_config=None):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer()])
        self.model.layers[0].self_attn.qkv_proj = torch.nn.Identity()

    def dflash_forward(self, q, k_cache, v_cache, cache_seqlens):
        from flash_attn import flash_attn_with_kvcache
        outs = []
        for layer_idx, layer in enumerate(self.model.layers):
            Q = layer.self_attn.qkv_proj(q)
            outs.append(flash_attn_with_kvcache(q=Q, k_cache=k_cache[:, layer_idx], v_cache=v_cache[:, layer_idx],
                                                cache_seqlens=cache_seqlens, causal=False))
        return outs

    def draft_step(self):
        cache = torch.zeros(1, 1, 8, 2, 8)
        return self.dflash_forward(torch.ones(1, 2, 4, 8), cache, cache.clone(), torch.tensor([7]))
"""
FLASH_ATTN = {"flash_attn/__init__.py": "from plugins.trtllm.standins import flash_attn_with_kvcache\n"}


HYBRID_ATTN = """
from plugins.trtllm.standins import dflash_ctx_paged_attention  # noqa: F401  (the real one is Triton)


def dflash_ctx_paged_attention_ref(q, k_cache, v_cache, block_idx, ctx_lens, k_noise, v_noise):
    return dflash_ctx_paged_attention(q, k_cache, v_cache, block_idx, ctx_lens, k_noise, v_noise)
"""
# In hybrid mode the block's keys are the first 5 context tokens of one 8-token page plus
# the 2 noise keys of the block: 7 keys per row, as in the other modes' stand-in calls.
HYBRID_CALL = (
    "        if getattr(self.config, 'dflash_hybrid', False):  # context in the target's paged pool\n"
    "            pool_k, pool_v = k_cache[0, None], v_cache[0, None]\n"
    "            return dflash_ctx_paged_attention(q, pool_k, pool_v, torch.zeros(1, 1, dtype=torch.int32),\n"
    "                                              torch.tensor([5], dtype=torch.int32), k_cache[:, 5:7],\n"
    "                                              v_cache[:, 5:7])\n")


def with_hybrid(files: dict[str, str]) -> dict[str, str]:
    """The newest sources: _torch/speculative/dflash_hybrid_attn.py (pins.SOURCES
    ["dflash_hybrid_attn"]) and a DFlash drafter that, in hybrid mode (its config sets
    dflash_hybrid), calls its module global dflash_ctx_paged_attention in the block decode.
    No stored modeling_dflash.py shows that call: this is one binding the hook must cover."""
    files["tensorrt_llm/_torch/speculative/dflash_hybrid_attn.py"] = HYBRID_ATTN
    rel = "tensorrt_llm/_torch/models/modeling_dflash.py"
    anchor = "        if self.dflash_attention_backend == \"VANILLA\":\n            return self._dflash_flash_attention("
    imports = "from ..speculative.dflash_attention import get_dflash_trtllm_gen_ops\n"
    assert anchor in files[rel] and imports in files[rel]
    files[rel] = files[rel].replace(anchor, HYBRID_CALL + anchor).replace(
        imports, imports + "from ..speculative.dflash_hybrid_attn import dflash_ctx_paged_attention\n")
    return files


def layout_1_3(files: dict[str, str]) -> dict[str, str]:
    """The older layout (pins.SOURCES["modeling_speculative_dflash_1_3"]: the stored copy
    importing ..modules.* and ..attention_backend.*, as the 1.3.0rc line did): no
    modeling_dflash.py; DFlashForCausalLM defined in modeling_speculative.py with the kernel
    held on the instance for VANILLA and TRTLLM only (any other backend: ValueError), no
    Laguna subclass."""
    dflash = files.pop("tensorrt_llm/_torch/models/modeling_dflash.py")
    classes = dflash[dflash.index("class DraftAttention"):dflash.index("class DFlashLagunaForCausalLM")]
    lines, kept, skip = classes.splitlines(keepends=True), [], 0
    for i, line in enumerate(lines):
        if skip:
            skip -= 1
        elif 'dflash_attention_backend == "FA4"' in line:  # the FA4 branch and its body
            indent = len(line) - len(line.lstrip())
            skip = next(n for n, rest in enumerate(lines[i + 1:])
                        if len(rest) - len(rest.lstrip()) <= indent and rest.strip())
        else:
            kept.append(line)
    classes = "".join(kept)
    assert "_dflash_fa4_fwd" not in classes, "that copy has no FA4 kernel"
    files["tensorrt_llm/_torch/models/modeling_speculative.py"] += (
        "\nfrom plugins.trtllm import standins as k\n"
        "from ..speculative.dflash_attention import get_dflash_trtllm_gen_ops\n\n\n" + classes +
        "\ndef build_dflash_draft(draft_config, attention_backend):\n"
        "    return DFlashForCausalLM(draft_config, dflash_attention_backend=attention_backend)\n")
    return files


def write_package(root: Path, version: str = pins.PINNED, drop: tuple[str, str] | None = None,
                  old_dflash: bool = False, unhooked_rank: int | None = None, dflash_layers: int = 2,
                  laguna_extra: str = "", layout: str = "1.4", forward_env: bool = True,
                  meta_init_fails: bool = False, hybrid: bool = False) -> Path:
    """The stand-in package under `root`. laguna_extra: a method source added to
    DFlashLagunaForCausalLM (e.g. an override outside the audited ones). layout "1.3": the
    older layout (layout_1_3). forward_env False: the MPI pool forwards no environment (older
    mpi_session copies) and workers hold none of the launcher's variables. meta_init_fails:
    the model's MetaInitMode build raises after the drafter was built, so the drafter is built
    twice. hybrid: the newest sources' dflash_hybrid_attn.py, with a drafter whose config sets
    dflash_hybrid routing its block decode through dflash_ctx_paged_attention."""
    files = {}
    for rel, text in (dict(FILES) | (FLASH_ATTN if old_dflash else {})).items():
        text = textwrap.dedent(text)
        if rel.endswith(("version.py", "modeling_speculative.py", "llm.py", "serve.py", "modeling_dflash.py",
                         "mapping.py", "mpi_session.py", "openengine_server.py", "modeling_utils.py")):
            text = text.format(version=version, dflash=textwrap.indent(OLD_DFLASH, "") if old_dflash else "",
                               unhooked_rank=unhooked_rank, dflash_layers=dflash_layers,
                               laguna_extra=textwrap.indent(textwrap.dedent(laguna_extra), "    "),
                               forward_env=forward_env, meta_init_fails=meta_init_fails)
        files[rel] = text
    if hybrid:
        files = with_hybrid(files)
    if layout == "1.3":
        files = layout_1_3(files)
    for rel, text in files.items():
        if drop and rel.endswith(drop[0]):
            text = text.replace(drop[1], "_removed_" + drop[1])
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root  # its modules import `plugins.trtllm.standins`: the checkout must be on sys.path


def forget_tensorrt_llm():
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")
                 or n == "flash_attn"]:
        del sys.modules[name]


def draft_config(scaling=None, attn_backend: str = "TRTLLM", **pretrained):
    """The ModelConfig a drafter constructor receives (SpecDecOneEngineForCausalLM:
    ModelConfig.from_pretrained(speculative_model, attn_backend=...)): pretrained_config is
    the drafter directory's config.json, SharpDraft's parameters under "sharpdraft" when
    the directory is a SharpDraft one (scaling given)."""
    import types

    if scaling is not None:
        pretrained[pins.SHARPDRAFT_KEY] = scaling.to_dict()
    return types.SimpleNamespace(pretrained_config=types.SimpleNamespace(**pretrained), attn_backend=attn_backend)
