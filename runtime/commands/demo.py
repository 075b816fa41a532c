"""`python -m runtime demo` (what `make demo` runs, after building the engine it opens):
continue a long evaluation document from ~4K tokens of context in every mode the default
SharpDraft engine runs -- SmolLM2-135M-Instruct with the DFlash drafter shipped in
checkpoints/: target-only, n-gram lookup, frozen drafter, the frozen drafter under its draft
window, SharpDraft, and the drafter modes assisted by n-gram lookup -- from the same
prefill, each several times interleaved, and print the medians. The engine is built by
build_engine.py (the Makefile's demo target: `--backend torch --default-mode rule`, no
graphs to export and no default mode to time, since the demo times every mode itself);
a command of the runtime never runs the builder (docs/layering.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.cli import UsageError, progress

ENGINE = Path("engines") / "dflash-sharpdraft"
BUILD = "build_engine.py --drafter dflash --sharpdraft"


def add_parser(sub):
    p = sub.add_parser("demo", help="compare target-only / n-gram / frozen / window / SharpDraft / "
                                    "hybrid on a long document with the default SharpDraft engine "
                                    "(make demo builds it first)")
    p.add_argument("--engine-dir", default=str(ENGINE))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per mode (median)")
    p.add_argument("--modes", nargs="+", metavar="MODE",
                   help="the modes to decode beside target-only (default: every mode the engine runs)")
    p.add_argument("--debug", action="store_true")


def run(args) -> int:
    from runtime.manifest import MANIFEST, EngineError
    from runtime.spec import open_spec
    from runtime.commands.bench import STYLE, first_difference, summarize
    from runtime.measure import decode_from_one_prefill
    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.modes import Mode
    from runtime.step_metadata import StepMetadata

    engine_dir = Path(args.engine_dir)
    if not (engine_dir / MANIFEST).is_file():
        raise EngineError(f"{engine_dir} has no {MANIFEST} — run make demo (it builds one), or "
                          f"python {BUILD} --output {engine_dir}")
    spec = open_spec(engine_dir)
    if spec.scaling is None:
        raise UsageError(f"{engine_dir} was built without --sharpdraft: the demo compares "
                         f"SharpDraft — rebuild it with python {BUILD} --output {engine_dir}")
    engine = Engine(spec)
    doc = default_documents("eval", 1)[0]
    (name, ids), = tokenized(engine.encode, [doc], args.context)
    modes = engine.spec.modes
    if args.modes:
        unknown = [m for m in args.modes if m not in modes]
        if unknown:
            raise UsageError(f"--modes: {', '.join(unknown)} not run by {engine_dir} "
                             f"(it runs {', '.join(modes)})")
        modes = [Mode.TARGET] + [m for m in modes if m in args.modes and m != Mode.TARGET]
    progress(f"demo: {name} (evaluation split, never trained on), context {args.context} tokens, "
             f"{args.new_tokens} new tokens, backend {engine.backend}; prefill once, decode "
             f"{len(modes)} ways x {args.repeats} interleaved repeats")
    decode_from_one_prefill(engine, ids[:64], 4, modes)  # warm-up
    gens = decode_from_one_prefill(engine, ids[:args.context], args.new_tokens, modes, args.repeats)
    row = summarize(args.context, [gens])
    s = engine.scaling
    print(f"\nSharpDraft demo: {args.context}-token context from {name}, {args.new_tokens} new "
          f"tokens, greedy, backend {engine.backend}, median of {args.repeats} interleaved runs")
    keys = StepMetadata(0, args.context).block_keys(engine.manifest.block_size)
    print(f"query scaling: {s.describe()} -> beta {s.beta(keys):.3f} at this context\n")
    # MAL leads: tokens per verify pass where drafts were checked, the figure that carries
    # over to a GPU; "drafted": the share of steps that checked drafts (the engine's step
    # costs sit a drafter out where it loses on this machine); then this machine's speed
    print(f"{'':<22}{'MAL':>6}{'drafted':>9}{'tok/s':>9}{'vs target':>11}  same tokens")
    print(f"{'target only':<22}{'1.00':>6}{'-':>9}{row['tok_s_target']:>9.1f}{'1.00x':>11}  -")
    for mode, (_, label) in STYLE.items():
        if mode not in gens:
            continue
        gen = gens[mode][0]
        diff = first_difference(gen.tokens, gens[Mode.TARGET][0].tokens)
        drafted = gen.drafted_steps / max(gen.verify_steps, 1)
        print(f"{label:<22}{gen.drafted_mean_accepted_length:>6.2f}{drafted:>9.0%}"
              f"{row['tok_s_' + mode]:>9.1f}{row['speedup_' + mode]:>10.2f}x  "
              f"{'yes' if diff is None else f'no (from token {diff})'}")
    text = engine.decode(gens[Mode.SHARPDRAFT][0].tokens)
    print("\nfirst lines generated (SharpDraft):")
    for line in text.splitlines()[:8]:
        print("  | " + line)
    print("\nmore: python -m runtime bench --engine-dir", engine_dir, "--json bench.json --plot bench.png")
    sys.stdout.flush()
    return 0
