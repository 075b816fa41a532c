"""`python -m runtime generate`: one prompt through an engine, streamed to the terminal
(or one JSON object with --json), with the drafter under SharpDraft, frozen, or not at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime.cli import UsageError, progress


def add_parser(sub):
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


def run(args) -> int:
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
    stream = None if args.json else TextStream(engine.decode)
    gen = engine.generate(prompt, args.max_new_tokens, mode, sampling,
                          stop=not args.ignore_eos, on_tokens=stream)
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


class TextStream:
    """Writes text as tokens are committed; decodes the whole output each time, since a
    token's text can depend on its neighbours (byte-level BPE)."""

    def __init__(self, decode):
        self.decode, self.tokens, self.shown = decode, [], ""

    def __call__(self, new: list[int]) -> None:
        self.tokens.extend(new)
        text = self.decode(self.tokens)
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text
