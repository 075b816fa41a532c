"""`python -m runtime generate|...` -- the runtime's command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime import bench, calibrate, demo, diagnose, overhead
from runtime.cli import Parser, UsageError, progress, run
from runtime.loadtest import add_loadtest, cmd_loadtest
from runtime.serve.command import add_serve, cmd_serve


def add_generate(sub):
    p = sub.add_parser("generate", help="generate text with an engine (streams to the terminal)")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--backend", choices=("torch", "onnxruntime"),
                   help="run with this backend instead of the one engine.json names")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-sharpdraft", action="store_true", help="run the drafter frozen")
    mode.add_argument("--target-only", action="store_true", help="no drafter at all")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    p.add_argument("--debug", action="store_true")


def read_prompt(args) -> str:
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UsageError(f"prompt file {path} does not exist")
        text = path.read_text(encoding="utf-8")
    else:
        text = args.prompt
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def cmd_generate(args) -> int:
    from runtime.engine import Engine
    from runtime.sampling import Sampling

    text = read_prompt(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    engine = Engine(args.engine_dir, backend=args.backend)
    prompt = engine.encode(text)
    if len(prompt) >= engine.context_limit:
        raise UsageError(f"the prompt has {len(prompt)} tokens; the target's context holds "
                         f"{engine.context_limit}")
    mode = "target" if args.target_only else "frozen" if args.no_sharpdraft else "sharpdraft"
    if mode == "sharpdraft" and engine.scaling is None:
        mode = "frozen"  # an engine built without --sharpdraft
    stream = None
    if not args.json:
        shown = ""

        def stream(_new):
            nonlocal shown
            now = engine.decode(gen_tokens)
            sys.stdout.write(now[len(shown):])
            sys.stdout.flush()
            shown = now

    gen_tokens: list[int] = []

    def on_tokens(new):
        gen_tokens.extend(new)
        if stream:
            stream(new)

    gen = engine.generate(prompt, args.max_new_tokens, mode, sampling,
                          stop=not args.ignore_eos, on_tokens=on_tokens)
    summary = gen.summary()
    scaling = engine.scaling.to_dict() if mode == "sharpdraft" else None
    if args.json:
        print(json.dumps({"mode": mode, "text": engine.decode(gen.tokens), "tokens": gen.tokens,
                          "sharpdraft": scaling} | summary))
    else:
        print()
        progress(f"[{mode}] {summary['new_tokens']} tokens, MAL {summary['mean_accepted_length']:.2f} "
                 f"over {summary['verify_steps']} verify steps, "
                 f"{summary['tokens_per_second']:.1f} tok/s")
    return 0


COMMANDS = {"generate": (add_generate, cmd_generate),
            "bench": (bench.add_parser, bench.run),
            "calibrate": (calibrate.add_parser, calibrate.run),
            "demo": (demo.add_parser, demo.run),
            "diagnose": (diagnose.add_parser, diagnose.run),
            "overhead": (overhead.add_parser, overhead.run),
            "serve": (add_serve, cmd_serve),
            "loadtest": (add_loadtest, cmd_loadtest)}


def main(argv) -> int:
    p = Parser(prog="python -m runtime", description="SharpDraft-TRT runtime")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add, _ in COMMANDS.values():
        add(sub)
    args = p.parse_args(argv)
    return COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
