"""The drafter families as the build sees them: the build's hooks for each family record
(runtime/families.py: name, style, preset, checkpoint, config reader), so that
build_engine.py dispatches through the record and never compares a family's name.

What a family is (its name, style, preset, default checkpoint, how its checkpoint loads)
is its record in runtime/families.py; what only the build does with it is here: the
drafter checkpoint files an engine reads, how the drafter loads and is checked against
the target (and the progress line that says so), the tokens one verify pass commits at
most, what engine.json's extra records of how it drafts, and how `--backend trtllm`
configures it. n-gram lookup is the one family with no drafter model: its record builds
an NGramProposer from the options instead (`lookup`) and reads no checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, NamedTuple

from runtime import families as records
from runtime.cli import UsageError, progress
from runtime.ngram import NGramProposer
from runtime.tree import TreeShape

# What an engine reads from a drafter checkpoint: DFlash and PARD publish these two files.
DRAFTER_FILES = ("config.json", "model.safetensors")


class TrtllmDrafter(NamedTuple):
    """What `--backend trtllm` writes of a drafter: the checkpoint files engine.json
    records, the tokens one verify pass checks, and the family's speculative_config
    fields (plugins/trtllm/config.py family_settings)."""

    files: list[str]
    block_size: int
    settings: dict


# -- the options a family reads, checked before anything loads --------------------------

def eagle3_shape(args) -> TreeShape:
    """--tree-top-k/--tree-depth/--tree-total-tokens, checked before anything loads; with
    top_k 1 the drafter drafts a chain of --num-draft-tokens."""
    try:
        if args.tree_top_k == 1:
            if args.num_draft_tokens < 1:
                raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
            return TreeShape(1, args.num_draft_tokens, args.num_draft_tokens + 1)
        return TreeShape(args.tree_top_k, args.tree_depth, args.tree_total_tokens)
    except ValueError as exc:
        raise UsageError(f"invalid EAGLE-3 tree: {exc}") from None


def check_eagle3(args) -> None:
    """EAGLE-3's tree options (a bad tree is named before anything loads)."""
    eagle3_shape(args)


def no_options(args) -> None:
    """A family whose options need no check of their own before anything loads."""


