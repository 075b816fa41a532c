"""`python -m runtime <command>`: the runtime's command line. Each command lives in its
own module with `add_parser(subparsers)` and `run(args)`."""

from __future__ import annotations

import sys

from runtime.commands import (bench, default_mode, demo, diagnose, generate, loadtest, overhead, report,
                              serve, trtllm_serve, vllm_serve)
from runtime.cli import Parser, run

COMMANDS = {"generate": generate, "bench": bench, "default-mode": default_mode, "diagnose": diagnose,
            "demo": demo, "overhead": overhead, "serve": serve, "loadtest": loadtest,
            "trtllm-serve": trtllm_serve, "vllm-serve": vllm_serve, "report": report}


def main(argv) -> int:
    p = Parser(prog="python -m runtime", description="SharpDraft-TRT runtime")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMANDS.values():
        module.add_parser(sub)
    args = p.parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
