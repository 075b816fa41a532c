"""Two checkouts measured against each other (scripts/tree_batch_ab.py, scripts/decode_ab.py):
one child script run by each checkout in a process of its own, on its own code
(PYTHONPATH and working directory), rounds interleaved with the order alternating per
round, so a drifting machine's drift falls on both. The child prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def add_checkout_arguments(parser) -> None:
    """--before (required) and --after (default: this checkout): the two checkouts an A/B
    script runs, each a directory."""
    parser.add_argument("--before", required=True, metavar="DIR", help="the checkout before the change")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1]), metavar="DIR")


class ArmFailed(Exception):
    """A checkout's child exited non-zero: the message names it and its last stderr line."""


def interleaved(child: str, code: dict[str, str], argv: dict[str, list[str]], rounds: int,
                env: dict | None = None,
                report: Callable[[int, str, dict], None] | None = None) -> dict[str, list[dict]]:
    """Each label's list of the child's JSON results, one per round: the child run with
    argv[label] in checkout code[label], labels in order on even rounds, reversed on odd
    ones; report(round, label, result) after each run."""
    runs: dict[str, list[dict]] = {label: [] for label in code}
    order = list(code)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            out = subprocess.run([sys.executable, "-c", child, *argv[label]], cwd=code[label],
                                 env=(env or os.environ) | {"PYTHONPATH": code[label]},
                                 capture_output=True, text=True)
            if out.returncode:
                last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
                raise ArmFailed(f"the {label} checkout failed: {last}")
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            if report:
                report(r, label, runs[label][-1])
    return runs
