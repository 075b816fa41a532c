"""`python -m runtime default-mode`: the engine's default decoding mode, measured
(runtime/measure.py: every mode the engine lists, timed on this machine) and recorded in
engine.json (extra.default_mode): the mode served requests run when they name none.
build_engine.py measures it after its step costs (on the CPU, steps not compiled); this
command records it on an engine built before, or re-measures it on another machine or as
the engine will be served (--backend, --device, --dtype, --steps), without a rebuild: the
record applies only where it was measured (Manifest.measured_on).

Decode speed, not MAL: a mode that accepts more but pays more per step (a window, n-gram
lookup) is only worth defaulting to if it is faster here. Modes run interleaved from one
prefill, repeat after repeat, so a machine that slows down part-way slows every mode alike.

Under load the answer can change (a drafter's edge narrows as the batch, not the
drafter, fills the verify pass), so the modes that batch are also timed as loaded
batches (--loaded-batch rows, and half as many, each a window of the document (or one of
one's own prompts) decoding together, total tokens per second) and all are recorded
(by_batch); the served default follows the batch a request joins (runtime/modes.py:
measured_default)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.backends import RUNNABLE_BACKENDS
from runtime.cli import UsageError, add_device_options, device_options, progress
from runtime.measure import CONTEXT, LOADED_BATCH, NEW_TOKENS, REPEATS, measure, record


def add_parser(sub):
    p = sub.add_parser("default-mode", help="measure the fastest decoding mode and record it in "
                                            "engine.json as the served default")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--context", type=int, default=CONTEXT,
                   help="prompt tokens from the evaluation split (clipped to the engine's context)")
    p.add_argument("--prompts-file",
                   help="measure on these prompts instead (one's own traffic): one prompt per "
                        "line, or a .jsonl file of {\"text\": ...} objects, as loadtest reads them; "
                        "each decoded one stream at a time, and the loaded batch's rows")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--loaded-batch", type=int, default=LOADED_BATCH,
                   help="also time the modes that batch with this many rows decoding together, "
                        "and with half as many (1: one stream only; default %(default)s)")
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS,
                   help="measure with this backend (default: the one engine.json names)")
    add_device_options(p)
    p.add_argument("--dry-run", action="store_true", help="measure and print, change nothing")
    p.add_argument("--debug", action="store_true")


def own_prompts(engine, path: Path) -> list[list[int]]:
    """The token ids of a prompts file's prompts (loadtest's formats)."""
    from runtime.commands.loadtest import read_prompts

    prompts = [ids for ids in map(engine.encode, read_prompts(path)) if ids]
    if not prompts:
        raise UsageError(f"prompt file {path} has no prompts")
    return prompts


def run(args) -> int:
    from runtime.engine import Engine
    from runtime.spec import open_spec

    for flag in ("context", "new_tokens", "repeats", "loaded_batch"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    settings = {"context": args.context, "new_tokens": args.new_tokens, "repeats": args.repeats,
                "loaded_batch": args.loaded_batch}
    # the record holds where it was measured (EngineSpec.placement): an engine served
    # elsewhere (another backend, device, dtype or steps) runs the table's rule instead
    engine = Engine(open_spec(args.engine_dir, backend=args.backend, **device_options(args)))
    if args.prompts_file:
        settings |= {"prompts": own_prompts(engine, Path(args.prompts_file)),
                     "source": args.prompts_file}
    progress(f"default-mode: every mode of {args.engine_dir}, {args.repeats} repeat(s)" +
             (f", {len(settings['prompts'])} prompts of {args.prompts_file}" if args.prompts_file else ""))
    if args.dry_run:
        result = measure(engine, progress=progress, **settings)
    else:
        result = record(engine, progress=progress, **settings)
    print(json.dumps(result))
    progress(f"default-mode: {result['mode']}" + ("" if args.dry_run else
                                                   f" (recorded in {args.engine_dir}/engine.json)"))
    return 0
