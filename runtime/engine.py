"""An engine directory, loaded: tokenizer, target and drafter behind the backend
interface (the one engine.json names, or an override), and `generate` in the three
modes every command compares (target-only, frozen drafter, SharpDraft drafter)."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.manifest import EngineError, Manifest, read_manifest
from runtime import speculative
from runtime.backends import RUNNABLE_BACKENDS
from runtime.backends.torch import TorchDFlash, TorchTarget
from runtime.metrics import Generation
from runtime.models.dflash import load_dflash
from runtime.models.target import ModelError, load_target
from runtime.sampling import Sampler, Sampling
from plugins.scaling import QueryScaling

MODES = ("target", "frozen", "sharpdraft")  # no drafter, drafter unscaled, drafter with beta


class Engine:
    def __init__(self, engine_dir: str | Path, verify: str = "quick", backend: str | None = None):
        self.dir = Path(engine_dir)
        self.manifest: Manifest = read_manifest(self.dir, verify=verify)
        if self.manifest.drafter != "dflash":
            raise EngineError(f"{self.dir}: drafter {self.manifest.drafter!r} is not supported "
                              "by this runtime yet")
        self.backend = backend or self.manifest.backend
        self.scaling = self.manifest.query_scaling
        if self.backend == "torch":
            dtype = getattr(torch, self.manifest.dtype)
            self.model, self.tokenizer = load_target(self.manifest.target_dir, dtype)
            self.drafter_model = load_dflash(self.manifest.drafter_dir, dtype)
            self.drafter_model.config.check_target(self.model.config)
            self.target = TorchTarget(self.model, self.drafter_model.config.target_layer_ids)
        elif self.backend == "onnxruntime":
            from runtime.backends.onnxruntime import OnnxEngine

            self.onnx = OnnxEngine(self.dir, self.manifest)
            self.tokenizer = load_tokenizer(self.manifest.target_dir)
            self.target = self.onnx.target
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

    def drafter(self, frozen: bool = False):
        """The drafter with the engine's query scaling, or frozen (no scaling)."""
        if self.backend == "onnxruntime":
            return self.onnx.drafter(sharpdraft=not frozen)
        return TorchDFlash(self.drafter_model, self.model, None if frozen else self.scaling)

    def drafter_with_scaling(self, scaling: QueryScaling | None):
        """The drafter under any other scaling (calibration, diagnostics): torch only,
        since a compiled drafter graph has its scaling built in."""
        if self.backend != "torch":
            raise EngineError(f"{self.dir}: a {self.backend} drafter's scaling is compiled "
                              "in; try other values with the torch backend (--backend torch)")
        return TorchDFlash(self.drafter_model, self.model, scaling)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = "sharpdraft",
                 sampling: Sampling = Sampling(), stop: bool = True, on_tokens=None) -> Generation:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        stop_ids = self.stop_ids if stop else frozenset()
        sampler = Sampler(sampling)
        if mode == "target":
            return speculative.generate_target_only(self.target, prompt, max_new_tokens,
                                                    sampler, stop_ids, on_tokens)
        return speculative.generate_block(self.target, self.drafter(frozen=mode == "frozen"),
                                          prompt, max_new_tokens, sampler, stop_ids, on_tokens)


def load_tokenizer(path: str | Path):
    """The target's tokenizer alone (backends that run exported graphs need no weights)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None
