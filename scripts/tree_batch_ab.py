#!/usr/bin/env python3
"""EAGLE-3 tree drafting time per step for a batch of rows, before and after a change, as
the step-cost tool times a drafter step (runtime/step_costs.py: _drafter_step, timed after
a target pass, fastest of the repeats; the median is printed beside it): each checkout in
a process of its own, on the same engine directory (or each on its own: below), rounds
interleaved (the order alternates per round), so a contended machine's drift falls on
both. A checkout whose drafter drafts trees one row at a time (no draft_trees: before
trees drafted as a batch) runs one per-row drafter step per row, as its decode loop did;
one whose drafter drafts a batch runs the tool's step for the batch.

    OMP_NUM_THREADS=1 python scripts/tree_batch_ab.py --engine-dir engines/eagle3-torch \\
        --before /tmp/before-checkout --batch 4 --context 512 --rounds 5

A change to the graphs an engine exports (ONNX Runtime's tree levels over the draft
vocabulary) compares each checkout on the engine its own build wrote:
--before-engine-dir for the before checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file, too
from scripts.checkout_ab import ArmFailed, interleaved  # noqa: E402

CHILD = r'''
import json, statistics, sys, time
import torch
from runtime import step_costs
from runtime.engine import Engine

engine_dir, backend, batch, context, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(1)
try:  # a checkout with the engine spec opens the engine through it
    from runtime.spec import open_spec
    engine = Engine(open_spec(engine_dir, backend=backend))
except ImportError:  # one from before it
    engine = Engine(engine_dir, backend=backend)
try:  # a checkout whose roles take several rows' ids flat
    from runtime.backends.roles import TokenRows
    flat = TokenRows.of
except ImportError:  # one from before: rows as lists
    flat = list
ids = torch.randint(0, engine.tokenizer.vocab_size, (context + 8,),
                    generator=torch.Generator().manual_seed(0)).tolist()
target = engine.loaded.batch_target()
_, features = target.add(ids[:context], context + 8)
if hasattr(engine.drafter(scaled=False), "draft_trees"):  # trees drafted as a batch
    step = step_costs._drafter_step(engine, ids, features, context, repeats, batch=batch)
else:  # one tree drafter per row, each drafting its own tree, as the per-row decode loop ran them
    steps = [step_costs._drafter_step(engine, ids, features, context, repeats) for _ in range(batch)]
    step = lambda: [s() for s in steps]

def target_pass():  # what runs between two drafter steps in decoding (the tool's `before`)
    target.verify(flat([ids[context:context + step_costs.DRAFTER_AFTER_VERIFY]]))
    target.rollback([context])

times = []
for _ in range(repeats):
    target_pass()
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"fastest": min(times), "median": statistics.median(times)}))
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--before", required=True, metavar="DIR", help="the checkout before the change")
    p.add_argument("--after", default=str(Path(__file__).resolve().parents[1]), metavar="DIR",
                   help="the checkout after it (default: this one)")
    p.add_argument("--before-engine-dir", metavar="DIR",
                   help="the engine the before checkout runs (default: --engine-dir); for a "
                        "change to the graphs an engine exports, each checkout runs the engine "
                        "its own build_engine.py writes (same checkpoints)")
    p.add_argument("--backend", default="torch")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    engine_dir = str(Path(args.engine_dir).resolve())
    engines = {"before": str(Path(args.before_engine_dir or args.engine_dir).resolve()),
               "after": engine_dir}
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = {"before": args.before, "after": args.after}
    argv_of = {label: [engines[label], args.backend, str(args.batch), str(args.context), str(args.repeats)]
               for label in code}

    def report(r, label, run):
        print(f"  round {r}: {label} {run['fastest'] * 1e3:.1f} ms (fastest), "
              f"{run['median'] * 1e3:.1f} ms (median)", file=sys.stderr, flush=True)

    try:
        runs = interleaved(CHILD, code, argv_of, args.rounds, env, report)
    except ArmFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = {"command": "python scripts/tree_batch_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "engine": engine_dir, "before_engine": engines["before"], "backend": args.backend,
              "batch": args.batch,
              "context": args.context, "repeats": args.repeats, "rounds": args.rounds}
    for stat in ("fastest", "median"):
        before = statistics.median(run[stat] for run in runs["before"])
        after = statistics.median(run[stat] for run in runs["after"])
        result[stat] = {"before_ms": round(before * 1e3, 2), "after_ms": round(after * 1e3, 2),
                        "ratio": round(before / after, 2)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
