"""An engine directory, opened by its backend's loader (runtime/backends: LOADERS, the
backend engine.json names or an override, on a device and in a dtype): tokenizer, target
and drafters, the decoding modes of runtime/modes.py's table this engine can run
(Engine.modes; the table says what each mode needs and why one is refused), and
`generate`. Every mode runs the one decode loop (runtime/decode.py), put together by
runtime/assembly.py from the mode and this engine's roles: DFlash drafts blocks (which
n-gram lookup can assist), PARD chains, EAGLE-3 trees or, built with top_k 1, chains.
Nothing here compares backend or family names: the registry and the table answer."""

from __future__ import annotations

from pathlib import Path

from plugins.scaling import PRESETS, QueryScaling
from runtime import assembly, modes
from runtime.backends import LOADERS, RUNNABLE_BACKENDS
from runtime.backends.roles import drafting_of, load_tokenizer  # noqa: F401
from runtime.decode import Decoder, Request
from runtime.manifest import DRAFTERS, EngineError, Manifest, read_manifest
from runtime.metrics import Generation
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling
from runtime.step_costs import StepCosts


class Engine:
    """An engine directory opened by its backend's loader (runtime/backends: LOADERS);
    `device` / `dtype` / `steps` are the loader's (torch: cpu / cuda, any dtype, compiled
    steps or eager; default cpu, engine.json's dtype, eager); a loader that cannot honour
    one refuses it."""

    def __init__(self, engine_dir: str | Path, verify: str = "quick", backend: str | None = None,
                 device: str | None = None, dtype: str | None = None, steps: str | None = None,
                 prefill_dtype: str | None = None):
        self.dir = Path(engine_dir)
        self.manifest: Manifest = read_manifest(self.dir, verify=verify)
        if self.manifest.drafter not in DRAFTERS:
            raise EngineError(f"{self.dir}: drafter {self.manifest.drafter!r} is not supported "
                              "by this runtime yet")
        self.backend = backend or self.manifest.backend
        self.scaling = self.manifest.query_scaling
        drafting = drafting_of(self.dir, self.manifest)
        # style: how the drafter model drafts ("block", "chain", "tree"; None: n-gram engine)
        self.style, self.tree_shape, self.max_drafts = (drafting.style, drafting.tree_shape,
                                                        drafting.max_drafts)
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
        options = {k: v for k, v in (("device", device), ("dtype", dtype), ("steps", steps),
                                     ("prefill_dtype", prefill_dtype)) if v is not None}
        for option, value in options.items():  # each backend takes the options it declares
            why = loader.refusal(self.backend, option, value)
            if why:
                raise EngineError(f"{self.dir}: {why}")
        self.loaded = loader(self.dir, self.manifest, drafting, **options)
        # where and how the steps run: a record measured elsewhere does not apply here
        loaded = self.loaded
        self.placement = {"backend": self.backend,
                          "device": str(getattr(loaded, "device", None) or "cpu").split(":")[0],
                          "dtype": getattr(loaded, "dtype", None) or self.manifest.dtype,
                          "steps": getattr(loaded, "steps", None)}  # None: not compiled
        # Measured at build time for each backend (the CPU, steps not compiled); None (older or
        # TensorRT engines, or this engine placed elsewhere): every step verifies the
        # whole block.
        costs = self.manifest.extra.get("step_costs", {}).get(self.backend)
        costs = self.manifest.measured_on(costs, self.placement)
        self.step_costs = StepCosts.from_dict(costs) if costs else None
        self.tokenizer, self.target = self.loaded.tokenizer, self.loaded.target
        # a prefill that gives the same bits only when chunks are a multiple of this
        # (--prefill-dtype bfloat16); None: any chunking
        self.prefill_grid = getattr(self.loaded, "prefill_grid", None)
        # Engines built with --max-seq-len serve no longer sequences, whichever backend runs.
        limit = self.manifest.extra.get("max_seq_len")
        if limit:
            self.target.context_limit = min(self.target.context_limit, int(limit))
        self.context_limit = self.target.context_limit
        self.stop_ids = frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])

    @property
    def has_drafter_model(self) -> bool:
        return self.style is not None

    @property
    def model(self):
        """The target model (torch backend: the loader's)."""
        return self._torch_module("model")

    @property
    def drafter_model(self):
        """The drafter model (torch backend: the loader's)."""
        return self._torch_module("drafter_model")

    def _torch_module(self, name: str):
        module = getattr(self.loaded, name, None)
        if module is None:
            raise EngineError(f"{self.dir}: the {self.backend} backend holds no torch {name} "
                              "(--backend torch)")
        return module

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

    @property
    def draft_window(self) -> int | None:
        """The window modes' draft window: the DFlash drafter's training length, recorded at
        build time (extra.draft_window), where this backend's drafter can take one."""
        window = self.manifest.extra.get("draft_window")
        if window is None or not modes.takes_window(self.style) or not self.can.window:
            return None
        if not self.loaded.has_window():
            return None
        return int(window)

    def mode_for(self, scaled: bool = True) -> Mode:
        """The table's rule (modes.rule_default): SharpDraft, or the drafter frozen; what
        `generate` runs without --mode."""
        return modes.rule_default(self.style, self.scaling is not None, scaled)

    @property
    def default_mode(self) -> Mode:
        """What a served request runs when it names no mode (modes.default_mode: the
        fastest mode the build measured on this backend, else the table's rule)."""
        return modes.default_mode(self._default_record(), self.backend,
                                  self.modes, self.style, self.scaling is not None)

    def default_mode_at(self, batch: int) -> Mode:
        """The served default for a request joining `batch` sequences decoding together
        (itself included): modes.default_mode over the batch sizes the build measured
        (extra.default_mode.by_batch)."""
        return modes.default_mode(self._default_record(), self.backend,
                                  self.modes, self.style, self.scaling is not None, batch)

    def _default_record(self) -> dict | None:
        """The default-mode record measured as this engine runs (Engine.placement), else
        None (the table's rule)."""
        return self.manifest.default_record(self.placement)

    @property
    def family_preset(self) -> QueryScaling:
        """The preset scaling of the engine's drafter family (plugins/scaling.py: PRESETS),
        as engine.json recorded it at build time: the preset mode's scaling."""
        recorded = self.manifest.extra.get("family_preset")
        return QueryScaling.from_dict(recorded) if recorded else PRESETS[self.manifest.drafter]

    def ngram_lookup(self) -> NGramProposer:
        """A fresh n-gram lookup (it indexes one sequence as it grows)."""
        return NGramProposer.from_settings(self.ngram_settings)

    def drafter(self, scaled: bool = True, window: int | None = None):
        """The drafter with the engine's query scaling, or unscaled (frozen); with a
        `window`, its block rows see only the last `window` context keys (DFlash)."""
        self._check_drafter(window)
        return self.loaded.drafter(self.scaling if scaled else None, window)

    def _check_drafter(self, window: int | None) -> None:
        if not self.has_drafter_model:
            raise EngineError(f"{self.dir} is an n-gram engine: it has no drafter model")
        if window is not None and not modes.takes_window(self.style):
            raise EngineError(f"{self.dir}: a draft window is written for DFlash blocks only")

    def _check_swap(self) -> None:
        self._check_drafter(None)
        if not self.can.swap_scaling:
            raise EngineError(f"{self.dir}: a {self.backend} drafter's scaling is compiled "
                              "in; try other values with the torch backend (--backend torch)")

    def drafter_for(self, mode: Mode):
        """The drafter a drafter mode runs: unscaled, windowed, or under its beta scaling."""
        return self.loaded.drafter(*self.drafter_setting(mode))

    def batch_drafter_for(self, mode: Mode):
        """drafter_for's drafter for every row of a batch in one pass (the backend's
        batched form: the same scaling, the same draft window per row), or None where the
        table (modes.drafts_fused) has this mode draft one call per row."""
        if not modes.drafts_fused(mode, self.manifest.drafter, self.backend):
            return None
        return self.loaded.batch_drafter(*self.drafter_setting(mode))

    def drafter_setting(self, mode: Mode) -> tuple[QueryScaling | None, int | None]:
        """The (scaling, draft window) a drafter mode's drafter runs under, alone or
        batched: the family preset, the window unscaled, or the engine's scaling / none."""
        if mode.swaps_scaling:
            self._check_swap()
            return self.family_preset, None
        if mode.needs_window:
            self._check_drafter(self.draft_window)
            return None, self.draft_window
        self._check_drafter(None)
        return (self.scaling if mode.scaled else None), None

    def drafter_with_scaling(self, scaling: QueryScaling | None):
        """The drafter under any other scaling (calibration, diagnostics): backends that
        swap scalings at run time only, since a compiled drafter graph has its scaling
        built in."""
        self._check_swap()
        return self.loaded.drafter(scaling)

    def roles(self) -> assembly.Roles:
        """What this engine's decoders are built from (runtime/assembly.py)."""
        fused = self.can.batch

        def new_target():
            target = self.loaded.new_target()
            target.context_limit = self.context_limit
            return target

        def batch_target():
            target = self.loaded.batch_target()
            target.context_limit = self.context_limit
            return target

        return assembly.Roles(
            self.style, new_target, self.context_limit, drafter=self.drafter_for,
            batch_target=batch_target if fused else None,
            batch_drafter=self.batch_drafter_for if fused else None,
            lookup=self.ngram_lookup, tree_shape=self.tree_shape,
            block_size=self.manifest.block_size,
            lookup_drafts=self.ngram_settings["num_draft_tokens"])

    def decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True, target=None) -> Decoder:
        """The decode loop (runtime/decode.py) running `mode`, built by runtime/assembly.py.
        With `target` (the engine's own, or a PrefillOnce over it): a batch of one on it.
        Without: a batch requests join and leave. `adaptive`: drafter steps verify as many
        drafts as the measured step costs make worthwhile."""
        mode = self.check_mode(mode)
        if target is None and self.batch_refusal(mode):
            raise EngineError(f"{self.dir}: {self.batch_refusal(mode)}")
        return assembly.decoder(self.roles(), mode, target,
                                self.step_costs if adaptive else None)

    def batch_decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True) -> Decoder:
        """A decoder any number of requests join (in-flight batching)."""
        return self.decoder(mode, adaptive)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = Mode.SHARPDRAFT,
                 sampling: Sampling = Sampling(), stop: bool = True, on_tokens=None,
                 adaptive: bool = True) -> Generation:
        return run_mode(self, self.target, mode, prompt, max_new_tokens, Sampler(sampling),
                        self.stop_ids if stop else frozenset(), on_tokens, adaptive)


def run_mode(engine: Engine, target, mode: str, prompt: list[int], max_new_tokens: int,
             sampler: Sampler, stop_ids=frozenset(), on_tokens=None,
             adaptive: bool = True) -> Generation:
    """One decoding run of `mode` on `target` (the engine's own, or a PrefillOnce over it)."""
    return engine.decoder(mode, adaptive, target).generate(
        Request(prompt, max_new_tokens, stop_ids=stop_ids, on_tokens=on_tokens, sampler=sampler))
