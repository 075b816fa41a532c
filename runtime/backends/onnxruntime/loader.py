"""The onnxruntime backend's loader (runtime/backends/__init__.py: LOADERS): an engine
directory's graphs opened as sessions, the roles handed out over them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plugins.scaling import QueryScaling
from runtime import modes
from runtime.backends import bf16_prefill
from runtime.backends.roles import Loaded, style_as_built, load_tokenizer
from runtime.manifest import EngineError, Manifest, read_draft_vocab
from runtime.backends.onnxruntime.buffers import (EXPORT_VERSION, check_batched, has_window,
                                                  open_session)
from runtime.backends.onnxruntime.target import OnnxBatchTarget
from runtime.backends.onnxruntime.drafters import (BoundBatchDFlash, OnnxBatchDFlash,
                                                   OnnxBatchEagle3, OnnxBatchPARD)


class OnnxEngine(Loaded):
    """The sessions of one engine directory: target, SharpDraft drafter, frozen drafter.
    The onnxruntime backend's loader (runtime/backends/__init__.py: LOADERS): float32
    graphs on the CPU, so `device` and `dtype` take those values only; `prefill_dtype`
    bfloat16 prefills through runtime/backends/bf16_prefill.py instead of the graph."""

    can = modes.BACKENDS["onnxruntime"]

    def __init__(self, engine_dir: Path, manifest: Manifest, drafting=None,
                 threads: int | None = None, device: str = "cpu", dtype: str | None = None,
                 prefill_dtype: str | None = None):
        if str(device) != "cpu" or dtype not in (None, "float32"):
            raise EngineError(f"{engine_dir}: the onnxruntime backend runs float32 graphs on the "
                              f"cpu, not {dtype or 'float32'} on {device} — pass --backend torch")
        self.device, self.dtype = "cpu", "float32"
        record = manifest.extra.get("onnx")
        if not record:
            raise EngineError(f"{engine_dir} holds no ONNX graphs (built for backend "
                              f"{manifest.backend!r}) — rebuild with build_engine.py "
                              "--backend onnxruntime")
        if manifest.dtype != "float32":
            raise EngineError(f"{engine_dir}: the onnxruntime backend runs float32 graphs, this "
                              f"engine is {manifest.dtype}")
        version = record.get("export_version", 1)
        if version != EXPORT_VERSION or "target_kv" not in record["graphs"]:
            raise EngineError(f"{engine_dir} holds ONNX graphs of export version {version}; this "
                              f"runtime runs version {EXPORT_VERSION} (per-sequence lengths as "
                              "inputs) — rebuild it with build_engine.py --backend onnxruntime")
        graphs = record["graphs"]
        # A graph whose form over the runtime's cache buffers (name + "_kv") the engine
        # has is not run here: target.onnx, and the drafter graphs of native-form engines
        # built since drafter-kv.onnx (older engines and plugin-form ones have none).
        self.sessions = {name: open_session(Path(engine_dir) / g["file"], threads,
                                            python_ops=bool(g.get("plugin_nodes")))
                         for name, g in graphs.items() if name + "_kv" not in graphs}
        check_batched(engine_dir, self.sessions)
        self.scaling = manifest.query_scaling
        self.block_size = manifest.block_size
        self.mask_token_id = record["mask_token_id"]  # None in n-gram engines (no drafter)
        self.vocab = read_draft_vocab(engine_dir, record)
        self.drafter_family = manifest.drafter
        self.drafting = drafting or style_as_built(Path(engine_dir), manifest)
        self.tree_shape = self.drafting.tree_shape
        self.context_limit = int(manifest.extra["max_seq_len"])
        self.prefill_dtype = bf16_prefill.check_dtype(prefill_dtype)
        self.prefiller, self.prefill_grid = None, None
        if self.prefill_dtype == "bfloat16":
            self.prefill_grid = bf16_prefill.ROWS  # chunks must cut a prompt on it
            width = next(o for o in graphs["target_kv"]["outputs"] if o["name"] == "features")
            self.prefiller = bf16_prefill.Bf16Prefill.build(manifest, width["shape"][-1])
        self.tokenizer = load_tokenizer(manifest.target_dir)

    def _drafter_graph(self, sharpdraft: bool):
        """(session, scaling, in place) of the SharpDraft or the frozen drafter."""
        name, scaling = (("drafter", self.scaling) if sharpdraft and self.scaling is not None
                         else ("drafter_frozen", None))
        in_place = name + "_kv" in self.sessions
        return self.sessions[name + "_kv" if in_place else name], scaling, in_place

    @staticmethod
    def takes_window(manifest: Manifest) -> bool:
        """Whether the frozen drafter can draft under a window (window mode): a block
        drafter's graph over the runtime's cache buffers with a `window` input, as
        engine.json records the graphs (has_window asks a loaded session the same)."""
        graphs = (manifest.extra.get("onnx") or {}).get("graphs", {})
        frozen = graphs.get("drafter_frozen_kv") or {}
        return (modes.FAMILIES[manifest.drafter].takes_window
                and any(i.get("name") == "window" for i in frozen.get("inputs", ())))

    def _has_window(self) -> bool:
        session, _, in_place = self._drafter_graph(sharpdraft=False)
        return modes.takes_window(self.drafting.style) and in_place and has_window(session)

    def tree_drafter(self, scaling: QueryScaling | None) -> OnnxBatchEagle3:
        """An EAGLE-3 engine's trees for every row (BatchTreeDrafter: one run per level
        across the rows' frontiers), the tree it was built for, SharpDraft (`scaling`:
        the engine's) or frozen."""
        if self.tree_shape is None:
            raise EngineError(f"this engine's {self.drafter_family} drafter drafts no trees — "
                              "build one with build_engine.py --drafter eagle3")
        return self._batch_eagle3(scaling)

    def batch_target(self) -> OnnxBatchTarget:
        return OnnxBatchTarget(self.sessions["target_kv"], self.context_limit,
                               self.sessions.get("target_tree"), prefiller=self.prefiller)

    def batch_drafter(self, scaling: QueryScaling | None, window: int | None = None):
        """The drafter over a batch: DFlash blocks (with a `window`, over the drafter graph
        that takes one) and PARD chains in one run per step, EAGLE-3 chains in one run
        per step and chain link."""
        # each family's constructor here is `_batch_<family>` (runtime/families.py)
        return getattr(self, "_batch_" + self.drafter_family)(scaling, window)

    def _batch_eagle3(self, scaling: QueryScaling | None, window: None = None) -> OnnxBatchEagle3:
        session, scaling, _ = self._drafter_graph(scaling is not None)
        tree = self.sessions["drafter_tree" if scaling is not None else "drafter_frozen_tree"]
        return OnnxBatchEagle3(session, tree, scaling, self.tree_shape, max(self.block_size - 1, 1))

    def _batch_pard(self, scaling: QueryScaling | None, window: None = None) -> OnnxBatchPARD:
        session, scaling, _ = self._drafter_graph(scaling is not None)
        return OnnxBatchPARD(session, self.mask_token_id, self.block_size - 1, scaling)

    def _batch_dflash(self, scaling: QueryScaling | None, window: int | None = None):
        session, scaling, in_place = self._drafter_graph(scaling is not None)
        if window is not None:
            if not self._has_window():
                raise EngineError("this engine's drafter graphs take no draft window — rebuild "
                                  "it with build_engine.py (native attention)")
            return BoundBatchDFlash(session, self.block_size, self.mask_token_id, scaling,
                                    self.vocab, window)
        return (BoundBatchDFlash if in_place else OnnxBatchDFlash)(session, self.block_size,
                                                                   self.mask_token_id, scaling,
                                                                   self.vocab)

