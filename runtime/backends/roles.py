"""The roles every backend hands out (a loader of runtime/backends/__init__.py: LOADERS
opens an engine directory and returns a Loaded), written once here: this table is the
interface, the one description of every role; and how a batch drafter prefills a
joining sequence in parts (JoinInParts).

The decode loop (runtime/decode.py) and its proposers (runtime/proposers.py) only see
these roles, and every backend implements them over a batch: one request is a batch of
one. The loop runs over a batch of sequences at different lengths, one row each; a
sequence joins as the last row and leaves from any row, between steps. One role works
row by row:

  Tree drafter (EAGLE-3 trees: one per row, runtime/proposers.py Tree):
           reset(capacity)
           read(ids, features)    -- store the cache entries of committed tokens without
                                     drafting (the prompt, during prefill): feature row i
                                     paired with token ids[-len(features) + i]
           draft_tree(context [c, F], following [c], shape) -> (DraftTree, visible keys N)
                                  -- following: the token after each context row
           scaling

  BatchTarget:  add(ids, capacity)  -> (last logits [vocab], features [t, F]) -- a new row's
                                    prefill: prefill + join_prefilled
                prefill(ids, capacity); prefill_more(ids) -> as add's -- a joining
                                    sequence's prompt in parts (chunked prefill), held
                                    aside until join_prefilled() makes it the last row
                snapshot() / restore(snapshot, capacity) -- a copy of the held sequence,
                                    and that copy held again in a cache of `capacity`
                                    (PrefillOnce: several runs from one prefill)
                verify(rows of ids) -> (logits [b, T, vocab], features [b, T, F]) padded to T
                rollback(lengths)   -- each sequence's committed length
                remove(row)
                verify_trees(trees) -> [(logits [n, vocab], features [n, F])] per row: every
                                    row's DraftTree packed in one pass (runtime/tree.py:
                                    pack), each node seeing its own row's committed keys
                                    and its ancestors at that row's length + depth
                keep_paths(paths)   -- commit each row's accepted path (node indices)
  BatchBlockDrafter:
                add(capacity, context [c, F], last) -> the features its first draft() must
                                    pass (what it left unread); last: the prompt's last token
                prefill(capacity, context, last); prefill_more(context, last);
                join_prefilled() -> as add's      -- add in parts, like the target's
                                    prefill / prefill_more / join_prefilled: chunked
                                    prefill feeds it each chunk's features right after
                                    the target's chunk; the parts leave the cache one
                                    piece leaves (JoinInParts)
                draft(contexts, bonuses) -> (logits [b, block - 1, columns], visible N [b])
                                 -- context: each row's target features committed since
                                    its last call (an empty one, [0, F], adds nothing);
                                    bonus: its newest token, which the target has not run
                                    yet; the block's keys are scratch, only the context
                                    stays in the row's cache
                remove(row); block_size
                vocab               -- the target ids of the logits' columns (a DraftVocab:
                                    the drafter's draft vocabulary), or None (all of them)
                scaling             -- the QueryScaling it applies, or None (frozen)
  BatchChainDrafter (PARD; EAGLE-3 with top_k = 1):
                add(capacity, ids, features) -- a new row's prefill: its cache holds the
                                    entries of the committed tokens `ids` (each from its
                                    token, the features draft() pairs with it, and its
                                    position), without drafting
                prefill / prefill_more / join_prefilled -- add in parts (JoinInParts)
                draft(rows of ids, rows of features, ks, samplers) -> [ChainDraft or None]
                                 -- per row: ids, the tokens committed since its last call
                                    (the prompt and the first token at the first call),
                                    ending with the newest, which the target has not run
                                    yet; features, the target's features of the tokens just
                                    before its last len(features) ids ([t, F], or None for
                                    a drafter that reads none, like PARD); k drafts (None
                                    where k = 0): ChainDraft(tokens [k], probs [k, vocab]
                                    or None (greedy), logits [k, vocab], visible [k]: N of
                                    each draft row). A row commits exactly its ids; what a
                                    call writes while drafting lies past that, as scratch.
                                    One drafter pass per chain step for every row (PARD:
                                    one pass; EAGLE-3: one ingesting the rows' new entries,
                                    then one per link), each row at its own cache length,
                                    so its own N and beta; row r's drafts drawn by
                                    samplers[r] (Sampler.propose) from its own q, one draw
                                    per position, so sampling stays lossless
                remove(row); scaling
                max_drafts          -- the most drafts one call makes for a row (K)

  Loaded (what a loader returns for one engine directory; the roles made on demand):
                can                 -- what this backend runs (runtime/modes.py BACKENDS)
                tokenizer; device; dtype -- where and in which precision its roles run
                context_limit       -- the longest sequence its batch targets take (the
                                    target's, or engine.json's max_seq_len if shorter)
                batch_target()      -> a BatchTarget
                drafter(setting)    -> the drafter role for a DraftSetting (runtime/
                                    assembly.py), in one call: the batch drafter of blocks
                                    or chains, or one row's tree drafter
                batch_drafter(scaling, window=None) -> a BatchBlockDrafter (DFlash) or a
                                    BatchChainDrafter (PARD, EAGLE-3 with top_k 1) under
                                    `scaling` (None: frozen); with a `window`, each DFlash
                                    row sees only the last `window` of its context keys
                tree_drafter(scaling) -> an EAGLE-3 tree drafter for one row
                takes_window(manifest) -- (static) whether its DFlash drafter can draft
                                    under a window, from engine.json alone
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runtime import modes
from runtime.manifest import EngineError, Manifest
from runtime.models.target import load_tokenizer  # noqa: F401 -- backends that run graphs load it
from runtime.tree import TreeShape


class PrefillOnce:
    """A batch target, one row at a time, whose prefill of one prompt is computed once and
    then replayed (snapshot / restore, in the cache each run asks for), so that several
    decoding runs (target-only, frozen, SharpDraft) start from the SAME prefill."""

    def __init__(self, target, prompt: list[int], capacity: int | None = None):
        self.target, self.prompt = target, list(prompt)
        self.context_limit = target.context_limit
        self.result = target.prefill(self.prompt, capacity or len(self.prompt))
        self.saved = target.snapshot()

    def add(self, ids: list[int], capacity: int):
        if list(ids) != self.prompt:
            raise ValueError("PrefillOnce replays only the prompt it was built for")
        self.target.restore(self.saved, capacity)
        self.target.join_prefilled()
        return self.result

    def verify(self, rows):
        return self.target.verify(rows)

    def rollback(self, lengths: list[int]) -> None:
        self.target.rollback(lengths)

    def remove(self, row: int) -> None:
        self.target.remove(row)

    def verify_trees(self, trees):
        return self.target.verify_trees(trees)

    def keep_paths(self, paths: list[list[int]]) -> None:
        self.target.keep_paths(paths)


class JoinInParts:
    """How a batch drafter (blocks or chains) prefills a joining sequence: it reads the
    prompt's part into a cache of the sequence's own (the backend's hooks
    `_reset_joining`, `_read_joining`), then the row joins the batch (`_join_row`). In
    parts, like the target's prefill / prefill_more / join_prefilled, so that a prompt
    prefilling in chunks (Decoder.join) has the drafter read each chunk right after the
    target's chunk, and the join's last part holds no drafter pass over the whole prompt.
    A part is a block drafter's context features (and `more`: the prompt's last token,
    the bonus of the scratch block drafted after it) or a chain drafter's token ids (and
    `more`: the features draft() pairs with them, or None). Each part's entries land
    at the committed length and depend only on their own inputs and positions (a DFlash
    context key on its token's features; a chain entry on its token, features and
    position), and whatever a part drafts is scratch, so the parts leave the cache one
    piece leaves (to rounding: a part's projections are matmuls of another shape). add()
    is all three at once."""

    room = 0  # cache room the joining sequence needs past its capacity

    def add(self, capacity: int, part, more):
        self.prefill(capacity, part, more)
        return self.join_prefilled()

    def prefill(self, capacity: int, part, more) -> None:
        self._reset_joining(capacity + self.room)
        # what the row's first draft() passes: nothing (the drafter reads every row's new
        # input every step, so it holds none back)
        self.unread = part[:0]
        self.prefill_more(part, more)

    def prefill_more(self, part, more) -> None:
        if len(part):
            self._read_joining(part, more)

    def join_prefilled(self):
        """The sequence read in parts becomes the batch's last row; returns what its first
        draft() must pass beyond its new input (a block drafter's context: nothing)."""
        self._join_row()
        return self.unread

    def _reset_joining(self, capacity: int) -> None:
        """An empty cache of `capacity` entries for the joining sequence."""
        raise NotImplementedError

    def _read_joining(self, part, more) -> None:
        """The joining sequence's next part into its cache, at its committed length: a
        block drafter's context features (`more`: the bonus of the block drafted after
        them, scratch), or a chain drafter's committed ids (`more`: their features,
        feature row i paired with token ids[-len(features) + i], or None)."""
        raise NotImplementedError

    def _join_row(self) -> None:
        """The joining sequence's cache in as the batch's last row."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Drafting:
    """How an engine's drafter model drafts: its style (modes.FAMILIES: "block", "chain",
    "tree"; None: an n-gram engine), the tree it was built for (EAGLE-3) and the most
    drafts one chain call makes."""

    style: str | None
    tree_shape: TreeShape | None
    max_drafts: int

    @property
    def drafts_trees(self) -> bool:
        return self.style == "tree"


class Loaded:
    """What every loader's Loaded shares: the drafter role for a drafting setting, handed
    out in one call (`drafting`: the engine's Drafting, set by the loader)."""

    drafting: Drafting

    def drafter(self, setting):
        """The drafter role under `setting` (runtime/assembly.py DraftSetting: scaling,
        window): one row's tree drafter where the engine drafts trees, else the batch
        drafter of blocks or chains."""
        if self.drafting.drafts_trees:
            return self.tree_drafter(setting.scaling)
        return self.batch_drafter(setting.scaling, setting.window)


def drafting_of(engine_dir: Path, manifest: Manifest, shaped: bool = True) -> Drafting:
    """The drafting an engine was built for: its family's style, and a tree family built
    with one child per node (top_k 1) drafts chains. `shaped` False: the tree's shape is
    not ours to read (a backend that runs its own loop configures its own trees)."""
    style, shape = modes.FAMILIES[manifest.drafter], None
    if style == "tree" and shaped:
        try:
            shape = TreeShape(**manifest.extra["eagle3"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{engine_dir}: engine.json has no valid extra.eagle3 tree shape "
                              f"({exc}) — rebuild the engine") from None
        if shape.top_k == 1:  # one child per node: a chain
            style = "chain"
    # Chain drafters draft as many tokens as one verify pass checks, less the bonus.
    return Drafting(style, shape, manifest.block_size - 1)


def _dflash_config(drafter_dir: Path):
    from runtime.models.dflash import read_dflash_config

    return read_dflash_config(drafter_dir)


def _pard_config(drafter_dir: Path):
    from runtime.models.pard import read_pard_config

    return read_pard_config(drafter_dir)


def _eagle3_config(drafter_dir: Path):
    from runtime.models.eagle3 import read_eagle3_config

    return read_eagle3_config(drafter_dir)


# drafter family -> the reader of its checkpoint's config (the one place the runtime's
# families are told apart outside their loaders; n-gram engines have no checkpoint)
DRAFTER_CONFIGS = {"dflash": _dflash_config, "pard": _pard_config, "eagle3": _eagle3_config}


def drafter_config(manifest: Manifest):
    """The engine's drafter checkpoint config (its family's), or None (no checkpoint)."""
    if manifest.drafter_dir is None or manifest.drafter not in DRAFTER_CONFIGS:
        return None
    return DRAFTER_CONFIGS[manifest.drafter](manifest.drafter_dir)


def drafter_feature_layers(manifest: Manifest, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs an engine's drafter reads (the target's `features`,
    TargetModel's convention), from the drafter checkpoint's config: DFlash's
    target_layer_ids, EAGLE-3's auxiliary layers; none for PARD and n-gram engines. The
    torch loader and the bfloat16 prefill (bf16_prefill.py) both read them here."""
    layers = FEATURE_LAYERS.get(manifest.drafter)
    return layers(drafter_config(manifest), num_layers) if layers else ()


def _dflash_layers(config, num_layers: int) -> tuple[int, ...]:
    return tuple(config.target_layer_ids)


def _eagle3_layers(config, num_layers: int) -> tuple[int, ...]:
    return tuple(config.feature_layers(num_layers))


# drafter family -> the target layers its config says it reads (PARD reads none)
FEATURE_LAYERS = {"dflash": _dflash_layers, "eagle3": _eagle3_layers}
