#!/usr/bin/env bash
# Serving measured the way the field does: NVIDIA's AIPerf against our OpenAI endpoint
# (`python -m runtime serve ... --start --openai-port PORT`), at each concurrency, for each
# mode and prompt length; one JSON of TTFT p50/p99, ITL p50/p99, output tok/s and
# request throughput per run, gathered into OUT/summary.json.
#
# AIPerf has heavy dependencies: it lives in its own venv under .cache/ (never in
# requirements.txt). Start the server first; run this on an idle machine.
#
#   scripts/aiperf_serving.sh --url http://127.0.0.1:9000 --model dflash-sharpdraft \
#       --tokenizer checkpoints/<target> --modes "sharpdraft frozen" --isl "512 4096" \
#       --concurrency "1 4 8" --requests 32 --osl 256 --out results/aiperf
#
# --modes: names sent as {"sharpdraft": {"mode": NAME}}; "default" sends none.
# --eval-prompts ENGINE_DIR: prompts of --isl tokens cut from the evaluation split with
# that engine's tokenizer (scripts/aiperf_prompts.py), instead of AIPerf's synthetic ones.
# --input-file: a JSONL of {"text": PROMPT} (AIPerf's single_turn dataset) for every run
# (then --isl only labels the runs).
# --metrics URL: Triton's metrics endpoint of the same server (serve prints it; default
# http://127.0.0.1:8002/metrics, "none" to skip): the sharpdraft_spec_* counters are
# scraped before and after each run, and what the run added (steps, draft and accepted
# tokens, MAL, sit-outs, mean beta per mode and context bucket) lands in
# OUT/<run>/speculation.json and in the summary. AIPerf's own server-metrics collection
# is off (--no-server-metrics): on 2 cores its service missed heartbeats and AIPerf exited
# 1, calling the run degraded; the sharpdraft_spec_* scrape above is ours.
set -euo pipefail

AIPERF_VERSION=0.13.0
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.cache/aiperf-venv"
URL=http://127.0.0.1:9000 MODEL="" TOKENIZER="" MODES=default ISL=512 CONC="1 4 8"
REQUESTS=32 OSL=256 OUT="$ROOT/results/aiperf" INPUT_FILE="" EVAL_ENGINE=""
METRICS=http://127.0.0.1:8002/metrics

die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --url) URL="$2";; --model) MODEL="$2";; --tokenizer) TOKENIZER="$2";; --modes) MODES="$2";;
    --isl) ISL="$2";; --concurrency) CONC="$2";; --requests) REQUESTS="$2";; --osl) OSL="$2";;
    --out) OUT="$2";; --input-file) INPUT_FILE="$2";; --eval-prompts) EVAL_ENGINE="$2";;
    --metrics) METRICS="$2";;
    -h|--help) sed -n '2,25p' "$0"; exit 0;;
    *) die "unknown argument $1 (see --help)";;
  esac
  shift 2 || die "$1 needs a value"
done
[ -n "$MODEL" ] || die "--model NAME is required (GET $URL/v1/models lists it)"
[ -n "$TOKENIZER" ] || die "--tokenizer DIR (the target's tokenizer) is required: AIPerf counts tokens with it"
curl -sf "$URL/v1/models" >/dev/null || die "no OpenAI endpoint answers at $URL (start serve with --openai-port)"
if [ "$METRICS" != none ]; then
  curl -sf "$METRICS" >/dev/null || die "no metrics endpoint answers at $METRICS (pass --metrics URL or none)"
fi

# The server's speculation counters (runtime/metrics.py: read_speculation), as JSON.
scrape() {
  curl -sf "$METRICS" | "$ROOT/.venv/bin/python" -c 'import json, sys
sys.path.insert(0, sys.argv[1])
from runtime.metrics import read_speculation
print(json.dumps([[list(k), v] for k, v in read_speculation(sys.stdin.read()).items()]))' "$ROOT"
}

