"""`python -m runtime default-mode`: measure which decoding mode is fastest on this engine
and this machine and record it in engine.json (extra.default_mode), the mode served
requests run when they name none. build_engine.py does the same after its step costs;
this records it on an engine built before it did, or re-measures it on another machine,
without a rebuild (runtime/mode_speed.py)."""

from __future__ import annotations

import json

from runtime import mode_speed
from runtime.cli import UsageError, progress


def add_parser(sub):
    p = sub.add_parser("default-mode", help="measure the fastest decoding mode and record it in "
                                            "engine.json as the served default")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--context", type=int, default=mode_speed.CONTEXT,
                   help="prompt tokens from the evaluation split (clipped to the engine's context)")
    p.add_argument("--new-tokens", type=int, default=mode_speed.NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=mode_speed.REPEATS)
    p.add_argument("--dry-run", action="store_true", help="measure and print, change nothing")
    p.add_argument("--debug", action="store_true")


def run(args) -> int:
    from runtime.engine import Engine

    for flag in ("context", "new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    settings = {"context": args.context, "new_tokens": args.new_tokens, "repeats": args.repeats}
    progress(f"default-mode: every mode of {args.engine_dir}, {args.repeats} repeat(s)")
    if args.dry_run:
        result = mode_speed.measure(Engine(args.engine_dir), progress=progress, **settings)
    else:
        result = mode_speed.record(args.engine_dir, progress=progress, **settings)
    print(json.dumps(result))
    progress(f"default-mode: {result['mode']}" + ("" if args.dry_run else
                                                   f" (recorded in {args.engine_dir}/engine.json)"))
    return 0
