"""`python -m build.calibrate`: choose ref_keys and slope (and the cap) for THIS drafter.

The paper's DFlash preset (ref_keys 2048) was tuned for a drafter trained on 3,072-token
sequences and asks to be re-validated per drafter. This sweeps ref_keys x slope on the
calibration split (never the evaluation documents), measuring greedy MAL at long
contexts and at one context within the drafter's training length, and keeps the setting
with the best long-context MAL that loses no more than --tolerance at the short one
(settings within --tolerance of that best count as tied: the gentlest of them wins).
--max-log-scales adds the cap on beta (the paper's e^0.5) to the grid: it binds only
where 1 + ln(r) / slope exceeds it, so only long contexts (--lengths) can tell caps apart.

MAL here is teacher-forced (runtime/acceptance.py): the target decodes --new-tokens
greedy tokens after each document's prefix once, and every setting drafts at every one
of them, scoring what a greedy step anchored there commits. That is what decoding would
commit at the anchors it visits, over about MAL times as many anchors, and the target's
passes are paid once rather than once per setting: the same time buys more documents and
tokens, which the settings' small differences need (two documents x 64 decoded tokens
picked a setting that the evaluation documents then disagreed with by more than a
drafter generation's gain).

The choice becomes the engine's query scaling; the scaling it replaces and the whole grid
stay recorded in engine.json (extra.calibration); --write-checkpoint also saves it beside
the drafter (sharpdraft.json), which engines read at build time only. An engine whose
drafter graphs were exported with the old scaling gets them exported again: calibrating
rewrites an engine, so it is a build step and sits in build/ (docs/layering.md).
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from pathlib import Path

from build.checkpoints import CALIBRATION_FILE
from runtime.cli import Parser, UsageError, progress, run
from runtime.commands.provenance import provenance
from runtime.modes import Mode

PROG = "python -m build.calibrate"


def parse(argv):
    p = Parser(prog=PROG, description="sweep ref_keys x slope on the calibration split and "
                                      "write the best into the engine")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--ref-keys", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--slopes", type=float, nargs="+", default=[2.5, 5.0, 10.0])
    p.add_argument("--max-log-scales", type=float, nargs="+", metavar="CAP",
                   help="caps on ln(beta) to try (default: the engine's own, the paper's 0.5)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096],
                   help="long contexts whose mean MAL is maximised")
    p.add_argument("--short", type=int, help="a context within the training length that must not "
                                             "lose MAL (default: training length - block - 8)")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--new-tokens", type=int, default=128,
                   help="anchors per document and context: greedy tokens the target decodes "
                        "once, every setting drafting at each")
    p.add_argument("--docs", nargs="+", metavar="FILE", help="default: the --max-docs longest "
                                                               "calibration-split stdlib files")
    p.add_argument("--max-docs", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="measure and report, change nothing")
    p.add_argument("--write-checkpoint", action="store_true",
                   help="also save the choice as the drafter checkpoint's sharpdraft.json, the "
                        "default that build_engine.py --sharpdraft then uses for this drafter")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def sweep(engine, docs, lengths, short, settings, new_tokens, extra, bar) -> dict:
    """{setting: {length: [tokens committed at each anchor, all docs]}}; None = frozen.
    extra: the tokens the last anchor's step checks, decoded past the anchors."""
    from runtime.acceptance import committed_per_anchor, greedy_continuation

    drafting, shape = engine.style, engine.tree_shape
    target = engine.loaded.batch_target()
    results = {s: {n: [] for n in [short, *lengths]} for s in [None, *settings]}
    for length in [short, *lengths]:
        for _, ids in docs:
            cont = greedy_continuation(target, ids[:length], new_tokens + extra)
            for setting in results:
                drafter = engine.drafter(scaling=setting)
                results[setting][length] += committed_per_anchor(drafter, cont, drafting, shape)
                bar.update(1)
    return results


def mean(values: list[int]) -> float:
    return round(sum(values) / len(values), 4)


def choose(results, lengths, short, tolerance):
    frozen_short = mean(results[None][short])
    table = []
    for setting, by_length in results.items():
        row = {"query_scaling": setting.to_dict() if setting else None,
               "mal_short": mean(by_length[short]),
               "mal_long": mean([c for n in lengths for c in by_length[n]]),
               "mal_by_length": {str(n): mean(by_length[n]) for n in lengths}}
        row["keeps_short"] = row["mal_short"] >= (1 - tolerance) * frozen_short
        table.append((setting, row))
    candidates = [(s, r) for s, r in table if s is not None and r["keeps_short"]]
    if not candidates:
        return None, [r for _, r in table]
    # Long-context MALs within --tolerance of the best are the same measurement (a few
    # accepted tokens over a few docs); among them keep the gentlest setting. A larger
    # ref_keys first: beta is exactly 1 up to ref_keys keys, so every context shorter than
    # that decodes exactly as the frozen drafter -- short contexts then cost nothing by
    # construction, not only on the one short context measured here. Then a larger slope,
    # then a lower cap.
    top = max(r["mal_long"] for _, r in candidates)
    near = [(s, r) for s, r in candidates if r["mal_long"] >= (1 - tolerance) * top]
    best = max(near, key=lambda sr: (sr[0].ref_keys, sr[0].slope, -sr[0].max_log_scale,
                                     sr[1]["mal_long"]))
    return best[0], [r for _, r in table]


