#!/usr/bin/env python3
"""Decode speed of engines side by side: the same prompt, one prefill per engine and
context (runtime.backends.PrefillOnce), then greedy runs interleaved across engines,
median tok/s (prefill excluded) of --repeats runs each.

    python -m scripts.bench_backends --engine torch=engines/torch \
        --engine ort=engines/ort --contexts 512 4096 7680 --modes target

An engine is NAME=DIR, or NAME=DIR@BACKEND to run an engine directory on another
backend. Prompts are the first N tokens of the first evaluation-split document.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path


from runtime.commands.provenance import provenance
from runtime.modes import Mode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", required=True, metavar="NAME=DIR[@BACKEND]")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 7680])
    p.add_argument("--modes", nargs="+", default=[Mode.TARGET.value],
                   choices=[m.value for m in Mode])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from runtime.backends import PrefillOnce
    from runtime.commands.documents import default_documents
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engines = {}
    for spec in args.engine:
        name, _, rest = spec.partition("=")
        path, _, backend = rest.partition("@")
        engines[name] = Engine(open_spec(path, backend=backend or None))
    first = next(iter(engines.values()))
    doc = default_documents("eval", 1)[0]
    ids = first.encode(doc.read_text(encoding="utf-8"))
    print(f"document {doc.name}: {len(ids)} tokens; threads {args.threads}", file=sys.stderr)

    rows = []
    for context in args.contexts:
        prompt = ids[:context]
        onces = {}
        for name, engine in engines.items():
            onces[name] = PrefillOnce(engine.loaded.batch_target(), prompt, len(prompt))
        for mode in args.modes:
            speeds = {name: [] for name in engines}
            tokens = {}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    gen = engine.generate(prompt, args.new_tokens, mode, stop=False, target=onces[name])
                    speeds[name].append(gen.tokens_per_second)
                    tokens.setdefault(name, gen.tokens)
            reference = next(iter(tokens.values()))
            for name in engines:
                row = {"context": context, "mode": mode, "engine": name,
                       "tok_s_median": round(statistics.median(speeds[name]), 2),
                       "tok_s_runs": [round(s, 2) for s in speeds[name]],
                       "same_tokens_as_first": tokens[name] == reference}
                rows.append(row)
                print(f"context {context:5d} {mode:10s} {name:12s} "
                      f"{row['tok_s_median']:6.2f} tok/s  runs {row['tok_s_runs']}  "
                      f"same tokens: {row['same_tokens_as_first']}", flush=True)
    if args.json:
        line = shlex.join(["python", "-m", "scripts.bench_backends", *(sys.argv[1:] if argv is None else argv)])
        Path(args.json).write_text(json.dumps({**provenance("bench_backends", line), "args": vars(args),
                                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
