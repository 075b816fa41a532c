"""The decoding modes as data: one row per mode -- which drafter proposes (none, the
engine's model, n-gram lookup), how the drafter attends (frozen, a draft window, or beta
with the calibrated or the family-preset QueryScaling) and whether n-gram lookup assists
it -- plus what each drafter family drafts and what each backend can run. The engine,
build_engine.py's refusals, the CLI flags, bench's rows and the serving protocol read
this table; nothing else spells a mode's name. How results draw and label a mode is
presentation, kept with the commands that draw (runtime/commands/styles.py). Pure Python (no torch), so
the build and the served model's protocol import it cheaply.

The anchor is TensorRT-LLM's SpeculativeDecodingMode: one enum, its rules as predicates.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from runtime import families

# What proposes drafts (Mode.draft_source): none, the engine's drafter model, n-gram lookup.
# ("drafter" alone is the object that drafts; what kind of checkpoint it is, its family:
# runtime/families.py; how it drafts, its style; what a mode runs it under, its setting.)
NO_DRAFTER, MODEL, LOOKUP = "none", "model", "ngram lookup"
# How the drafter model attends to the context: unscaled over every key; unscaled over
# the last `draft_window` keys (its training length); scaled by beta (a QueryScaling).
UNSCALED, WINDOWED, BETA = "unscaled", "windowed", "beta"
# Which QueryScaling a beta mode uses: the engine's own (calibrated at build time) or
# its family's preset (the paper's values, runtime/families.py: its record).
CALIBRATED, FAMILY_PRESET = "calibrated", "family preset"


class Mode(StrEnum):
    """A decoding mode; its value is the name users type (`generate --mode NAME`)."""

    # name, draft source, attention, scaling, n-gram assist, study (how results show a mode:
    # runtime/commands/styles.py)
    TARGET = ("target", NO_DRAFTER, None, None, False, False)
    NGRAM = ("ngram", LOOKUP, None, None, False, False)
    FROZEN = ("frozen", MODEL, UNSCALED, None, False, False)
    WINDOW = ("window", MODEL, WINDOWED, None, False, False)
    PRESET = ("preset", MODEL, BETA, FAMILY_PRESET, False, True)
    SHARPDRAFT = ("sharpdraft", MODEL, BETA, CALIBRATED, False, False)
    HYBRID = ("hybrid", MODEL, BETA, CALIBRATED, True, False)
    FROZEN_HYBRID = ("frozen-hybrid", MODEL, UNSCALED, None, True, False)
    WINDOW_HYBRID = ("window-hybrid", MODEL, WINDOWED, None, True, False)

    def __new__(cls, name, draft_source, attention, scaling, ngram_assist, study):
        mode = str.__new__(cls, name)
        mode._value_ = name
        mode.draft_source, mode.attention, mode.scaling = draft_source, attention, scaling
        mode.ngram_assist = ngram_assist
        # A comparison run only when asked (bench --modes preset): not an engine's
        # everyday mode, so not in EngineSpec.modes, demo or serving.
        mode.study = study
        return mode

    # -- predicates: what a mode needs of the engine -----------------------------------
    @property
    def uses_drafter_model(self) -> bool:
        return self.draft_source == MODEL

    @property
    def scaled(self) -> bool:
        """The drafter attends under a QueryScaling (SharpDraft)."""
        return self.attention == BETA

    @property
    def swaps_scaling(self) -> bool:
        """Runs the drafter under a scaling other than the engine's own."""
        return self.scaling == FAMILY_PRESET

    @property
    def needs_window(self) -> bool:
        return self.attention == WINDOWED

# The drafter alone under a QueryScaling: its MAL over frozen's is SharpDraft's effect.
SCALED = tuple(m for m in Mode if m.scaled and not m.ngram_assist)


def find(draft_source: str, attention: str | None = None, ngram_assist: bool = False,
         scaling: str | None = None) -> Mode | None:
    """The mode with these parts, or None (the table has no such combination)."""
    if attention == BETA and scaling is None:
        scaling = CALIBRATED
    for mode in Mode:
        if (mode.draft_source, mode.attention, mode.scaling, mode.ngram_assist) == (
                draft_source, attention, scaling, ngram_assist):
            return mode
    return None


