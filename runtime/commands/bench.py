"""`python -m runtime bench`: mean accepted length (MAL) and speed against context length.

For each context length, the first N tokens of each document are prefilled ONCE; from
that same prefill the engine then decodes every way it can -- target-only, n-gram lookup
(the drafter-free peer), frozen drafter, the frozen drafter under a draft window of its
training length (the drafter-side peer: it never sees more keys than it trained on),
SharpDraft drafter, hybrid (SharpDraft with
n-gram lookup verified instead when it finds a better proposal), window-hybrid (the same
with the windowed drafter) -- greedily (or with lossless
sampling, --temperature), --repeats times, interleaved in a rotating order. On the torch
backend `--modes ... preset` adds the drafter under its family's preset scaling (the
paper's values) beside the engine's own (calibrated) one. Rows report MAL, tokens/s (the
median over repeats of the tokens/s pooled over documents), speedup over target-only, how
often beta > 1, the share of hybrid steps that verified n-gram drafts, each scaled mode's
per-document MAL ratio over frozen with a bootstrap interval and, for greedy runs, whether
every way produced the target's tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from runtime.backends import RUNNABLE_BACKENDS
from runtime.cli import UsageError, add_device_options, device_options, progress
from runtime.commands.provenance import provenance
from runtime.commands.styles import STYLES
from runtime.measure import decode_from_one_prefill  # noqa: F401 -- bench's runs
from runtime.metrics import paired_ratio_ci, pooled_mean_accepted_length, pooled_tokens_per_second
from runtime.modes import SCALED, Mode

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 7680)
# the drafter alone under a query scaling: its MAL over frozen is SharpDraft's effect
SCALED_MODES = SCALED


def add_parser(sub):
    p = sub.add_parser("bench", help="MAL and tokens/s vs context length: target-only, frozen, "
                                     "SharpDraft from the same prefill")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS)
    add_device_options(p)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--docs", nargs="+", metavar="FILE", help="text files (default: the 3 longest "
                                                               "evaluation-split stdlib files)")
    p.add_argument("--max-docs", type=int, default=3)
    p.add_argument("--modes", nargs="+", metavar="MODE",
                   help="decode only these ways (docs/modes.md; target-only always runs: every "
                        f"other way is checked against it); '{Mode.PRESET}' (torch backend): the "
                        "drafter under its family's preset scaling. Default: every way the engine "
                        "lists")
    p.add_argument("--draft-length", choices=("adaptive", "full"), default="adaptive",
                   help="drafter steps verify the drafts their confidence and the measured "
                        "verify cost make worthwhile, and hybrid runs the drafter only where "
                        "it pays (adaptive); or the whole block, every unmatched step")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved decoding runs per mode from each prefill (speed: median)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: lossless speculative sampling instead of greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the same seed starts every run")
    p.add_argument("--batch", type=int, metavar="B",
                   help="decode B sequences of different context lengths (cycling --lengths) "
                        "together with in-flight batching, against one at a time")
    p.add_argument("--json", metavar="OUT", help="write the results object here ('-': stdout)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--verify", action="store_true",
                   help="hash every file the engine depends on (default: size/mtime stamp)")
    p.add_argument("--debug", action="store_true")


def check_args(args, context_limit: int) -> None:
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    bad = [n for n in args.lengths if n < 1 or n + args.new_tokens > context_limit]
    if bad:
        raise UsageError(f"context length(s) {bad} do not fit: each length + --new-tokens "
                         f"({args.new_tokens}) must be within the target's {context_limit}")


def bench_modes(engine, asked: list[str] | None) -> tuple[Mode, ...]:
    """The ways to decode, in the table's order: target-only first, then the asked ones
    (default: every mode the engine lists; study modes such as preset when asked)."""
    if not asked:
        return engine.spec.modes
    refused = {}
    for name in asked:
        mode = next((m for m in Mode if m == name), None)
        why = "no such mode" if mode is None else engine.spec.refusal(mode)
        if why:
            refused[name] = why
    if refused:
        studies = [m for m in Mode if m.study and engine.spec.refusal(m) is None]
        raise UsageError(f"{engine.dir} cannot run mode(s) {list(refused)}: " + "; ".join(
            f"{m}: {why}" for m, why in refused.items())
            + f" (it runs {', '.join([*engine.spec.modes, *studies])})")
    return tuple(m for m in Mode if m == Mode.TARGET or m in asked)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(context: int, runs: list[dict], greedy: bool = True) -> dict:
    """One row from the runs of one context length (a {mode: [Generation per repeat]} per
    document): MAL pooled over documents (tokens / verify passes); tokens/s pooled over
    documents per repeat, then the median over repeats."""
    modes = list(runs[0])
    drafting = [m for m in modes if m != Mode.TARGET]
    repeats = len(runs[0][Mode.TARGET])
    row = {"context_tokens": context, "documents": len(runs), "repeats": repeats}
    for mode in drafting:
        row[f"mal_{mode}"] = round(pooled_mean_accepted_length([r[mode][0] for r in runs]), 4)
    for mode in modes:
        per_repeat = [pooled_tokens_per_second([r[mode][i] for r in runs]) for i in range(repeats)]
        row[f"tok_s_{mode}_repeats"] = [round(x, 3) for x in per_repeat]
        row[f"tok_s_{mode}"] = round(statistics.median(per_repeat), 3)
    for mode in drafting:
        # ratio of medians; the per-repeat ratios are in the JSON via the repeats above
        row[f"speedup_{mode}"] = round(row[f"tok_s_{mode}"] / row["tok_s_target"], 4)
    for mode in modes:  # the target's prefill is replayed, so this is the drafter's own
        row[f"prefill_ms_{mode}"] = round(statistics.median(
            statistics.fmean(r[mode][i].seconds["prefill"] for r in runs)
            for i in range(repeats)) * 1e3, 1)
    if Mode.SHARPDRAFT in modes:
        betas = [b for r in runs for b in r[Mode.SHARPDRAFT][0].beta_per_step]
        row["beta_above_1_fraction"] = round(sum(b > 1 for b in betas) / len(betas), 4) if betas else 0.0
        row["beta_mean"] = round(statistics.fmean(betas), 4) if betas else 1.0
    for mode in Mode:  # adaptive: steps its (unassisted) drafter sat out
        if mode in modes and mode.uses_drafter_model and not mode.ngram_assist:
            gens = [r[mode][0] for r in runs]
            row[f"plain_share_{mode}"] = round(sum(g.ngram_steps for g in gens)
                                               / max(sum(g.verify_steps for g in gens), 1), 4)
    for mode in drafting:  # what a verify pass checked: adaptive length cuts it below the block
        gens = [r[mode][0] for r in runs]
        row[f"drafts_per_step_{mode}"] = round(sum(sum(g.verified_per_step) for g in gens)
                                               / max(sum(g.verify_steps for g in gens), 1), 4)
    for mode in Mode:  # how often the lookup's drafts were verified
        if mode in modes and mode.ngram_assist:
            gens = [r[mode][0] for r in runs]
            row[f"ngram_share_{mode}"] = round(sum(g.ngram_steps for g in gens)
                                               / sum(g.verify_steps for g in gens), 4)
    row["mal_per_document"] = {m: [round(r[m][0].mean_accepted_length, 3) for r in runs]
                               for m in drafting}
    for mode in SCALED_MODES:  # SharpDraft's effect, with its noise
        if {Mode.FROZEN, mode} <= set(drafting):
            row[f"mal_ratio_{mode}_{Mode.FROZEN}"] = paired_ratio_ci(
                [r[mode][0].mean_accepted_length for r in runs],
                [r[Mode.FROZEN][0].mean_accepted_length for r in runs])
    if {Mode.WINDOW, Mode.SHARPDRAFT} <= set(drafting):  # SharpDraft against the draft-window peer
        row[f"mal_ratio_{Mode.SHARPDRAFT}_{Mode.WINDOW}"] = paired_ratio_ci(
            [r[Mode.SHARPDRAFT][0].mean_accepted_length for r in runs],
            [r[Mode.WINDOW][0].mean_accepted_length for r in runs])
    if greedy:  # sampled runs draw different tokens by design; only greedy must agree
        row["first_divergence"] = {
            m: [first_difference(g.tokens, r[Mode.TARGET][0].tokens) for r in runs for g in r[m]]
            for m in drafting}
        row["identical_to_target"] = {m: [d is None for d in row["first_divergence"][m]]
                                      for m in drafting}
    return row


# the drafting modes' plot colors and legend labels, in the table's order
STYLE = {m: (STYLES[m].color, STYLES[m].label) for m in Mode if m != Mode.TARGET}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["context_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 6), dpi=120)
    ax2 = ax.twinx()
    for mode, (color, label) in STYLE.items():
        if f"mal_{mode}" not in rows[0]:
            continue
        ax.plot(x, [r[f"mal_{mode}"] for r in rows], "o-", color=color, label=f"MAL, {label}")
        ax2.plot(x, [r[f"speedup_{mode}"] for r in rows], "s--", color=color, alpha=0.6,
                 label=f"speedup, {label}")
    ax2.axhline(1.0, color="black", lw=0.8, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens (prefill)")
    ax.set_ylabel("mean accepted length (tokens / verify)")
    ax.grid(alpha=0.3)
    ax2.set_ylabel("decode speedup over target-only")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    # below the axes, in two columns: with six modes, a legend inside hides the lines
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, ncol=2,
              loc="upper center", bbox_to_anchor=(0.5, -0.14))
    scaling = result.get("query_scaling") or {}
    ax.set_title(f"{result['target']}, {result['backend']}: drafter trained at "
                 f"{result.get('training_max_length')} tokens; beta ref_keys={scaling.get('ref_keys')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def training_max_length(engine) -> int | None:
    """The drafter's training max length, as its config.json records it (None: unknown)."""
    from runtime.backends.roles import drafter_config

    config = drafter_config(engine.manifest)
    return None if config is None else config.training_max_length


