"""`python -m runtime demo` (what `make demo` runs): build the SharpDraft engine on the
default pair -- SmolLM2-135M-Instruct and the DFlash drafter shipped in checkpoints/ --
if it is not built yet, then continue a long evaluation document from ~4K tokens of
context six ways (target-only, n-gram lookup, frozen drafter, the frozen drafter under
its draft window, SharpDraft, SharpDraft assisted by n-gram lookup) from the same
prefill, each several times interleaved, and print the medians."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.cli import progress

ENGINE = Path("engines") / "dflash-sharpdraft"


def add_parser(sub):
    p = sub.add_parser("demo", help="build the default SharpDraft engine if needed and compare "
                                    "target-only / n-gram / frozen / window / SharpDraft / hybrid on a "
                                    "long document")
    p.add_argument("--engine-dir", default=str(ENGINE))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per mode (median)")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--debug", action="store_true")


def run(args) -> int:
    import build_engine
    from runtime.manifest import EngineError, read_manifest
    from runtime.commands.bench import STYLE, first_difference, summarize
    from runtime.measure import decode_from_one_prefill
    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.modes import Mode
    from runtime.step_metadata import StepMetadata

    engine_dir = Path(args.engine_dir)
    try:
        stale = args.rebuild or read_manifest(engine_dir).query_scaling is None
    except EngineError:
        stale = True
    if stale:
        progress(f"demo: building {engine_dir} (target + shipped drafter, SharpDraft on)")
        code = build_engine.main(["--drafter", "dflash", "--sharpdraft", "--output", str(engine_dir)])
        if code:
            return code
    engine = Engine(engine_dir)
    doc = default_documents("eval", 1)[0]
    (name, ids), = tokenized(engine.encode, [doc], args.context)
    modes = engine.modes
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
    print(f"{'':<22}{'MAL':>6}{'tok/s':>9}{'vs target':>11}  same tokens")
    print(f"{'target only':<22}{'1.00':>6}{row['tok_s_target']:>9.1f}{'1.00x':>11}  -")
    for mode, (_, label) in STYLE.items():
        if mode not in gens:
            continue
        diff = first_difference(gens[mode][0].tokens, gens[Mode.TARGET][0].tokens)
        print(f"{label:<22}{row['mal_' + mode]:>6.2f}{row['tok_s_' + mode]:>9.1f}"
              f"{row['speedup_' + mode]:>10.2f}x  {'yes' if diff is None else f'no (from token {diff})'}")
    text = engine.decode(gens[Mode.SHARPDRAFT][0].tokens)
    print("\nfirst lines generated (SharpDraft):")
    for line in text.splitlines()[:8]:
        print("  | " + line)
    print("\nmore: python -m runtime bench --engine-dir", engine_dir, "--json bench.json --plot bench.png")
    sys.stdout.flush()
    return 0
