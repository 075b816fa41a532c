#!/usr/bin/env python3
"""Teacher-forced MAL of a DFlash engine's drafter under draft windows, beside the frozen
and SharpDraft drafters, on the calibration split (as `calibrate` scores settings): the
target decodes `--new-tokens` greedy tokens after each file's first N tokens once, and
every way drafts at every one of them (runtime/acceptance.py). A window W lets a block's
rows see the block and the last W context keys only (runtime/models/layers.py:
window_mask); the window mode runs the frozen drafter under the engine's recorded window.

    python -m scripts.draft_window_sweep --engine-dir engines/sd-torch --windows 384 512 768 1024 \
        --lengths 4096 7680 --json results/draft-window-sweep.json

Torch backend (the drafter's window is a runtime argument there). Prints one line per
document and context, then the means; --json keeps every anchor's count.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path


from runtime import families
from runtime.acceptance import committed_per_anchor, greedy_continuation
from runtime.backends.pytorch import TorchBatchDFlash
from runtime.cli import UsageError
from runtime.commands.documents import default_documents, tokenized
from runtime.commands.provenance import provenance
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError
from runtime.modes import Mode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--windows", type=int, nargs="+", default=[512])
    p.add_argument("--sharpdraft-windows", type=int, nargs="*", default=[],
                   help="also SharpDraft under these windows (beta from the keys left)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 7680])
    p.add_argument("--max-docs", type=int, default=5)
    p.add_argument("--docs", nargs="+", metavar="FILE",
                   help="text files instead of the calibration split's long files")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        engine = Engine(open_spec(args.engine_dir, backend="torch"))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not families.takes_window(engine.style) or min(args.windows + args.sharpdraft_windows) < 1:
        print("error: draft windows are for DFlash engines, each window >= 1", file=sys.stderr)
        return 2
    ways = {str(Mode.FROZEN): (None, None), str(Mode.SHARPDRAFT): (engine.scaling, None)}
    ways |= {f"window {w}": (None, w) for w in args.windows}
    ways |= {f"sharpdraft, window {w}": (engine.scaling, w) for w in args.sharpdraft_windows}
    try:
        paths = args.docs or default_documents("calibration", args.max_docs)
        docs = tokenized(engine.encode, paths, max(args.lengths))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = {way: {n: [] for n in args.lengths} for way in ways}
    extra = engine.manifest.block_size - 1  # the drafts the last anchor's step checks
    for n in args.lengths:
        for name, ids in docs:
            cont = greedy_continuation(engine.loaded.batch_target(), ids[:n], args.new_tokens + extra)
            line = {}
            for way, (scaling, window) in ways.items():
                drafter = TorchBatchDFlash(engine.drafter_model, engine.model, scaling, window)
                got = committed_per_anchor(drafter, cont, "block")
                counts[way][n] += got
                line[way] = round(statistics.fmean(got), 3)
            print(n, name, json.dumps(line), flush=True)
    means = {way: {n: round(statistics.fmean(v), 4) for n, v in per.items()}
             for way, per in counts.items()}
    for way, per in means.items():
        print(f"{way:>24}: " + "  ".join(f"{n}: {m:.3f}" for n, m in per.items()))
    if args.json:
        line = shlex.join(["python", "-m", "scripts.draft_window_sweep",
                           *(sys.argv[1:] if argv is None else argv)])
        Path(args.json).write_text(json.dumps({
            **provenance("draft_window_sweep", line), "engine": args.engine_dir, "documents": [name for name, _ in docs],
            "new_tokens": args.new_tokens, "mean_mal": means,
            "committed_per_anchor": counts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
