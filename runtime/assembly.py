"""The one way a decode loop (runtime/decode.py) is put together: a mode of the table
(runtime/modes.py) and the roles a backend hands out (runtime/backends) -> a proposer
(runtime/proposers.py) over a target. Engine.decoder builds every decoder through here
(and so the server and the commands); tests that hold bare roles (a model in hand, no
engine directory) build theirs here too, so they run the production shape.

Drafters are the backend's fused batch drafter (blocks, chains) wherever it has one, else
one per row. A `target` given (the engine's own, or a PrefillOnce over it): a batch of one
on it. Without: the backend's batch target where it has one, else one target per row; trees verify packed in the batch
target's pass, each row under its own mask, where it `packs_trees` (else one target per
row); a padded verify row or a tree writes scratch keys past its own budget, so every
cache gets `slack` tokens of room past it."""

from __future__ import annotations

import dataclasses
from typing import Callable

from runtime import modes, proposers
from runtime.backends.rows import RowBlockDrafters, RowChainDrafters, RowTargets
from runtime.decode import Decoder, policy_for
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape


@dataclasses.dataclass(frozen=True)
class DraftSetting:
    """A mode's drafting configuration, resolved once where the mode enters (Engine.decoder)
    and passed down: the drafter's `scaling` (None: frozen), its draft `window` (DFlash;
    None: the whole context), whether n-gram lookup assists its blocks, and whether its
    rows draft `fused` in one batched call (modes.drafts_fused) or one call per row."""

    scaling: object = None
    window: int | None = None
    ngram_assist: bool = False
    fused: bool = True


@dataclasses.dataclass
class Roles:
    """What decoders are built from. `style`: how the drafter model drafts (modes.FAMILIES:
    "block", "chain", "tree"; None: no drafter model). Roles are made on demand, one per
    row where a row needs its own: `new_target()` a single-sequence target with its own
    cache; `drafter(setting)` the per-row drafter under a DraftSetting; `batch_target()` /
    `batch_drafter(setting)` the fused batch roles (None, or a batch_drafter returning None
    for a setting: rows run one by one); `lookup()` an n-gram proposer."""

    style: str | None
    new_target: Callable[[], object]
    context_limit: int
    drafter: Callable[[DraftSetting], object] | None = None
    batch_target: Callable[[], object] | None = None
    batch_drafter: Callable[[DraftSetting], object] | None = None
    lookup: Callable[[], NGramProposer] = NGramProposer
    tree_shape: TreeShape | None = None
    block_size: int = 1  # tokens one verify row of the drafter holds (bonus + drafts)
    lookup_drafts: int = NGramProposer().settings()["num_draft_tokens"]

    @property
    def slack(self) -> int:
        """Cache room past a sequence's budget for a verify row padded to the batch's
        widest: the widest row any proposer makes (a block, or a lookup's drafts + 1)."""
        return max(self.block_size, self.lookup_drafts + 1)


def proposer(roles: Roles, mode: Mode, setting: DraftSetting) -> proposers.Proposer:
    """How the rows of a `mode` decoder draft, under its drafting `setting`: on the batch
    drafter wherever the roles give one (a run on one given target too: a batch of one)."""
    if not mode.uses_drafter_model:
        return proposers.Lookup(roles.lookup) if mode.draft_source == modes.LOOKUP else proposers.NoDrafts()
    drafter = lambda: roles.drafter(setting)  # noqa: E731 -- one per row
    lookup = roles.lookup if setting.ngram_assist else None
    fused = roles.batch_drafter is not None and setting.fused
    return DRAFTER_PROPOSERS[roles.style](roles, setting, drafter, lookup, fused)


# One proposer per drafting style: the only place the style chooses code. A batched
# drafter (a window or a preset too: modes.drafts_fused) where the roles give one for
# the mode, else one per row.
DRAFTER_PROPOSERS = {
    "tree": lambda roles, setting, drafter, lookup, fused: proposers.Tree(drafter, roles.tree_shape),
    "chain": lambda roles, setting, drafter, lookup, fused: proposers.Chain(
        (roles.batch_drafter(setting) if fused else None) or RowChainDrafters(drafter)),
    "block": lambda roles, setting, drafter, lookup, fused: proposers.Block(
        (roles.batch_drafter(setting) if fused else None) or RowBlockDrafters(drafter), lookup),
}


def decoder(roles: Roles, mode: Mode, target=None, costs: StepCosts | None = None,
            setting: DraftSetting | None = None) -> Decoder:
    """The decode loop running `mode` on `roles`, its drafters under `setting` (the
    mode's, resolved by the caller; default: no scaling, no window, n-gram assist as the
    mode says): with `target`, a batch of one on it; without, a batch requests join and
    leave. `costs`: the measured step costs that shape drafter steps (None: every step
    verifies every draft)."""
    batched = target is None
    if setting is None:
        setting = DraftSetting(ngram_assist=mode.ngram_assist)
    chosen = proposer(roles, mode, setting)
    policy = policy_for(costs if mode.uses_drafter_model else None)
    rows = roles.batch_target() if batched and roles.batch_target is not None else None
    if rows is None or (chosen.drafts_trees and not getattr(rows, "packs_trees", False)):
        one = target  # one target per row (a batch of one; a batch target that cannot pack trees)
        rows = RowTargets(roles.new_target if one is None else (lambda: one), roles.context_limit)
        return Decoder(rows, chosen, policy)
    # a packed tree's nodes are scratch keys past each row's committed ones, as a padded row's
    slack = max(roles.slack, roles.tree_shape.total_tokens if chosen.drafts_trees else 0)
    return Decoder(rows, chosen, policy, slack)
