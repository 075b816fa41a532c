"""An engine directory, loaded: tokenizer, target and drafter behind the backend
interface (the one engine.json names, or an override), and `generate` in any decoding
mode of runtime/modes.py's table this engine can run (Engine.modes; the table says what
each mode needs). Every mode runs the one decode loop (runtime/decode.py); the mode and
the drafter family choose its proposer (runtime/proposers.py): DFlash drafts blocks
(which n-gram lookup can assist), PARD chains, EAGLE-3 trees or, built with top_k 1,
chains."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.manifest import DRAFTERS, EngineError, Manifest, read_manifest
from runtime import modes, proposers
from runtime.modes import Mode
from runtime.backends import RUNNABLE_BACKENDS
from runtime.backends.rows import RowBlockDrafters, RowTargets
from runtime.decode import Decoder, Request, policy_for
from runtime.backends.torch import TorchDFlash, TorchEagle3, TorchPARD, TorchTarget
from runtime.metrics import Generation
from runtime.ngram import NGramProposer
from runtime.step_costs import StepCosts
from runtime.models.dflash import load_dflash
from runtime.models.eagle3 import load_eagle3
from runtime.models.pard import load_pard
from runtime.models.target import ModelError, load_target
from runtime.sampling import Sampler, Sampling
from runtime.tree import TreeShape
from plugins.scaling import QueryScaling

class Engine:
    def __init__(self, engine_dir: str | Path, verify: str = "quick", backend: str | None = None):
        self.dir = Path(engine_dir)
        self.manifest: Manifest = read_manifest(self.dir, verify=verify)
        if self.manifest.drafter not in DRAFTERS:
            raise EngineError(f"{self.dir}: drafter {self.manifest.drafter!r} is not supported "
                              "by this runtime yet")
        self.backend = backend or self.manifest.backend
        self.scaling = self.manifest.query_scaling
        self.drafting = modes.FAMILIES[self.manifest.drafter]  # None: no drafter model
        self.has_drafter_model = self.drafting is not None
        # Chain drafters draft as many tokens as one verify pass checks, less the bonus.
        self.max_drafts = self.manifest.block_size - 1
        self.tree_shape = None
        if self.manifest.drafter == "eagle3":
            self.tree_shape = eagle3_tree_shape(self.dir, self.manifest)
            if self.tree_shape.top_k == 1:  # one child per node: a chain
                self.drafting = "chain"
            if self.backend in modes.BACKENDS and "tree" not in modes.BACKENDS[self.backend].drafting:
                raise EngineError(f"{self.dir}: EAGLE-3 runs on the "
                                  f"{' and '.join(modes.backends_drafting('tree'))} backends, "
                                  f"not {self.backend} — pass --backend onnxruntime")
        # Every engine can draft by n-gram lookup (the bench's drafter-free peer); an
        # ngram engine records its own settings.
        self.ngram_settings = self.manifest.extra.get("ngram") or NGramProposer().settings()
        # Measured at build time for each backend; None (older or TensorRT engines): every
        # step verifies the whole block.
        costs = self.manifest.extra.get("step_costs", {}).get(self.backend)
        self.step_costs = StepCosts.from_dict(costs) if costs else None
        if self.backend == "torch":
            dtype = getattr(torch, self.manifest.dtype)
            self.model, self.tokenizer = load_target(self.manifest.target_dir, dtype)
            feature_layers = ()
            if self.manifest.drafter == "dflash":
                self.drafter_model = load_dflash(self.manifest.drafter_dir, dtype)
                self.drafter_model.config.check_target(self.model.config)
                feature_layers = self.drafter_model.config.target_layer_ids
            elif self.manifest.drafter == "pard":
                self.drafter_model = load_pard(self.manifest.drafter_dir, dtype)
                self.drafter_model.config.check_target(self.model.config)
            elif self.manifest.drafter == "eagle3":  # checked against the target as it loads
                self.drafter_model = load_eagle3(self.manifest.drafter_dir, dtype, self.model)
                feature_layers = self.drafter_model.config.feature_layers(self.model.config.num_layers)
            self.target = TorchTarget(self.model, feature_layers)
        elif self.backend == "onnxruntime":
            from runtime.backends.onnxruntime import OnnxEngine

            self.onnx = OnnxEngine(self.dir, self.manifest)
            self.tokenizer = load_tokenizer(self.manifest.target_dir)
            self.target = self.onnx.target
        elif self.backend == "tensorrt":
            from runtime.backends.tensorrt import TensorRTEngine

            self.tensorrt = TensorRTEngine(self.dir, self.manifest)
            self.tokenizer = load_tokenizer(self.manifest.target_dir)
            self.target = self.tensorrt.target
        elif self.backend == "trtllm":
            raise EngineError(f"{self.dir} is configuration for TensorRT-LLM: run it with `python -m "
                              "runtime generate` or `trtllm-serve` where TensorRT-LLM is installed")
        else:
            raise EngineError(f"{self.dir}: backend {self.backend!r} cannot run here (this "
                              f"runtime has {', '.join(RUNNABLE_BACKENDS)}) — pass --backend onnxruntime")
        # Engines built with --max-seq-len serve no longer sequences, whichever backend runs.
        limit = self.manifest.extra.get("max_seq_len")
        if limit:
            self.target.context_limit = min(self.target.context_limit, int(limit))
        self.context_limit = self.target.context_limit
        self.stop_ids = frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The decoding modes this engine runs, in the table's order (study modes such as
        the family preset run too when named, but are not listed)."""
        return tuple(m for m in Mode if not m.study and self.refusal(m) is None)

    def refusal(self, mode: Mode) -> str | None:
        """Why this engine cannot run `mode` (the table's rules), or None if it can."""
        return modes.refusal(mode, self.drafting, self.backend, self.scaling is not None,
                             self.draft_window is not None)

    def batch_refusal(self, mode: Mode) -> str | None:
        """Why this engine cannot batch `mode` (one it runs), or None if it can."""
        return modes.batch_refusal(mode, self.drafting, self.backend)

    def check_mode(self, name: str) -> Mode:
        """The mode called `name`, refused in one line naming the modes this engine runs."""
        mode = modes.parse(name)
        why = self.refusal(mode)
        if why:
            raise ValueError(f"{self.dir} cannot run mode '{mode}': {why} (it runs "
                             f"{', '.join(self.modes)})")
        return mode

    @property
    def draft_window(self) -> int | None:
        """The window modes' draft window: the DFlash drafter's training length, recorded at
        build time (extra.draft_window), where this backend's drafter can take one."""
        window = self.manifest.extra.get("draft_window")
        if window is None or self.drafting != "block" or not modes.BACKENDS[self.backend].window:
            return None
        if self.backend == "onnxruntime" and not self.onnx.has_window():
            return None
        return int(window)

    def mode_for(self, sharpdraft: bool = True) -> Mode:
        """The table's rule (modes.default_mode): SharpDraft, or the drafter frozen; what
        `generate` runs without --mode."""
        return modes.default_mode(self.drafting, self.scaling is not None, sharpdraft)

    @property
    def default_mode(self) -> Mode:
        """What a served request runs when it names no mode: the fastest mode the build
        measured on this backend (extra.default_mode, runtime/commands/default_mode.py), else the
        table's rule (engines built before it was measured, or with fixed step costs)."""
        return modes.measured_default(self.manifest.extra.get("default_mode"), self.backend,
                                      self.modes) or self.mode_for()

    def default_mode_at(self, batch: int) -> Mode:
        """The served default for a request joining `batch` sequences decoding together
        (itself included): the rule of modes.measured_default over the batch sizes the
        build measured (extra.default_mode.by_batch), else default_mode."""
        return modes.measured_default(self.manifest.extra.get("default_mode"), self.backend,
                                      self.modes, batch) or self.default_mode

    @property
    def family_preset(self) -> QueryScaling:
        """The preset scaling of the engine's drafter family (plugins/scaling.py: PRESETS),
        as engine.json recorded it at build time: the preset mode's scaling."""
        from plugins.scaling import PRESETS

        recorded = self.manifest.extra.get("family_preset")
        return QueryScaling.from_dict(recorded) if recorded else PRESETS[self.manifest.drafter]

    def proposer(self) -> NGramProposer:
        """A fresh n-gram proposer (it indexes one sequence as it grows)."""
        return NGramProposer.from_settings(self.ngram_settings)

    def drafter(self, frozen: bool = False, window: int | None = None):
        """The drafter with the engine's query scaling, or frozen (no scaling); with a
        `window`, its block rows see only the last `window` context keys (DFlash)."""
        if not self.has_drafter_model:
            raise EngineError(f"{self.dir} is an n-gram engine: it has no drafter model")
        if window is not None and self.drafting != "block":
            raise EngineError(f"{self.dir}: a draft window is written for DFlash blocks only")
        if self.backend == "onnxruntime":
            return self.onnx.drafter(sharpdraft=not frozen, window=window)
        if self.backend == "tensorrt":
            if window is not None:
                raise EngineError(f"{self.dir}: TensorRT plans take no draft window (the plugin "
                                  "has no such field) — pass --backend onnxruntime")
            return self.tensorrt.drafter(sharpdraft=not frozen)
        if window is not None:
            return TorchDFlash(self.drafter_model, self.model, None if frozen else self.scaling,
                               window)
        return self._torch_drafter(None if frozen else self.scaling)

    def _torch_drafter(self, scaling: QueryScaling | None):
        if self.manifest.drafter == "eagle3":
            return TorchEagle3(self.drafter_model, scaling, self.tree_shape, max(self.max_drafts, 1))
        if self.drafting == "chain":
            return TorchPARD(self.drafter_model, self.model.config.vocab_size, self.max_drafts, scaling)
        return TorchDFlash(self.drafter_model, self.model, scaling)

    def drafter_for(self, mode: Mode):
        """The drafter a drafter mode runs: frozen, windowed, or under its beta scaling."""
        if mode.swaps_scaling:
            return self.drafter_with_scaling(self.family_preset)
        if mode.needs_window:
            return self.drafter(frozen=True, window=self.draft_window)
        return self.drafter(frozen=not mode.scaled)

    def drafter_with_scaling(self, scaling: QueryScaling | None):
        """The drafter under any other scaling (calibration, diagnostics): torch only,
        since a compiled drafter graph has its scaling built in."""
        if not self.has_drafter_model:
            raise EngineError(f"{self.dir} is an n-gram engine: it has no drafter model")
        if self.backend != "torch":
            raise EngineError(f"{self.dir}: a {self.backend} drafter's scaling is compiled "
                              "in; try other values with the torch backend (--backend torch)")
        return self._torch_drafter(scaling)

    def decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True, target=None) -> Decoder:
        """The decode loop (runtime/decode.py) running `mode`. With `target` (the engine's
        own, or a PrefillOnce over it): a batch of one on it. Without: a batch requests
        join and leave, over the backend's batched target and DFlash drafter where it has
        them, else one target / drafter per row. `adaptive`: drafter steps verify as many
        drafts as the measured step costs make worthwhile."""
        mode = self.check_mode(mode)
        batched = target is None
        if batched and self.batch_refusal(mode):
            raise EngineError(f"{self.dir}: {self.batch_refusal(mode)}")
        proposer = self._proposer(mode, batched)
        slack = 0  # a padded verify row writes scratch keys past its own budget
        if batched and self.drafting != "tree":
            target = self._batch_target()
            slack = max(self.manifest.block_size, self.ngram_settings["num_draft_tokens"] + 1)
        else:
            one = target
            target = RowTargets(lambda: self._new_target() if one is None else one,
                                self.context_limit)
        costs = self.step_costs if adaptive and mode.uses_drafter_model else None
        return Decoder(target, proposer, policy_for(costs), slack)

    def batch_decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True) -> Decoder:
        """A decoder any number of requests join (in-flight batching)."""
        return self.decoder(mode, adaptive)

    def _proposer(self, mode: Mode, batched: bool) -> proposers.Proposer:
        if mode.drafter == modes.NO_DRAFTER:
            return proposers.NoDrafts()
        if mode.drafter == modes.LOOKUP:
            return proposers.Lookup(self.proposer)
        drafter = lambda: self.drafter_for(mode)  # noqa: E731 -- one per row
        if self.drafting == "tree":
            return proposers.Tree(drafter, self.tree_shape)
        if self.drafting == "chain":
            return proposers.Chain(drafter)
        lookup = self.proposer if mode.ngram_assist else None
        if batched and not (mode.needs_window or mode.swaps_scaling):
            return proposers.Block(self._batch_drafter(mode), lookup)
        return proposers.Block(RowBlockDrafters(drafter), lookup)

    def _new_target(self):
        """Another single-sequence target (its own cache) over the same weights / sessions."""
        if self.backend == "torch":
            target = TorchTarget(self.model, self.target.feature_layers)
        elif self.backend == "onnxruntime":
            target = self.onnx.new_target()
        else:
            raise EngineError(f"{self.dir}: {self.backend} engines hold one target")
        target.context_limit = self.context_limit
        return target

    def _batch_target(self):
        if self.backend == "torch":
            from runtime.backends.torch import TorchBatchTarget

            target = TorchBatchTarget(self.model, self.target.feature_layers)
            target.context_limit = self.context_limit
            return target
        return self.onnx.batch_target()

    def _batch_drafter(self, mode: Mode):
        scaling = self.scaling if mode.scaled else None
        if self.backend == "torch":
            from runtime.backends.torch import TorchBatchDFlash

            return TorchBatchDFlash(self.drafter_model, self.model, scaling)
        return self.onnx.batch_drafter(sharpdraft=scaling is not None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = Mode.SHARPDRAFT,
                 sampling: Sampling = Sampling(), stop: bool = True, on_tokens=None,
                 adaptive: bool = True) -> Generation:
        return run_mode(self, self.target, mode, prompt, max_new_tokens, Sampler(sampling),
                        self.stop_ids if stop else frozenset(), on_tokens, adaptive)


def run_mode(engine: Engine, target, mode: str, prompt: list[int], max_new_tokens: int,
             sampler: Sampler, stop_ids=frozenset(), on_tokens=None,
             adaptive: bool = True) -> Generation:
    """One decoding run of `mode` on `target` (the engine's own, or a PrefillOnce over it)."""
    return engine.decoder(mode, adaptive, target).generate(
        Request(prompt, max_new_tokens, stop_ids=stop_ids, on_tokens=on_tokens, sampler=sampler))


def eagle3_tree_shape(engine_dir: Path, manifest: Manifest) -> TreeShape:
    """The draft tree an EAGLE-3 engine was built for (engine.json extra.eagle3)."""
    try:
        return TreeShape(**manifest.extra["eagle3"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{engine_dir}: engine.json has no valid extra.eagle3 tree shape ({exc}) "
                          "— rebuild the engine") from None


def load_tokenizer(path: str | Path):
    """The target's tokenizer alone (backends that run exported graphs need no weights)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None
