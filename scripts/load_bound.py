"""Where one served instance's time goes, one request at a time against eight at once, in
process: the serving scheduler itself (runtime/serve/scheduler.py, the default mode,
chunked prefill as served) without Triton, so the split between prefill and decode steps
is read directly rather than inferred from TTFT.

    python -m scripts.load_bound --engine-dir engines/dflash-sharpdraft \
        --prompts-file results/loadtest-mixed/prompts.jsonl --max-new-tokens 32 \
        --out results/loadtest-mixed/bound.json

Prefill does not batch (a prompt's tokens already fill the matrix multiplies), so however
cheap batched decoding gets, c8 throughput over c1 stays under
(prefill + decode alone) / prefill; the JSON records that ceiling beside the measured c8.
The peers (--peers, default target-only and n-gram lookup) run the same prompts the same
two ways in the same run, each request naming its mode, so the default's figures sit
beside theirs (`peers`, and `default_speedup`: a peer's wall time over the default's).
With --repeats R the default and the peers run in R interleaved rounds (default, peers,
default, peers, ...), so a drift in the machine's speed falls on every mode alike; each
figure is then the median over the rounds, and every round is kept under `rounds`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path


from runtime.placement import DTYPES, PREFILL_DTYPES
from runtime.modes import BACKENDS
from runtime.openmp import in_own_thread


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--prompts-file", required=True, help='JSONL of {"text": ...}')
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", choices=list(BACKENDS),
                   help="run with this backend instead of the one engine.json names")
    p.add_argument("--dtype", choices=DTYPES,
                   help="torch backend: weights and KV caches in this dtype (bfloat16 runs "
                        "its matrix multiplies on AMX where the CPU has it)")
    p.add_argument("--prefill-dtype", choices=PREFILL_DTYPES,
                   help="onnxruntime backend: prefill in bfloat16 matrix multiplies "
                        "(runtime/backends/bf16_prefill.py) instead of the float32 graphs")
    p.add_argument("--peers", nargs="*", default=["target", "ngram"], metavar="MODE",
                   help="modes measured beside the default, the same two ways (default: "
                        "target ngram; none: --peers with no mode)")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved rounds of the default and its peers; figures are "
                        "their medians")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def medians(runs: list[dict]) -> dict:
    """One run's figures as the median over `runs` (errors: all of them)."""
    merged = {}
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        if isinstance(value, list):
            merged[key] = sum(values, [])
        elif len(set(values)) == 1:
            merged[key] = value  # a count every round shares stays an integer
        else:
            merged[key] = round(statistics.median(values), 3)
    return merged


def one_at_a_time(engine, prompts, new_tokens, mode, sampling) -> dict:
    seconds = collections.Counter()
    start = time.perf_counter()
    outputs = []
    for ids in prompts:
        gen = engine.generate(ids, new_tokens, mode, sampling)
        seconds.update(gen.seconds)
        outputs.append(gen.tokens)
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 3), "tokens": sum(map(len, outputs)),
            "prefill_s": round(seconds["prefill"], 3),
            "decode_s": round(seconds["total"] - seconds["prefill"], 3)}, outputs


def concurrent(engine, prompts, new_tokens, concurrency, sampling, mode=None) -> dict:
    """The served scheduler with `concurrency` requests in flight, each naming `mode`
    (None: the served default for the batch it joins); its prefill turns and batch steps
    timed apart."""
    from runtime import decode
    from runtime.request import Request
    from runtime.serve import scheduler

    spent, rows = collections.Counter(), []
    real_step, real_prefill = decode.Decoder.step, scheduler.StepScheduler._prefill

    def step(self, aside=frozenset()):
        t = time.perf_counter()
        rows.append(len(self.active))
        try:
            return real_step(self, aside)
        finally:
            spent["steps"] += time.perf_counter() - t

    def prefill(self):
        t = time.perf_counter()
        try:
            return real_prefill(self)
        finally:
            spent["prefill"] += time.perf_counter() - t

    decode.Decoder.step, scheduler.StepScheduler._prefill = step, prefill
    outputs, errors, left = {}, [], list(range(len(prompts)))
    finished, lock = threading.Semaphore(0), threading.Lock()
    sched = scheduler.StepScheduler(engine, max_batch=concurrency)

    def submit():
        with lock:
            if not left:
                return
            i = left.pop(0)

        def done(gen, mode, i=i):
            outputs[i] = gen.tokens
            finished.release()
            submit()

        def failed(exc):
            errors.append(repr(exc))
            finished.release()

        sched.submit(Request(prompt=prompts[i], max_new_tokens=new_tokens, mode=mode, sampling=sampling,
                             stop_ids=engine.stop_ids, on_tokens=lambda t: None, on_done=done,
                             on_error=failed))

    try:
        start = time.perf_counter()
        for _ in range(concurrency):
            submit()
        for _ in prompts:
            finished.acquire()
        wall = time.perf_counter() - start
    finally:
        sched.close()
        decode.Decoder.step, scheduler.StepScheduler._prefill = real_step, real_prefill
    return {"wall_s": round(wall, 3), "tokens": sum(map(len, outputs.values())),
            "prefill_s": round(spent["prefill"], 3), "steps_s": round(spent["steps"], 3),
            "steps": len(rows), "mean_rows_per_step": round(sum(rows) / max(len(rows), 1), 2),
            "errors": errors}, [outputs[i] for i in sorted(outputs)]


