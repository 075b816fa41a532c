#!/usr/bin/env python3
"""`generate` in two checkouts, interleaved, at batch 1 and batch B: the decode loop's and the
backends' cost before and after a change, every mode beside target-only and n-gram lookup.
Each child (its own process, its own code: scripts/checkout_ab.py) opens the engine, then
per mode decodes the prompts one at a time (Engine.generate, a batch of one) and together
(Decoder.run, one row each); greedy, stop tokens ignored. It also reports a digest of
every mode's tokens, so the run shows whether the change left outputs unchanged.

    python -m scripts.generate_ab --engine-dir engines/dflash-sharpdraft --before /path/to/old \\
        --out results/generate-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file, too
from runtime.manifest import MANIFEST  # noqa: E402
from runtime.modes import Mode  # noqa: E402
from scripts.checkout_ab import ArmFailed, add_checkout_arguments, interleaved  # noqa: E402

CHILD = r'''
import hashlib, json, sys, time
import torch
engine_dir, modes, context, new, batch, adaptive, threads = sys.argv[1], sys.argv[2].split(","), *map(int, sys.argv[3:8])
torch.set_num_threads(threads)
from runtime.commands.documents import default_documents, tokenized
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
engine = Engine(open_spec(engine_dir))
docs = tokenized(engine.encode, default_documents("eval", batch), context)
prompts = [ids[:context] for _, ids in docs]
prompts = (prompts * batch)[:batch]
engine.generate(prompts[0][:32], 4, modes[0], stop=False)  # warm-up
out = {}
for mode in modes:
    digest = hashlib.sha256()
    start = time.perf_counter()
    for p in prompts[:1]:  # batch 1: the first prompt alone
        digest.update(json.dumps(engine.generate(p, new, mode, stop=False, adaptive=bool(adaptive)).tokens).encode())
    alone = time.perf_counter() - start
    requests = [Request(prompt=p, max_new_tokens=new) for p in prompts]
    start = time.perf_counter()
    done = engine.decoder(mode, bool(adaptive)).run(requests)
    together = time.perf_counter() - start
    for seq in done:
        digest.update(json.dumps(seq.gen.tokens).encode())
    out[mode] = {"batch1_tok_s": new / alone, f"batch{batch}_tok_s": sum(len(s.gen.tokens) for s in done) / together,
                 "tokens_sha256": digest.hexdigest()[:16]}
print(json.dumps(out))
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    add_checkout_arguments(p)
    p.add_argument("--modes", nargs="+",
                   default=[str(m) for m in (Mode.TARGET, Mode.NGRAM, Mode.FROZEN, Mode.SHARPDRAFT)])
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each evaluation document")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--fixed-policy", action="store_true",
                   help="verify every draft every step (no step costs): the loop alone")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    engine_dir = str(Path(args.engine_dir).resolve())
    if not (Path(engine_dir) / MANIFEST).is_file():
        print(f"error: {args.engine_dir} has no {MANIFEST}", file=sys.stderr)
        return 2
    code = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    child_argv = [engine_dir, ",".join(args.modes), str(args.context), str(args.max_new_tokens),
                  str(args.batch), str(int(not args.fixed_policy)), str(args.threads)]
    keys = ("batch1_tok_s", f"batch{args.batch}_tok_s")

    def report(r, label, run):
        print(f"  round {r}: {label} " + ", ".join(
            f"{mode} {m[keys[0]]:.2f}/{m[keys[1]]:.2f} tok/s" for mode, m in run.items()),
            file=sys.stderr, flush=True)

    try:
        runs = interleaved(CHILD, code, {label: child_argv for label in code}, args.rounds, report=report)
    except ArmFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = {"command": "python -m scripts.generate_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
              "engine": engine_dir, "load_average_at_end": os.getloadavg(), "runs": runs}
    for label, arm in runs.items():  # medians over the rounds
        result[label] = {mode: {key: round(statistics.median(r[mode][key] for r in arm), 3) for key in keys}
                         for mode in args.modes}
    result["ratio_after_over_before"] = {
        mode: {key: round(result["after"][mode][key] / result["before"][mode][key], 3) for key in keys}
        for mode in args.modes}
    result["same_tokens"] = {mode: len({r[mode]["tokens_sha256"] for arm in runs.values() for r in arm}) == 1
                             for mode in args.modes}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("ratio_after_over_before", "same_tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
