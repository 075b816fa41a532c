"""An engine directory, opened by its backend's loader (runtime/backends: LOADERS, the
backend engine.json names or an override, on a device and in a dtype): tokenizer, target
and drafters, the decoding modes of runtime/modes.py's table this engine can run
(Engine.modes; the table says what each mode needs and why one is refused), and
`generate`. Every mode runs the one decode loop (runtime/decode.py), put together by
runtime/assembly.py from the mode and this engine's roles: DFlash drafts blocks (which
n-gram lookup can assist), PARD chains, EAGLE-3 trees or, built with top_k 1, chains.
Nothing here compares backend or family names: the registry and the table answer.

engine.json is read once, into the spec (runtime/manifest.py: Manifest) an Engine is
opened with or reads itself, and handed down; a mode becomes its drafting configuration
(assembly.DraftSetting: scaling, window, n-gram assist) here, once, and is passed
down to the decoder it builds -- nothing below calls back up for it."""

from __future__ import annotations

from pathlib import Path

from plugins.scaling import PRESETS, QueryScaling
from runtime import assembly, modes
from runtime.assembly import DraftSetting
from runtime.backends import LOADERS, OPTIONS, RUNNABLE_BACKENDS
from runtime.backends.roles import drafting_of, load_tokenizer  # noqa: F401
from runtime.decode import Decoder, Request
from runtime.manifest import DRAFTERS, PLACEMENT, EngineError, Manifest, open_spec
from runtime.metrics import Generation
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling
from runtime.step_costs import StepCosts