def run(args) -> int:
    from tqdm import tqdm

    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.sampling import Sampling

    engine = Engine(open_spec(args.engine_dir, backend=args.backend, verify="full" if args.verify else "quick",
                    **device_options(args)))
    check_args(args, engine.context_limit)
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    modes = bench_modes(engine, args.modes)
    paths = args.docs or default_documents("eval", args.max_docs)
    docs = tokenized(engine.encode, paths, max(args.lengths))
    if args.batch is not None:
        return run_batch(args, engine, docs, sampling, modes)
    progress(f"bench: {len(docs)} document(s) {[name for name, _ in docs]}, lengths "
             f"{args.lengths}, {args.new_tokens} new tokens, modes {[str(m) for m in modes]}, "
             f"{args.repeats} interleaved repeat(s), backend {engine.backend}")
    # Untimed warm-up of every path: first calls pay one-off costs (lazy imports,
    # allocator growth) that would otherwise land on whichever run comes first.
    decode_from_one_prefill(engine, docs[0][1][:min(64, max(args.lengths))], 4, modes)
    rows = []
    bar = tqdm(total=len(args.lengths) * len(docs), desc="bench", unit="prefill", file=sys.stderr)
    for length in args.lengths:
        runs = []
        for i, (name, ids) in enumerate(docs):
            bar.set_postfix(context=length, doc=name)
            runs.append(decode_from_one_prefill(engine, ids[:length], args.new_tokens, modes,
                                                args.repeats, sampling, rotation=i,
                                                adaptive=args.draft_length == "adaptive"))
            bar.update(1)
        rows.append(summarize(length, runs, sampling.greedy))
        r = rows[-1]
        bar.write(f"  {length:>6} tokens: " + "; ".join(
            f"{m} {r[f'tok_s_{m}']:.1f} tok/s" + (f" MAL {r[f'mal_{m}']:.3f}" if m != Mode.TARGET else "")
            for m in modes), file=sys.stderr)
    bar.close()
    result = {
        **provenance("bench"),
        "engine_dir": str(args.engine_dir), "backend": engine.backend,
        "target": engine.manifest.target_dir.name,
        "drafter": engine.manifest.drafter, "modes": list(modes),
        "drafter_checkpoint": (engine.manifest.drafter_checkpoint or {}).get("path"),
        "training_max_length": training_max_length(engine), "ngram": engine.spec.ngram_settings,
        "query_scaling": engine.scaling.to_dict() if engine.scaling else None,
        "preset_scaling": engine.spec.family_preset.to_dict() if Mode.PRESET in modes else None,
        "preset_is_calibrated": Mode.PRESET in modes and engine.spec.family_preset == engine.scaling,
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "draft_length": args.draft_length if engine.step_costs else "full (no step costs measured)",
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed},
        "documents": [name for name, _ in docs], "rows": rows,
    }
    write_result(result, args.json)
    if args.plot:
        plot(result, args.plot)
        progress(f"wrote {args.plot}")
    if args.json != "-":
        print_table(rows)
    return 0


