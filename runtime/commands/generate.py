"""`python -m runtime generate`: one prompt through an engine, streamed to the terminal
(or one JSON object with --json), in any decoding mode of runtime/modes.py's table the
engine runs (--mode NAME; default SharpDraft where the engine has it). The older flags
stay as aliases: --no-sharpdraft, --target-only, --ngram, --hybrid, and --window, which
swaps the drafter for its windowed, frozen self (alone, or with --hybrid)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from runtime.backends import RUNNABLE_BACKENDS
from runtime.cli import UsageError, add_device_options, device_options, progress
from runtime import modes
from runtime.modes import Mode
from runtime.streaming import TextStream

# The flags that name a mode (before --mode existed), as the table's rows they choose.
ALIASES = {"target_only": Mode.TARGET, "ngram": Mode.NGRAM, "hybrid": Mode.HYBRID,
           "no_sharpdraft": Mode.FROZEN}


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text with an engine (streams to the terminal)")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS,
                   help="run with this backend instead of the one engine.json names")
    add_device_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--mode", choices=[m.value for m in Mode], metavar="NAME",
                      help="decoding mode (docs/modes.md): " + ", ".join(Mode)
                           + "; default: sharpdraft where the engine has it")
    mode.add_argument("--no-sharpdraft", action="store_true", help="run the drafter frozen")
    mode.add_argument("--target-only", action="store_true", help="no drafter at all")
    mode.add_argument("--ngram", action="store_true",
                      help="draft by n-gram lookup in the context instead of the drafter")
    mode.add_argument("--hybrid", action="store_true",
                      help="SharpDraft drafter, with n-gram lookup's drafts verified instead "
                           "when it finds a better proposal (DFlash engines)")
    p.add_argument("--window", action="store_true",
                   help="the drafter frozen, its blocks seeing only the last context keys of "
                        "its training length (engine.json extra.draft_window; DFlash); with "
                        "--hybrid, that drafter assisted by n-gram lookup")
    p.add_argument("--draft-length", choices=("adaptive", "full"), default="adaptive",
                   help="verify the drafts worth their measured cost, and with --hybrid run the "
                        "drafter only where it pays (adaptive); or the whole block")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    p.add_argument("--verify", action="store_true",
                   help="hash every file the engine depends on (default: size/mtime stamp)")
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


def decoding_mode(args, default: Mode) -> Mode:
    """The mode --mode names, or the alias flags choose; --window swaps the drafter's
    attention for its draft window."""
    if args.window:
        if args.target_only or args.ngram or args.mode:
            raise UsageError("--window is a drafter's draft window; it does not combine with "
                             "--target-only, --ngram or --mode (try --mode window)")
        return modes.find(modes.MODEL, modes.WINDOWED, ngram_assist=args.hybrid)
    if args.mode:
        return Mode(args.mode)
    return next((m for flag, m in ALIASES.items() if getattr(args, flag)), default)


def alias_flags(args) -> list[str]:
    """The mode-naming flags given, as typed."""
    given = [flag for flag in (*ALIASES, "window", "mode") if getattr(args, flag)]
    return ["--" + flag.replace("_", "-") for flag in given]


def run(args) -> int:
    from runtime.engine import Engine
    from runtime.sampling import Sampling
    from runtime.spec import open_spec

    text = read_prompt(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    spec = open_spec(Path(args.engine_dir), args.backend,
                     verify="full" if args.verify else "quick", **device_options(args))
    if spec.own_loop:
        return run_own_loop(args, spec, text, sampling)
    engine = Engine(spec)  # the spec opened above
    prompt = engine.encode(text)
    if len(prompt) >= engine.context_limit:
        raise UsageError(f"the prompt has {len(prompt)} tokens; the target's context holds "
                         f"{engine.context_limit}")
    mode = decoding_mode(args, spec.rule_default())
    why = spec.refusal(mode)
    if why:
        raise UsageError(f"{args.engine_dir} cannot run '{mode}': {why} (it runs "
                         f"{', '.join(spec.modes)})")
    stream = None if args.json else TextStream(engine.decode)

    def show(new: list[int]) -> None:
        sys.stdout.write(stream.push(new))
        sys.stdout.flush()

    gen = engine.generate(prompt, args.max_new_tokens, mode, sampling,
                          stop=not args.ignore_eos, on_tokens=None if args.json else show,
                          adaptive=args.draft_length == "adaptive")
    summary = gen.summary()
    scaling = (spec.family_preset if mode.swaps_scaling else spec.scaling).to_dict() \
        if mode.scaled else None
    if args.json:
        # Peak resident memory of this process (KiB on Linux): model, caches and all.
        peak_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        print(json.dumps({"mode": mode, "backend": engine.backend, "peak_rss_mib": peak_mib,
                          "text": engine.decode(gen.tokens), "tokens": gen.tokens,
                          "sharpdraft": scaling} | summary))
    else:
        print(stream.flush())
        progress(f"[{mode}] {summary['new_tokens']} tokens, MAL {summary['mean_accepted_length']:.2f} "
                 f"over {summary['verify_steps']} verify steps, "
                 f"{summary['tokens_per_second']:.1f} tok/s")
    return 0


def run_own_loop(args, spec, text: str, sampling) -> int:
    """An engine whose backend runs its own loop (TensorRT-LLM or vLLM: its LLM with its
    speculative_config, SharpDraft's hook or plugin where the drafter asks for it), so --draft-length, the modes
    it has no such loop for, --backend and the placement options do not apply."""
    mode = decoding_mode(args, spec.rule_default())
    why = spec.refusal(mode)
    if why or spec.refusals:
        flags = (alias_flags(args) if why else []) + ["--" + k.replace("_", "-") for k in spec.options]
        raise UsageError(modes.own_loop_refusal(args.engine_dir, flags, why or spec.refusals[0],
                                                spec.modes, spec.backend))
    loop = spec.loader(spec.dir, spec.manifest, spec.drafting)
    result = loop.generate(text, args.max_new_tokens, sampling, sharpdraft=mode.scaled,
                           speculative=mode.uses_drafter_model)
    scaling = spec.scaling.to_dict() if mode.scaled else None
    if args.json:  # sharpdraft_applied: what the proof check saw (drafter, layers, processes)
        print(json.dumps({"mode": mode, "backend": spec.backend, "sharpdraft": scaling} | result))
    else:
        print(result["text"])
        progress(f"[{mode}] {len(result['tokens'])} tokens (its backend's own loop)")
    return 0