# run as `python -m aiperf`: the console script's shebang names the folder the venv was
# made in, so it breaks when the checkout moves
if ! "$VENV/bin/python" -m pip show aiperf 2>/dev/null | grep -q "^Version: $AIPERF_VERSION$"; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet "aiperf==$AIPERF_VERSION"
fi

mkdir -p "$OUT"
for mode in $MODES; do
  # Greedy, as the bench decodes; the mode travels in the extension field (JSON form: the
  # key:value form would send the object as a string).
  if [ "$mode" = default ]; then
    extra=(--extra-inputs '{"temperature": 0}')
  else
    extra=(--extra-inputs "{\"temperature\": 0, \"sharpdraft\": {\"mode\": \"$mode\"}}")
  fi
  for isl in $ISL; do
    if [ -n "$EVAL_ENGINE" ]; then
      prompts="$OUT/prompts-$isl.jsonl"
      [ -f "$prompts" ] || PYTHONPATH="$ROOT" "$ROOT/.venv/bin/python" -m scripts.aiperf_prompts \
        --engine-dir "$EVAL_ENGINE" --tokens "$isl" --count "$REQUESTS" --out "$prompts"
      inputs=(--input-file "$prompts" --custom-dataset-type single_turn)
    elif [ -n "$INPUT_FILE" ]; then
      inputs=(--input-file "$INPUT_FILE" --custom-dataset-type single_turn)
    else
      inputs=(--synthetic-input-tokens-mean "$isl" --synthetic-input-tokens-stddev 0)
    fi
    for c in $CONC; do
      dir="$OUT/$mode-isl$isl-c$c"
      echo "aiperf: mode $mode, isl $isl, concurrency $c -> $dir" >&2
      [ "$METRICS" = none ] || before="$(scrape)"
      "$VENV/bin/python" -m aiperf profile --model "$MODEL" --url "$URL" --endpoint-type completions --streaming \
        --tokenizer "$TOKENIZER" "${inputs[@]}" --output-tokens-mean "$OSL" --output-tokens-stddev 0 \
        --concurrency "$c" --request-count "$REQUESTS" "${extra[@]}" --artifact-dir "$dir" --ui-type none \
        --no-server-metrics
      if [ "$METRICS" != none ]; then
        after="$(scrape)"
        "$ROOT/.venv/bin/python" -c 'import json, sys
sys.path.insert(0, sys.argv[1])
from runtime.metrics import speculation_delta
b, a = ({tuple(k): v for k, v in json.loads(x)} for x in sys.argv[2:4])
for d in (b, a):
    for v in d.values():
        v["accepted_per_position"] = {int(p): n for p, n in v["accepted_per_position"].items()}
print(json.dumps(speculation_delta(b, a), indent=2))' "$ROOT" "$before" "$after" > "$dir/speculation.json"
      fi
    done
  done
done

# One summary from AIPerf's own JSON exports (profile_export_aiperf.json per run).
"$VENV/bin/python" - "$OUT" <<'EOF'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
rows = []
for export in sorted(out.glob("*/profile_export_aiperf.json")):
    data = json.loads(export.read_text())
    metrics = data.get("records", data)

    def stat(name, key):
        value = metrics.get(name)
        return value.get(key) if isinstance(value, dict) else None

    mode, isl, conc = export.parent.name.rsplit("-", 2)
    rows.append({"run": export.parent.name, "mode": mode, "isl": int(isl[3:]), "concurrency": int(conc[1:]),
                 "ttft_ms": {"p50": stat("time_to_first_token", "p50"), "p99": stat("time_to_first_token", "p99")},
                 "itl_ms": {"p50": stat("inter_token_latency", "p50"), "p99": stat("inter_token_latency", "p99")},
                 "output_tokens_per_s": stat("output_token_throughput", "avg"),
                 "requests_per_s": stat("request_throughput", "avg")}
                | ({"speculation": json.loads((export.parent / "speculation.json").read_text())["rows"]}
                   if (export.parent / "speculation.json").exists() else {}))
(out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
print(json.dumps(rows, indent=2))
EOF
