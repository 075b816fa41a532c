#!/usr/bin/env python3
"""Teacher-forced MAL of DFlash drafters on EVERY anchor of the cached held-out windows,
paired (same blocks for each drafter). train_drafter.py's evaluate draws 16 random
blocks per window (256 blocks: a standard error of ~0.05 MAL, as large as the gains
being compared); every anchor of the 16 windows is 8,064 blocks.

    python -m scripts.heldout_mal checkpoints/dflash-smollm2-135m .cache/drafter-v8 \
        --held-out .cache/train-dflash-cont/held-out.pt --anchors-from 192

(held-out.pt: the held-out shard a train_drafter.py work dir caches, from the calibration
split; rebuild one with the drafter card's command.)

A block anchored after token a drafts positions a+1 .. a+block-1 from the target's
features of tokens < a and its own token a; MAL is 1 + the leading drafts equal to the
target's greedy choice (the cached top-1), as in speculative decoding's greedy check.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


from build.train_drafter import _Head, load_shards, target_at
from runtime.commands.provenance import provenance
from runtime.models.dflash import DraftHead, load_dflash
from runtime.models.target import load_target
from runtime.sampling import target_ids

CHUNK = 64  # anchors per forward pass: bounds the block-attention memory


@torch.no_grad()
def heldout_mal(drafter, embed: torch.Tensor, data: dict, first_anchor: int = 1) -> torch.Tensor:
    """MAL of every block anchored at first_anchor or later in every window, flattened."""
    head = DraftHead(_Head(embed), drafter.draft_token_ids())  # the target's tied head
    block, seq = drafter.config.block_size, data["ids"].shape[1]
    out = []
    for w in range(len(data["ids"])):
        features = data["features"][torch.tensor([w])].float()
        for start in range(first_anchor, seq - block + 1, CHUNK):
            anchors = torch.arange(start, min(start + CHUNK, seq - block + 1))[None]
            block_ids = torch.full((1, anchors.shape[1], block), drafter.config.mask_token_id)
            block_ids[:, :, 0] = data["ids"][w][anchors]
            hidden = drafter.forward_train(F.embedding(block_ids.flatten(1), embed), features, anchors)
            hidden = hidden.unflatten(1, (anchors.shape[1], block))[:, :, 1:]
            drafted = target_ids(head(hidden).argmax(-1), head.vocab)
            source = anchors[:, :, None] + torch.arange(block - 1)  # the target's row for each draft
            want = target_at(data, torch.tensor([w]), source, "top")[..., 0].long()
            out.append(1 + (drafted == want).float().cumprod(-1).sum(-1).flatten())
    return torch.cat(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", help="DFlash checkpoint directories")
    p.add_argument("--held-out", required=True, metavar="FILE",
                   help="a held-out.pt that train_drafter.py cached in its work dir")
    p.add_argument("--anchors-from", type=int, default=1, metavar="A",
                   help="score only blocks anchored at token A or later: on a held-out shard of "
                        "continuations (train_drafter.py --data continuations), A = its "
                        "--prompt-len keeps the blocks whose bonus token and every checked "
                        "token are the target's own greedy text: what greedy speculation with "
                        "whole blocks would accept there, given the same context")
    p.add_argument("--target", default=None, help="target directory (default: the one engines/targets holds)")
    p.add_argument("--json", metavar="OUT", help="also write the scores, command, machine and date here")
    args = p.parse_args(argv)
    if not Path(args.held_out).is_file():
        p.error(f"--held-out {args.held_out}: no such file (train_drafter.py caches "
                "held-out.pt in its --work dir)")
    for path in args.drafters:
        if not (Path(path) / "config.json").is_file():
            p.error(f"{path}: not a DFlash checkpoint directory (no config.json)")
    data = load_shards([Path(args.held_out)])
    target_dir = Path(args.target) if args.target else next(Path("engines/targets").iterdir())
    target, _ = load_target(target_dir)
    embed = target.embed_tokens.weight.detach().float()
    first, scores = None, []
    for path in args.drafters:
        drafter = load_dflash(path).float().eval()
        last = data["ids"].shape[1] - drafter.config.block_size  # the last anchor a whole block fits
        if not 1 <= args.anchors_from <= last:
            p.error(f"--anchors-from must lie in 1..{last} for these windows and {path}'s blocks")
        mal = heldout_mal(drafter, embed, data, args.anchors_from)
        line = f"{path}: teacher-forced MAL {float(mal.mean()):.4f} over {len(mal)} blocks"
        score = {"drafter": str(path), "mal": round(float(mal.mean()), 4), "blocks": len(mal)}
        if first is None:
            first = mal
        else:
            diff = mal - first
            line += (f"; minus the first drafter's {float(diff.mean()):+.4f} "
                     f"(paired standard error {float(diff.std() / len(diff) ** 0.5):.4f})")
            score |= {"minus_first": round(float(diff.mean()), 4),
                      "paired_standard_error": round(float(diff.std() / len(diff) ** 0.5), 4)}
        scores.append(score)
        print(line)
    if args.json:
        line = shlex.join(["python", "-m", "scripts.heldout_mal", *(sys.argv[1:] if argv is None else argv)])
        Path(args.json).write_text(json.dumps(
            {**provenance("heldout_mal", line), "held_out": str(args.held_out),
             "anchors_from": args.anchors_from, "drafters": scores}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
