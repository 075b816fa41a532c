#!/usr/bin/env python3
"""Train an EAGLE-3 drafter for the default target (SmolLM2-135M-Instruct) on CPU, from
the target states build/train_drafter.py already cached.

    python -m build.train_eagle3 --cache .cache/train-dflash     # resumable (state in --work)

1. Data: train_drafter.py's shards -- 512-token windows of the stdlib *train* split, the
   target's hidden states at layers [1, 7, 14, 20, 27] (outputs, TargetModel's
   convention) and its top-32 next-token distribution per position; held-out.pt comes
   from the calibration split. EAGLE-3 reads three of those layers (default: outputs of
   1, 14, 27 = EAGLE ids 2, 15, 28; EAGLE's own default for 30 layers is 2, 15, 27).
2. Draft vocabulary: the N tokens the target picks most often (greedily) in the
   training windows, as d2t/t2d.
3. Training-time test, as EAGLE-3 trains: step 0 drafts after every position from the
   target's features; step j from the drafter's own state of step j - 1, attending to
   the context up to its row and its own earlier steps -- exactly what the j-th draft of
   a chain sees at inference, at the same positions. Soft cross-entropy against the
   target's top-32 distribution (inside the draft vocabulary), counted only while the
   text follows the target's greedy path, step j weighted decay^j.
4. Write the published layout (config.json + model.safetensors; embed_tokens left out:
   it is the target's, frozen, and load_eagle3 shares it) and a card (README.md,
   training.json).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from build import checkpoints, recipe
from plugins.attention import sharpdraft_attention
from runtime.cli import Parser, progress, run
from runtime.models.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from runtime.models.target import load_target


def parse(argv):
    p = Parser(prog="python -m build.train_eagle3", description=__doc__.splitlines()[0])
    recipe.add_target_and_out(p, "eagle3")
    p.add_argument("--cache", default=".cache/train-dflash",
                   help="train_drafter.py's cached target states (shard-*.pt, held-out.pt, meta.json)")
    p.add_argument("--work", default=".cache/train-eagle3", help="resumable training state")
    p.add_argument("--aux-layers", type=int, nargs=3, default=[1, 14, 27], metavar="L",
                   help="three of the cached layers (their outputs) for fc; EAGLE ids are these + 1")
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps (drafts ahead)")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=2, help="windows per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--decay", type=float, default=0.8, help="weight of step j: decay^j")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: whole)")
    p.add_argument("--init", choices=("random", "target-layer"), default="target-layer",
                   help="target-layer: MLP, o_proj, norms and the hidden half of q/k/v from the "
                        "target's last layer, lm_head from its LM head rows, fc passing the "
                        "highest aux layer through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-windows", type=int, help="use only this many training windows (smoke tests)")
    p.add_argument("--save-every", type=int, default=50, help="steps between saved states")
    recipe.add_time_limit(p, " (a step took ~11 s there)")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def read_cache(cache: Path, source: dict, max_windows: int | None):
    """The shards, checked against the target they were cached for."""
    meta_path = cache / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{cache} has no meta.json — run python -m build.train_drafter first (it caches the states)")
    meta = json.loads(meta_path.read_text())
    cached = str(meta.get("target"))
    # A GGUF's digest, or a directory build/checkpoints.py converted it into (named for it)
    same = (source.get("sha256") == cached if source.get("sha256")
            else Path(source.get("path", "")).name.endswith(cached[:12]) or source.get("path") == cached)
    if not same:
        raise ValueError(f"{cache} caches states of another target ({cached[:16]}…); pass its --target")
    shards = sorted(cache.glob("shard-*.pt"))
    if not shards or not (cache / "held-out.pt").is_file():
        raise ValueError(f"{cache} has no shard-*.pt or held-out.pt — run python -m build.train_drafter first")
    parts = [torch.load(p) for p in shards]
    train = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if max_windows:
        train = {k: v[:max_windows] for k, v in train.items()}
    return meta, train, torch.load(cache / "held-out.pt")


def pick_features(data: dict, cached_layers: list[int], wanted: list[int], width: int) -> dict:
    """Keep only the wanted layers' slices of the cached features (in fc's order)."""
    missing = [layer for layer in wanted if layer not in cached_layers]
    if missing:
        raise ValueError(f"layers {missing} are not cached (the cache holds {cached_layers})")
    slices = [data["features"][..., cached_layers.index(i) * width:(cached_layers.index(i) + 1) * width]
              for i in wanted]
    return data | {"features": torch.cat(slices, -1)}


def draft_vocabulary(data: dict, vocab: int, size: int) -> torch.Tensor:
    """The `size` target tokens most often chosen greedily in the windows, sorted."""
    if not size or size >= vocab:
        return torch.arange(vocab)
    counts = torch.bincount(data["top"][..., 0].flatten().long(), minlength=vocab)
    return counts.topk(size).indices.sort().values


def new_drafter(target, args, ids: torch.Tensor, seq_len: int) -> Eagle3Drafter:
    tc = target.config
    config = Eagle3Config(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta, vocab_size=tc.vocab_size, draft_vocab_size=len(ids),
        target_hidden_size=tc.hidden_size, aux_layer_ids=tuple(i + 1 for i in args.aux_layers),
        max_position_embeddings=tc.max_position_embeddings, training_max_length=seq_len)
    config.check_target(tc)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        drafter.d2t.copy_(ids - torch.arange(len(ids)))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight)
        if args.init == "target-layer":
            last = target.layers[-1]
            layer = drafter.midlayer
            for name in ("q_proj", "k_proj", "v_proj"):  # read the hidden half, as the target's layer did
                w = getattr(layer.self_attn, name).weight
                w.zero_()
                w[:, tc.hidden_size:] = getattr(last.self_attn, name).weight
            layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            layer.mlp.load_state_dict(last.mlp.state_dict())
            layer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
            layer.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
            drafter.norm.load_state_dict(target.norm.state_dict())
            drafter.lm_head.weight.copy_(target.lm_head.weight[ids])
            # fc starts by passing the highest aux layer through: the layer then reads a
            # state like the one the target's last layer reads, not noise
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -tc.hidden_size:] = torch.eye(tc.hidden_size)
    drafter.embed_tokens.weight.requires_grad_(False)  # the target's, frozen (as EAGLE trains)
    return drafter


def training_time_test(drafter: Eagle3Drafter, ids: torch.Tensor, features: torch.Tensor, steps: int):
    """Normalised states [b, T, H] of each step j: row p drafts the token at p + 2 + j,
    reading the token at p + 1 + j at position p + j and seeing the context keys 0..p
    plus its own keys of steps 1..j (a chain's view; the step's N = p + 1 + j keys)."""
    b, T = ids.shape
    hidden = drafter.project(features)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    own = torch.eye(T, dtype=torch.bool)
    keys, values, states = [], [], []
    for j in range(steps):
        token = ids[:, (torch.arange(T) + 1 + j).clamp(max=T - 1)]  # rows past the end are not scored
        rope = drafter.rotary((torch.arange(T) + j).expand(b, T), hidden.dtype)
        mask = torch.cat([causal] + [own] * j, -1).expand(b, T, T * (j + 1))
        bound = torch.full((b, T), T * (j + 1), dtype=torch.long)  # the mask decides

        def attend(q, k, v, mask=mask, bound=bound):
            keys.append(k)
            values.append(v)
            return sharpdraft_attention(q, torch.cat(keys, 2), torch.cat(values, 2), bound, None, mask)

        h = drafter.midlayer(drafter.embed_tokens(token), hidden, rope, attend)
        normed = drafter.norm(h)
        states.append(normed)
        hidden = normed if drafter.config.norm_output else h
    return states


def step_targets(data: dict, rows: torch.Tensor, j: int, to_draft: torch.Tensor):
    """For step j: the target's top-32 (as draft indices, -1 outside) and probabilities
    at the labels' positions, and each row's weight (0 past the window or off the
    target's greedy path)."""
    ids, top = data["ids"][rows], data["top"][rows].long()
    T = ids.shape[1]
    label_at = (torch.arange(T) + 1 + j).clamp(max=T - 1)
    weight = (torch.arange(T) + 1 + j <= T - 1).float().expand(len(rows), T).clone()
    for i in range(1, j + 1):  # input token p + 1 + i must be the target's argmax at p + i
        src = (torch.arange(T) + i).clamp(max=T - 1)
        nxt = (torch.arange(T) + 1 + i).clamp(max=T - 1)
        weight *= (ids[:, nxt] == top[:, src, 0]).float()
    cand = to_draft[top[:, label_at]]
    probs = data["probs"][rows][:, label_at].float() * (cand >= 0)
    mass = probs.sum(-1, keepdim=True)
    weight *= (mass[..., 0] > 0).float()
    return cand.clamp(min=0), probs / mass.clamp(min=1e-12), weight, top[:, label_at, 0]


def ttt_loss(drafter, data, rows, args, to_draft, ids_of):
    states = training_time_test(drafter, data["ids"][rows], data["features"][rows].float(), args.ttt_steps)
    total, norm, agree = 0.0, 0.0, []
    for j, state in enumerate(states):
        cand, probs, weight, top1 = step_targets(data, rows, j, to_draft)
        log_q = torch.log_softmax(state @ drafter.lm_head.weight.T, -1)
        per_row = -(probs * log_q.gather(-1, cand)).sum(-1)
        w = weight * args.decay ** j
        total = total + (per_row * w).sum()
        norm += float(w.sum())
        agree.append(((ids_of[log_q.argmax(-1)] == top1).float() * weight, weight))
    return total / max(norm, 1e-9), agree


@torch.no_grad()
def evaluate(drafter, data, args, to_draft, ids_of) -> dict:
    """Teacher-forced top-1 agreement with the target per step (where the text follows
    the target's greedy path) and the mean accepted length a chain of ttt_steps drafts
    implies (1 + leading agreements, rows whose chain lies inside the window; a chain
    the text leaves counts as rejected there, so this errs low)."""
    rows = torch.arange(min(16, len(data["ids"])))
    _, agree = ttt_loss(drafter, data, rows, args, to_draft, ids_of)
    by_step = [round(float(a.sum() / w.sum().clamp(min=1)), 4) for a, w in agree]
    hits = torch.stack([a for a, _ in agree], -1)  # [b, T, steps]
    T = hits.shape[1]
    whole = hits[:, :T - args.ttt_steps]
    return {"top1_agreement_by_step": by_step,
            "teacher_forced_mal": round(float(1 + whole.cumprod(-1).sum(-1).mean()), 4)}


def main(argv) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    started = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    target, _ = load_target(target_dir)
    meta, train, held_out = read_cache(Path(args.cache), source, args.max_windows)
    width = target.config.hidden_size
    train = pick_features(train, meta["target_layer_ids"], args.aux_layers, width)
    held_out = pick_features(held_out, meta["target_layer_ids"], args.aux_layers, width)
    ids = draft_vocabulary(train, target.config.vocab_size, args.draft_vocab)
    drafter = new_drafter(target, args, ids, train["ids"].shape[1])
    del target
    to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))

    settings = {k: getattr(args, k) for k in ("aux_layers", "ttt_steps", "steps", "batch", "lr", "decay",
                                              "draft_vocab", "init", "seed", "max_windows")}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.01, betas=(0.9, 0.95))
    state_path = work / "state.pt"
    step, history, _ = recipe.resume(state_path, settings, drafter, opt)
    g = torch.Generator().manual_seed(args.seed + step)
    n = len(train["ids"])
    bar = tqdm(total=args.steps, initial=step, desc="train eagle3", unit="step", file=sys.stderr)
    drafter.train()
    stopped_early = False
    while step < args.steps:
        if recipe.out_of_time(started, args.max_minutes, step):
            stopped_early = True
            break
        recipe.set_lr(opt, recipe.cosine_lr(args.lr, step, args.steps))
        rows = torch.randint(0, n, (args.batch,), generator=g)
        loss, agree = ttt_loss(drafter, train, rows, args, to_draft, ids)
        recipe.optimizer_step(drafter, opt, loss)
        step += 1
        history.append(loss.item())
        first = agree[0]
        bar.set_postfix(loss=f"{sum(history[-50:]) / len(history[-50:]):.3f}",
                        agree=f"{float(first[0].sum() / first[1].sum().clamp(min=1)):.2f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.steps:
            recipe.save_state(state_path, drafter, opt, step, history, settings)
        if step % 250 == 0 or step == args.steps:
            drafter.eval()  # the held-out trajectory, to stop a recipe that is not learning
            bar.write(f"step {step}: held-out {evaluate(drafter, held_out, args, to_draft, ids)}",
                      file=sys.stderr)
            drafter.train()
    bar.close()
    if stopped_early:
        recipe.save_state(state_path, drafter, opt, step, history, settings)

    drafter.eval()
    metrics = {"held_out_calibration_split": evaluate(drafter, held_out, args, to_draft, ids),
               "training_windows": evaluate(drafter, train, args, to_draft, ids)}
    progress(f"held-out: {json.dumps(metrics)}")
    out = Path(args.out)
    publish(drafter, out)
    write_card(out, args, drafter.config, source, n, history, metrics, time.time() - started, step)
    print(f"drafter written to {out}" + (f" after {step} of {args.steps} steps (rerun to continue)"
                                         if stopped_early else ""))
    print(f"next: python build_engine.py --drafter eagle3 --drafter-checkpoint {out} --backend torch")
    return 0


def publish(drafter: Eagle3Drafter, out: Path) -> None:
    """The published layout in bfloat16, without embed_tokens (the target's own)."""
    from safetensors.torch import save_file

    save_eagle3(drafter, out)  # config.json (+ a full model.safetensors, replaced below)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, out / "model.safetensors")


def write_card(out: Path, args, config, source, windows, history, metrics, seconds, steps_done):
    losses, last = recipe.loss_summary(history)
    size = (out / "model.safetensors").stat().st_size
    seq_len = config.training_max_length
    card = {"target": source, "training_max_length": seq_len, "windows": windows, "tokens": windows * seq_len,
            "steps": steps_done, "steps_planned": args.steps, "batch_windows": args.batch,
            "ttt_steps": args.ttt_steps,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids), "lr": args.lr,
            "decay": args.decay, "seed": args.seed, "init": args.init,
            "draft_vocab_size": config.draft_vocab_size, "loss_every_tenth": losses,
            "final_loss_last100": last, "held_out": metrics, "wall_seconds_this_run": round(seconds),
            "bytes": size}
    (out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    command = recipe.command_line("train_eagle3")
    held = metrics["held_out_calibration_split"]
    (out / "README.md").write_text(f"""# EAGLE-3 drafter for SmolLM2-135M-Instruct (trained here, on CPU)

One EAGLE-3 decoder layer (hidden {config.hidden_size}, q/k/v over [embedding, hidden]) in
the published layout (`midlayer.*`, `fc`, `lm_head`, `d2t`/`t2d`): `config.json` +
`model.safetensors` (bfloat16, {size / 1e6:.1f} MB; no `embed_tokens`: the target's,
shared at load time).

- Target: SmolLM2-135M-Instruct (sha256 {str(source.get('sha256', '?'))[:16]}…); fc reads EAGLE
  ids {list(config.aux_layer_ids)} (the outputs of target layers {list(args.aux_layers)}).
- Data: the DFlash recipe's cached target states (`build/train_drafter.py`): {windows}
  windows x {seq_len} tokens of the CPython stdlib *train* split; held out: calibration split.
- Training max length: **{seq_len} tokens** on purpose (the target reads far more), so long
  contexts dilute this drafter as the SharpDraft paper describes.
- Objective: training-time test over {args.ttt_steps} steps, soft cross-entropy against
  the target's top-32 distribution inside the draft vocabulary, on the target's greedy
  path, step j weighted {args.decay}^j.
- Draft vocabulary: {config.draft_vocab_size:,} tokens (the target's most frequent greedy choices).
- Init: {args.init}; {steps_done} of {args.steps} planned steps x {args.batch} windows, AdamW lr
  {args.lr} cosine, seed {args.seed}.
- Loss (last 100 steps): {last}; every tenth: {losses}.
- Held-out teacher-forced top-1 agreement by step {held['top1_agreement_by_step']},
  implied chain MAL {held['teacher_forced_mal']}.
- Made by: `{command}` ({seconds / 60:.0f} min, 2 CPU cores). `training.json` holds the numbers.
""")


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
