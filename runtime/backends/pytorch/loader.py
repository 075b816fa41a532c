"""The torch backend's loader (runtime/backends/__init__.py: LOADERS["torch"]): an engine
directory's target and drafter checkpoints on a device in a dtype (placement.py), its
roles eager (eager.py) or compiled (compiled.py)."""

from __future__ import annotations

from pathlib import Path

from plugins.scaling import QueryScaling
from runtime import modes
from runtime.backends.pytorch.eager import (TorchBatchDFlash, TorchBatchEagle3, TorchBatchPARD,
                                            TorchBatchTarget)
from runtime.backends.roles import StyleAsBuilt, Loaded, drafter_feature_layers
from runtime.manifest import Manifest
from runtime.models import layers
from runtime.models.target import ModelError
from runtime.ngram import NGramProposer


class TorchLoaded(Loaded):
    """An engine directory on the torch backend: the target and drafter models from their
    checkpoints, on `device` in `dtype` (default: cpu, the dtype engine.json records;
    placement.py loads and places them).

    `steps`: None runs every role eagerly (the default). "eager" / "inductor" / "cudagraph"
    (compiled.py: compile_step's backends) run fixed-shape steps for a decode (1),
    an n-gram verify (ngram drafts + 1) and a block verify (block_size), the DFlash
    block, the PARD chain and EAGLE-3's chain passes: the batch roles are
    CompiledBatchTarget, CompiledBatchDFlash, CompiledBatchPARD and CompiledBatchEagle3
    (EAGLE-3 chains and trees: a tree level's step takes its mask as an input), all over
    this engine's one EngineSteps (`shared`: its compiled steps, graphs and KV buffer
    pool; a graph per slot count and row width), so a request after the first compiles
    and captures nothing. Trees verify packed, eagerly, over CompiledBatchTarget's
    slotted buffers."""

    can = modes.BACKENDS["torch"]

    def __init__(self, engine_dir: str | Path, manifest: Manifest, drafting: StyleAsBuilt,
                 device: str = "cpu", dtype: str | None = None, steps: str | None = None):
        from runtime.backends.pytorch import compiled, placement

        if steps is not None and steps not in compiled.STEPS:
            raise ModelError(f"steps {steps!r} is not one of {', '.join(compiled.STEPS)}")
        self.dir, self.drafting, self.family = Path(engine_dir), drafting, manifest.drafter
        self.device, self.dtype, self.steps = str(device), dtype or manifest.dtype, steps
        self.model, self.tokenizer = placement.load_target(manifest.target_dir, self.device, self.dtype)
        # engines built with --max-seq-len serve no longer sequences
        positions = self.model.config.max_position_embeddings
        self.context_limit = min(positions, int(manifest.extra.get("max_seq_len") or positions))
        torch_dtype = placement.resolve_dtype(self.dtype)
        self.drafter_model = None
        family = modes.FAMILIES[manifest.drafter]
        if family.load is not None:
            self.drafter_model = family.load(manifest.drafter_dir, torch_dtype, self.model)
            placement.place(self.drafter_model, self.device)
        # the linear layers' kernel for a step's few rows, as measured where this runs
        # (step_costs.choose_transposed_rows; engines built before it: F.linear)
        where = {"backend": "torch", "device": self.device.split(":")[0], "dtype": self.dtype,
                 "steps": steps}
        costs = manifest.measured_on(manifest.extra.get("step_costs", {}).get("torch"), where)
        for model in (self.model, self.drafter_model):
            if model is not None:
                layers.transpose_rows(model, (costs or {}).get("transposed_rows", ()))
        self.feature_layers = drafter_feature_layers(manifest, self.model.config.num_layers)
        # the widths a single sequence's verify takes: a decode step, an n-gram verify
        # (ngram drafts + the bonus), a block verify
        ngram = (manifest.extra.get("ngram") or NGramProposer().settings())["num_draft_tokens"] + 1
        self.widths = tuple(sorted({1, ngram, manifest.block_size}))
        self.shared = None if steps is None else compiled.EngineSteps(
            self.model, self.feature_layers, self.widths, steps, drafter=self.drafter_model,
            context_limit=self.context_limit)

    def batch_target(self) -> TorchBatchTarget:
        if self.shared is not None:
            return self.shared.batch_target()
        return TorchBatchTarget(self.model, self.feature_layers, self.context_limit)

    @staticmethod
    def takes_window(manifest: Manifest) -> bool:
        return True  # the eager DFlash drafter takes any window

    def batch_dflash(self, scaling: QueryScaling | None, window: int | None = None
                     ) -> TorchBatchDFlash:
        """One batched DFlash pass for every row, under any scaling and draft window:
        compiled with `steps` (whole context), eager under a window."""
        if self.shared is not None and window is None:
            return self.shared.batch_dflash(scaling)
        return TorchBatchDFlash(self.drafter_model, self.model, scaling, window)

    def batch_pard(self, scaling: QueryScaling | None, window: None = None) -> TorchBatchPARD:
        """PARD chains for every row in one pass: compiled with `steps`, else eager."""
        if self.shared is not None:
            return self.shared.batch_pard(scaling, self.drafting.max_drafts)
        return TorchBatchPARD(self.drafter_model, self.model.config.vocab_size,
                              self.drafting.max_drafts, scaling)

    def batch_eagle3(self, scaling: QueryScaling | None, window: None = None) -> TorchBatchEagle3:
        """EAGLE-3 chains (top_k 1) for every row, one pass per link: compiled with
        `steps`, else eager."""
        if self.shared is not None:
            return self.shared.batch_eagle3(scaling, max(self.drafting.max_drafts, 1))
        return TorchBatchEagle3(self.drafter_model, scaling, max(self.drafting.max_drafts, 1))

    def batch_drafter(self, scaling: QueryScaling | None, window: int | None = None):
        """The drafter over a batch (BatchBlockDrafter, BatchChainDrafter): one pass per
        step (per chain link) for every row; a `window` is DFlash's."""
        # each family's constructor here is `batch_<family>` (runtime/families.py)
        return getattr(self, "batch_" + self.family)(scaling, window)

    def tree_drafter(self, scaling: QueryScaling | None) -> TorchBatchEagle3:
        """EAGLE-3 trees for every row (BatchTreeDrafter), the tree the engine was built
        for, under `scaling` (None: frozen): one pass per level across the rows' frontiers,
        compiled with `steps`, else eager."""
        shape, most = self.drafting.tree_shape, max(self.drafting.max_drafts, 1)
        if self.shared is not None:
            return self.shared.batch_eagle3(scaling, most, shape)
        return TorchBatchEagle3(self.drafter_model, scaling, most, shape)

