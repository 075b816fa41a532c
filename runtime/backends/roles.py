"""The roles every backend hands out, as code: a loader of runtime/backends/__init__.py
(LOADERS) opens an engine directory and returns a Loaded, whose batch target and drafters
subclass the interfaces below (BatchTarget; a drafter per drafting style: BatchBlockDrafter,
BatchChainDrafter, BatchTreeDrafter). The decode loop (runtime/decode.py) and its proposers
(runtime/proposers.py) see only these. Also here: how a batch drafter prefills a joining
sequence in parts (JoinInParts), and what an engine's drafter drafts (StyleAsBuilt).

Every role runs over a batch: a request is a batch of one. The loop runs over sequences at
different lengths, one row each; a sequence joins as the last row and leaves from any row,
between steps. Shapes: b rows, T a verify pass's widest row, t a row's tokens, F the target
features the drafter reads (the layers concatenated), vocab the target's vocabulary. Token
ids of several rows cross the roles flat (TokenRows: ids [num_tokens], offsets cu [b + 1]),
never as Python lists of lists."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime import families, modes
from runtime.manifest import EngineError, Manifest
from runtime.models.target import load_tokenizer  # noqa: F401 -- backends that run graphs load it
from runtime.tree import TreeShape


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Token ids of b rows, flat: `ids` int64 [num_tokens], the rows one after another,
    and `cu` int64 [b + 1], their cumulative offsets (row r is ids[cu[r]:cu[r + 1]]), as
    vLLM's SpecDecodeMetadata carries a batch's drafts (draft_token_ids, and
    cu_num_draft_tokens). What the roles take where every row has its own number of
    tokens: a verify pass's rows, a chain or tree drafter's newly committed ids, a tree's
    accepted path. A backend takes its rows padded with one index operation (padded)."""

    ids: Tensor
    cu: Tensor

    @classmethod
    def of(cls, rows) -> "TokenRows":
        """From rows of token ids (sequences of ints)."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
        return cls(ids, F.pad(lengths.cumsum(0), (1, 0)))

    def __len__(self) -> int:
        return len(self.cu) - 1

    @property
    def lengths(self) -> Tensor:
        """Each row's token count, [b]."""
        return self.cu[1:] - self.cu[:-1]

    @property
    def width(self) -> int:
        """The widest row's token count (0 with no rows)."""
        return int(self.lengths.max()) if len(self) else 0

    @property
    def last(self) -> Tensor:
        """Each row's last token, [b] (every row has one)."""
        return self.ids[self.cu[1:] - 1]

    def row(self, r: int) -> Tensor:
        """Row r's ids, [t] (a view)."""
        start, end = self.cu[r:r + 2].tolist()
        return self.ids[start:end]

    def padded(self, members=None, width: int | None = None, fill: int = 0) -> Tensor:
        """Rows `members` (default: all), in that order, each padded at its end with
        `fill` to `width` (default: the widest of them): [len(members), width], one
        gather from the flat ids."""
        starts, lengths = self.cu[:-1], self.lengths
        if members is not None:
            starts, lengths = starts[members], lengths[members]
        if width is None:
            width = int(lengths.max()) if len(lengths) else 0
        columns = torch.arange(width)
        at = starts[:, None] + columns
        # past a row's end: the one fill entry appended after the flat ids
        at = torch.where(columns < lengths[:, None], at, len(self.ids))
        return F.pad(self.ids, (0, 1), value=fill)[at]

    def tails(self, counts: Tensor) -> "TokenRows":
        """Each row's last counts[r] tokens (counts [b], each at most the row's length)."""
        cu = F.pad(counts.cumsum(0), (1, 0))
        # token j of new row r: old row r's end - counts[r] + j
        shift = (self.cu[1:] - counts - cu[:-1]).repeat_interleave(counts)
        return TokenRows(self.ids[torch.arange(int(cu[-1])) + shift], cu)

    def extended(self, counts: Tensor, token: int) -> "TokenRows":
        """Each row followed by counts[r] copies of `token` (PARD's rows: the unread
        tokens, then the pard tokens)."""
        cu = F.pad((self.lengths + counts).cumsum(0), (1, 0))
        ids = torch.full((int(cu[-1]),), token, dtype=torch.long)
        # an old token moves by the tokens appended to the rows before it
        shift = (cu[:-1] - self.cu[:-1]).repeat_interleave(self.lengths)
        ids[torch.arange(len(self.ids)) + shift] = self.ids
        return TokenRows(ids, cu)


