"""The one way a decode loop (runtime/decode.py) is put together: a mode of the table
(runtime/modes.py) and the roles a backend hands out (runtime/backends) -> a proposer
(runtime/proposers.py) over a target. Engine.decoder builds every decoder through here
(and so the server and the commands); tests that hold bare roles (a model in hand, no
engine directory) build theirs here too, so they run the production shape.

Every backend's roles are batch roles: the batch target, a batch drafter for blocks and
chains, and a batch tree drafter for EAGLE-3's trees. A `target` given (a PrefillOnce over a batch
target): the decoder runs on it. A padded verify row or a tree writes scratch keys past
a sequence's budget, so every cache gets `slack` tokens of room past it."""

from __future__ import annotations

import dataclasses
from typing import Callable

from runtime import modes, proposers
from runtime.decode import Decoder, policy_for
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape


@dataclasses.dataclass(frozen=True)
class DraftSetting:
    """A mode's drafting configuration, resolved once where the mode enters (Engine.decoder)
    and passed down: the drafter's `scaling` (None: frozen), its draft `window` (DFlash;
    None: the whole context) and whether n-gram lookup assists its blocks."""

    scaling: object = None
    window: int | None = None
    ngram_assist: bool = False


@dataclasses.dataclass
class Roles:
    """What decoders are built from. `style`: how the drafter model drafts (modes.FAMILIES:
    "block", "chain", "tree"; None: no drafter model). Roles are made on demand:
    `batch_target()` the batch target, `batch_drafter(setting)` the batch drafter of
    blocks or chains under a DraftSetting, `tree_drafter(setting)` an EAGLE-3 tree drafter
    over a batch, `lookup()` an n-gram proposer."""

    style: str | None
    batch_target: Callable[[], object]
    context_limit: int
    batch_drafter: Callable[[DraftSetting], object] | None = None
    tree_drafter: Callable[[DraftSetting], object] | None = None
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
    """How the rows of a `mode` decoder draft, under its drafting `setting`."""
    if not mode.uses_drafter_model:
        return proposers.Lookup(roles.lookup) if mode.draft_source == modes.LOOKUP else proposers.NoDrafts()
    lookup = roles.lookup if setting.ngram_assist else None
    return DRAFTER_PROPOSERS[roles.style](roles, setting, lookup)


# One proposer per drafting style: the only place the style chooses code. Trees on the
# batch tree drafter; blocks and chains on the batch drafter.
DRAFTER_PROPOSERS = {
    "tree": lambda roles, setting, lookup: proposers.Tree(roles.tree_drafter(setting),
                                                          roles.tree_shape),
    "chain": lambda roles, setting, lookup: proposers.Chain(roles.batch_drafter(setting)),
    "block": lambda roles, setting, lookup: proposers.Block(roles.batch_drafter(setting), lookup),
}


# The drafter role of each style, over a batch (Engine.drafter: calibration, diagnostics,
# step costs).
DRAFTER_ROLES = {
    "tree": lambda loaded, scaling, window: loaded.tree_drafter(scaling),
    "chain": lambda loaded, scaling, window: loaded.batch_drafter(scaling, window),
    "block": lambda loaded, scaling, window: loaded.batch_drafter(scaling, window),
}


def decoder(roles: Roles, mode: Mode, target=None, costs: StepCosts | None = None,
            setting: DraftSetting | None = None) -> Decoder:
    """The decode loop running `mode` on `roles`, its drafters under `setting` (the
    mode's, resolved by the caller; default: no scaling, no window, n-gram assist as the
    mode says), on `target` (a PrefillOnce over a batch target) or the roles' batch
    target, which requests join and leave. `costs`: the measured step costs that shape
    drafter steps (None: every step verifies every draft)."""
    if setting is None:
        setting = DraftSetting(ngram_assist=mode.ngram_assist)
    chosen = proposer(roles, mode, setting)
    policy = policy_for(costs if mode.uses_drafter_model else None)
    rows = roles.batch_target() if target is None else target
    # a packed tree's nodes are scratch keys past each row's committed ones, as a padded row's
    slack = max(roles.slack, roles.tree_shape.total_tokens if chosen.drafts_trees else 0)
    return Decoder(rows, chosen, policy, slack)
