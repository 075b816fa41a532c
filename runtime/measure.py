"""Measurements the build and the commands share: decoding every mode from ONE prefill
(bench, demo, the default mode), and the engine's default mode -- a short greedy decode
of one evaluation document in every mode the engine lists, on the backend it runs, timed
on this machine -- recorded in engine.json (extra.default_mode): the mode served requests
run when they name none (modes.default_mode). build_engine.py measures it after its step
costs; `python -m runtime default-mode` (runtime/commands/default_mode.py) records it on
an engine built before. Part of the runtime core, so the build reads it without
importing a command.

Decode speed, not MAL: a mode that accepts more but pays more per step (a window, n-gram
lookup) is only worth defaulting to if it is faster here. Modes run interleaved from one
prefill, repeat after repeat, so a machine that slows down part-way slows every mode alike."""

from __future__ import annotations

import statistics
import time

from runtime import corpus
from runtime.cli import UsageError
from runtime.modes import Mode

CONTEXT, NEW_TOKENS, REPEATS = 1024, 40, 2
# The loaded batch: this many rows, each of a LOADED_CONTEXT-token prompt (shorter than
# CONTEXT, so eight prefills per mode keep the build's time bounded).
LOADED_BATCH, LOADED_CONTEXT = 8, 256
# A mode other than target-only is the loaded default only if it decodes the loaded batch
# this much faster: the timing leaves out what drafting adds to each join (a drafter's
# read of the prompt), so a near tie here is a loss served (docs/serving.md: an engine
# whose build found SharpDraft and target-only tied at 8 rows ran mixed prompts slower
# with SharpDraft than target-only).
LOADED_MARGIN = 1.05
WARMUP_TOKENS = 4  # one short untimed run per mode: its sessions and caches are built then


def evaluation_prompt(engine, context: int, new_tokens: int) -> tuple[str, list[int]]:
    """(document name, its first `context` tokens), clipped so the decode fits the
    engine's context: the longest evaluation-split source file."""
    context = min(context, engine.context_limit - new_tokens - 1)
    if context < 1:
        raise UsageError(f"{engine.dir}: a context of {engine.context_limit} tokens leaves no room "
                         f"for a prompt and {new_tokens} new tokens")
    docs = corpus.long_documents("eval", min_chars=4 * context)
    if not docs:
        raise UsageError(f"no evaluation-split document of {4 * context}+ characters under "
                         f"{corpus.STDLIB} to measure the default mode on")
    ids = engine.encode(docs[0].read_text(encoding="utf-8"))[:context]
    return docs[0].name, ids


