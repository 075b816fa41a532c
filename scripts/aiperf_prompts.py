"""Prompts for AIPerf from the evaluation split: COUNT windows of TOKENS tokens (the target's
tokenizer) from the longest evaluation-split stdlib files, one per file in turn and
further into the file each round, written as AIPerf's single_turn JSONL ({"text": ...}).

    python -m scripts.aiperf_prompts --engine-dir engines/dflash-sharpdraft --tokens 512 \
        --count 8 --out /tmp/prompts-512.jsonl

Decoding a window and encoding it again can move a boundary token, so each prompt is
within a few tokens of TOKENS; the script prints the lengths it got.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from runtime.corpus import long_documents
from runtime.engine import load_tokenizer
from runtime.spec import open_spec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(open_spec(Path(args.engine_dir)).manifest.target_dir)
    docs = [tokenizer(path.read_text(), add_special_tokens=False).input_ids
            for path in long_documents("eval", 4 * args.tokens)[:args.count]]
    docs = [ids for ids in docs if len(ids) >= args.tokens]
    if not docs:
        print(f"error: no evaluation-split file holds {args.tokens} tokens", file=sys.stderr)
        return 1
    prompts = []
    for i in range(args.count):
        ids = docs[i % len(docs)]
        start = (i // len(docs)) * args.tokens % max(1, len(ids) - args.tokens + 1)
        prompts.append(tokenizer.decode(ids[start:start + args.tokens]))
    Path(args.out).write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
    lengths = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in prompts]
    print(f"wrote {args.out}: {len(prompts)} prompts of {lengths} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
