#!/usr/bin/env python3
"""The target as a half-precision transformers directory in shards small enough to carry
one per transfer to a machine without the `gguf` package (the GPU machine: one transfer
holds 64 MiB; the GGUF alone is 98 MB).

    python -m scripts.convert_target --out engines/gpu/smollm2-135m-fp16   # default target
    python -m scripts.convert_target --target DIR_OR_GGUF --out DIR --dtype float16 --shard-mb 60

Writes config.json, the tokenizer, model-0000N-of-0000M.safetensors shards (each at most
--shard-mb) and their index, then prints one line per shard with its size (the default
target: 5 shards, 256.6 MiB in fp16): carry them in consecutive runs, one each (see
scripts/gpu_e2e.py). Progress on stderr; errors in one line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from runtime.placement import DTYPES


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.convert_target", description=__doc__.splitlines()[0])
    p.add_argument("--target", metavar="PATH", help="transformers directory or .gguf (default: "
                   "the default target, SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--out", required=True, metavar="DIR")
    # float16 keeps the Q4_1 values (scale * q + min, scale and min in fp16) closer than bf16
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.add_argument("--shard-mb", type=float, default=60, help="largest shard, in MB (default 60)")
    return p.parse_args(argv)


def convert(target, out: Path, dtype: str, shard_mb: float) -> list[Path]:
    import torch

    from build.checkpoints import prepare_target
    from runtime.models.target import load_hf_causal_lm

    source, _ = prepare_target(target, progress=lambda m: print(m, file=sys.stderr))
    model, tokenizer = load_hf_causal_lm(source, getattr(torch, dtype))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=int(shard_mb * 10**6))
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(out.glob("*.safetensors"))


def main(argv=None) -> int:
    args = parse(argv)
    if not args.shard_mb > 0:
        print(f"error: --shard-mb must be > 0, got {args.shard_mb}", file=sys.stderr)
        return 2
    from runtime.models.target import ModelError

    try:
        shards = convert(args.target, Path(args.out), args.dtype, args.shard_mb)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = 0
    for shard in shards:
        size = shard.stat().st_size
        total += size
        print(f"{shard} {size / 2**20:.1f} MiB")
    print(f"{len(shards)} shards, {total / 2**20:.1f} MiB in all, in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
