#!/usr/bin/env python3
"""Decode speed of one engine under two step-cost tables: its own (engine.json) against
another build's (--costs-from, e.g. the engine.json of a build before a change to
runtime/step_costs.py), everything else equal. Per document and context: one prefill,
then target-only and each mode under each table, interleaved (the order alternates per
repeat); every run must be token-identical to target-only. Prints, per context, mode
and table, the median speed-up over target-only of the same round and the mean MAL.

    python -m scripts.ab_step_costs --engine-dir engines/dflash-sharpdraft \
        --costs-from old-engine.json --lengths 512 4096 7680
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


from runtime.modes import Mode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--costs-from", required=True, metavar="ENGINE_JSON",
                   help="the engine.json whose step costs (same backend) to compare against")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 7680])
    p.add_argument("--modes", nargs="+", default=[Mode.SHARPDRAFT, Mode.HYBRID])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--docs", nargs="+", metavar="FILE",
                   help="text files (default: the evaluation split's --max-docs longest)")
    p.add_argument("--max-docs", type=int, default=3)
    args = p.parse_args(argv)

    from runtime.cli import UsageError
    from runtime.measure import decode_from_one_prefill
    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.step_costs import StepCosts

    try:
        engine = Engine(open_spec(args.engine_dir))
        other = json.loads(Path(args.costs_from).read_text()).get("extra", {}).get(
            "step_costs", {}).get(engine.backend)
        if other is None or engine.step_costs is None:
            raise UsageError(f"{args.costs_from} and {args.engine_dir} must both hold step "
                             f"costs for {engine.backend}")
        drafting = [m.value for m in engine.spec.modes if m != Mode.TARGET]
        if any(m not in drafting for m in args.modes):
            raise UsageError(f"--modes: pick from {drafting}")
        docs = tokenized(engine.encode, args.docs or default_documents("eval", args.max_docs),
                         max(args.lengths))
    except (UsageError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tables = {"own": engine.step_costs, "other": StepCosts.from_dict(other)}
    print(f"own   {tables['own']}\nother {tables['other']}", flush=True)
    rows: dict = {}
    for n in args.lengths:
        for name, ids in docs:
            for r in range(args.repeats):
                for label in (("own", "other") if r % 2 == 0 else ("other", "own")):
                    engine.step_costs = tables[label]
                    gens = decode_from_one_prefill(engine, ids[:n], args.new_tokens,
                                                   (Mode.TARGET, *args.modes), 1, rotation=r)
                    target = gens[Mode.TARGET][0]
                    decode = target.seconds["total"] - target.seconds["prefill"]
                    for mode in args.modes:
                        g = gens[mode][0]
                        if g.tokens != target.tokens:
                            print(f"error: {mode} under the {label} costs differs from "
                                  f"target-only at {n} tokens of {name}", file=sys.stderr)
                            return 1
                        x = decode / (g.seconds["total"] - g.seconds["prefill"])
                        rows.setdefault((n, mode, label), []).append((x, g.mean_accepted_length))
            print(f"  {n} tokens: {name} done", file=sys.stderr, flush=True)
    print(f"{'context':>7} {'mode':10} {'costs':5} {'x target (median)':>17} {'MAL':>6}  runs")
    for (n, mode, label), v in sorted(rows.items()):
        print(f"{n:7d} {mode:10} {label:5} {statistics.median(x for x, _ in v):17.3f} "
              f"{statistics.fmean(m for _, m in v):6.3f}  {len(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
