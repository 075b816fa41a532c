"""`python -m runtime report`: docs/results.md, written from the results files alone.

Each table is read from a JSON under results/ (what bench, calibrate, diagnose, loadtest,
generate and the scripts wrote) and printed with the command, machine and date the file
records ("not recorded" where an older file lacks one) and the plot beside it. Rerun the
measurements, then this command, and the published figures follow the files.

    python -m runtime report                 # writes docs/results.md
    python -m runtime report --check         # exit 1 if docs/results.md is out of date
    python -m runtime report --headline      # the README's results table, to stdout
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.cli import progress
from runtime.commands.styles import STYLES
from runtime.modes import SCALED, Mode

REPO = Path(__file__).resolve().parents[2]

# bench's modes, in the order and the words the tables use (runtime/modes.py)
MODE_NAMES = {m: STYLES[m].word for m in Mode}
NOT_RECORDED = "not recorded"
# Results kept only as text: named in the page, not parsed.
TEXT_ONLY = {
    "heldout-continuations.txt": "held-out teacher-forced MAL of the drafters on continuations "
                                 "of calibration-split prompts (scripts/heldout_mal.py)",
    "heldout-text.txt": "held-out teacher-forced MAL on text windows (scripts/heldout_mal.py)",
    "drafter-step-kv.txt": "one drafter step, drafter.onnx against drafter-kv.onnx",
}


class ReportError(ValueError):
    """A results file that is missing or does not hold what its table needs."""


def add_parser(sub):
    p = sub.add_parser("report", help="write docs/results.md from results/*.json")
    p.add_argument("--results", default=str(REPO / "results"), metavar="DIR",
                   help="the results folder (default: results/ of this checkout)")
    p.add_argument("--output", default=str(REPO / "docs" / "results.md"), metavar="MD")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if OUTPUT differs from what would be written")
    p.add_argument("--headline", action="store_true",
                   help="print the README's results table (from bench.json) and nothing else")
    p.add_argument("--debug", action="store_true")


# -- reading --------------------------------------------------------------------------

def load(folder: Path, name: str) -> dict:
    path = folder / name
    if not path.is_file():
        raise ReportError(f"{path} is missing: rerun the command that writes it "
                          "(docs/results.md names each one) or restore it from git")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def field(data: dict, name: str, *keys):
    """data[k1][k2]...; a missing key names the file and the key in one line."""
    value = data
    for key in keys:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            # str(): a Mode key reads as its name, as the file spells it
            where = "".join(f"[{(str(k) if isinstance(k, str) else k)!r}]" for k in keys)
            raise ReportError(f"{name} has no {where}: not the file its table expects") from None
    return value


def numbers(data) -> list[float]:
    """Every number in a JSON value (for checking published figures against the files)."""
    if isinstance(data, bool):
        return []
    if isinstance(data, (int, float)):
        return [float(data)]
    if isinstance(data, dict):
        return [x for v in data.values() for x in numbers(v)]
    if isinstance(data, list):
        return [x for v in data for x in numbers(v)]
    return []


# -- formatting -----------------------------------------------------------------------

def table(header: list[str], rows: list[list], right: int = 0) -> list[str]:
    """A markdown table; the first `right` columns are right-aligned numbers."""
    align = ["---:" if i < right else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def describe_machine(machine) -> str:
    if not machine:
        return NOT_RECORDED
    threads = machine.get("torch_threads")
    return (f"{machine.get('cpus', '?')} CPUs ({machine.get('processor', '?')}), "
            + (f"{threads} torch thread(s), " if threads else "")
            + f"torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}")


def provenance_lines(data: dict, name: str, folder: Path, command: str | None = None) -> list[str]:
    lines = [f"- file: `results/{name}`",
             f"- command: `{data.get('command') or command}`" if data.get("command") or command
             else f"- command: {NOT_RECORDED}",
             f"- machine: {describe_machine(data.get('machine'))}",
             f"- date: {data.get('date') or NOT_RECORDED}"]
    if command and not data.get("command"):
        lines[1] += " (from the file's recorded arguments; the file does not record the command line)"
    return lines


def plot_line(folder: Path, stem: str, caption: str) -> list[str]:
    return [f"![{caption}](../results/{stem}.png)", ""] if (folder / f"{stem}.png").is_file() else []


def modes_of(data: dict, name: str) -> list[str]:
    rows = field(data, name, "rows")
    if not rows:
        raise ReportError(f"{name} has no rows")
    return [m for m in MODE_NAMES if m != Mode.TARGET and f"mal_{m}" in rows[0]]


def same_tokens(row: dict) -> str:
    flags = [x for v in row.get("identical_to_target", {}).values() for x in v]
    return "yes" if flags and all(flags) else ("no" if flags else "—")


def headline(data: dict, name: str = "bench.json") -> list[str]:
    """The bench table the README shows: per context, target-only tok/s and each mode's
    MAL and speedup over target-only (the median over the interleaved repeats)."""
    modes = modes_of(data, name)
    header = ["context tokens", "target-only tok/s",
              *(f"{MODE_NAMES[m]}: MAL, x" for m in modes), "same tokens"]
    rows = []
    for i, r in enumerate(field(data, name, "rows")):
        rows.append([field(data, name, "rows", i, "context_tokens"),
                     f"{field(data, name, 'rows', i, 'tok_s_target'):.1f}",
                     *(f"{field(data, name, 'rows', i, f'mal_{m}'):.3f}, "
                       f"{field(data, name, 'rows', i, f'speedup_{m}'):.2f}x" for m in modes),
                     same_tokens(r)])
    return table(header, rows, right=2 + len(modes))


def ratio(r: dict, key: str) -> str:
    value = r.get(key)
    if not value:
        return "—"
    return f"{value['mean']:.3f} [{value['ci'][0]:.3f}, {value['ci'][1]:.3f}]"


def bench_section(folder: Path, name: str, title: str, intro: str, plot: str | None,
                  level: str = "##") -> list[str]:
    data = load(folder, name)
    modes = modes_of(data, name)
    lines = [f"{level} {title}", "", *([intro, ""] if intro else []), *provenance_lines(data, name, folder),
             f"- engine: `{data.get('engine_dir', NOT_RECORDED)}` ({data.get('backend', '?')} backend), "
             f"drafter `{data.get('drafter_checkpoint') or NOT_RECORDED}`, query scaling "
             f"{scaling(data.get('query_scaling'))}",
             f"- documents: {', '.join(data.get('documents', [])) or NOT_RECORDED}; "
             f"{data.get('new_tokens', '?')} new tokens, {data.get('repeats', 1)} repeat(s), "
             f"draft length {data.get('draft_length', NOT_RECORDED)}", ""]
    lines += headline(data, name)
    ratios = [k for k in ("mal_ratio_sharpdraft_frozen", "mal_ratio_sharpdraft_window",
                          "mal_ratio_preset_frozen") if k in data["rows"][0]]
    if ratios:
        lines += ["", "Paired per-document MAL ratios, mean [95% bootstrap interval over documents]:", ""]
        lines += table(["context tokens", *(k.removeprefix("mal_ratio_").replace("_", " / ")
                                            for k in ratios)],
                       [[r["context_tokens"], *(ratio(r, k) for k in ratios)] for r in data["rows"]],
                       right=1)
    spread = repeat_spread(data["rows"], modes)
    if spread:
        lines += ["", "Speed over target-only in each interleaved repeat (repeat i of a mode over "
                  "repeat i of target-only), lowest–highest:", ""]
        lines += table(["context tokens", *(MODE_NAMES[m] for m in modes)], spread, right=1)
    return [*lines, "", *(plot_line(folder, plot, title) if plot else [])]


def repeat_spread(rows: list[dict], modes: list[str]) -> list[list]:
    """Per-repeat speedups, where the file keeps more than one repeat per mode."""
    if not all(len(r.get("tok_s_target_repeats", [])) > 1 for r in rows):
        return []
    out = []
    for r in rows:
        target = r["tok_s_target_repeats"]
        cells = []
        for m in modes:
            ratios = [x / t for x, t in zip(r.get(f"tok_s_{m}_repeats", []), target)]
            cells.append(f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "—")
        out.append([r["context_tokens"], *cells])
    return out


def scaling(s) -> str:
    if not s:
        return "none"
    return f"ref_keys {s['ref_keys']}, slope {s['slope']}, cap e^{s['max_log_scale']}"


def batch_section(folder: Path) -> list[str]:
    name = "bench-batch8.json"
    data = load(folder, name)
    rows = [[MODE_NAMES.get(r["mode"], r["mode"]), r["batch"], f"{r['mal']:.3f}",
             f"{r['tok_s_batched']:.1f}", f"{r['tok_s_one_at_a_time']:.1f}",
             f"{r['batching_speedup']:.2f}", "yes" if all(r["identical_to_one_at_a_time"]) else "no"]
            for r in field(data, name, "rows")]
    return ["## Batched decoding", "",
            f"Sequences of contexts {data.get('contexts')} decoded together versus one at a time.", "",
            *provenance_lines(data, name, folder),
            f"- query scaling: {scaling(data.get('query_scaling'))}", "",
            *table(["mode", "batch", "MAL", "tok/s batched", "tok/s one at a time", "x",
                    "same tokens"], rows), ""]


def diagnose_section(folder: Path) -> list[str]:
    lines = ["## Attention dilution (diagnose)", "",
             "Mean attention mass on each block query's top-k keys, per drafter layer, frozen "
             "and under SharpDraft's scale.", ""]
    for name in sorted(p.name for p in folder.glob("diagnose*.json")):
        data = load(folder, name)
        rows = field(data, name, "rows")
        layers = len(field(data, name, "rows", 0, Mode.FROZEN))
        header = ["context tokens", "visible keys", "beta",
                  *(f"L{i} frozen" for i in range(layers)), *(f"L{i} SharpDraft" for i in range(layers))]
        body = [[r["context_tokens"], r["visible_keys"], f"{r['beta']:.4f}",
                 *(f"{x:.4f}" for x in r[Mode.FROZEN]), *(f"{x:.4f}" for x in r[Mode.SHARPDRAFT])]
                for r in rows]
        lines += [f"### `{name}`: {scaling(data.get('query_scaling'))}", "",
                  *provenance_lines(data, name, folder, command=None),
                  f"- top-k: {data.get('top_k')}; documents: {', '.join(data.get('documents', []))}", "",
                  *table(header, body, right=len(header)), "",
                  *plot_line(folder, Path(name).stem, name)]
    return lines


def calibrate_section(folder: Path) -> list[str]:
    lines = ["## Calibration (calibrate)", ""]
    for name in sorted(p.name for p in folder.glob("calibrate*.json")):
        data = load(folder, name)
        longs = [str(n) for n in field(data, name, "long_contexts")]
        grid = [field(data, name, Mode.FROZEN), *field(data, name, "grid")]
        chosen = data.get("chosen")
        body = []
        for row in grid:
            s = row["query_scaling"]
            body.append([(STYLES[Mode.FROZEN].word if s is None else f"{s['ref_keys']} / {s['slope']} / e^{s['max_log_scale']}")
                         + (" (chosen)" if s is not None and s == chosen else ""),
                         f"{row['mal_short']:.3f}", f"{row['mal_long']:.3f}",
                         *(f"{row['mal_by_length'][n]:.3f}" for n in longs),
                         "yes" if row["keeps_short"] else "no"])
        lines += [f"### `{name}`", "", *provenance_lines(data, name, folder),
                  f"- measure: {data.get('measure', NOT_RECORDED)}",
                  f"- criterion: {data.get('criterion')}",
                  f"- documents ({data.get('split')} split): {', '.join(data.get('documents', []))}",
                  f"- chosen: {scaling(chosen)}", "",
                  *table(["ref_keys / slope / cap", f"MAL at {data.get('short_context')}",
                          "mean MAL long", *(f"MAL at {n}" for n in longs), "keeps short"], body), ""]
    return lines


def families_section(folder: Path) -> list[str]:
    names = sorted(p.name for p in folder.glob("families-*.json"))
    if not names:
        raise ReportError(f"{folder} has no families-*.json (scripts/bench_families.sh writes them)")
    lines = ["## SharpDraft across drafter families", "",
             "Whole-block MAL of each family's drafter frozen, under the family's preset and under "
             "its calibrated scaling (the engine's own).", ""]
    body = []
    for name in names:
        data = load(folder, name)
        lines += [f"`{name}`:", "", *provenance_lines(data, name, folder),
                  f"- calibrated: {scaling(data.get('query_scaling'))}; preset: "
                  f"{scaling(data.get('preset_scaling'))}; documents: {', '.join(data.get('documents', []))}", ""]
        for i, r in enumerate(field(data, name, "rows")):
            body.append([data.get("drafter", name), r["context_tokens"],
                         *(f"{field(data, name, 'rows', i, f'mal_{m}'):.3f}"
                           for m in (Mode.FROZEN, *SCALED)),
                         *(ratio(r, f"mal_ratio_{m}_{Mode.FROZEN}") for m in SCALED)])
    lines += table(["drafter", "context", "MAL frozen", "MAL preset", "MAL calibrated",
                    "preset / frozen [95% CI]", "calibrated / frozen [95% CI]"], body)
    return [*lines, "", *plot_line(folder, "families", "MAL per drafter family")]


def window_section(folder: Path) -> list[str]:
    name = "draft-window-sweep.json"
    data = load(folder, name)
    means = field(data, name, "mean_mal")
    lengths = list(next(iter(means.values())))
    body = [[n, *(f"{means[k][n]:.3f}" for k in means)] for n in lengths]
    return ["## Draft windows, teacher-forced (scripts/draft_window_sweep.py)", "",
            "Mean tokens a whole-block step commits, per draft window, on the calibration split.", "",
            *provenance_lines(data, name, folder),
            f"- engine: `{data.get('engine', NOT_RECORDED)}`; documents: "
            f"{', '.join(data.get('documents', []))}; {data.get('new_tokens')} anchors per file", "",
            *table(["context tokens", *means], body, right=1 + len(means)), ""]


def loadtest_section(folder: Path) -> list[str]:
    names = sorted(p.name for p in folder.glob("loadtest-*.json"))
    lines = ["## Serving load test (loadtest)", ""]
    for name in names:
        data = load(folder, name)
        body = [[lv["concurrency"], f"{lv['requests_per_second']:.2f}", f"{lv['tokens_per_second']:.1f}",
                 f"{lv['ttft_ms']['p50']:.1f}", f"{lv['latency_ms']['p50']:.1f}",
                 f"{lv['latency_ms']['p95']:.1f}", f"{lv['mean_accepted_length']:.3f}"]
                for lv in field(data, name, "levels")]
        if "in_process" in data:
            lv = data["in_process"]
            body.append(["in process, one at a time", f"{lv['requests_per_second']:.2f}",
                         f"{lv['tokens_per_second']:.1f}", f"{lv['ttft_ms']['p50']:.1f}",
                         f"{lv['latency_ms']['p50']:.1f}", f"{lv['latency_ms']['p95']:.1f}",
                         f"{lv['mean_accepted_length']:.3f}"])
        lines += [f"### `{name}`", "", *provenance_lines(data, name, folder),
                  f"- model `{data.get('model')}` at {data.get('url')}, {data.get('requests')} requests "
                  f"of {data.get('max_new_tokens')} new tokens; token mismatches against in-process "
                  f"decoding: {data.get('token_mismatches', NOT_RECORDED)}", "",
                  *table(["concurrency", "requests/s", "tokens/s", "TTFT p50 ms", "latency p50 ms",
                          "latency p95 ms", "MAL"], body), ""]
    return lines


def rss_section(folder: Path) -> list[str]:
    body, names = [], sorted(p.name for p in folder.glob("rss-*.json"))
    for name in names:
        data = load(folder, name)
        seconds = data.get("seconds", {})
        body.append([data.get("backend", name), field(data, name, "prompt_tokens"),
                     data.get("new_tokens"), f"{field(data, name, 'peak_rss_mib'):.1f}",
                     f"{seconds.get('prefill', 0):.1f}", f"{seconds.get('verify', 0):.1f}"])
    return ["## Peak memory (generate --json)", "",
            f"- files: {', '.join(f'`results/{n}`' for n in names)}",
            "- command: not recorded in the files (`python -m runtime generate --engine-dir "
            "engines/dflash-sharpdraft --backend B --prompt-file FILE --max-new-tokens 32 --json`)",
            "- machine: not recorded", "- date: not recorded", "",
            *table(["backend", "prompt tokens", "new tokens", "peak RSS MiB", "prefill s", "verify s"],
                   body), ""]


def backends_section(folder: Path) -> list[str]:
    name = "backends.json"
    data = load(folder, name)
    args = field(data, name, "args")
    command = ("python -m scripts.bench_backends " + " ".join(f"--engine {e}" for e in args["engine"])
               + f" --contexts {' '.join(map(str, args['contexts']))} --modes {' '.join(args['modes'])}"
               + f" --new-tokens {args['new_tokens']} --repeats {args['repeats']}")
    body = [[r["context"], r["mode"], r["engine"], f"{r['tok_s_median']:.2f}",
             "yes" if r.get("same_tokens_as_first") else "no"] for r in field(data, name, "rows")]
    return ["## Backends head to head (scripts/bench_backends.py)", "",
            *provenance_lines(data, name, folder, command=command), "",
            *table(["context", "mode", "backend", "tok/s median", "same tokens"], body), ""]


def heldout_section(folder: Path) -> list[str]:
    """scripts/heldout_mal.py --json files; none yet from before it wrote JSON."""
    lines = []
    for name in sorted(p.name for p in folder.glob("heldout*.json")):
        data = load(folder, name)
        body = [[d["drafter"], f"{d['mal']:.4f}", d["blocks"],
                 f"{d['minus_first']:+.4f} ({d['paired_standard_error']:.4f})" if "minus_first" in d else "—"]
                for d in field(data, name, "drafters")]
        lines += [f"### `{name}`", "", *provenance_lines(data, name, folder),
                  f"- held-out windows: `{data.get('held_out')}`, blocks anchored at token "
                  f"{data.get('anchors_from')} or later", "",
                  *table(["drafter", "teacher-forced MAL", "blocks",
                          "minus the first (paired standard error)"], body), ""]
    if not lines:
        return []
    return ["## Held-out MAL of drafters (scripts/heldout_mal.py)", "", *lines]


GPU_FIGURES = ("status", "graph_capture_passed", "host_us_per_call", "single_launch_vs_split",
               "decode_vs_sdpa")  # named first; any other flat figure follows


def _figure(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def measurement_rows(data: dict) -> list[str]:
    """A section's `rows` (scripts/gpu_e2e.py: one per mode and context, transformers'
    peers named in their mode, step costs with host and GPU time) as a table; a row that
    was skipped, failed or fell back says so."""
    rows = [r for r in data.get("rows") or [] if isinstance(r, dict) and "mode" in r]
    if not rows:
        return []

    def note(r: dict) -> str:
        said = [f"{k}: {r[k]}" for k in ("skipped", "error", "fallback") if r.get(k)]
        if "tokens_equal_target" in r:
            said.append("tokens = target-only's" if r["tokens_equal_target"] else "tokens DIFFER from target-only's")
        return "; ".join(said)

    cell = lambda r, k: "" if r.get(k) is None else r[k]  # noqa: E731
    return table(["mode", "context", "tok/s", "MAL", "host ms", "GPU ms", "note"],
                 [[r["mode"], cell(r, "context"), cell(r, "tok_s"), cell(r, "mal"), cell(r, "host_ms"),
                   cell(r, "gpu_ms"), note(r)] for r in rows]) + [""]


def gpu_section(folder: Path) -> list[str]:
    """results/gpu/*.json from scripts/gpu_check.py (one file per section, plus the kernel
    bench's): device, date, command, each flat figure the file holds, then its
    measurement rows as a table."""
    gpu = folder / "gpu"
    lines = []
    for path in sorted(gpu.glob("*.json")) if gpu.is_dir() else []:
        name = f"gpu/{path.name}"
        data = load(folder, name)
        flat = {k: v for k, v in data.items()
                if not isinstance(v, (list, dict)) or (isinstance(v, dict) and v
                                                       and not any(isinstance(x, (list, dict)) for x in v.values()))}
        keys = [k for k in GPU_FIGURES if k in flat] + sorted(
            k for k in flat if k not in GPU_FIGURES and k not in {"device", "date", "command", "section"})
        lines += [f"### `results/{name}`", "", f"- device: {data.get('device') or NOT_RECORDED}",
                  *provenance_lines(data, name, folder)[1:2], *provenance_lines(data, name, folder)[3:], "",
                  *(f"- {k}: {_figure(flat[k])}" for k in keys), "",
                  *measurement_rows(data),
                  *plot_line(folder, f"gpu/{path.stem}", path.stem)]
    if not lines:
        return []
    return ["## GPU runs (scripts/gpu_check.py)", "", *lines]


def lossless_section(folder: Path) -> list[str]:
    """scripts/dtype_lossless.py files: prompts whose greedy tokens differ from target-only
    alone, per backend, dtype and mode, one at a time and in flight."""
    names = sorted(p.name for p in folder.glob("lossless-dtype*.json"))
    if not names:
        return []
    lines = ["## Greedy tokens against target-only per backend and dtype (scripts/dtype_lossless.py)", "",
             "Prompts whose greedy tokens differ from target-only one at a time in the same "
             "backend and dtype (and prefill dtype), target-only's prefill and decode seconds "
             "one at a time, and, where the file records it, how many prompts' target-only "
             "tokens differ from the first configuration's (another target, not a loss).", ""]
    for name in names:
        data = load(folder, name)
        level = f"c{field(data, name, 'concurrency')}"

        def config(r):
            prefill = r.get("prefill_dtype", "float32")
            return f"{r['backend']}, {r['dtype']}" + (f", prefill {prefill}" if prefill != "float32" else "")

        def drift(r):
            vs = r.get("target_vs_first")
            return NOT_RECORDED if vs is None else f"{len(vs['differ'])} (vs {vs['config']})"

        body = [[config(r), mode, len(m["alone"]), len(m[level]),
                 f"{r['target_alone_prefill_s']:.2f} / {r['target_alone_decode_s']:.2f}", drift(r)]
                for r in field(data, name, "configs") for mode, m in r["modes"].items()]
        lines += [f"### `{name}` (code {data.get('commit', NOT_RECORDED)}; {data['requests']} prompts, "
                  f"{data['max_new_tokens']} tokens)", "", *provenance_lines(data, name, folder), "",
                  *table(["backend, dtype", "mode", "differ alone", f"differ at {level}",
                          "target-only alone: prefill / decode s",
                          "target-only differs from the first config"], body), ""]
    return lines


def render(folder: Path) -> str:
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder of results")
    lines = ["# Results", "",
             "Generated by `python -m runtime report` from the files under `results/`; do not edit "
             "by hand: rerun the command that wrote a file, then the report. Where a file does not "
             "record its command, machine or date, the page says \"not recorded\". The README "
             "shows the first table and what it means; docs/calibration.md and docs/engines.md "
             "read the others, and CHANGELOG.md says what changed between runs.", ""]
    lines += bench_section(folder, "bench.json", "Speed and MAL per mode (bench, adaptive draft length)",
                           "Decode-phase tokens per second over target-only, and MAL, per mode; "
                           "the median over interleaved repeats.", "bench")
    lines += bench_section(folder, "bench-mal.json", "MAL against context (bench, whole blocks)",
                           "Every block verified whole, so MAL is the drafter's, not the cost "
                           "model's; the tok/s columns of this run are not speed results.", "bench-mal")
    lines += batch_section(folder)
    lines += diagnose_section(folder)
    lines += calibrate_section(folder)
    lines += families_section(folder)
    lines += window_section(folder)
    lines += loadtest_section(folder)
    lines += rss_section(folder)
    lines += backends_section(folder)
    lines += lossless_section(folder)
    lines += heldout_section(folder)
    lines += gpu_section(folder)
    older = sorted(p.name for p in folder.glob("bench-*.json")
                   if p.name not in {"bench-mal.json", "bench-batch8.json"})
    if older:
        lines += ["## Older bench runs kept in results/", "",
                  "Earlier drafters and settings; the files do not say which drafter version ran "
                  "(see CHANGELOG.md).", ""]
        for name in older:
            stem = Path(name).stem
            lines += bench_section(folder, name, f"`{name}`", "", stem, level="###")
    text_only = [n for n in TEXT_ONLY if (folder / n).is_file()]
    if text_only:
        lines += ["## Results kept as text only (not in JSON)", "",
                  *(f"- `results/{n}`: {TEXT_ONLY[n]}" for n in text_only), ""]
    return "\n".join(lines).rstrip() + "\n"


def run(args) -> int:
    folder, output = Path(args.results), Path(args.output)
    try:
        if args.headline:
            print("\n".join(headline(load(folder, "bench.json"))))
            return 0
        text = render(folder)
    except (KeyError, IndexError, TypeError) as exc:  # a row missing what its table reads
        raise ReportError(f"a file under {folder} lacks a field its table reads: {exc!r}") from None
    if args.check:
        if not output.is_file() or output.read_text() != text:
            raise ReportError(f"{output} is out of date: run python -m runtime report")
        progress(f"{output} is up to date")
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    progress(f"wrote {output}")
    return 0
