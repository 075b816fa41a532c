"""`python -m runtime overhead`: what SharpDraft adds to a drafter step. The SharpDraft
drafter and the frozen one run the same step on the same backend, in the same process,
interleaved A/B at fixed context lengths; medians and their ratio go to stdout.

    python -m runtime overhead --engine-dir engines/dflash-sharpdraft --context 512 4096
"""

from __future__ import annotations

import json
import statistics
import time

from runtime.backends import RUNNABLE_BACKENDS
from runtime import families
from runtime.cli import UsageError, progress
from runtime.modes import Mode


def add_parser(subparsers):
    p = subparsers.add_parser("overhead", help="drafter step time with SharpDraft vs frozen")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS,
                   help="run with this backend instead of the one engine.json names")
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096], metavar="N",
                   help="context tokens in the drafter's cache before the timed step")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per drafter and context")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, metavar="N",
                   help="intra-op threads for torch and ONNX Runtime (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true")
    return p


def _time_step(drafter, context, bonus: int) -> tuple[float, int]:
    start = time.perf_counter()
    _, visible = drafter.draft([context], [bonus])
    return time.perf_counter() - start, int(visible[0])


def measure(engine, context: int, repeats: int, warmup: int) -> dict:
    """Median step time of both drafters, each a batch of one whose row holds `context`
    tokens and reads one more per step (the target's features of seeded random tokens:
    token values do not change the work a step does). N is the first step's (each step
    after it sees one key more)."""
    import torch

    steps = warmup + repeats
    drafters = {Mode.SHARPDRAFT: engine.drafter(), Mode.FROZEN: engine.drafter(scaled=False)}
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, engine.tokenizer.vocab_size, (context + steps,), generator=gen).tolist()
    _, features = engine.loaded.batch_target().add(ids, context + steps)
    bonus = 0
    held = {}
    for name, drafter in drafters.items():  # fill its row to `context` tokens
        held[name] = drafter.add(context + steps + drafter.block_size, features[:context], bonus)
    times = {name: [] for name in drafters}
    visible = {}
    for i in range(steps):
        # Alternate who goes first so drift (thermal, other jobs) hits both alike.
        order = list(drafters) if i % 2 == 0 else list(reversed(drafters))
        for name in order:
            step = features[context + i:context + i + 1]
            if i == 0:  # what its prefill held back for the first draft (none, fused)
                step = torch.cat([held[name], step])
            seconds, n = _time_step(drafters[name], step, bonus)
            visible.setdefault(name, n)
            if i >= warmup:
                times[name].append(seconds)
    sharp, frozen = (statistics.median(times[n]) * 1e3 for n in (Mode.SHARPDRAFT, Mode.FROZEN))
    n = visible[Mode.SHARPDRAFT]
    return {"context": context, "visible_keys": n,
            "beta": round(engine.scaling.beta(n), 6),
            "sharpdraft_ms": round(sharp, 4), "frozen_ms": round(frozen, 4),
            "ratio": round(sharp / frozen, 4)}


def run(args) -> int:
    from runtime.engine import Engine
    from runtime.spec import open_spec

    if args.repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats must be >= 1 and --warmup >= 0")
    if any(c < 1 for c in args.context):
        raise UsageError(f"--context lengths must be >= 1, got {args.context}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)  # ONNX Runtime sessions follow torch's count
    engine = Engine(open_spec(args.engine_dir, backend=args.backend))
    if families.drafts_from_ids(engine.style):
        raise UsageError(f"{args.engine_dir}: overhead times DFlash block steps; a "
                         f"{engine.manifest.drafter} engine's step is not timed by it yet")
    if engine.scaling is None:
        raise UsageError(f"{args.engine_dir} was built without --sharpdraft: there is no "
                         "SharpDraft drafter to compare")
    onnx = engine.manifest.extra.get("onnx") or {}
    attention = onnx.get("attention") if engine.backend in ("onnxruntime", "tensorrt") else "reference op"
    import torch

    progress(f"drafter step, SharpDraft vs frozen: backend {engine.backend} ({attention}), "
             f"{torch.get_num_threads()} thread(s), {args.repeats} interleaved repeats after "
             f"{args.warmup} warm-up")
    rows = []
    for context in args.context:
        progress(f"  context {context} ...")
        rows.append(measure(engine, context, args.repeats, args.warmup))
    if args.json:
        print(json.dumps({"engine": str(engine.dir), "backend": engine.backend,
                          "attention": attention, "threads": torch.get_num_threads(),
                          "repeats": args.repeats, "results": rows}))
        return 0
    print(f"{'context':>8} {'N':>7} {'beta':>7} {'sharpdraft ms':>14} {'frozen ms':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['context']:>8} {r['visible_keys']:>7} {r['beta']:>7.4f} "
              f"{r['sharpdraft_ms']:>14.3f} {r['frozen_ms']:>10.3f} {r['ratio']:>7.3f}")
    return 0