def main(argv=None) -> int:
    args = parse(argv)
    if not Path(args.prompts_file).is_file():
        print(f"error: --prompts-file {args.prompts_file} does not exist", file=sys.stderr)
        return 2
    import torch

    from runtime.cli import code_commit
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.manifest import EngineError
    from runtime.sampling import Sampling

    torch.set_num_threads(args.threads)
    try:
        engine = in_own_thread(Engine, open_spec(args.engine_dir, backend=args.backend, dtype=args.dtype,
                               prefill_dtype=args.prefill_dtype))  # no pool left here
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    texts = [json.loads(line)["text"] for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    prompts = [engine.encode(texts[i % len(texts)]) for i in range(args.requests)]
    mode, greedy = engine.spec.default_mode, Sampling(0.0)
    unknown = [m for m in args.peers if m not in engine.spec.modes]
    if unknown:
        print(f"error: --peers {' '.join(unknown)}: not a mode of this engine "
              f"(it has {', '.join(map(str, engine.spec.modes))})", file=sys.stderr)
        return 2
    def both_ways(alone_mode, served_mode):
        """Sessions warmed, then the prompts one at a time (alone_mode) and all in flight
        through the scheduler (served_mode; None: the served default)."""
        in_own_thread(engine.generate, prompts[0], 4, alone_mode, greedy)
        return (*in_own_thread(one_at_a_time, engine, prompts, args.max_new_tokens, alone_mode,
                               greedy),
                *concurrent(engine, prompts, args.max_new_tokens, args.concurrency, greedy,
                            served_mode))

    modes = [None] + list(args.peers)  # None: the default
    runs = {m: ([], []) for m in modes}
    identical, n, reference = True, args.concurrency, None
    for r in range(args.repeats):
        for m in modes:
            one, alone, many, batched = both_ways(mode if m is None else m, m)
            # greedy: every mode, either way, commits the target's own tokens
            reference = alone if reference is None else reference
            identical = identical and alone == batched == reference
            runs[m][0].append(one)
            runs[m][1].append(many)
            print(f"round {r + 1}/{args.repeats} {m or 'default'}: c1 {one['wall_s']:.2f} s, "
                  f"c{n} {many['wall_s']:.2f} s", file=sys.stderr)
    c1, cn = medians(runs[None][0]), medians(runs[None][1])

    def median_ratio(tops, bottoms, field="wall_s"):
        return round(statistics.median(a["wall_s"] / b[field] for a, b in zip(tops, bottoms)), 3)

    ratio = median_ratio(*runs[None])
    ceiling = median_ratio(*runs[None], field="prefill_s")
    peers = {peer: {"c1": medians(runs[peer][0]), f"c{n}": medians(runs[peer][1]),
                    "throughput_ratio": median_ratio(*runs[peer])} for peer in args.peers}
    report = {
        "command": "python -m scripts.load_bound " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": code_commit(),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "torch_threads": args.threads,
                    "python": platform.python_version(), "torch": torch.__version__},
        "engine_dir": args.engine_dir, "backend": engine.backend,
        "dtype": args.dtype or engine.manifest.dtype,
        "prefill_dtype": args.prefill_dtype or "float32", "mode_alone": str(mode), "requests": args.requests,
        "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.max_new_tokens,
        "c1": c1, f"c{args.concurrency}": cn,
        "throughput_ratio": ratio,
        "prefill_share_c1": round(c1["prefill_s"] / c1["wall_s"], 3),
        # decode free: c1's whole time over the prefill alone (which no batch shares)
        "ceiling_if_decode_were_free": ceiling,
        "peers": peers,
        # a peer's wall time over the default's in the same round, one at a time and at
        # the concurrency (median over the rounds)
        "default_speedup": {peer: {"c1": median_ratio(runs[peer][0], runs[None][0]),
                                   f"c{n}": median_ratio(runs[peer][1], runs[None][1])}
                            for peer in args.peers},
        "tokens_identical": identical,
        "repeats": args.repeats,
        "rounds": [{m or "default": {"c1": runs[m][0][r], f"c{n}": runs[m][1][r]}
                    for m in modes} for r in range(args.repeats)],
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"c1 {c1['wall_s']:.2f} s (prefill {c1['prefill_s']:.2f}), c{args.concurrency} "
          f"{cn['wall_s']:.2f} s (prefill {cn['prefill_s']:.2f}, steps {cn['steps_s']:.2f}, "
          f"{cn['mean_rows_per_step']} rows a step): {ratio:.2f}x; ceiling {ceiling:.2f}x; "
          f"tokens identical: {report['tokens_identical']}")
    return 0 if identical and not cn["errors"] and not any(
        v[f"c{args.concurrency}"]["errors"] for v in peers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
