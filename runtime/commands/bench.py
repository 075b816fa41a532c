"""`python -m runtime bench`: mean accepted length (MAL) and speed against context length.

For each context length, the first N tokens of each document are prefilled ONCE; from
that same prefill the engine then decodes three ways -- target-only, frozen drafter,
SharpDraft drafter -- greedily (or with lossless sampling, --temperature), and the rows
report MAL, tokens/s, speedup over target-only, how often beta > 1 and, for greedy runs,
whether all three produced the same tokens.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

from runtime.backends import RUNNABLE_BACKENDS
from runtime.cli import UsageError, progress
from runtime.engine import MODES
from runtime.metrics import pooled_mean_accepted_length, pooled_tokens_per_second

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 7680)


def add_parser(sub):
    p = sub.add_parser("bench", help="MAL and tokens/s vs context length: target-only, frozen, "
                                     "SharpDraft from the same prefill")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--docs", nargs="+", metavar="FILE", help="text files (default: the 3 longest "
                                                               "evaluation-split stdlib files)")
    p.add_argument("--max-docs", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: lossless speculative sampling instead of greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the same seed starts every run")
    p.add_argument("--json", metavar="OUT", help="write the results object here ('-': stdout)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--verify", action="store_true",
                   help="hash every file the engine depends on (default: size/mtime stamp)")
    p.add_argument("--debug", action="store_true")


def check_args(args, context_limit: int) -> None:
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    bad = [n for n in args.lengths if n < 1 or n + args.new_tokens > context_limit]
    if bad:
        raise UsageError(f"context length(s) {bad} do not fit: each length + --new-tokens "
                         f"({args.new_tokens}) must be within the target's {context_limit}")


def run_three_ways(engine, prompt: list[int], new_tokens: int, order,
                   sampling=None) -> dict:
    """Decoding three ways from one prefill of `prompt` (greedy unless `sampling`)."""
    from runtime import speculative
    from runtime.backends import PrefillOnce
    from runtime.sampling import Sampler, Sampling

    sampling = sampling or Sampling()
    once = PrefillOnce(engine.target, prompt, len(prompt) + new_tokens)
    gens = {}
    for mode in order:
        if mode == "target":
            gens[mode] = speculative.generate_target_only(once, prompt, new_tokens, Sampler(sampling))
        else:
            gens[mode] = speculative.generate_block(once, engine.drafter(frozen=mode == "frozen"),
                                                    prompt, new_tokens, Sampler(sampling))
    return gens


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(context: int, runs: list[dict], greedy: bool = True) -> dict:
    """Pool the documents of one context length: MAL = tokens / verify steps overall."""
    row = {"context_tokens": context, "documents": len(runs)}
    for mode in ("frozen", "sharpdraft"):
        row[f"mal_{mode}"] = round(pooled_mean_accepted_length([r[mode] for r in runs]), 4)
    for mode in MODES:
        row[f"tok_s_{mode}"] = round(pooled_tokens_per_second([r[mode] for r in runs]), 3)
    for mode in ("frozen", "sharpdraft"):
        row[f"speedup_{mode}"] = round(row[f"tok_s_{mode}"] / row["tok_s_target"], 4)
    betas = [b for r in runs for b in r["sharpdraft"].beta_per_step]
    row["beta_above_1_fraction"] = round(sum(b > 1 for b in betas) / len(betas), 4) if betas else 0.0
    row["beta_mean"] = round(statistics.fmean(betas), 4) if betas else 1.0
    row["mal_per_document"] = {m: [round(r[m].mean_accepted_length, 3) for r in runs]
                               for m in ("frozen", "sharpdraft")}
    if greedy:  # sampled runs draw different tokens by design; only greedy must agree
        row["identical_to_target"] = {
            m: [first_difference(r[m].tokens, r["target"].tokens) is None for r in runs]
            for m in ("frozen", "sharpdraft")}
        row["first_divergence"] = {
            m: [first_difference(r[m].tokens, r["target"].tokens) for r in runs]
            for m in ("frozen", "sharpdraft")}
    return row


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["context_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(x, [r["mal_frozen"] for r in rows], "o-", color="tab:gray", label="MAL, frozen drafter")
    ax.plot(x, [r["mal_sharpdraft"] for r in rows], "o-", color="tab:blue", label="MAL, SharpDraft")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens (prefill)")
    ax.set_ylabel("mean accepted length (tokens / verify)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r["speedup_frozen"] for r in rows], "s--", color="tab:gray", alpha=0.6,
             label="speedup, frozen")
    ax2.plot(x, [r["speedup_sharpdraft"] for r in rows], "s--", color="tab:blue", alpha=0.6,
             label="speedup, SharpDraft")
    ax2.set_ylabel("decode speedup over target-only")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="best")
    scaling = result.get("query_scaling") or {}
    ax.set_title(f"{result['target']} + DFlash drafter (trained at {result.get('training_max_length')}"
                 f" tokens); beta ref_keys={scaling.get('ref_keys')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def training_max_length(engine) -> int | None:
    from runtime.models.dflash import read_dflash_config

    return read_dflash_config(engine.manifest.drafter_dir).training_max_length


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__}


def run(args) -> int:
    from tqdm import tqdm

    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.sampling import Sampling

    engine = Engine(args.engine_dir, backend=args.backend, verify="full" if args.verify else "quick")
    if engine.scaling is None:
        raise UsageError(f"{args.engine_dir} was built without --sharpdraft; bench compares the "
                         "frozen and SharpDraft drafters of one engine")
    check_args(args, engine.context_limit)
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    paths = args.docs or default_documents("eval", args.max_docs)
    docs = tokenized(engine.encode, paths, max(args.lengths))
    progress(f"bench: {len(docs)} document(s) {[name for name, _ in docs]}, lengths "
             f"{args.lengths}, {args.new_tokens} new tokens, backend {engine.backend}")
    # Untimed warm-up of all three paths: first calls pay one-off costs (lazy imports,
    # allocator growth) that would otherwise land on whichever run comes first.
    run_three_ways(engine, docs[0][1][:min(64, max(args.lengths))], 4, MODES)
    rows = []
    bar = tqdm(total=len(args.lengths) * len(docs), desc="bench", unit="run", file=sys.stderr)
    for length in args.lengths:
        runs = []
        for i, (name, ids) in enumerate(docs):
            bar.set_postfix(context=length, doc=name)
            order = MODES[i % 3:] + MODES[:i % 3]  # rotate who goes first: warm caches, fairness
            runs.append(run_three_ways(engine, ids[:length], args.new_tokens, order, sampling))
            bar.update(1)
        rows.append(summarize(length, runs, sampling.greedy))
        r = rows[-1]
        bar.write(f"  {length:>6} tokens: MAL frozen {r['mal_frozen']:.3f} -> SharpDraft "
                  f"{r['mal_sharpdraft']:.3f}; tok/s target {r['tok_s_target']:.1f}, frozen "
                  f"{r['tok_s_frozen']:.1f}, SharpDraft {r['tok_s_sharpdraft']:.1f}", file=sys.stderr)
    bar.close()
    result = {
        "command": "python -m runtime bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else []),
        "engine_dir": str(args.engine_dir), "backend": engine.backend,
        "target": engine.manifest.target_dir.name,
        "drafter_checkpoint": engine.manifest.drafter_checkpoint["path"],
        "training_max_length": training_max_length(engine),
        "query_scaling": engine.scaling.to_dict(), "new_tokens": args.new_tokens,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed},
        "documents": [name for name, _ in docs], "machine": machine(), "rows": rows,
    }
    text = json.dumps(result, indent=2)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
        progress(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        progress(f"wrote {args.plot}")
    if args.json != "-":
        print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'context':>8} {'MAL frozen':>10} {'MAL SharpD':>10} {'tok/s tgt':>9} "
          f"{'tok/s frz':>9} {'tok/s SD':>9} {'x frozen':>8} {'x SD':>6} {'beta>1':>6} {'same':>5}")
    for r in rows:
        same = r.get("identical_to_target")
        same = "-" if same is None else "yes" if all(same["frozen"] + same["sharpdraft"]) else "NO"
        print(f"{r['context_tokens']:>8} {r['mal_frozen']:>10.3f} {r['mal_sharpdraft']:>10.3f} "
              f"{r['tok_s_target']:>9.1f} {r['tok_s_frozen']:>9.1f} {r['tok_s_sharpdraft']:>9.1f} "
              f"{r['speedup_frozen']:>8.2f} {r['speedup_sharpdraft']:>6.2f} "
              f"{r['beta_above_1_fraction']:>6.2f} {same:>5}")
