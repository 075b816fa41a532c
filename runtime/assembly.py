"""The one way a decode loop (runtime/decode.py) is put together: a mode of the table
(runtime/modes.py) and the roles a backend hands out (runtime/backends) -> a proposer
(runtime/proposers.py) over a target. Engine.decoder builds every decoder through here
(and so the server and the commands); tests that hold bare roles (a model in hand, no
engine directory) build theirs here too, so they run the production shape.

Every backend's roles are batch roles: the batch target, a batch drafter for blocks and
chains, and a batch tree drafter for EAGLE-3's trees, each loader handing out the drafter
for a setting in one call (Loaded.drafter). A `target` given (a PrefillOnce over a batch
target): the decoder runs on it. A padded verify row or a tree writes scratch keys past
a sequence's budget, so every cache gets `slack` tokens of room past it."""

from __future__ import annotations

import dataclasses
from typing import Callable

from runtime import families, modes, proposers
from runtime.decode import Decoder, policy_for
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape


@dataclasses.dataclass(frozen=True)
class DraftSetting:
    """A mode's drafting configuration, resolved once where the mode enters
    (runtime/spec.py: EngineSpec.setting) and passed down: the drafter's `scaling` (None:
    frozen), its draft `window` (DFlash; None: the whole context) and whether n-gram
    lookup assists its blocks."""

    scaling: object = None
    window: int | None = None
    ngram_assist: bool = False


@dataclasses.dataclass
class Roles:
    """What decoders are built from. `style`: how the drafter model drafts (modes.FAMILIES:
    "block", "chain", "tree"; None: no drafter model). Roles are made on demand:
    `batch_target()` a batch target, `drafter(setting)` the drafter role under a
    DraftSetting (a loader's Loaded.drafter: the batch drafter of blocks or chains, or the
    batch tree drafter of EAGLE-3's trees), `lookup()` an n-gram proposer."""

    style: str | None
    batch_target: Callable[[], object]
    drafter: Callable[[DraftSetting], object] | None = None
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
    return PROPOSERS[roles.style](roles, setting)


def _trees(roles: Roles, setting: DraftSetting) -> proposers.Proposer:
    return proposers.Tree(roles.drafter(setting), roles.tree_shape)


def _chains(roles: Roles, setting: DraftSetting) -> proposers.Proposer:
    return proposers.Chain(roles.drafter(setting))


def _blocks(roles: Roles, setting: DraftSetting) -> proposers.Proposer:
    return proposers.Block(roles.drafter(setting), roles.lookup if setting.ngram_assist else None)


# One proposer per drafting style: the only place the style chooses code. Every style
# drafts on one batch drafter (trees: the batch tree drafter).
PROPOSERS = {families.TREE: _trees, families.CHAIN: _chains, families.BLOCK: _blocks}


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