def parse(name: str) -> Mode:
    try:
        return Mode(name)
    except ValueError:
        raise ValueError(f"no decoding mode {name!r} (modes: {', '.join(Mode)})") from None


# The drafter families (what each drafts, its preset, its checkpoint) are records in
# runtime/families.py; the table reads their style from there.
FAMILIES = families.FAMILIES
takes_window = families.takes_window


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend can run."""

    styles: frozenset[str]  # the drafting styles (runtime/families.py) it has drafters for
    window: bool  # a DFlash drafter under a draft window
    batch: bool  # several requests decode together (runtime/decode.py); else one at a time
    swap_scaling: bool  # a drafter under any QueryScaling at run time (else compiled in)
    own_loop: bool  # the engine runs its own decode loop (TensorRT-LLM, vLLM): only plain modes
    attention_forms: tuple[str, ...] = ()  # exported SharpDraft attention, the default first
    runs_in: str = ""  # own_loop: the serving engine whose loop runs it, as users name it
    triton: bool = True  # Triton Inference Server serves it (ours, or TensorRT-LLM's llmapi model)


BACKENDS = {
    # its batched drafters take any QueryScaling: the preset fuses for blocks and chains
    "torch": Backend(frozenset(families.STYLES), window=True, batch=True,
                     swap_scaling=True, own_loop=False),
    # the window needs a drafter graph exported with its input (OnnxEngine.takes_window)
    "onnxruntime": Backend(frozenset(families.STYLES), window=True, batch=True,
                           swap_scaling=False, own_loop=False,
                           # the plugin node runs only through a Python bridge here
                           attention_forms=("native", "plugin")),
    "tensorrt": Backend(frozenset({families.BLOCK}), window=False, batch=False, swap_scaling=False,
                        own_loop=False, attention_forms=("plugin", "native")),
    # TensorRT-LLM's own loop: its DFlash / PARD / EAGLE-3 with SharpDraft's hook, or not
    "trtllm": Backend(frozenset(families.STYLES), window=False, batch=True,
                      swap_scaling=False, own_loop=True, runs_in="TensorRT-LLM"),
    # vLLM's own loop: its DFlash (with SharpDraft's plugin, or not), PARD (draft_model with
    # parallel drafting) and EAGLE-3 (chains of num_speculative_tokens), n-gram lookup
    "vllm": Backend(frozenset(families.STYLES), window=False, batch=True,
                    swap_scaling=False, own_loop=True, runs_in="vLLM", triton=False),
}


def backends_drafting(style: str) -> list[str]:
    return [name for name, can in BACKENDS.items() if style in can.styles]


def refusal(mode: Mode, style: str | None, backend: str, scaled: bool,
            window: bool) -> str | None:
    """Why an engine cannot run `mode`, or None if it can. `style`: its family's drafting
    (its family's, None: no drafter model); `scaled`: built with --sharpdraft (a calibrated
    QueryScaling); `window`: it has a draft window (recorded, and the drafter takes it)."""
    can = BACKENDS[backend]
    if can.own_loop and (mode.draft_source == LOOKUP or mode.ngram_assist or mode.needs_window
                         or mode.swaps_scaling):
        return f"{backend} engines run {can.runs_in}'s own loop, which has no such mode"
    if mode.draft_source in (NO_DRAFTER, LOOKUP):
        return None
    if style is None:
        return "it needs a drafter model and this is an n-gram engine"
    if mode.scaled and not scaled:
        return "the engine was built without --sharpdraft (no calibrated QueryScaling)"
    if mode.swaps_scaling and not can.swap_scaling:
        return f"it swaps the drafter's scaling, which a {backend} drafter has compiled in " \
               "— pass --backend torch"
    if (mode.needs_window or mode.ngram_assist) and not takes_window(style):
        what = "a draft window" if mode.needs_window else "n-gram assist"
        return f"{what} is written for block drafters (DFlash) only"
    if mode.needs_window and not can.window:
        return f"{backend} drafters take no draft window — pass --backend " + \
               " or ".join(n for n, c in BACKENDS.items() if c.window)
    if mode.needs_window and not window:
        return "the engine records no draft window its drafter takes (rebuild it with " \
               "build_engine.py; onnxruntime: a drafter graph exported with one)"
    return None


def batch_refusal(backend: str) -> str | None:
    """Why an engine on `backend` cannot batch the modes it runs, or None if it can: every
    mode batches (runtime/decode.py) where the backend holds a target per sequence."""
    if not BACKENDS[backend].batch:
        batching = [n for n, c in BACKENDS.items() if c.batch and not c.own_loop]
        return f"batched decoding runs on the {' and '.join(batching)} backends, not " \
               f"{backend} (pass --backend onnxruntime)"
    return None


def family_refusal(family: str, backend: str) -> str | None:
    """Why a drafter family cannot run on `backend` at all (its own drafting style is not
    among what the backend drafts), or None."""
    record = FAMILIES.get(family)
    style = record.style if record else None
    if style is None or backend not in BACKENDS or style in BACKENDS[backend].styles:
        return None
    return (f"{record.display} runs on the {' and '.join(backends_drafting(style))} "
            f"backends, not {backend} — pass --backend onnxruntime")


def unrunnable(engine_dir, backend: str, runnable) -> str:
    """Why this runtime cannot open the engine in `engine_dir` on `backend` (one with no
    loader)."""
    if backend in BACKENDS and BACKENDS[backend].own_loop:
        engine = BACKENDS[backend].runs_in
        return (f"{engine_dir} is configuration for {engine}: run it with `python -m runtime "
                f"generate` where {engine} is installed (docs/{backend}.md)")
    return (f"{engine_dir}: backend {backend!r} cannot run here (this runtime has "
            f"{', '.join(runnable)}) — pass --backend onnxruntime")


def own_loop_refusal(engine_dir, flags: list[str], why: str, runs, backend: str = "trtllm") -> str:
    """Why an engine run in its backend's own loop (TensorRT-LLM, vLLM) cannot take `flags`."""
    return (f"{engine_dir} runs in {BACKENDS[backend].runs_in}: drop {' '.join(flags)} ({why}; its own loop "
            f"runs {', '.join(runs)})")


