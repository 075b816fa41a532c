"""Is greedy decoding still lossless in another backend or dtype? For each configuration
(backend:dtype, or backend:dtype:prefill-dtype for --prefill-dtype), every prompt decoded greedily in each mode one at a time and all in
flight through the serving scheduler (scripts/load_bound.py's two ways, chunked prefill
as served), each compared token for token with target-only one at a time in that same
configuration. One process, configurations run one after another.

    python -m scripts.dtype_lossless --engine-dir engines/dflash-sharpdraft \\
        --prompts-file results/loadtest-mixed/prompts.jsonl \\
        --config onnxruntime:float32 torch:float32 torch:bfloat16 \\
        --out results/lossless-dtype.json

Each configuration's target-only tokens are also compared with the first
configuration's (`target_vs_first`): not a losslessness check (another dtype is
another target) but how far the tokens drift from it.

A speculative mode commits the target's own argmax, so any difference is the target's
arithmetic giving different logits for the same position when it is computed another
way: in a verify pass of several tokens instead of one, in a batch of rows, or after a
prefill in chunks. In float32 those differences stay below the gaps between logits; in
bfloat16 they do not. Exit status 1 when any configuration differs anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from runtime.placement import DTYPES, PREFILL_DTYPES
from runtime.modes import BACKENDS, Mode
from runtime.openmp import in_own_thread


def load_bound():
    from scripts import load_bound

    return load_bound


def differences(reference: list[list[int]], outputs: list[list[int]]) -> list[dict]:
    """Prompts whose tokens differ from the reference's, each with the first position
    that differs (a shorter output that is a prefix differs where it ends)."""
    found = []
    for i, (want, got) in enumerate(zip(reference, outputs)):
        if want != got:
            at = next((p for p, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            found.append({"prompt": i, "first_token": at})
    return found


def split_config(config: str) -> tuple[str, str, str | None]:
    """BACKEND:DTYPE[:PREFILL_DTYPE] -> (backend, dtype, prefill dtype or None)."""
    backend, _, rest = config.partition(":")
    dtype, _, prefill = rest.partition(":")
    return backend, dtype, prefill or None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--prompts-file", required=True, help='JSONL of {"text": ...}')
    p.add_argument("--config", nargs="+", default=["onnxruntime:float32"],
                   metavar="BACKEND:DTYPE[:PREFILL_DTYPE]")
    p.add_argument("--modes", nargs="+", default=[Mode.TARGET, Mode.WINDOW_HYBRID, Mode.SHARPDRAFT])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for config in args.config:
        backend, dtype, prefill = split_config(config)
        if backend not in BACKENDS or dtype not in DTYPES or prefill not in (None,) + PREFILL_DTYPES:
            p.error(f"--config {config}: expected BACKEND:DTYPE[:PREFILL_DTYPE], BACKEND one of "
                    f"{', '.join(BACKENDS)}, DTYPE one of {', '.join(DTYPES)}, PREFILL_DTYPE one "
                    f"of {', '.join(PREFILL_DTYPES)}")
    if Mode.TARGET not in args.modes:
        args.modes = [Mode.TARGET] + args.modes  # the reference
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from runtime.cli import UsageError, code_commit
    from runtime.commands.loadtest import read_prompts
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.manifest import EngineError
    from runtime.sampling import Sampling

    try:
        texts = read_prompts(args.prompts_file)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    lb, greedy = load_bound(), Sampling(0.0)
    results, first = [], None
    for config in args.config:
        backend, dtype, prefill = split_config(config)
        try:
            engine = in_own_thread(Engine, open_spec(args.engine_dir, backend=backend, dtype=dtype,
                                   prefill_dtype=prefill))  # no pool left on this thread
        except EngineError as exc:
            print(f"error: --config {config}: {exc}", file=sys.stderr)
            return 2
        unknown = [m for m in args.modes if m not in engine.spec.modes]
        if unknown:
            print(f"error: --modes {' '.join(unknown)}: not a mode of this engine", file=sys.stderr)
            return 2
        prompts = [engine.encode(texts[i % len(texts)]) for i in range(args.requests)]
        # off the main thread, as load_bound runs them (runtime/openmp.py says why)
        in_own_thread(engine.generate, prompts[0], 4, Mode.TARGET, greedy)  # warm
        one, reference = in_own_thread(lb.one_at_a_time, engine, prompts, args.max_new_tokens,
                                       Mode.TARGET, greedy)
        first = first or (config, reference)
        row = {"backend": backend, "dtype": dtype, "prefill_dtype": prefill or "float32",
               "target_alone_prefill_s": one["prefill_s"], "target_alone_decode_s": one["decode_s"],
               "target_vs_first": {"config": first[0], "differ": differences(first[1], reference)},
               "modes": {}}
        for mode in args.modes:
            alone = reference if mode == Mode.TARGET else in_own_thread(
                lb.one_at_a_time, engine, prompts, args.max_new_tokens, mode, greedy)[1]
            many, batched = lb.concurrent(engine, prompts, args.max_new_tokens, args.concurrency,
                                          greedy, mode)
            row["modes"][mode] = {"alone": differences(reference, alone),
                                  f"c{args.concurrency}": differences(reference, batched),
                                  "errors": many["errors"]}
            print(f"{config} {mode}: differ alone {len(row['modes'][mode]['alone'])}, "
                  f"c{args.concurrency} {len(row['modes'][mode][f'c{args.concurrency}'])} "
                  f"of {len(prompts)}", file=sys.stderr)
        results.append(row)
        del engine
    lossless = all(not any(m["alone"] or m[f"c{args.concurrency}"] or m["errors"]
                           for m in r["modes"].values()) for r in results)
    report = {
        "command": "python -m scripts.dtype_lossless " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": code_commit(),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "torch_threads": args.threads, "python": platform.python_version(),
                    "torch": torch.__version__},
        "engine_dir": args.engine_dir, "requests": args.requests,
        "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
        "reference": "target-only, one request at a time, in the same configuration",
        "configs": results, "lossless": lossless,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for r in results:
        worst = max(len(m[k]) for m in r["modes"].values() for k in m if k != "errors")
        print(f"{r['backend']} {r['dtype']} (prefill {r['prefill_dtype']}): {'lossless' if worst == 0 else f'up to {worst} of {args.requests} prompts differ'}; "
              f"target-only alone: prefill {r['target_alone_prefill_s']:.2f} s, decode {r['target_alone_decode_s']:.2f} s")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
