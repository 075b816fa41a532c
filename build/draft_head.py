"""Write the draft-vocabulary head into a DFlash checkpoint that lacks it.

    python -m build.draft_head DIR [--target PATH]

A DFlash drafter with a draft vocabulary (`draft_vocab_size` and `d2t`) drafts over the
target head's rows for those ids. Engines read those rows from the checkpoint's
`lm_head.weight`; without it vLLM silently scores draft token j with target row j
(runtime/models/dflash.py, docs/vllm.md), and our own loader refuses the checkpoint.
This writes `lm_head.weight` = target_head[arange(draft_vocab_size) + d2t], in the target
head's dtype, to DIR/lm_head.safetensors (model.safetensors is left as it was published).
The target defaults to the embedded one (build/checkpoints.py prepare_target).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.cli import UsageError, progress, run


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m build.draft_head", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", metavar="DIR", help="DFlash checkpoint (config.json + model.safetensors)")
    p.add_argument("--target", metavar="PATH", help="transformers directory or .gguf (default: the embedded target)")
    return p.parse_args(argv)


def target_head(target_dir: Path):
    """The target's LM head weight [vocab, hidden] (its embedding when tied)."""
    import torch

    from runtime.models.target import load_target

    model, _ = load_target(target_dir, torch.float32)
    return model.lm_head.weight.detach()


def add_head(checkpoint: Path, head) -> str:
    """Write `checkpoint`'s draft head (HEAD_FILE); returns what was done."""
    import torch
    from safetensors.torch import load_file, save_file

    from runtime.models.dflash import CHECKPOINT_FILES, HEAD_FILE, read_dflash_config

    config = read_dflash_config(checkpoint)
    if not config.draft_vocab_size:
        raise UsageError(f"{checkpoint} drafts over the target's whole vocabulary: it shares the "
                         "target's head, so there is no draft head to write")
    if head.shape[0] != config.vocab_size:
        raise UsageError(f"the target's head has {head.shape[0]} rows, {checkpoint} was built for a "
                         f"{config.vocab_size}-token vocabulary")
    state = load_file(checkpoint / CHECKPOINT_FILES[1])
    out = checkpoint / HEAD_FILE
    if out.is_file():
        state |= load_file(out)
    ids = torch.arange(config.draft_vocab_size) + state["d2t"].long()
    rows = head[ids].clone().contiguous()
    if "lm_head.weight" in state:
        if torch.equal(state["lm_head.weight"], rows):
            return f"{checkpoint} already holds the draft head"
        raise UsageError(f"{checkpoint} holds an lm_head.weight other than the target head's rows; "
                         "left as it is")
    save_file({"lm_head.weight": rows}, out, metadata={"format": "pt"})
    return f"{out}: lm_head.weight [{rows.shape[0]}, {rows.shape[1]}] ({rows.dtype}) written"


def main(argv) -> int:
    from build.checkpoints import prepare_target

    args = parse(argv)
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise UsageError(f"{checkpoint} is not a checkpoint directory (no config.json)")
    target_dir, _ = prepare_target(args.target, progress)
    print(add_head(checkpoint, target_head(target_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