def write_result(result: dict, where: str | None) -> None:
    """The results object to stdout ('-') or a file; nothing when no --json."""
    text = json.dumps(result, indent=2)
    if where == "-":
        print(text)
    elif where:
        Path(where).write_text(text + "\n")
        progress(f"wrote {where}")


def run_batch(args, engine, docs, sampling, modes) -> int:
    from runtime.commands import bench_batch
    from runtime.engine import EngineError

    why = next((w for m in modes if (w := engine.spec.batch_refusal(m))), None)
    if why:
        raise EngineError(f"{engine.dir}: {why}")
    modes = list(modes)
    requests = bench_batch.batch_requests(docs, args.lengths, args.batch, args.new_tokens, sampling)
    progress(f"bench --batch {args.batch}: contexts {[len(q.prompt) for q in requests]}, "
             f"{args.new_tokens} new tokens each, modes {[str(m) for m in modes]}, {args.repeats} interleaved "
             f"repeat(s), backend {engine.backend}")
    adaptive = args.draft_length == "adaptive"
    bench_batch.measure(engine, requests[:1], modes, 1, adaptive)  # warm-up, untimed
    rows = bench_batch.measure(engine, requests, modes, args.repeats, adaptive)
    result = {
        **provenance("bench"),
        "engine_dir": str(args.engine_dir), "backend": engine.backend, "batch": args.batch,
        "contexts": [len(q.prompt) for q in requests], "new_tokens": args.new_tokens,
        "repeats": args.repeats, "query_scaling": engine.scaling.to_dict() if engine.scaling else None,
        "draft_length": args.draft_length if engine.step_costs else "full (no step costs measured)",
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed},
        "documents": [name for name, _ in docs], "rows": rows,
    }
    write_result(result, args.json)
    if args.json != "-":
        bench_batch.print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    modes = [m for m in Mode if f"tok_s_{m}" in rows[0]]
    drafting = modes[1:]
    header = f"{'context':>8}" + "".join(f" {'MAL ' + m:>15}" for m in drafting)
    header += "".join(f" {'tok/s ' + m:>16}" for m in modes)
    header += "".join(f" {'x ' + m:>12}" for m in drafting) + f" {'same':>5}"
    shares = [m for m in Mode if f"ngram_share_{m}" in rows[0]]
    header += "".join(f" {m + ' n-gram share':>27}" for m in shares)
    plain = f"plain_share_{Mode.SHARPDRAFT}" in rows[0]  # adaptive: steps the drafter sat out
    if plain:
        header += f" {Mode.SHARPDRAFT + ' plain share':>23}"
    # time to first token beyond target-only's: the drafter reading the prompt's features
    prefill = [m for m in drafting if f"prefill_ms_{m}" in rows[0]]
    header += "".join(f" {'+prefill ms ' + m:>22}" for m in prefill)
    ratios = [m for m in SCALED_MODES if f"mal_ratio_{m}_{Mode.FROZEN}" in rows[0]]
    header += "".join(f" {f'MAL {m}/{Mode.FROZEN} [95% CI]':>31}" for m in ratios)
    print(header)
    for r in rows:
        same = r.get("identical_to_target")
        same = "-" if same is None else "yes" if all(sum(same.values(), [])) else "NO"
        print(f"{r['context_tokens']:>8}" + "".join(f" {r[f'mal_{m}']:>15.3f}" for m in drafting)
              + "".join(f" {r[f'tok_s_{m}']:>16.1f}" for m in modes)
              + "".join(f" {r[f'speedup_{m}']:>12.2f}" for m in drafting) + f" {same:>5}"
              + "".join(f" {r[f'ngram_share_{m}']:>27.2f}" for m in shares)
              + (f" {r[f'plain_share_{Mode.SHARPDRAFT}']:>23.2f}" if plain else "")
              + "".join(f" {r[f'prefill_ms_{m}'] - r['prefill_ms_target']:>22.1f}" for m in prefill)
              + "".join(f" {format_ratio(r[f'mal_ratio_{m}_{Mode.FROZEN}']):>31}" for m in ratios))


def format_ratio(ratio: dict) -> str:
    low, high = ratio["ci"]
    return f"{ratio['mean']:.3f} [{low:.3f}, {high:.3f}] n={ratio['items']}"
