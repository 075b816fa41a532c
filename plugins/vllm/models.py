"""The SharpDraft DFlash drafter as vLLM builds it (imported only by vLLM's model registry,
for a drafter whose config.json names plugins/vllm ARCHITECTURE).

It IS vLLM's DFlash drafter (a subclass: the proposer checks isinstance), built and loaded
by vLLM's own code; the constructor then wraps each draft layer's attention with the
QueryScaling its config carries (scaled.py), after checking the structure it relies on
(pins.py), writes a `wrapped` proof record and says so in one line on stderr. A drafter
that cannot be scaled stops the launch: the constructor raises PluginError, whose one line
ends the error vLLM reports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from ..scaling import QueryScaling
from . import ARCHITECTURE, pins, scaled
from ..trtllm import proof  # the proof records and device counts every hook shares


def config_scaling(config) -> QueryScaling:
    """The QueryScaling a drafter config carries (PluginError, one line, when it carries
    none or a bad one: this architecture is written only for SharpDraft drafters)."""
    value = getattr(config, pins.SHARPDRAFT_KEY, None)
    if not isinstance(value, dict):
        raise pins.PluginError(f"sharpdraft: the drafter names {ARCHITECTURE} but its config.json carries no "
                               f"\"{pins.SHARPDRAFT_KEY}\" parameters (rebuild it with build_engine.py "
                               "--backend vllm --sharpdraft)")
    try:
        return QueryScaling.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise pins.PluginError(f"sharpdraft: the drafter's \"{pins.SHARPDRAFT_KEY}\" parameters are invalid: "
                               f"{exc}") from None


class SharpDraftDFlash(DFlashQwen3ForCausalLM):
    """vLLM's DFlash drafter with beta(N) in every draft layer's attention."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        scaling = config_scaling(self.config)
        layers = pins.draft_layers(self)
        drafter_dir = Path(str(vllm_config.speculative_config.draft_model_config.model))
        where = proof_directory(drafter_dir)
        units = [name for name, _, _ in layers]
        self.sharpdraft_tally = proof.Tally(units, where)
        for index, (_, attention, causal) in enumerate(layers):
            scaled.wrap(attention, scaling, causal, self.sharpdraft_tally, index)
        self.sharpdraft_scaling = scaling
        proof.record("wrapped", where, drafter=type(self).__name__, directory=str(drafter_dir), units=units,
                     layers=len(units), scaling=scaling.to_dict())
        proof.start_reporter()
        sys.stderr.write(f"sharpdraft: {drafter_dir.name} scaled in pid {os.getpid()}: {len(units)} draft "
                         f"layers, {scaling.describe()}\n")


def proof_directory(drafter_dir: Path) -> Path:
    """Where this drafter's process writes its proof: `proof/` beside the drafter directory
    (the engine directory's, which our launcher clears before each launch). Derived from
    the directory vLLM was given, so it reaches every worker with no environment."""
    return drafter_dir.resolve().parent / "proof"
