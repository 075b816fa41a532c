"""The engine spec: what an engine directory can run, answered once and without loading
anything. open_spec(dir, backend, **options) reads engine.json (runtime/manifest.py),
picks the backend (engine.json's, or the one asked for) and its loader in the registry
(runtime/backends: LOADERS, each with its capabilities, runtime/modes.py BACKENDS), works
out how the drafter drafts (roles.style_as_built) and which options the backend refuses.

Every command, and the served model, opens the spec once where it enters and hands it
on: the modes, their refusals, the defaults, the family preset, the drafting setting of a
mode and whether the backend runs its own loop are all asked here. Engine
(runtime/engine.py) loads and runs what a spec describes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from plugins.scaling import QueryScaling
from runtime import families, modes
from runtime.assembly import DraftSetting
from runtime.backends import LOADERS, OPTIONS, RUNNABLE_BACKENDS, Loader
from runtime.backends.roles import StyleAsBuilt, style_as_built
from runtime.manifest import DRAFTERS, EngineError, Manifest, read_manifest
from runtime.modes import Mode


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine directory can run on a backend with some options: engine.json (the
    Manifest), the backend and its loader (with the backend's capabilities), the drafting
    shape, the options it is opened with and the refusals they meet (one line each; Engine
    raises the first). Opened by open_spec; loads nothing."""

    manifest: Manifest
    backend: str
    loader: Loader
    drafting: StyleAsBuilt
    options: dict
    refusals: tuple[str, ...]
    # the window modes' draft window (DFlash's training length, extra.draft_window) where
    # this backend's drafter takes one; None: no window mode
    draft_window: int | None
    # where the steps run (manifest.PLACEMENT's keys): a record measured elsewhere does not
    # apply here
    placement: dict

    @property
    def dir(self) -> Path:
        return Path(self.manifest.dir)

    @property
    def can(self) -> modes.Backend:
        """What the backend runs (runtime/modes.py BACKENDS)."""
        return self.loader.can

    @property
    def own_loop(self) -> bool:
        """Whether the backend runs its own decode loop (TensorRT-LLM), not ours."""
        return self.can.own_loop

    @property
    def scaling(self) -> QueryScaling | None:
        """The calibrated QueryScaling (None: built without --sharpdraft)."""
        return self.manifest.query_scaling

    @property
    def style(self) -> str | None:
        """How the drafter model drafts ("block", "chain", "tree"; None: n-gram engine)."""
        return self.drafting.style

    @property
    def ngram_settings(self) -> dict:
        """n-gram lookup's settings: every engine can draft by lookup; an n-gram engine
        records its own."""
        from runtime.ngram import NGramProposer

        return self.manifest.extra.get("ngram") or NGramProposer().settings()

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The decoding modes this engine runs, in the table's order (study modes such as
        the family preset run too when named, but are not listed)."""
        return tuple(m for m in Mode if not m.study and self.refusal(m) is None)

    def refusal(self, mode: Mode) -> str | None:
        """Why this engine cannot run `mode` (the table's rules), or None if it can."""
        return modes.refusal(mode, self.style, self.backend, self.scaling is not None,
                             self.draft_window is not None)

    @property
    def batches(self) -> bool:
        """Whether several requests decode together on this engine's backend (the table's
        rule: modes.batch_refusal); else they run one at a time."""
        return modes.batch_refusal(self.backend) is None

    def batch_refusal(self, mode: Mode) -> str | None:
        """Why this engine cannot batch `mode`, or None if it can: a mode it does not run
        at all, else its backend's rule (every mode batches where the backend does)."""
        return self.refusal(mode) or modes.batch_refusal(self.backend)

    def check_mode(self, name: str) -> Mode:
        """The mode called `name`, refused in one line naming the modes this engine runs."""
        mode = modes.parse(name)
        why = self.refusal(mode)
        if why:
            raise ValueError(f"{self.dir} cannot run mode '{mode}': {why} (it runs "
                             f"{', '.join(self.modes)})")
        return mode

    def rule_default(self, scaled: bool = True) -> Mode:
        """The table's rule (modes.rule_default): SharpDraft, or the drafter frozen; what
        `generate` runs without --mode."""
        return modes.rule_default(self.style, self.scaling is not None, scaled)

    @property
    def default_mode(self) -> Mode:
        """What a served request runs when it names no mode: default_mode_at(1)."""
        return self.default_mode_at(1)

    def default_mode_at(self, batch: int) -> Mode:
        """The served default for a request joining `batch` sequences decoding together
        (itself included): modes.default_mode over the batch sizes the build measured
        (extra.default_mode.by_batch), from the record measured as this spec places the
        engine (none: the table's rule)."""
        return modes.default_mode(self.manifest.default_record(self.placement), self.backend,
                                  self.modes, self.style, self.scaling is not None, batch)

    @property
    def step_costs(self):
        """The step costs measured at build time where this spec places the engine
        (runtime/step_costs.py StepCosts), or None (older or TensorRT engines, or placed
        elsewhere): every step verifies the whole block."""
        from runtime.step_costs import StepCosts

        costs = self.manifest.extra.get("step_costs", {}).get(self.backend)
        costs = self.manifest.measured_on(costs, self.placement)
        return StepCosts.from_dict(costs) if costs else None

    @property
    def family_preset(self) -> QueryScaling:
        """The preset scaling of the engine's drafter family (runtime/families.py: its record's preset),
        as engine.json recorded it at build time: the preset mode's scaling."""
        recorded = self.manifest.extra.get("family_preset")
        return QueryScaling.from_dict(recorded) if recorded else families.preset(self.manifest.drafter)

    @property
    def context(self) -> int | None:
        """The target's context as engine.json and the target's config.json say (the
        loaded engine may hold less: Engine.context_limit); None if neither says."""
        limits = ([int(self.manifest.extra["max_seq_len"])]
                  if self.manifest.extra.get("max_seq_len") else [])
        config = Path(self.manifest.target_dir) / "config.json"
        if config.is_file():
            positions = json.loads(config.read_text()).get("max_position_embeddings")
            if positions:
                limits.append(int(positions))
        return min(limits) if limits else None

    def drafter_refusal(self, window: int | None = None, swap: bool = False) -> str | None:
        """Why the engine cannot make this drafter (None: it can): none on an n-gram engine,
        a window on a drafter other than DFlash, a swapped scaling where it is compiled in."""
        if self.style is None:
            return f"{self.dir} is an n-gram engine: it has no drafter model"
        if window is not None and not modes.takes_window(self.style):
            return f"{self.dir}: a draft window is written for DFlash blocks only"
        if swap and not self.can.swap_scaling:
            return (f"{self.dir}: a {self.backend} drafter's scaling is compiled in; try other "
                    "values with the torch backend (--backend torch)")
        return None

    def setting(self, mode: Mode) -> DraftSetting:
        """`mode`'s drafting configuration, resolved once here and passed down: the family
        preset's scaling, the window unscaled, or the engine's scaling / none; n-gram
        assist as the mode says. A drafter mode on an engine without a drafter model, a
        window on a drafter that takes none or a swapped scaling on a backend that
        compiles its scaling in is refused in one line."""
        if not mode.uses_drafter_model:
            return DraftSetting(None, None, mode.ngram_assist)
        if mode.swaps_scaling:
            why = self.drafter_refusal(swap=True)
            scaling, window = self.family_preset, None
        elif mode.needs_window:
            why = self.drafter_refusal(window=self.draft_window)
            scaling, window = None, self.draft_window
        else:
            why = self.drafter_refusal()
            scaling, window = (self.scaling if mode.scaled else None), None
        if why:
            raise EngineError(why)
        return DraftSetting(scaling, window, mode.ngram_assist)


def open_spec(engine_dir: str | Path, backend: str | None = None, verify: str = "quick",
              **options) -> EngineSpec:
    """THE way in to an engine: engine.json read and checked (read_manifest: `verify`
    quick, full or skip), on `backend` (default: the one engine.json names) with the
    loader's `options` (runtime.backends.OPTIONS; None values are dropped). Called once per
    process where it enters (a command, the served model) and handed down."""
    manifest = read_manifest(Path(engine_dir), verify)
    where = Path(manifest.dir)
    if manifest.drafter not in DRAFTERS:
        raise EngineError(f"{where}: drafter {manifest.drafter!r} is not supported by this "
                          "runtime yet")
    backend = backend or manifest.backend
    loader = LOADERS.get(backend)
    if loader is None:
        raise EngineError(modes.unrunnable(where, backend, RUNNABLE_BACKENDS))
    why = modes.family_refusal(manifest.drafter, backend)
    if why:
        raise EngineError(f"{where}: {why}")
    built = LOADERS.get(manifest.backend)
    configuration = built is not None and built.can.own_loop  # for a backend's own loop
    drafting = style_as_built(where, manifest, shaped=not (loader.can.own_loop or configuration))
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(OPTIONS) - set(loader.options))
    if unknown:
        raise TypeError(f"open_spec takes no option {unknown[0]!r}")
    refusals = [f"{where}: {why}" for option, value in options.items()
                if (why := loader.refusal(backend, option, value))]
    if configuration and not loader.can.own_loop:
        refusals.insert(0, f"{where} is configuration for {manifest.backend}, which runs its "
                           f"own loop: drop --backend {backend}")
    elif loader.can.own_loop and not configuration:
        refusals.insert(0, f"{where} was built for backend {manifest.backend!r}; {backend} runs "
                           f"engines built with build_engine.py --backend {backend}")
    window = manifest.extra.get("draft_window")
    takes = (window is not None and modes.takes_window(drafting.style) and loader.can.window
             and loader.takes_window(manifest))
    return EngineSpec(manifest, backend, loader, drafting, options, tuple(refusals),
                      int(window) if takes else None, loader.placement(manifest, options))