# the shapes crossing the roles
Ids = list[int]  # one sequence's token ids
LastLogits = Annotated[Tensor, "[vocab]"]
Features = Annotated[Tensor, "[t, F]"]
VerifyLogits = Annotated[Tensor, "[b, T, vocab]"]
VerifyFeatures = Annotated[Tensor, "[b, T, F]"]
BlockLogits = Annotated[Tensor, "[b, block - 1, columns]"]
Visible = Annotated[Tensor, "[b]"]


class BatchTarget(ABC):
    """The target over a batch of rows (vLLM's model runner; TensorRT-LLM's target model
    with its KV cache manager). `context_limit`: the longest sequence it takes."""

    context_limit: int

    @abstractmethod
    def add(self, ids: Ids, capacity: int) -> tuple[LastLogits, Features]:
        """A new row's prefill (prefill + join_prefilled): the last token's logits and
        every token's features, in a cache of `capacity`."""

    @abstractmethod
    def prefill(self, ids: Ids, capacity: int) -> tuple[LastLogits, Features]:
        """A joining sequence's first part (chunked prefill), held aside until
        join_prefilled makes it the last row."""

    @abstractmethod
    def prefill_more(self, ids: Ids) -> tuple[LastLogits, Features]:
        """The joining sequence's next part."""

    @abstractmethod
    def join_prefilled(self) -> None:
        """The sequence prefilled in parts becomes the batch's last row."""

    @abstractmethod
    def snapshot(self):
        """A copy of the held (prefilled, not joined) sequence."""

    @abstractmethod
    def restore(self, snapshot, capacity: int) -> None:
        """That copy held again, in a cache of `capacity` (PrefillOnce)."""

    @abstractmethod
    def verify(self, rows: TokenRows) -> tuple[VerifyLogits, VerifyFeatures]:
        """One pass over every row's [last token, *drafts] (rows: b rows, T = rows.width),
        padded to the widest: the logits [b, T, vocab] and features [b, T, F] (None: a
        target whose drafter reads none); a padding position's are never read."""

    @abstractmethod
    def rollback(self, lengths: list[int]) -> None:
        """Each row's cache cut back to its committed length."""

    @abstractmethod
    def remove(self, row: int) -> None:
        """The row leaves the batch; the rows after it move up."""

    def verify_trees(self, trees: list) -> list[tuple[Annotated[Tensor, "[n, vocab]"],
                                                      Annotated[Tensor, "[n, F]"]]]:
        """Every row's DraftTree packed in one pass (runtime/tree.py: pack), each node
        seeing its own row's committed keys and its ancestors: per row, the logits and
        features of its n nodes. Backends that draft trees implement it."""
        raise NotImplementedError(f"{type(self).__name__} verifies no trees")

    def keep_paths(self, paths: TokenRows) -> None:
        """Commit each row's accepted path (paths: b rows of node indices, root first) of
        its verified tree."""
        raise NotImplementedError(f"{type(self).__name__} verifies no trees")


class Drafter(ABC):
    """What every batch drafter shares: a row joins (add, or prefill / prefill_more /
    join_prefilled in parts: JoinInParts) and leaves (remove); `scaling`: the
    QueryScaling it applies (None: frozen)."""

    scaling: object

    @abstractmethod
    def add(self, capacity: int, part, more):
        """A new row's prefill, in a cache of `capacity` (a block drafter: its context
        features [c, F] and the prompt's last token; a chain or tree drafter: the committed
        ids and the features draft() pairs with them, or None)."""

    @abstractmethod
    def remove(self, row: int) -> None:
        """The row leaves the batch."""


class BatchBlockDrafter(Drafter):
    """Drafts a block per row from the target's features (DFlash): `block_size`; `vocab`:
    the target ids of the logits' columns (a DraftVocab), or None (all of them)."""

    block_size: int
    vocab: object

    @abstractmethod
    def draft(self, contexts: list[Features], bonuses: Ids) -> tuple[BlockLogits, Visible]:
        """Per row: its target features committed since its last call (an empty [0, F]
        adds nothing) and its newest token, which the target has not run yet. The block's
        keys are scratch; only the context stays in the row's cache. Returns the block's
        logits and the visible-key count N of each row."""


class BatchChainDrafter(Drafter):
    """Drafts a chain per row, one drafter pass per link for every row (PARD: one pass;
    EAGLE-3 with top_k 1): at most `max_drafts` (K) per call."""

    max_drafts: int

    @abstractmethod
    def draft(self, ids: TokenRows, features: list[Features | None], ks: list[int],
              samplers: list) -> list:
        """Per row (ids: b rows of t_r tokens): the tokens committed since its last call,
        ending with the newest (not run by the target yet); the target's features [f_r, F]
        of the tokens before its last f_r ids (None: a drafter that reads none); k drafts
        (None where k = 0): a ChainDraft (runtime/chain.py: tokens [k], probs [k, vocab] or
        None, logits [k, vocab], visible [k]), drawn by samplers[r] from the row's own q."""