def loaded_rows(prompt: list[int], batch: int) -> list[list[int]]:
    """`batch` distinct rows of up to LOADED_CONTEXT tokens from one evaluation prompt,
    spread evenly over it: each row continues another point of the document, so rows
    accept drafts unevenly, as a served batch's do (copies of one row would all
    accept alike)."""
    width = min(LOADED_CONTEXT, len(prompt))
    room = len(prompt) - width
    return [prompt[start:start + width]
            for start in (room * r // max(batch - 1, 1) for r in range(batch))]


def loaded_sizes(batch: int) -> list[int]:
    """The loaded batch sizes timed: half the loaded batch and the whole. A served batch
    runs the choice of the largest size measured not above it (modes.measured_default),
    so with the whole alone every batch of 2 to 7 rows would run one stream's choice."""
    return sorted({batch // 2, batch} - {0, 1})


def loaded_choice(speeds: dict[str, float]) -> str:
    """The loaded default: the fastest mode, if it beats target-only by LOADED_MARGIN;
    else target-only (see LOADED_MARGIN)."""
    best, target = max(speeds, key=speeds.get), str(Mode.TARGET)
    if target in speeds and speeds[best] < LOADED_MARGIN * speeds[target]:
        return target
    return best


def measure_loaded(engine, prompts: list[list[int]], new_tokens: int, batch: int, repeats: int,
                   progress=None) -> dict[str, float]:
    """{mode: tokens/s of `batch` rows decoding together} for the modes that batch, row r
    a decode of prompts[r % len(prompts)]: every row joins (prefill untimed), then the
    steps until all are done are timed; the median over `repeats`, modes interleaved,
    after an untimed warm-up."""
    from runtime.decode import Request

    listed = [m for m in engine.spec.modes if not engine.spec.batch_refusal(m)]
    decoders = {m: engine.decoder(m) for m in listed}

    def one(mode, n):
        decoder = decoders[mode]
        for r in range(batch):
            decoder.add(Request(prompt=prompts[r % len(prompts)], max_new_tokens=n))
        start, tokens = time.perf_counter(), 0
        while decoder.active:
            tokens += sum(len(s.gen.tokens) - 1 for s in decoder.step())  # less the prefill's token
        return tokens / (time.perf_counter() - start)

    for mode in listed:
        one(mode, WARMUP_TOKENS)
    speeds = {str(m): [] for m in listed}
    for r in range(repeats):
        k = r % len(listed)
        for mode in listed[k:] + listed[:k]:
            speeds[str(mode)].append(one(mode, new_tokens))
    medians = {m: round(statistics.median(v), 2) for m, v in speeds.items()}
    if progress:
        progress(f"      default mode at batch {batch}: " +
                 ", ".join(f"{m} {v:.1f}" for m, v in medians.items()) + " tok/s")
    return medians


def measure(engine, context: int = CONTEXT, new_tokens: int = NEW_TOKENS, repeats: int = REPEATS,
            progress=None, loaded_batch: int = LOADED_BATCH, prompts: list[list[int]] | None = None,
            source: str | None = None) -> dict:
    """What engine.json's extra.default_mode holds: the fastest mode and how it was chosen.
    `prompts` (token ids, from `source`): one's own traffic instead of the evaluation
    document -- every mode decodes each of them one stream at a time, and they are the
    loaded batch's rows in turn -- so the default is the fastest for that traffic."""
    if prompts:
        room = engine.context_limit - new_tokens - 1
        if room < 1:
            raise UsageError(f"{engine.dir}: a context of {engine.context_limit} tokens leaves no "
                             f"room for a prompt and {new_tokens} new tokens")
        prompts = [p[-room:] for p in prompts]  # a decode continues a prompt's end
        name, rows = source, prompts
    else:
        name, prompt = evaluation_prompt(engine, context, new_tokens)
        prompts, rows = [prompt], None  # loaded_rows(prompt, size) for each loaded size
    listed = engine.spec.modes
    # One prefill per prompt, replayed for every run: the runs differ only in how they
    # decode. The warm-up builds each mode's sessions and caches, untimed.
    decode_from_one_prefill(engine, prompts[0], WARMUP_TOKENS, listed)
    gens = {mode: [] for mode in listed}
    for i, prompt in enumerate(prompts):
        for mode, runs in decode_from_one_prefill(engine, prompt, new_tokens, listed, repeats,
                                                  rotation=i).items():
            gens[mode] += runs
    medians = {}
    for mode, runs in gens.items():
        medians[str(mode)] = round(statistics.median(g.tokens_per_second for g in runs), 2)
        if progress:
            progress(f"      default mode: {mode} {medians[str(mode)]:.1f} tok/s (MAL "
                     f"{statistics.fmean(g.mean_accepted_length for g in runs):.2f}, "
                     f"{', '.join(f'{g.tokens_per_second:.1f}' for g in runs[:8])})")
    best = max(medians, key=medians.get)
    by_batch = {"1": {"mode": best, "tokens_per_second": medians}}
    for size in loaded_sizes(loaded_batch):
        size_rows = rows or loaded_rows(prompts[0], size)
        loaded = measure_loaded(engine, size_rows, new_tokens, size, repeats, progress)
        if loaded:
            by_batch[str(size)] = {"mode": loaded_choice(loaded), "tokens_per_second": loaded,
                                   "context": round(statistics.median(map(len, size_rows)))}
    return {"mode": best, "tokens_per_second": medians, "by_batch": by_batch, **engine.spec.placement,
            "document": name, "context": round(statistics.median(map(len, prompts))),
            "prompts": len(prompts), "new_tokens": new_tokens, "repeats": repeats,
            "rule": "fastest median greedy decode (prefill excluded) over the modes the engine "
                    "lists, interleaved from one prefill per prompt, after an untimed warm-up; "
                    "by_batch: the same at one stream and, for the modes that batch, loaded batches "
                    f"(half and all of {loaded_batch} distinct rows), where a mode must beat "
                    f"target-only by {LOADED_MARGIN}x"}


def record(engine, progress=None, **settings) -> dict:
    """Measure the default mode of `engine` (an Engine) and write it to its engine.json."""
    result = measure(engine, progress=progress, **settings)
    engine.manifest.keep_default_record(result)
    engine.manifest.write(engine.dir)
    return result



def decode_from_one_prefill(engine, prompt: list[int], new_tokens: int, modes, repeats: int = 1,
                            sampling=None, rotation: int = 0, adaptive: bool = True) -> dict:
    """{mode: [Generation per repeat]}: every mode decodes `repeats` times from ONE prefill
    of `prompt`, interleaved (the order rotates each repeat), greedy unless `sampling`."""
    from runtime.backends import PrefillOnce
    from runtime.sampling import Sampling

    sampling = sampling or Sampling()
    once = PrefillOnce(engine.loaded.batch_target(), prompt, len(prompt))
    # calibration may keep the preset: then the preset runs are the SharpDraft runs
    same = (Mode.PRESET in modes and Mode.SHARPDRAFT in modes
            and engine.spec.family_preset == engine.scaling)
    runs = [m for m in modes if not (same and m == Mode.PRESET)]
    gens = {mode: [] for mode in runs}
    for r in range(repeats):
        k = (rotation + r) % len(runs)
        for mode in runs[k:] + runs[:k]:
            gens[mode].append(engine.generate(prompt, new_tokens, mode, sampling, stop=False,
                                              adaptive=adaptive, target=once))
    if same:
        gens[Mode.PRESET] = gens[Mode.SHARPDRAFT]
    return {mode: gens[mode] for mode in modes}
