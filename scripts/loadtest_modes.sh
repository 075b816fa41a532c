#!/usr/bin/env bash
# Every mode the engine lists, served: for each, `python -m runtime loadtest` at
# concurrency 1 and 8 against a running server (the streaming model: in-flight batching),
# with the same prompts decoded in-process to check the served tokens (greedy) are the
# engine's own. One JSON per mode and OUT/summary.json: tok/s one at a time and at
# concurrency 8, their ratio, and token mismatches. Run on an idle machine.
#
#   python -m runtime serve --engine-dir engines/dflash-sharpdraft --model-repository /tmp/repo \
#       --streaming --start &
#   scripts/loadtest_modes.sh --url grpc://127.0.0.1:8001 --engine-dir engines/dflash-sharpdraft \
#       --requests 16 --max-new-tokens 64 --out results/loadtest-modes
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
URL=grpc://127.0.0.1:8001 ENGINE="" REQUESTS=16 NEW=64 OUT="$ROOT/results/loadtest-modes" MODES=""

die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --url) URL="$2";; --engine-dir) ENGINE="$2";; --requests) REQUESTS="$2";;
    --max-new-tokens) NEW="$2";; --out) OUT="$2";; --modes) MODES="$2";;
    -h|--help) sed -n '2,12p' "$0"; exit 0;;
    *) die "unknown argument $1 (see --help)";;
  esac
  shift 2 || die "$1 needs a value"
done
[ -n "$ENGINE" ] || die "--engine-dir DIR is required (the served engine, decoded in-process too)"
if [ -z "$MODES" ]; then
  MODES=$("$PY" -c "import sys; sys.path.insert(0, '$ROOT'); from runtime.spec import open_spec; print(' '.join(open_spec('$ENGINE').modes))")
fi

mkdir -p "$OUT"
for mode in $MODES; do
  echo "loadtest: mode $mode" >&2
  "$PY" -m runtime loadtest --url "$URL" --mode "$mode" --concurrency 1 8 --requests "$REQUESTS" \
    --max-new-tokens "$NEW" --engine-dir "$ENGINE" --threads 1 --json > "$OUT/$mode.json" \
    || echo "loadtest: mode $mode reported errors or token mismatches (see $OUT/$mode.json)" >&2
done

"$PY" - "$OUT" $MODES <<'PYEOF'
import json, pathlib, sys

out, modes = pathlib.Path(sys.argv[1]), sys.argv[2:]
rows = []
for mode in modes:
    data = json.loads((out / f"{mode}.json").read_text())
    level = {lv["concurrency"]: lv for lv in data["levels"]}
    rows.append({"mode": mode, "requests": data["requests"], "max_new_tokens": data["max_new_tokens"],
                 "tok_s_c1": level[1]["tokens_per_second"], "tok_s_c8": level[8]["tokens_per_second"],
                 "c8_over_c1": round(level[8]["tokens_per_second"] / level[1]["tokens_per_second"], 3),
                 "errors": level[1]["errors"] + level[8]["errors"],
                 "mal": level[8]["mean_accepted_length"],
                 "token_mismatches": data["token_mismatches"],
                 # the responses' own speculation objects, pooled (loadtest): the mode that
                 # ran, steps, accepted / drafted, MAL, mean beta
                 "speculation_c8": level[8].get("speculation")})
(out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{'mode':<15}{'tok/s c1':>10}{'tok/s c8':>10}{'c8/c1':>8}{'MAL':>7}  identical")
for r in rows:
    same = "yes" if r["token_mismatches"] == 0 and r["errors"] == 0 else f"NO ({r['token_mismatches']})"
    print(f"{r['mode']:<15}{r['tok_s_c1']:>10.1f}{r['tok_s_c8']:>10.1f}{r['c8_over_c1']:>8.2f}{r['mal']:>7.3f}  {same}")
PYEOF