def apply(engine_dir: Path, engine, chosen, record: dict) -> None:
    """Make `chosen` the engine's scaling; re-export a compiled drafter graph if any."""
    from runtime.manifest import engine_files

    manifest = engine.manifest
    manifest.query_scaling = chosen
    manifest.extra["calibration"] = record
    onnx = manifest.extra.get("onnx")
    if onnx and "drafter" in onnx["graphs"]:
        from build import export  # torch and ONNX exporters: only engines with graphs need them
        from plugins.plugin_spec import plugin_fields

        progress("calibrate: re-exporting the SharpDraft drafter graphs with the chosen values")
        graphs = onnx["graphs"]
        graphs["drafter"] = export.export_drafter(engine.drafter_model, engine.model, chosen,
                                                  onnx["attention"],
                                                  engine_dir / graphs["drafter"]["file"])
        if "drafter_kv" in graphs:  # the form ONNX Runtime runs, where the engine has it
            graphs["drafter_kv"] = export.export_drafter_kv(engine.drafter_model, engine.model,
                                                            chosen,
                                                            engine_dir / graphs["drafter_kv"]["file"])
        if "drafter_tree" in graphs:  # EAGLE-3: its tree levels scale by beta too
            graphs["drafter_tree"] = export.export_eagle3_tree(
                engine.drafter_model, chosen, engine_dir / graphs["drafter_tree"]["file"])
        if onnx.get("plugin"):
            onnx["plugin"]["fields"] = plugin_fields(chosen)
        manifest.artifacts = engine_files(engine_dir)
    manifest.write(engine_dir)


def main(argv) -> int:
    from tqdm import tqdm

    from plugins.scaling import QueryScaling
    from runtime.acceptance import max_drafts
    from runtime.commands.bench import training_max_length
    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.spec import open_spec

    args = parse(argv)
    engine_dir = Path(args.engine_dir)
    engine = Engine(open_spec(engine_dir, backend="torch"))  # try settings without recompiling graphs
    why = engine.spec.refusal(Mode.SHARPDRAFT)  # calibration picks that mode's QueryScaling
    if why:
        raise UsageError(f"{engine_dir} has no SharpDraft mode, nothing to calibrate: {why}")
    try:
        caps = args.max_log_scales or [engine.scaling.max_log_scale]
        settings = [QueryScaling(r, engine.scaling.top_k, s, c)
                    for r, s, c in itertools.product(args.ref_keys, args.slopes, caps)]
    except ValueError as exc:
        raise UsageError(f"invalid grid: {exc}") from None
    bs = engine.manifest.block_size  # tokens one verify pass checks
    trained = training_max_length(engine)
    short = args.short or (trained - bs - 8 if trained else 448)
    lengths = sorted(set(args.lengths))
    extra = max_drafts(engine.drafter(scaling=None), engine.style, engine.tree_shape)
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if short < 2 or lengths[0] < 2 or lengths[-1] + args.new_tokens + extra > engine.context_limit:
        raise UsageError(f"lengths + --new-tokens + {extra} (the last anchor's drafts) must fit the "
                         f"target's {engine.context_limit}, and every length be >= 2")
    paths = args.docs or default_documents("calibration", args.max_docs)
    docs = tokenized(engine.encode, paths, lengths[-1])
    runs = (len(settings) + 1) * (len(lengths) + 1) * len(docs)
    progress(f"calibrate: {len(settings)} settings x contexts {[short, *lengths]} x "
             f"{len(docs)} docs {[n for n, _ in docs]}, teacher-forced at {args.new_tokens} "
             "anchors each")
    with tqdm(total=runs, desc="calibrate", unit="run", file=sys.stderr) as bar:
        results = sweep(engine, docs, lengths, short, settings, args.new_tokens, extra, bar)
    chosen, table = choose(results, lengths, short, args.tolerance)
    frozen = table[0]
    record = {"previous_scaling": engine.scaling.to_dict(),
              "chosen": chosen.to_dict() if chosen else None,
              "measure": (f"teacher-forced MAL: what a greedy step anchored at each of {args.new_tokens} "
                          "target greedy tokens commits (runtime/acceptance.py)"),
              "anchors": {str(n): len(results[None][n]) for n in [short, *lengths]},
              "criterion":
              (f"max mean MAL at {lengths} (within {args.tolerance} of the max: the largest "
               f"ref_keys, then slope, then the lowest cap); MAL at {short} >= "
               f"(1 - {args.tolerance}) x frozen"),
              "short_context": short, "long_contexts": lengths, "new_tokens": args.new_tokens,
              "documents": [n for n, _ in docs], "split": "calibration" if not args.docs else "user",
              Mode.FROZEN: frozen, "grid": table[1:],
              **provenance("calibrate", shlex.join(["python", "-m", "build.calibrate", *argv]))}
    print(f"{'ref_keys':>8} {'slope':>6} {'cap':>5} {'MAL short':>9} {'MAL long':>9}  keeps short")
    print(f"{Mode.FROZEN:>8} {'':>6} {'':>5} {frozen['mal_short']:>9.3f} {frozen['mal_long']:>9.3f}")
    for row in table[1:]:
        s = row["query_scaling"]
        mark = " <- chosen" if chosen and s == chosen.to_dict() else ""
        print(f"{s['ref_keys']:>8} {s['slope']:>6} {s['max_log_scale']:>5} {row['mal_short']:>9.3f} "
              f"{row['mal_long']:>9.3f}  {'yes' if row['keeps_short'] else 'no'}{mark}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if chosen is None:
        raise UsageError("no setting keeps the short-context MAL within --tolerance; engine unchanged")
    if args.dry_run:
        progress("calibrate: --dry-run, engine unchanged")
    else:
        apply(engine_dir, engine, chosen, record)
        progress(f"calibrate: {engine_dir}/engine.json now uses {chosen.describe()} (the "
                 "previous values kept under extra.calibration)")
        if args.write_checkpoint:
            path = engine.manifest.drafter_dir / CALIBRATION_FILE
            path.write_text(json.dumps({"query_scaling": chosen.to_dict(), "calibration": record},
                                       indent=2) + "\n")
            progress(f"calibrate: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
