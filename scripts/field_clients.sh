#!/usr/bin/env bash
# The field's clients (guidellm, AIPerf, lm-evaluation-harness), each in its own venv under
# .cache/, against a served engine on loopback: scripts/field_clients.py does the work and
# says how (--help). Results land in results/clients/ (summary.json and each tool's files).
#
#   scripts/field_clients.sh [--engine-dir engines/dflash-sharpdraft] [--out results/clients]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/field_clients.py" "$@"