def rule_default(style: str | None, scaled: bool, wanted: bool = True) -> Mode:
    """The table's rule for the mode a request runs unless it names one: SharpDraft where
    the engine has it (`scaled`: built with --sharpdraft) and it is `wanted`, the drafter
    frozen when it is not (or absent), n-gram lookup on an ngram engine."""
    if style is None:
        return Mode.NGRAM
    return Mode.SHARPDRAFT if wanted and scaled else Mode.FROZEN


def measured_default(record: dict | None, backend: str, runnable, batch: int = 1) -> Mode | None:
    """The mode engine.json's extra.default_mode names (runtime/measure.py), if it was
    measured on `backend` and is among the `runnable` modes; else None (the rule applies).
    For a `batch` of sequences decoding together: the fastest mode at the largest batch
    size the build measured that is not above it (by_batch; one stream: the top-level
    mode), so the served default follows the load -- a mode that pays for one stream but
    not in a full batch steps aside there."""
    if not record or record.get("backend") != backend:
        return None
    measured = {int(size): entry.get("mode") for size, entry in record.get("by_batch", {}).items()}
    sizes = [size for size in measured if size <= batch]
    name = measured[max(sizes)] if sizes else record.get("mode")
    return next((m for m in runnable if m == name), None)


def default_mode(record: dict | None, backend: str, runnable, style: str | None,
                 scaled: bool, batch: int = 1) -> Mode:
    """THE default mode of an engine (the one rule: EngineSpec.default_mode, the OpenAI
    endpoint and the served model all read it here): the mode engine.json's
    extra.default_mode measured fastest for a `batch` of sequences decoding together
    (measured_default), else the table's rule (rule_default)."""
    return measured_default(record, backend, runnable, batch) or rule_default(style, scaled)