class Engine:
    """An engine directory opened by its backend's loader (runtime/backends: LOADERS): its
    spec (engine.json, read once: pass a Manifest read elsewhere, or a directory), the
    loaded roles and the tokenizer. `device` / `dtype` / `steps` / `prefill_dtype` are the
    loader's options (torch: cpu / cuda, any dtype, compiled steps or eager; default cpu,
    engine.json's dtype, eager); an option a backend does not declare is refused in one
    line."""

    def __init__(self, engine: str | Path | Manifest, verify: str = "quick", backend: str | None = None,
                 device: str | None = None, dtype: str | None = None, steps: str | None = None,
                 prefill_dtype: str | None = None):
        self.manifest = open_spec(engine, verify)
        self.dir = Path(self.manifest.dir)
        if self.manifest.drafter not in DRAFTERS:
            raise EngineError(f"{self.dir}: drafter {self.manifest.drafter!r} is not supported "
                              "by this runtime yet")
        self.backend = backend or self.manifest.backend
        self.scaling = self.manifest.query_scaling
        drafting = drafting_of(self.dir, self.manifest)
        # style: how the drafter model drafts ("block", "chain", "tree"; None: n-gram engine)
        self.style, self.tree_shape, self.max_drafts = (drafting.style, drafting.tree_shape,
                                                        drafting.max_drafts)
        self.has_drafter_model = self.style is not None
        why = modes.family_refusal(self.manifest.drafter, self.backend)
        if why:
            raise EngineError(f"{self.dir}: {why}")
        loader = LOADERS.get(self.backend)
        if loader is None:
            raise EngineError(modes.unrunnable(self.dir, self.backend, RUNNABLE_BACKENDS))
        self.can = modes.BACKENDS[self.backend]
        # Every engine can draft by n-gram lookup (the bench's drafter-free peer); an
        # ngram engine records its own settings.
        self.ngram_settings = self.manifest.extra.get("ngram") or NGramProposer().settings()
        options = {k: v for k, v in zip(OPTIONS, (device, dtype, steps, prefill_dtype))
                   if v is not None}
        for option, value in options.items():  # each backend takes the options it declares
            why = loader.refusal(self.backend, option, value)
            if why:
                raise EngineError(f"{self.dir}: {why}")
        self.loaded = loader(self.dir, self.manifest, drafting, **options)
        # where and how the steps run (manifest.PLACEMENT's keys): a record measured
        # elsewhere does not apply here
        loaded = self.loaded
        where = {"backend": self.backend,
                 "device": str(getattr(loaded, "device", None) or "cpu").split(":")[0],
                 "dtype": getattr(loaded, "dtype", None) or self.manifest.dtype,
                 "steps": getattr(loaded, "steps", None)}  # None: not compiled
        self.placement = {k: where[k] for k in PLACEMENT}
        # Measured at build time for each backend (the CPU, steps not compiled); None (older or
        # TensorRT engines, or this engine placed elsewhere): every step verifies the
        # whole block.
        costs = self.manifest.extra.get("step_costs", {}).get(self.backend)
        costs = self.manifest.measured_on(costs, self.placement)
        self.step_costs = StepCosts.from_dict(costs) if costs else None
        self.tokenizer = self.loaded.tokenizer
        # the torch backend's models (None on backends that run graphs or plans)
        self.model = getattr(self.loaded, "model", None)
        self.drafter_model = getattr(self.loaded, "drafter_model", None)
        # a prefill that gives the same bits only when chunks are a multiple of this
        # (--prefill-dtype bfloat16); None: any chunking
        self.prefill_grid = getattr(self.loaded, "prefill_grid", None)
        # Engines built with --max-seq-len serve no longer sequences, whichever backend runs.
        limit = self.manifest.extra.get("max_seq_len")
        self.context_limit = min(self.loaded.context_limit, int(limit or self.loaded.context_limit))
        self.stop_ids = frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        # The window modes' draft window: the DFlash drafter's training length, recorded at
        # build time (extra.draft_window), where this backend's drafter can take one.
        window = self.manifest.extra.get("draft_window")
        self.draft_window = (int(window) if window is not None and modes.takes_window(self.style)
                             and self.can.window and self.loaded.has_window() else None)

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The decoding modes this engine runs, in the table's order (study modes such as
        the family preset run too when named, but are not listed)."""
        return tuple(m for m in Mode if not m.study and self.refusal(m) is None)

    def refusal(self, mode: Mode) -> str | None:
        """Why this engine cannot run `mode` (the table's rules), or None if it can."""
        return modes.refusal(mode, self.style, self.backend, self.scaling is not None,
                             self.draft_window is not None)

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

    def mode_for(self, scaled: bool = True) -> Mode:
        """The table's rule (modes.rule_default): SharpDraft, or the drafter frozen; what
        `generate` runs without --mode."""
        return modes.rule_default(self.style, self.scaling is not None, scaled)

    @property
    def default_mode(self) -> Mode:
        """What a served request runs when it names no mode (modes.default_mode: the
        fastest mode the build measured on this backend, else the table's rule)."""
        return self.default_mode_at(1)

    def default_mode_at(self, batch: int) -> Mode:
        """The served default for a request joining `batch` sequences decoding together
        (itself included): modes.default_mode over the batch sizes the build measured
        (extra.default_mode.by_batch), from the record measured as this engine runs
        (Engine.placement; none: the table's rule)."""
        return modes.default_mode(self.manifest.default_record(self.placement), self.backend,
                                  self.modes, self.style, self.scaling is not None, batch)

    @property
    def family_preset(self) -> QueryScaling:
        """The preset scaling of the engine's drafter family (plugins/scaling.py: PRESETS),
        as engine.json recorded it at build time: the preset mode's scaling."""
        recorded = self.manifest.extra.get("family_preset")
        return QueryScaling.from_dict(recorded) if recorded else PRESETS[self.manifest.drafter]

    def setting(self, mode: Mode) -> DraftSetting:
        """`mode`'s drafting configuration, resolved once here and passed down: the family
        preset's scaling, the window unscaled, or the engine's scaling / none; n-gram
        assist as the mode says. A drafter mode on an engine without a drafter model, a
        window on a drafter that takes none or a swapped scaling on a backend that
        compiles its scaling in is refused in one line."""
        if not mode.uses_drafter_model:
            return DraftSetting(None, None, mode.ngram_assist)
        if mode.swaps_scaling:
            check_drafter(self, swap=True)
            scaling, window = self.family_preset, None
        elif mode.needs_window:
            check_drafter(self, window=self.draft_window)
            scaling, window = None, self.draft_window
        else:
            check_drafter(self)
            scaling, window = (self.scaling if mode.scaled else None), None
        return DraftSetting(scaling, window, mode.ngram_assist)

    def drafter(self, scaled: bool = True, window: int | None = None, *, scaling=...):
        """The drafter role, for one row or a batch (calibration, diagnostics, step
        costs): the batch drafter of blocks or chains, or a tree engine's tree drafter for
        one row; with the engine's query scaling, or unscaled (frozen); with a `window`,
        its block rows see only the last `window` context keys (DFlash). `scaling`: any
        other QueryScaling, on backends that swap scalings at run time only (a compiled
        drafter graph has its scaling built in)."""
        if scaling is ...:
            check_drafter(self, window=window)
            scaling = self.scaling if scaled else None
        else:
            check_drafter(self, swap=True)
        return assembly.DRAFTER_ROLES[self.style](self.loaded, scaling, window)

    def decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True, target=None) -> Decoder:
        """The decode loop (runtime/decode.py) running `mode`, built by runtime/assembly.py
        from this engine's roles and the mode's DraftSetting, on its batch target, which
        any number of requests join and leave (in-flight batching; one at a time where
        the backend does not batch: batch_refusal), or on `target` (a PrefillOnce over
        one). `adaptive`: drafter steps verify as many drafts as the measured step costs
        make worthwhile."""
        mode = self.check_mode(mode)
        setting = self.setting(mode)
        loaded, limit = self.loaded, self.context_limit

        def limited(target):
            target.context_limit = limit
            return target

        roles = assembly.Roles(
            self.style, lambda: limited(loaded.batch_target()), limit,
            batch_drafter=lambda s: loaded.batch_drafter(s.scaling, s.window),
            tree_drafter=lambda s: loaded.tree_drafter(s.scaling),
            lookup=lambda: NGramProposer.from_settings(self.ngram_settings),
            tree_shape=self.tree_shape, block_size=self.manifest.block_size,
            lookup_drafts=self.ngram_settings["num_draft_tokens"])
        return assembly.decoder(roles, mode, None if target is None else limited(target),
                                self.step_costs if adaptive else None, setting)

    batch_decoder = decoder  # a decoder any number of requests join

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = Mode.SHARPDRAFT,
                 sampling: Sampling = Sampling(), stop: bool = True, on_tokens=None,
                 adaptive: bool = True) -> Generation:
        # a request alone is a batch of one on the batch roles
        return run_mode(self, None, mode, prompt, max_new_tokens, Sampler(sampling),
                        self.stop_ids if stop else frozenset(), on_tokens, adaptive)


def check_drafter(engine: Engine, window: int | None = None, swap: bool = False) -> None:
    """Refuse in one line a drafter the engine cannot make: none on an n-gram engine, a
    window on a drafter other than DFlash, a swapped scaling where it is compiled in."""
    if not engine.has_drafter_model:
        raise EngineError(f"{engine.dir} is an n-gram engine: it has no drafter model")
    if window is not None and not modes.takes_window(engine.style):
        raise EngineError(f"{engine.dir}: a draft window is written for DFlash blocks only")
    if swap and not engine.can.swap_scaling:
        raise EngineError(f"{engine.dir}: a {engine.backend} drafter's scaling is compiled "
                          "in; try other values with the torch backend (--backend torch)")


def run_mode(engine: Engine, target, mode: str, prompt: list[int], max_new_tokens: int,
             sampler: Sampler, stop_ids=frozenset(), on_tokens=None,
             adaptive: bool = True) -> Generation:
    """One decoding run of `mode` on `target` (a PrefillOnce over a batch target of the
    engine's), or without one (None) as a batch of one on the engine's batch roles."""
    return engine.decoder(mode, adaptive, target).generate(
        Request(prompt, max_new_tokens, stop_ids=stop_ids, on_tokens=on_tokens, sampler=sampler))
