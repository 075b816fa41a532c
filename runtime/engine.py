"""An engine, loaded and running: what an engine spec (runtime/spec.py: EngineSpec, opened
once where a command enters and handed here) describes, opened by its backend's loader
(runtime/backends: LOADERS): tokenizer, target and drafters, and `generate`. What the
engine can run -- its modes, their refusals, the defaults, a mode's drafting setting --
is the spec's to answer (Engine.spec); an Engine only loads and runs.

Every mode runs the one decode loop (runtime/decode.py), put together by
runtime/assembly.py from the mode's DraftSetting (EngineSpec.setting, resolved once and
passed down) and this engine's roles: DFlash drafts blocks (which n-gram lookup can
assist), PARD chains, EAGLE-3 trees or, built with top_k 1, chains. Nothing here compares
backend or family names: the registry, the table and the spec answer."""

from __future__ import annotations

import functools

from runtime import assembly, modes
from runtime.assembly import DraftSetting
from runtime.backends import RUNNABLE_BACKENDS
from runtime.backends.roles import load_tokenizer  # noqa: F401 -- the commands' tokenizer
from runtime.decode import Decoder, Request
from runtime.manifest import EngineError
from runtime.metrics import Generation
from runtime.modes import Mode
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, Sampling
from runtime.spec import EngineSpec


class Engine:
    """The engine an EngineSpec describes, loaded by its backend's loader with the spec's
    options (torch: cpu / cuda, any dtype, compiled steps or eager; default cpu,
    engine.json's dtype, eager): the loaded roles and the tokenizer. A spec whose backend
    runs its own loop, or whose options the backend refuses, is refused in one line."""

    def __init__(self, spec: EngineSpec):
        if spec.own_loop:
            raise EngineError(modes.unrunnable(spec.dir, spec.backend, RUNNABLE_BACKENDS))
        if spec.refusals:
            raise EngineError(spec.refusals[0])
        self.spec, self.manifest, self.dir = spec, spec.manifest, spec.dir
        self.backend, self.scaling, self.style = spec.backend, spec.scaling, spec.style
        self.tree_shape = spec.drafting.tree_shape
        self.loaded = spec.loader(self.dir, self.manifest, spec.drafting, **spec.options)
        self.step_costs = spec.step_costs
        self.tokenizer = self.loaded.tokenizer
        # the torch backend's models (None on backends that run graphs or plans)
        self.model = getattr(self.loaded, "model", None)
        self.drafter_model = getattr(self.loaded, "drafter_model", None)
        # a prefill that gives the same bits only when chunks are a multiple of this
        # (--prefill-dtype bfloat16); None: any chunking
        self.prefill_grid = getattr(self.loaded, "prefill_grid", None)
        # the longest sequence its batch targets take (engines built with --max-seq-len
        # serve no longer ones, whichever backend runs)
        self.context_limit = self.loaded.context_limit
        self.stop_ids = frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])

    def drafter(self, scaled: bool = True, window: int | None = None, *, scaling=...):
        """The drafter role, for one row or a batch (calibration, diagnostics, step
        costs): the batch drafter of blocks or chains, or a tree engine's batch tree
        drafter; with the engine's query scaling, or unscaled (frozen); with a `window`,
        its block rows see only the last `window` context keys (DFlash). `scaling`: any
        other QueryScaling, on backends that swap scalings at run time only (a compiled
        drafter graph has its scaling built in)."""
        swap = scaling is not ...
        why = self.spec.drafter_refusal(window=None if swap else window, swap=swap)
        if why:
            raise EngineError(why)
        if not swap:
            scaling = self.scaling if scaled else None
        return self.loaded.drafter(DraftSetting(scaling, window))

    def decoder(self, mode: str = Mode.SHARPDRAFT, adaptive: bool = True, target=None) -> Decoder:
        """The decode loop (runtime/decode.py) running `mode`, built by runtime/assembly.py
        from this engine's roles and the mode's DraftSetting, on a batch target of its own,
        which any number of requests join and leave (in-flight batching; one at a time
        where the backend does not batch: EngineSpec.batch_refusal), or on `target` (a
        PrefillOnce over one). `adaptive`: drafter steps verify as many drafts as the
        measured step costs make worthwhile."""
        mode = self.spec.check_mode(mode)
        settings = self.spec.ngram_settings
        roles = assembly.Roles(
            self.style, self.loaded.batch_target, self.loaded.drafter,
            lookup=functools.partial(NGramProposer.from_settings, settings),
            tree_shape=self.tree_shape, block_size=self.manifest.block_size,
            lookup_drafts=settings["num_draft_tokens"])
        return assembly.decoder(roles, mode, target, self.step_costs if adaptive else None,
                                self.spec.setting(mode))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = Mode.SHARPDRAFT,
                 sampling: Sampling = Sampling(), stop: bool = True, on_tokens=None,
                 adaptive: bool = True, target=None) -> Generation:
        """One decoding run of `mode`: a request alone, a batch of one on the engine's
        batch roles, or on `target` (a PrefillOnce over a batch target of the engine's:
        several runs from one prefill)."""
        request = Request(prompt=prompt, max_new_tokens=max_new_tokens,
                          stop_ids=self.stop_ids if stop else frozenset(), on_tokens=on_tokens,
                          sampler=Sampler(sampling))
        return self.decoder(mode, adaptive, target).generate(request)

