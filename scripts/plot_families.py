"""The three-family result: MAL against context length for DFlash, PARD and EAGLE-3,
frozen vs family preset vs calibrated SharpDraft, from one `bench --modes frozen preset
sharpdraft --json` file per family (scripts/bench_families.sh runs them).

    python -m scripts.plot_families results/families-{dflash,pard,eagle3}.json \
        --plot results/families.png > results/families.md

Prints a markdown table (MAL per mode, and each scaled mode's per-document MAL ratio over
frozen with its 95% bootstrap interval, as bench computed it) and draws one column per
family: MAL on top, the paired ratios with their intervals below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from runtime.commands.styles import STYLES
from runtime.modes import SCALED as SCALED_MODES, Mode

# the drafter frozen, and under each QueryScaling: (color, label) from the modes table
MODES = {m: (STYLES[m].color, STYLES[m].label) for m in (Mode.FROZEN, *SCALED_MODES)}
RATIOS = SCALED_MODES


def load(paths: list[str]) -> list[dict]:
    results = []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            sys.exit(f"error: cannot read {path}: {exc}")
        missing = [m for m in MODES if m not in result.get("modes", [])]
        if missing:
            sys.exit(f"error: {path} has no {missing} runs — bench it with --modes {' '.join(MODES)}")
        results.append(result)
    return results


def scaling(s: dict | None) -> str:
    return "-" if not s else f"ref_keys {s['ref_keys']}, slope {s['slope']:g}"


def ratio_text(r: dict) -> str:
    low, high = r["ci"]
    return f"{r['mean']:.3f} [{low:.3f}, {high:.3f}]"


def table(results: list[dict]) -> str:
    lines = ["| drafter | context | MAL frozen | MAL preset | MAL calibrated | preset / frozen [95% CI] "
             "| calibrated / frozen [95% CI] |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["rows"]:
            lines.append(f"| {result['drafter']} | {row['context_tokens']} | "
                         + " | ".join(f"{row[f'mal_{m}']:.3f}" for m in MODES) + " | "
                         + " | ".join(ratio_text(row[f"mal_ratio_{m}_{Mode.FROZEN}"]) for m in RATIOS) + " |")
    notes = [f"- {r['drafter']}: preset {scaling(r.get('preset_scaling'))}; calibrated "
             f"{scaling(r.get('query_scaling'))}; {len(r['documents'])} documents, "
             f"{r['new_tokens']} new tokens, greedy; every run identical to target-only: "
             f"{all(all(v) for row in r['rows'] for v in row.get('identical_to_target', {}).values())}"
             for r in results]
    return "\n".join(lines + [""] + notes)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 6.4), dpi=120,
                             squeeze=False, sharex=True)
    for col, result in enumerate(results):
        x = [r["context_tokens"] for r in result["rows"]]
        top, bottom = axes[0][col], axes[1][col]
        for mode, (color, label) in MODES.items():
            top.plot(x, [r[f"mal_{mode}"] for r in result["rows"]], "o-", color=color, label=label)
        for shift, mode in zip((0.97, 1.03), RATIOS):  # side by side at each length
            ratios = [r[f"mal_ratio_{mode}_{Mode.FROZEN}"] for r in result["rows"]]
            mean = [q["mean"] for q in ratios]
            err = [[m - q["ci"][0] for m, q in zip(mean, ratios)],
                   [q["ci"][1] - m for m, q in zip(mean, ratios)]]
            bottom.errorbar([v * shift for v in x], mean, yerr=err, fmt="o", capsize=3,
                            color=MODES[mode][0], label=f"{MODES[mode][1]} / frozen")
        bottom.axhline(1.0, color="black", lw=0.8, alpha=0.5)
        top.set_title(f"{result['drafter']} ({len(result['documents'])} docs, "
                      f"{result['new_tokens']} tokens each)", fontsize=9)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.grid(alpha=0.3)
        bottom.set_xlabel("context tokens")
        if col == 0:
            top.set_ylabel("mean accepted length")
            bottom.set_ylabel("MAL ratio over frozen\n(per document, 95% bootstrap CI)")
            top.legend(fontsize=8)
            bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench JSON files, one per drafter family")
    p.add_argument("--plot", metavar="PNG")
    args = p.parse_args(argv)
    results = load(args.results)
    print(table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
