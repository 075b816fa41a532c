"""Every decoding mode's tokens on tiny engines, to a JSON file: run it on two commits and
compare the files (`cmp` or `diff`) to show a refactor left outputs unchanged.

The engines are built by build_engine.py itself over scripts/tiny_checkpoints.py's seeded
checkpoints (DFlash on torch and on onnxruntime with a draft window, PARD, EAGLE-3 trees
and chains, n-gram), with fixed step costs so that no timing reaches a decision. For each engine, each
mode it runs (the preset study mode too) decodes one prompt greedily and with seeded
sampling, alone and, where the backend batches, as a batch of two requests. A mode that
refuses (a tree asked to sample) records its one-line refusal instead of tokens.

    OMP_NUM_THREADS=1 .venv/bin/python -m scripts.compare_outputs --output /tmp/new.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)

NEW_TOKENS = 20
PROMPT = "def fibonacci(n):\n    "
SECOND = "import os\nimport sys\n\ndef main(argv):\n"
SAMPLINGS = {"greedy": dict(), "sampled": dict(temperature=0.8, top_p=0.95, seed=7)}


def build(argv: list[str]) -> None:
    import build_engine

    code = build_engine.main(argv + ["--step-costs", "fixed"])
    if code != 0:
        raise SystemExit(f"error: build_engine.py {' '.join(argv)} exited {code}")


def engines(root: Path) -> dict[str, Path]:
    """The engines compared, built under `root`."""
    from scripts import tiny_checkpoints as tiny

    target = tiny.make_target(root / "target")
    long_target = tiny.make_target(root / "long-target", context=4096)
    dflash = tiny.make_drafter(root / "dflash", target)
    long_dflash = tiny.make_drafter(root / "long-dflash", long_target, draft_vocab=256)
    pard = tiny.make_pard(root / "pard", target)
    eagle3 = tiny.make_eagle3(root / "eagle3", target, draft_vocab=200)
    scaling = ["--sharpdraft", "--ref-keys", "64", "--top-k", "8"]
    recipes = {
        "dflash-torch": ["--drafter", "dflash", *scaling, "--target", str(target),
                         "--drafter-checkpoint", str(dflash), "--backend", "torch",
                         "--draft-window", "16"],
        "dflash-onnxruntime": ["--drafter", "dflash", *scaling, "--target", str(long_target),
                               "--drafter-checkpoint", str(long_dflash), "--backend",
                               "onnxruntime", "--draft-window", "48"],
        "pard-torch": ["--drafter", "pard", *scaling, "--target", str(target),
                       "--drafter-checkpoint", str(pard), "--num-draft-tokens", "3",
                       "--backend", "torch"],
        "eagle3-tree-torch": ["--drafter", "eagle3", *scaling, "--target", str(target),
                              "--drafter-checkpoint", str(eagle3), "--tree-top-k", "3",
                              "--tree-depth", "3", "--tree-total-tokens", "8", "--backend", "torch"],
        "eagle3-chain-torch": ["--drafter", "eagle3", *scaling, "--target", str(target),
                               "--drafter-checkpoint", str(eagle3), "--tree-top-k", "1",
                               "--num-draft-tokens", "3", "--backend", "torch"],
        "ngram-torch": ["--drafter", "ngram", "--num-draft-tokens", "3", "--target", str(target),
                        "--backend", "torch"],
    }
    out = {}
    for name, argv in recipes.items():
        out[name] = root / "engines" / name
        build(argv + ["--output", str(out[name])])
    return out


def run_engine(engine_dir: Path) -> dict:
    from runtime.decode import Request
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.modes import Mode
    from runtime.sampling import Sampler, Sampling

    engine = Engine(open_spec(engine_dir))
    prompts = [engine.encode(PROMPT), engine.encode(SECOND)]
    record = {"modes": list(engine.spec.modes), "runs": {}}
    for mode in Mode:
        if engine.spec.refusal(mode) is not None:
            record["runs"][str(mode)] = {"refused": engine.spec.refusal(mode)}
            continue
        for how, kwargs in SAMPLINGS.items():
            key = f"{mode}/{how}"
            try:
                gen = engine.generate(prompts[0], NEW_TOKENS, mode=mode, stop=False,
                                      sampling=Sampling(**kwargs))
                record["runs"][key] = {"tokens": gen.tokens, "steps": gen.committed_per_step,
                                       "visible": gen.visible_per_step,
                                       "beta": [round(b, 12) for b in gen.beta_per_step]}
            except ValueError as exc:
                record["runs"][key] = {"refused": str(exc)}
            if engine.spec.batch_refusal(mode):
                record["runs"][key + "/batch"] = {"refused": engine.spec.batch_refusal(mode)}
                continue
            requests = [Request(prompt=p, max_new_tokens=NEW_TOKENS, sampler=Sampler(Sampling(**kwargs)))
                        for p in prompts]
            try:
                done = engine.decoder(mode).run(requests)
                record["runs"][key + "/batch"] = [
                    {"tokens": s.gen.tokens, "error": s.error} for s in done]
            except ValueError as exc:
                record["runs"][key + "/batch"] = {"refused": str(exc)}
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, path in engines(Path(tmp)).items():
            print(f"decoding on {name}", file=sys.stderr)
            results[name] = run_engine(path)
    args.output.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    runs = sum(len(r["runs"]) for r in results.values())
    print(f"{runs} runs on {len(results)} engines written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
