#!/usr/bin/env python3
"""One request at a time through a decoder, as the server's scheduler drives it (a join
with a prefill chunk, then steps until the row leaves), in two checkouts, each in a
process of its own, rounds interleaved: the decode path's share of a served
concurrency-1 figure, without Triton, the client or the network. Greedy, stop tokens
ignored; each child runs every mode of --modes in turn (default: SharpDraft beside its
peers, target-only and n-gram lookup); torch threads as the server sets them (--threads).

    python scripts/decode_ab.py --engine-dir engines/eagle3-torch --before /path/to/checkout \\
        --prompts-file results/loadtest-mixed/prompts.jsonl --rounds 3 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file, too
from scripts.checkout_ab import ArmFailed, add_checkout_arguments, interleaved  # noqa: E402

CHILD = r'''
import json, statistics, sys, time
import torch
engine_dir, modes, chunk, new, threads, requests = sys.argv[1], sys.argv[2].split(","), *map(int, sys.argv[3:7])
prompts = sys.argv[7]
torch.set_num_threads(threads)
from runtime.decode import Request
from runtime.engine import Engine
try:  # a checkout with the engine spec opens the engine through it
    from runtime.spec import open_spec
    engine = Engine(open_spec(engine_dir, backend="torch"))
except ImportError:  # one from before it
    engine = Engine(engine_dir, backend="torch")
ids = [engine.encode(json.loads(line)["text"]) for line in open(prompts)][:requests]

def one(decoder, prompt):
    start = time.perf_counter()
    join = decoder.join(Request(prompt=prompt, max_new_tokens=new), chunk or None)
    for _ in join:  # the prefill's parts, then the first token
        pass
    first = time.perf_counter() - start
    while decoder.active:
        decoder.step()
    return first, time.perf_counter() - start

out = {}
for mode in modes:
    decoder = engine.decoder(mode)
    one(decoder, ids[0][:32])  # warm-up
    runs = [one(decoder, p) for p in ids]
    out[mode] = {"ttft_ms": statistics.median(r[0] for r in runs) * 1e3,
                 "seconds": sum(r[1] for r in runs), "tokens": new * len(ids)}
print(json.dumps(out))
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    add_checkout_arguments(p)
    p.add_argument("--prompts-file", required=True, help="JSON lines with a 'text' field")
    p.add_argument("--modes", nargs="+", default=["sharpdraft", "target", "ngram"],
                   help="decoding modes, each in every child (default: SharpDraft and its peers)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="the server's default: 128")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="the file's first N prompts")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    engine_dir, prompts = str(Path(args.engine_dir).resolve()), str(Path(args.prompts_file).resolve())
    code = {"before": args.before, "after": args.after}
    child_argv = [engine_dir, ",".join(args.modes), str(args.prefill_chunk), str(args.max_new_tokens),
                  str(args.threads), str(args.requests), prompts]

    def report(r, label, run):
        print(f"  round {r}: {label} " + ", ".join(
            f"{mode} {m['tokens'] / m['seconds']:.2f} tok/s (TTFT {m['ttft_ms']:.0f} ms)"
            for mode, m in run.items()), file=sys.stderr, flush=True)

    try:
        runs = interleaved(CHILD, code, {label: child_argv for label in code}, args.rounds, report=report)
    except ArmFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = {"command": "python scripts/decode_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "engine": engine_dir, "modes": args.modes, "threads": args.threads, "runs": runs}
    for label, arm in runs.items():  # per mode, medians over the rounds
        result[label] = {mode: {"tokens_per_second": round(statistics.median(
                                    r[mode]["tokens"] / r[mode]["seconds"] for r in arm), 2),
                                "ttft_ms": round(statistics.median(r[mode]["ttft_ms"] for r in arm), 1)}
                         for mode in args.modes}
    result["ratio"] = {mode: round(result["after"][mode]["tokens_per_second"]
                                   / result["before"][mode]["tokens_per_second"], 3) for mode in args.modes}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("before", "after", "ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