def ngram_proposer(args) -> NGramProposer:
    """--drafter ngram: the proposer its options describe (checked before anything loads)."""
    if args.sharpdraft:
        raise UsageError("--sharpdraft scales a drafter's attention; n-gram drafting has none "
                         "(drop --sharpdraft)")
    try:
        return NGramProposer(args.max_ngram, 1, args.num_draft_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# -- the drafter checkpoint files an engine reads ----------------------------------------

def published_files(drafter_dir: Path) -> list[str]:
    """DFlash and PARD checkpoints: config.json and model.safetensors."""
    return list(DRAFTER_FILES)


def dflash_files(drafter_dir: Path) -> list[str]:
    """DFlash: config.json, model.safetensors and its draft vocabulary's head file."""
    from runtime.models.dflash import checkpoint_files

    return checkpoint_files(drafter_dir)


def eagle3_files(drafter_dir: Path) -> list[str]:
    """EAGLE's own checkpoints may hold pytorch_model.bin instead of model.safetensors."""
    from runtime.models.eagle3 import checkpoint_files

    return checkpoint_files(drafter_dir)


# -- loading the drafter: (drafter, tokens one verify pass commits at most) ----------------

def load_dflash(args, drafter_dir: Path, target):
    """A DFlash drafter, checked against the target; a verify pass commits its block."""
    drafter = records.DFLASH.load(drafter_dir, None, target)
    progress(f"      drafter: {drafter.config.num_layers} layers, block {drafter.config.block_size}, "
             f"target layers {list(drafter.config.target_layer_ids)} ({drafter_dir})")
    return drafter, drafter.config.block_size


def load_pard(args, drafter_dir: Path, target):
    """A PARD drafter, checked against the target; a verify pass commits
    --num-draft-tokens + 1."""
    if args.num_draft_tokens < 1:
        raise UsageError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    drafter = records.PARD.load(drafter_dir, None, target)
    c = drafter.config.layers
    progress(f"      drafter: PARD, {c.num_layers} layers, hidden {c.hidden_size}, "
             f"{args.num_draft_tokens} drafts per step, pard_token {drafter.config.pard_token} "
             f"({drafter_dir})")
    return drafter, args.num_draft_tokens + 1


def load_eagle3(args, drafter_dir: Path, target):
    """An EAGLE-3 drafter (checked against the target as it loads); a verify pass commits
    a chain's --num-draft-tokens + 1 or a tree's depth + 1."""
    shape = eagle3_shape(args)
    drafter = records.EAGLE3.load(drafter_dir, None, target)
    c = drafter.config
    progress(f"      drafter: EAGLE-3, hidden {c.hidden_size}, target layers "
             f"{list(c.aux_layers(target.config.num_layers))}, draft vocabulary {c.draft_vocab_size}, "
             + (f"chain of {shape.depth}" if shape.top_k == 1 else
                f"tree top_k {shape.top_k} depth {shape.depth} total {shape.total_tokens}")
             + f" ({drafter_dir})")
    return drafter, shape.depth + 1


def load_ngram(args, drafter_dir: None, target):
    """No drafter model: n-gram lookup drafts --num-draft-tokens, and a verify pass checks
    those plus one."""
    proposer = ngram_proposer(args)
    progress(f"      drafter: n-gram lookup, {proposer.num_draft_tokens} drafts per step, "
             f"suffixes of {proposer.min_ngram}..{proposer.max_ngram} tokens")
    return None, proposer.num_draft_tokens + 1


# -- what engine.json's extra records of how the drafter drafts ---------------------------

def no_provenance(args, drafter) -> dict:
    """PARD: its chain length is the engine's block_size; nothing more to record."""
    return {}


def dflash_provenance(args, drafter) -> dict:
    """The window mode's draft window: the drafter sees what it trained on (or
    --draft-window); none where the checkpoint records no training length."""
    window = args.draft_window or drafter.config.training_max_length
    return {} if window is None else {"draft_window": int(window)}


def eagle3_provenance(args, drafter) -> dict:
    """The draft tree's shape, which the runtime drafts with."""
    return {"eagle3": dataclasses.asdict(eagle3_shape(args))}


def ngram_provenance(args, drafter) -> dict:
    """The n-gram proposer's settings, which the runtime drafts with."""
    return {"ngram": ngram_proposer(args).settings()}


# -- --backend trtllm: configuration for TensorRT-LLM's own speculative decoding ---------

def trtllm_dflash(args, drafter_dir: Path) -> TrtllmDrafter:
    """DFlash: its block size, mask token and target layers come from its config."""
    from plugins.trtllm import config as trtllm
    from runtime.models.dflash import checkpoint_files

    config = records.DFLASH.config_of(drafter_dir)
    settings = trtllm.family_settings(args.drafter, {"mask_token_id": config.mask_token_id,
                                                 "target_layer_ids": config.target_layer_ids},
                                      args.trtllm_attention)
    return TrtllmDrafter(checkpoint_files(drafter_dir), config.block_size, settings)


def trtllm_from_checkpoint(args, drafter_dir: Path) -> TrtllmDrafter:
    """PARD, EAGLE-3 (and a drafter only TensorRT-LLM runs): the checkpoint's config.json
    and weights as they are, --num-draft-tokens drafts per step; TensorRT-LLM reads the
    rest from the checkpoint."""
    from plugins.trtllm import config as trtllm
    from runtime.models.target import ModelError

    if not (drafter_dir / "config.json").is_file():
        raise ModelError(f"{drafter_dir} has no config.json (not a {args.drafter} checkpoint)")
    files = ["config.json"] + [p.name for p in sorted(drafter_dir.iterdir()) if p.is_file() and (
        p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json"))]
    return TrtllmDrafter(files, args.num_draft_tokens + 1, trtllm.family_settings(args.drafter))


# -- --backend vllm: configuration for vLLM's own speculative decoding ---------------------

@dataclasses.dataclass(frozen=True)
class VllmDrafter:
    """How vLLM drafts with a family's checkpoint: its speculative_config method, drafts
    per step, whether one pass drafts them all (PARD), the checkpoint files the engine
    records, and why SharpDraft's plugin cannot scale it (None: it can)."""

    method: str
    num_tokens: int
    files: list
    parallel: bool = False
    unscalable: str | None = None


def vllm_dflash(args, drafter_dir: Path) -> VllmDrafter:
    """DFlash: vLLM's `dflash` method, block_size - 1 drafts per step. The checkpoint is
    loaded by our own loader first, which refuses a draft vocabulary without its head
    (vLLM would misread it: runtime/models/dflash.py)."""
    from runtime.models.dflash import checkpoint_files, load_dflash

    drafter = load_dflash(drafter_dir)
    return VllmDrafter("dflash", drafter.config.block_size - 1, checkpoint_files(drafter_dir))


def vllm_eagle3(args, drafter_dir: Path) -> VllmDrafter:
    """EAGLE-3: vLLM's `eagle3` method (llama_eagle3), chains of --num-draft-tokens."""
    return VllmDrafter("eagle3", args.num_draft_tokens, eagle3_files(drafter_dir),
                       unscalable="vLLM's EAGLE-3 drafter (llama_eagle3) is not scaled by the plugin yet")


def vllm_pard(args, drafter_dir: Path) -> VllmDrafter:
    """PARD: vLLM's `draft_model` with parallel drafting (it reads `pard_token`)."""
    return VllmDrafter("draft_model", args.num_draft_tokens, published_files(drafter_dir), parallel=True,
                       unscalable="vLLM runs PARD as a generic draft model, which the plugin does not scale yet")


# -- the registry --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
    """What build_engine.py needs of one drafter family (`record`: runtime/families.py).
    Every hook takes the parsed command line (`args`) first."""

    record: records.Family
    # (args, drafter_dir, target) -> (the drafter model, or None for n-gram lookup; the
    # tokens one verify pass commits at most), checked against the target (a TargetModel)
    # and described in one progress line
    load: Callable
    # (drafter_dir) -> the drafter checkpoint files the engine reads (engine.json hashes them)
    files: Callable = published_files
    # (args) -> None: the family's own options, checked before anything loads, after the
    # refusals of a backend that does not draft this family's style
    check: Callable = no_options
    # (args, drafter) -> what engine.json's extra records of how the drafter drafts
    provenance: Callable = no_provenance
    # (args, drafter_dir) -> TrtllmDrafter for --backend trtllm; None: it refuses the family
    trtllm: Callable | None = trtllm_from_checkpoint
    # (args, drafter_dir) -> VllmDrafter for --backend vllm; None: it refuses the family
    vllm: Callable | None = None
    # No drafter model: (args) -> the NGramProposer its options describe, checked first,
    # in place of SharpDraft's scaling checks (there is no attention to scale); the build
    # then reads no drafter checkpoint. None: a drafter model family.
    lookup: Callable | None = None


DFLASH = Family(records.DFLASH, load=load_dflash, files=dflash_files, provenance=dflash_provenance,
                trtllm=trtllm_dflash, vllm=vllm_dflash)
"""DFlash: the drafter drafts a block from the target's hidden states; its block size is
its own (config), and its training length is the window mode's draft window."""

PARD = Family(records.PARD, load=load_pard, vllm=vllm_pard)
"""PARD: a small causal model that drafts --num-draft-tokens at once in a chain; nothing
beyond the block size to record."""

EAGLE3 = Family(records.EAGLE3, load=load_eagle3, files=eagle3_files, check=check_eagle3,
                provenance=eagle3_provenance, vllm=vllm_eagle3)
"""EAGLE-3: drafts a tree (or a chain with --tree-top-k 1) whose shape engine.json records;
its checkpoint may hold pytorch_model.bin."""

NGRAM = Family(records.NGRAM, load=load_ngram, lookup=ngram_proposer, provenance=ngram_provenance,
               trtllm=None)
"""n-gram lookup: no drafter model, checkpoint or SharpDraft; the proposer's settings are
what engine.json records. --backend trtllm configures drafter models only."""

# family name -> what the build needs of it, keyed by its record
FAMILIES = {family.record.name: family for family in (DFLASH, PARD, EAGLE3, NGRAM)}
assert set(FAMILIES) == set(records.FAMILIES), "every family record has a build record"


def trtllm_config(drafter: str) -> Callable | None:
    """How --backend trtllm configures `drafter`: its record's way; for a drafter only
    TensorRT-LLM runs (runtime/manifest.py TRTLLM_ONLY_DRAFTERS, no record here) the
    checkpoint's own files; None: --backend trtllm refuses it."""
    family = FAMILIES.get(drafter)
    return trtllm_from_checkpoint if family is None else family.trtllm


def vllm_config(drafter: str) -> Callable | None:
    """How --backend vllm configures `drafter` (None: it refuses it, as n-gram lookup)."""
    family = FAMILIES.get(drafter)
    return None if family is None else family.vllm
