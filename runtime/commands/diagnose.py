"""`python -m runtime diagnose`: the paper's Figure-1 measurement for our drafter -- the
mean attention mass on each query's top-32 keys, per drafter layer, against the number
of visible keys, with the drafter frozen and with SharpDraft's scale (DFlash: the block's
rows; PARD: the draft rows of one chain step).

One target prefill per document at the longest length gives the context features of
every shorter prefix too (causal attention), so each length costs one drafter step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from plugins.scaling import QueryScaling
from runtime import families
from runtime.cli import UsageError, progress
from runtime.commands.provenance import provenance
from runtime.modes import Mode
from runtime.step_metadata import StepMetadata

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 7680)


def add_parser(sub):
    p = sub.add_parser("diagnose", help="top-32 attention mass per drafter layer vs visible keys")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--docs", nargs="+", metavar="FILE")
    p.add_argument("--max-docs", type=int, default=3)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--json", metavar="OUT", help="write the results object here ('-': stdout)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--debug", action="store_true")


def attention_mass(q, k, visible: int, beta: float, top_k: int) -> float:
    """Mean over heads and block rows of the top-k attention mass (all rows see N keys)."""
    from plugins.scaling import top_k_mass

    k = k[:, :, :visible].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (beta * q.float()) @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return float(top_k_mass(torch.softmax(scores, -1), top_k).mean())


@torch.inference_mode()
def measure(engine, ids: list[int], lengths: list[int], top_k: int) -> dict:
    """{mode: {length: [mass per layer]}, "visible": {length: N of the first drafted row}}
    for one document."""
    model, drafter = engine.model, engine.drafter_model
    bs = drafter.config.block_size
    _, features = engine.loaded.batch_target().add(ids[:max(lengths)], max(lengths))
    out = {Mode.FROZEN: {}, Mode.SHARPDRAFT: {}, "visible": {}}
    for length in lengths:
        block = torch.tensor([[ids[length]] + [drafter.config.mask_token_id] * (bs - 1)])
        # the step's metadata, once: the block drafted after `length` context rows
        n = out["visible"][length] = StepMetadata(0, length).block_keys(bs)
        for mode, scaling in ((Mode.FROZEN, None), (Mode.SHARPDRAFT, engine.scaling)):
            masses = {}

            def probe(layer, q, k):
                masses[layer] = attention_mass(q, k, n, scaling.beta(n) if scaling else 1.0, top_k)

            cache = drafter.new_cache(length)
            drafter(model.embed_tokens(block), features[None, :length], cache, scaling, probe=probe)
            out[mode][length] = [masses[i] for i in range(len(masses))]
    return out


@torch.inference_mode()
def measure_chain(engine, ids: list[int], lengths: list[int], top_k: int) -> dict:
    """measure() for a chain drafter (PARD): one drafter pass per length over the first
    `length` tokens and its pard rows; the mass is the mean over the draft rows, each
    row over its own N keys with its own beta."""
    drafter = engine.drafter_model
    k = engine.spec.drafting.max_drafts
    out = {Mode.FROZEN: {}, Mode.SHARPDRAFT: {}, "visible": {}}
    for length in lengths:
        row = ids[:length] + [drafter.config.pard_token] * (k - 1)
        x = torch.tensor([row])
        visible = StepMetadata(0, len(row)).causal_visible(len(row), 1)[0, -k:].tolist()
        out["visible"][length] = visible[0]
        for mode, scaling in ((Mode.FROZEN, None), (Mode.SHARPDRAFT, engine.scaling)):
            masses = {}

            def probe(layer, q, keys):
                masses[layer] = sum(
                    attention_mass(q[:, :, len(row) - k + j:len(row) - k + j + 1], keys, n,
                                   scaling.beta(n) if scaling else 1.0, top_k)
                    for j, n in enumerate(visible)) / k

            drafter(x, drafter.new_cache(len(row)), scaling, probe=probe)
            out[mode][length] = [masses[i] for i in range(len(masses))]
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    x = [r["visible_keys"] for r in result["rows"]]
    layers = len(result["rows"][0][Mode.FROZEN])
    colors = plt.get_cmap("tab10")
    for layer in range(layers):
        ax.plot(x, [r[Mode.FROZEN][layer] for r in result["rows"]], "o--", color=colors(layer),
                alpha=0.6, label=f"layer {layer}, frozen")
        ax.plot(x, [r[Mode.SHARPDRAFT][layer] for r in result["rows"]], "o-", color=colors(layer),
                label=f"layer {layer}, SharpDraft")
    ax.axvline(result["training_max_length"] or 0, color="k", lw=0.8, ls=":",
               label="drafter's training length")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x], fontsize=7)
    ax.set_xlabel("visible keys N (context + block)")
    ax.set_ylabel(f"mean top-{result['top_k']} attention mass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    scaling = QueryScaling.from_dict(result["query_scaling"])
    ax.set_title(f"drafter attention dilution; beta {scaling.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args) -> int:
    from runtime.commands.bench import training_max_length
    from runtime.commands.documents import default_documents, tokenized
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(args.engine_dir, backend="torch"))  # the probe reads torch tensors
    if engine.style is None:
        raise UsageError(f"{args.engine_dir} has no drafter model; nothing to diagnose")
    if engine.tree_shape is not None:  # EAGLE-3, whose drafts need a tree of scratch keys
        raise UsageError(f"{args.engine_dir}: diagnose probes DFlash and PARD drafters; the "
                         "EAGLE-3 probe is not written yet")
    if engine.scaling is None:
        raise UsageError(f"{args.engine_dir} was built without --sharpdraft; nothing to compare")
    lengths = sorted(set(args.lengths))
    if lengths[0] < 1 or lengths[-1] >= engine.context_limit:
        raise UsageError(f"--lengths must lie in [1, {engine.context_limit - 1}]")
    paths = args.docs or default_documents("eval", args.max_docs)
    docs = tokenized(engine.encode, paths, lengths[-1] + 1)
    per_doc = []
    for name, ids in docs:
        progress(f"diagnose: {name} (prefill {lengths[-1]} tokens, then one drafter step per length)")
        chain = families.drafts_chains(engine.style)
        per_doc.append((measure_chain if chain else measure)(engine, ids, lengths, args.top_k))
    rows = []
    for length in lengths:
        # N of the first drafted row (a DFlash block's, all rows alike; a chain's first), as
        # the measured step's metadata gave it
        n = int(per_doc[0]["visible"][length])
        row = {"context_tokens": length, "visible_keys": n, "beta": round(engine.scaling.beta(n), 4)}
        for mode in (Mode.FROZEN, Mode.SHARPDRAFT):
            layers = zip(*(d[mode][length] for d in per_doc))
            row[mode] = [round(sum(v) / len(v), 4) for v in layers]
        rows.append(row)
    result = {**provenance("diagnose"), "engine_dir": str(args.engine_dir), "top_k": args.top_k,
              "query_scaling": engine.scaling.to_dict(),
              "training_max_length": training_max_length(engine),
              "documents": [n for n, _ in docs], "rows": rows}
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            progress(f"wrote {args.json}")
        layers = len(rows[0][Mode.FROZEN])
        print(f"{'N':>6} {'beta':>6}  " + "  ".join(f"L{i} frozen -> SharpDraft" for i in range(layers)))
        for r in rows:
            print(f"{r['visible_keys']:>6} {r['beta']:>6.3f}  " + "  ".join(
                f"{f:>9.3f} -> {s:<10.3f}" for f, s in zip(r[Mode.FROZEN], r[Mode.SHARPDRAFT])))
    if args.plot:
        plot(result, args.plot)
        progress(f"wrote {args.plot}")
    return 0
