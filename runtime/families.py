"""The drafter families, one record each: the one place a family's name is spelled and what
every layer above needs of it is written down (its display name, its drafting style, its
preset QueryScaling, how its checkpoint's config is read and loaded, which target layers
it reads, where its default checkpoint lives and which recipe trains it). The modes table
(runtime/modes.py), the backends' loaders, the build (build/families.py, build/checkpoints.py)
and build_engine.py key off these records; adding a family is a record here plus one
constructor per backend (a loader's `batch_<name>`, a build record).

Vocabulary, used everywhere: a *family* is the kind of drafter checkpoint (DFlash, PARD,
EAGLE-3, n-gram lookup); its *style* is how it drafts (block, chain, tree; an EAGLE-3 engine
built with tree top_k 1 drafts chains); a *setting* is what one mode or request runs the
drafter under (runtime/assembly.py DraftSetting: scaling, window, n-gram assist).

Pure Python at import (no torch): the registry and the command line read it cheaply; the
preset QueryScaling and the checkpoint readers import what they need when first asked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

# The drafting styles (Family.style). Only this module compares a style's name: everyone
# else asks a record (Family.drafts_trees, takes_window) or a backend's `styles`.
BLOCK, CHAIN, TREE = "block", "chain", "tree"
STYLES = (BLOCK, CHAIN, TREE)


@dataclasses.dataclass(frozen=True)
class Family:
    """One drafter family: what every layer needs of it. The callables import their model
    module when called."""

    name: str  # what users type (build_engine.py --drafter) and engine.json records
    display: str  # how results and messages name it
    style: str | None  # BLOCK, CHAIN or TREE; None: no drafter model (n-gram lookup)
    # the paper's QueryScaling for the family, as fields over QueryScaling's defaults
    # (plugins/scaling.py; None: nothing to scale)
    preset_fields: dict | None = None
    # (drafter_dir) -> its checkpoint's config
    read_config: Callable | None = None
    # (drafter_dir, dtype or None: the model's default, target) -> the drafter, checked
    # against the target (a TargetModel)
    load: Callable | None = None
    # (config, the target's layer count) -> the target layers the drafter reads
    feature_layers: Callable | None = None
    checkpoint: str | None = None  # its default checkpoint's folder under checkpoints/
    recipe: str | None = None  # the build module that trains that checkpoint

    @property
    def preset(self):
        """The family's preset QueryScaling (plugins/scaling.py), or None (n-gram)."""
        if self.preset_fields is None:
            return None
        from plugins.scaling import QueryScaling

        return QueryScaling(**self.preset_fields)

    @property
    def drafts_trees(self) -> bool:
        return drafts_trees(self.style)

    @property
    def takes_window(self) -> bool:
        """Whether its drafter drafts under a draft window (and n-gram assist): blocks."""
        return takes_window(self.style)

    def config_of(self, drafter_dir: Path | None):
        """Its checkpoint's config (None: no checkpoint)."""
        return None if drafter_dir is None or self.read_config is None else self.read_config(drafter_dir)

    def layers_read(self, drafter_dir: Path | None, num_layers: int) -> tuple[int, ...]:
        """The target layers its drafter reads (the target's `features`), from its
        checkpoint's config: DFlash's target_layer_ids, EAGLE-3's auxiliary layers; none
        for PARD and n-gram."""
        if self.feature_layers is None or drafter_dir is None:
            return ()
        return self.feature_layers(self.config_of(drafter_dir), num_layers)


def takes_window(style: str | None) -> bool:
    """Whether a drafter of this style drafts under a draft window (and n-gram assist)."""
    return style == BLOCK


def drafts_trees(style: str | None) -> bool:
    return style == TREE


def drafts_chains(style: str | None) -> bool:
    return style == CHAIN


def drafts_from_ids(style: str | None) -> bool:
    """Whether its drafter's cache holds committed token entries (chains and trees) rather
    than a block drafter's context features."""
    return style in (CHAIN, TREE)


def chain_if_one_child(style: str | None, top_k: int) -> str | None:
    """A tree family built with one child per node (top_k 1) drafts chains."""
    return CHAIN if style == TREE and top_k == 1 else style


# -- each family's checkpoint: read, load, the target layers it reads --------------------

def _dflash_config(drafter_dir):
    from runtime.models.dflash import read_dflash_config

    return read_dflash_config(drafter_dir)


def _load_dflash(drafter_dir, dtype, target):
    from runtime.models.dflash import load_dflash

    drafter = load_dflash(drafter_dir) if dtype is None else load_dflash(drafter_dir, dtype)
    drafter.config.check_target(target.config)
    return drafter


def _dflash_layers(config, num_layers: int) -> tuple[int, ...]:
    return tuple(config.target_layer_ids)


def _pard_config(drafter_dir):
    from runtime.models.pard import read_pard_config

    return read_pard_config(drafter_dir)


def _load_pard(drafter_dir, dtype, target):
    from runtime.models.pard import load_pard

    drafter = load_pard(drafter_dir) if dtype is None else load_pard(drafter_dir, dtype)
    drafter.config.check_target(target.config)
    return drafter


def _eagle3_config(drafter_dir):
    from runtime.models.eagle3 import read_eagle3_config

    return read_eagle3_config(drafter_dir)


def _load_eagle3(drafter_dir, dtype, target):  # checked against the target as it loads
    from runtime.models.eagle3 import load_eagle3

    return (load_eagle3(drafter_dir, target=target) if dtype is None
            else load_eagle3(drafter_dir, dtype, target))


def _eagle3_layers(config, num_layers: int) -> tuple[int, ...]:
    return tuple(config.feature_layers(num_layers))


# -- the records ---------------------------------------------------------------------------

DFLASH = Family("dflash", "DFlash", BLOCK, {"ref_keys": 2048}, _dflash_config, _load_dflash,
                _dflash_layers, "dflash-smollm2-135m", "build.train_drafter")
"""DFlash: drafts a block from the target's hidden states; the paper's primary preset."""

PARD = Family("pard", "PARD", CHAIN, {"ref_keys": 8192}, _pard_config, _load_pard, None,
              "pard-smollm2-135m", "build.train_pard")
"""PARD: a small causal model drafting a chain at once; the paper's longer reference count."""

EAGLE3 = Family("eagle3", "EAGLE-3", TREE, {"ref_keys": 2048}, _eagle3_config, _load_eagle3,
                _eagle3_layers, "eagle3-smollm2-135m", "build.train_eagle3")
"""EAGLE-3: drafts a tree (a chain with top_k 1). The paper gives no reference count: 2048
is its usual training length, and `python -m build.calibrate` is the way to set it."""

NGRAM = Family("ngram", "n-gram", None)
"""n-gram lookup: no drafter model, checkpoint or scaling."""

# family name -> its record: the one table of families
FAMILIES: dict[str, Family] = {f.name: f for f in (DFLASH, PARD, EAGLE3, NGRAM)}


def preset(name: str):
    """The preset QueryScaling of the family `name` (KeyError: no such family, or none)."""
    scaling = FAMILIES[name].preset
    if scaling is None:
        raise KeyError(name)
    return scaling
