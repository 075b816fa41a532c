#!/usr/bin/env python3
"""Does the compiled torch path (runtime/backends/pytorch/compiled.py, inductor on CPU) decode faster than
the eager torch roles and ONNX Runtime's? Median milliseconds of the target's 1-token
decode step and of a block-wide verify step, after a prompt of --context tokens, the
three backends alternating step by step so machine load hits them alike.

    python -m scripts.compiled_cpu_ab --target DIR [--engine-dir ORT_ENGINE] [--context 1024]

--engine-dir: an onnxruntime engine over the same target (build_engine.py --backend
onnxruntime); without it the ONNX Runtime column is left out. One JSON object on stdout,
with the command and the machine's load average (a loaded machine's figures are not
results); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path



def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.compiled_cpu_ab", description=__doc__.splitlines()[0])
    p.add_argument("--target", metavar="DIR", help="transformers directory (default: the default target)")
    p.add_argument("--engine-dir", metavar="DIR", help="an onnxruntime engine over the same target")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--width", type=int, default=8, help="verify rows (the DFlash block)")
    p.add_argument("--steps", type=int, default=24, help="timed steps per backend and width")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                   help="the compiled column's backend (eager: dynamo alone, a dry run of the "
                        "plumbing in seconds; its times are not inductor's)")
    args = p.parse_args(argv)

    import torch

    from build.checkpoints import prepare_target
    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.backends.roles import TokenRows
    from runtime.backends.pytorch.compiled import EngineSteps
    from runtime.models.target import ModelError, load_target

    try:
        target_dir, _ = prepare_target(args.target, progress=lambda m: print(m, file=sys.stderr))
        model, _ = load_target(target_dir)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    prompt = [(17 * i + 5) % model.config.vocab_size for i in range(args.context)]
    capacity = args.context + 4 * args.steps * (args.width + 1) + args.width
    # the compiled role as a loaded engine hands it out: over the engine's shared steps;
    # each a batch target holding one sequence, as a request alone runs
    steps = EngineSteps(model, widths=(1, args.width), backend=args.compiler)
    roles = {"torch eager": TorchBatchTarget(model),
             f"torch compiled ({args.compiler})": steps.batch_target()}
    if args.engine_dir:
        from runtime.engine import Engine
        from runtime.spec import open_spec

        roles["onnxruntime"] = Engine(open_spec(args.engine_dir, backend="onnxruntime")).loaded.batch_target()
    for name, role in roles.items():
        start = time.perf_counter()
        role.add(prompt, capacity)
        for width in (1, args.width):  # compiles (or warms up) each step shape
            role.verify(TokenRows.of([[1] * width]))
            role.rollback([args.context])
        print(f"{name}: prefill and warm-up {time.perf_counter() - start:.1f} s", file=sys.stderr)
    times = {(name, w): [] for name in roles for w in (1, args.width)}
    for _ in range(args.steps):
        for width in (1, args.width):
            for name, role in roles.items():
                start = time.perf_counter()
                role.verify(TokenRows.of([[1] * width]))
                times[name, width].append((time.perf_counter() - start) * 1e3)
                role.rollback([args.context])
    result = {"command": " ".join(["python -m scripts.compiled_cpu_ab"] + (argv or sys.argv[1:])),
              "load_average": os.getloadavg(), "threads": torch.get_num_threads(),
              "context": args.context,
              "median_ms": {f"{name}, {w} token(s)": round(statistics.median(v), 2)
                            for (name, w), v in times.items()}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
