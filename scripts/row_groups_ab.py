#!/usr/bin/env python3
"""One batched step of an ONNX Runtime engine's target with its rows grouped two ways:
every capacity in its own power-of-two group, and capacities up to a shared size in one
(runtime/step_metadata.py: row_group, SHARED_CAPACITY). The rows are prompts of the given
lengths, each with room for --new-tokens; per grouping and step width (a decode step, a
verify of several tokens), the median over --repeats interleaved steps.

    python -m scripts.row_groups_ab --engine-dir engines/dflash-sharpdraft \\
        --lengths 100 200 300 400 100 200 300 400 --shared 256 1024 \\
        --out results/row-groups.json

--shared 256 groups these rows as capacity_bucket alone would (only the shortest rows'
capacities are below it), 1024 is the default (SHARED_CAPACITY); the logits of every
grouping are checked equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path



def main(argv=None) -> int:
    from runtime.cli import run

    return run(_main, list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[100, 200, 300, 400] * 2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--shared", type=int, nargs="+", default=[256, 1024],
                   help="the shared capacities to compare (each a power of two)")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4],
                   help="tokens per row of the step (1: a decode step)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from runtime import step_metadata
    from runtime.backends.roles import TokenRows
    from runtime.cli import UsageError, code_commit
    from runtime.engine import Engine
    from runtime.spec import open_spec

    if any(s < 1 or s & (s - 1) for s in args.shared):
        raise UsageError(f"--shared takes powers of two, got {args.shared}")
    torch.set_num_threads(args.threads)
    engine = Engine(open_spec(args.engine_dir))  # a bad engine: one line and exit 1 (runtime.cli.run)
    if engine.backend != "onnxruntime":
        raise UsageError(f"{args.engine_dir} runs on {engine.backend}; this compares ONNX "
                         "Runtime's row groups")
    g = torch.Generator().manual_seed(0)
    vocab = len(engine.tokenizer)

    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    prompts = [ids(n) for n in args.lengths]
    batches = {}
    for shared in args.shared:  # each grouping's batch, its rows prefilled once
        step_metadata.SHARED_CAPACITY = shared  # row_group reads it as each row joins
        batch = engine.loaded.batch_target()
        for prompt in prompts:
            batch.add(prompt, len(prompt) + args.new_tokens)
        batches[shared] = batch
    times = {(s, w): [] for s in args.shared for w in args.widths}
    for r in range(args.repeats):
        for w in args.widths:
            rows = TokenRows.of([ids(w) for _ in prompts])
            order = args.shared if r % 2 == 0 else args.shared[::-1]
            logits = {}
            for shared in order:
                batch = batches[shared]
                lengths = list(batch.lengths)
                start = time.perf_counter()
                logits[shared], _ = batch.verify(rows)
                times[shared, w].append(time.perf_counter() - start)
                batch.rollback(lengths)
            first = logits[args.shared[0]]
            for shared, out in logits.items():
                torch.testing.assert_close(out, first, atol=1e-4, rtol=0)
        print(f"repeat {r + 1}/{args.repeats}", file=sys.stderr)
    rows = [{"shared_capacity": s, "tokens_per_row": w,
             "groups": len(batches[s].groups),
             "group_capacities": sorted(grp.cache.capacity for grp in batches[s].groups),
             "step_ms_median": round(1000 * statistics.median(times[s, w]), 2),
             "step_ms": [round(1000 * t, 2) for t in times[s, w]]}
            for w in args.widths for s in args.shared]
    record = {"command": "python -m scripts.row_groups_ab " + " ".join(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": code_commit(),
              "machine": f"{platform.machine()}, {args.threads} threads",
              "engine_dir": args.engine_dir, "lengths": args.lengths,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for row in rows:
        print(f"width {row['tokens_per_row']}, shared up to {row['shared_capacity']}: "
              f"{row['groups']} group(s) {row['group_capacities']}, "
              f"{row['step_ms_median']:.1f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