class BatchTreeDrafter(Drafter):
    """Drafts a tree per row (EAGLE-3): one pass ingests every row's new entries, then one
    pass per level expands every row's frontier (runtime/tree.py: grow_trees)."""

    @abstractmethod
    def draft_trees(self, ids: TokenRows, features: list[Features | None],
                    shapes: list[TreeShape | None]) -> list:
        """ids and features per row as BatchChainDrafter.draft's; shapes: each row's
        TreeShape (None: none this step). Per row: (DraftTree, N) or None; N: the most
        keys any of its drafter rows saw."""


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

    def verify(self, rows: TokenRows):
        return self.target.verify(rows)

    def rollback(self, lengths: list[int]) -> None:
        self.target.rollback(lengths)

    def remove(self, row: int) -> None:
        self.target.remove(row)

    def verify_trees(self, trees):
        return self.target.verify_trees(trees)

    def keep_paths(self, paths: TokenRows) -> None:
        self.target.keep_paths(paths)


BatchTarget.register(PrefillOnce)  # a batch target whose rows are added whole, replayed


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
class StyleAsBuilt:
    """How an engine's drafter model drafts: its style (runtime/families.py: block, chain,
    tree; None: an n-gram engine), the tree it was built for (EAGLE-3) and the most
    drafts one chain call makes."""

    style: str | None
    tree_shape: TreeShape | None
    max_drafts: int

    @property
    def drafts_trees(self) -> bool:
        return families.drafts_trees(self.style)


class Loaded(ABC):
    """What a loader returns for one engine directory, its roles made on demand: `can`,
    what the backend runs (runtime/modes.py BACKENDS); `tokenizer`, `device`, `dtype`;
    `context_limit`, the longest sequence its batch targets take; `drafting`, the engine's
    StyleAsBuilt (set by the loader)."""

    can: modes.Backend
    drafting: StyleAsBuilt
    context_limit: int

    @abstractmethod
    def batch_target(self) -> BatchTarget:
        """A new batch target over this engine's target."""

    @abstractmethod
    def batch_drafter(self, scaling, window: int | None = None) -> BatchBlockDrafter | BatchChainDrafter:
        """The batch drafter of blocks (DFlash) or chains (PARD, EAGLE-3 with top_k 1)
        under `scaling` (None: frozen); with a `window`, each DFlash row sees only the
        last `window` of its context keys."""

    @abstractmethod
    def tree_drafter(self, scaling) -> BatchTreeDrafter:
        """EAGLE-3's trees for every row, the tree the engine was built for."""

    @staticmethod
    @abstractmethod
    def takes_window(manifest: Manifest) -> bool:
        """Whether its DFlash drafter can draft under a window, from engine.json alone."""

    def drafter(self, setting):
        """The drafter role under `setting` (runtime/assembly.py DraftSetting: scaling,
        window): one row's tree drafter where the engine drafts trees, else the batch
        drafter of blocks or chains."""
        if self.drafting.drafts_trees:
            return self.tree_drafter(setting.scaling)
        return self.batch_drafter(setting.scaling, setting.window)


def style_as_built(engine_dir: Path, manifest: Manifest, shaped: bool = True) -> StyleAsBuilt:
    """The drafting an engine was built for: its family's style, and a tree family built
    with one child per node (top_k 1) drafts chains. `shaped` False: the tree's shape is
    not ours to read (a backend that runs its own loop configures its own trees)."""
    style, shape = modes.FAMILIES[manifest.drafter].style, None
    if families.drafts_trees(style) and shaped:
        try:
            shape = TreeShape(**manifest.extra["eagle3"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{engine_dir}: engine.json has no valid extra.eagle3 tree shape "
                              f"({exc}) — rebuild the engine") from None
        style = families.chain_if_one_child(style, shape.top_k)
    # Chain drafters draft as many tokens as one verify pass checks, less the bonus.
    return StyleAsBuilt(style, shape, manifest.block_size - 1)


def drafter_config(manifest: Manifest):
    """The engine's drafter checkpoint config (its family's), or None (no checkpoint)."""
    family = modes.FAMILIES.get(manifest.drafter)
    return family.config_of(manifest.drafter_dir) if family else None


def drafter_feature_layers(manifest: Manifest, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs an engine's drafter reads (the target's `features`,
    TargetModel's convention): its family record's answer (runtime/families.py). The torch
    loader and the bfloat16 prefill (bf16_prefill.py) both read them here."""
    family = modes.FAMILIES.get(manifest.drafter)
    return family.layers_read(manifest.drafter_dir, num_layers) if family else ()
