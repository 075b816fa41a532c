#!/usr/bin/env python3
"""End-to-end decoding on a GPU (scripts/gpu_check.py's gpu_e2e section; run(out_dir) ->
dict): the runtime's compiled torch path against HF transformers' own `generate` on the
same GPU in the same run.

(a) The real default target (SmolLM2-135M-Instruct) and the shipped DFlash drafter: every
    everyday mode (target-only, n-gram, frozen, SharpDraft, SharpDraft + n-gram, window +
    n-gram) at 4K and 8K context, tok/s and MAL, beside transformers' `generate` (static
    cache; prompt lookup for the n-gram peer).
(b) A Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head dim 128, random
    bf16 weights) with a DFlash-shaped drafter (5 layers, block 16): step costs only at
    4K, 16K and 32K context (1-token step, 17-token verify, drafter block; host time, GPU
    time, eager and CUDA-graph replay).

    python scripts/gpu_e2e.py --out DIR [--target DIR] [--steps cudagraph|inductor]

The target of (a) is read from a transformers directory: --target, else
engines/gpu/smollm2-135m-fp16 (scripts/convert_target.py writes it in fp16 shards of
--shard-mb, the first with the tokenizer and config: carried one per transfer, each beside
the travelling tree within its limit), else the default GGUF where the `gguf` package
imports; without any, (a) is "not run" with the reason (a missing shard is named).

Rows go to DIR/gpu_e2e.json (device, date, command; one row per measurement with mode,
context, tok_s, mal; transformers' rows name it in their mode), rewritten after each part,
so a run stopped at its limit keeps what it measured. tok_s is decode speed on both sides:
the N - 1 tokens after the prefill's first over the time after it. Each drafting mode's row
says whether its greedy tokens equal target-only's at that context (tokens_equal_target:
lossless on the device); `goals` holds the issue's GPU goals as ratios of the rows
(target-only / transformers' static cache, SharpDraft + n-gram / target-only, host / GPU
time of a graph-replayed decode step). The section passes when something was measured and none of the
runtime's rows failed, fell back to eager steps or differed from target-only; a part that
raises is a note, and the next part runs. Without CUDA: one line `error: ...`, exit 1.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_TARGET_DIR = REPO / "engines" / "gpu" / "smollm2-135m-fp16"  # git-ignored: carried
DRAFTER_DIR = REPO / "checkpoints" / "dflash-smollm2-135m"
CONTEXTS_A = (4096, 8192)
CONTEXTS_B = (4096, 16384, 32768)
NEW_TOKENS = 128
MODES = ("target", "ngram", "frozen", "sharpdraft", "hybrid", "window-hybrid")
BUDGET_S = 230  # the section's share of one device run; rows past it are skipped, saying so
# of BUDGET_S: the most (a)'s runtime rows take, and what (b) keeps whatever (a) took
RESERVE = {"ours": 0.3, "step_costs": 0.35}
QWEN3_8B = dict(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                head_dim=128, block=16, draft_layers=5)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Clock:
    """The section's time budget: what is left, and a reason when it ran out."""

    def __init__(self, budget_s: float):
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()

    def out(self) -> bool:
        return self.left() <= 0


# -- (a) the real target, every mode, beside transformers --------------------------------

@functools.cache
def eval_documents() -> tuple[Path, ...]:
    from runtime.corpus import long_documents

    return tuple(long_documents("eval", 20_000))  # a walk of the stdlib: once


def prompt_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of held-out CPython source (runtime/corpus.py's eval split)."""
    ids: list[int] = []
    for path in eval_documents():
        text = path.read_text(errors="replace")
        # tokenizing a whole 200 kB file for a short prompt costs seconds: a prefix first
        for part in (text[:8 * (length - len(ids))], text):
            more = tokenizer(part, add_special_tokens=False).input_ids
            if len(ids) + len(more) >= length or part is text:
                break
        ids += more
        if len(ids) >= length:
            return ids[:length]
    raise RuntimeError(f"the eval documents hold {len(ids)} tokens, fewer than {length}")


def mode_decoder(mode: str, target, drafter_model, target_model, scaling, window, shared):
    """The decode loop (runtime/decode.py) for `mode` over the compiled roles: the
    proposer the engine would pick (runtime/modes.py's table), every drafter step
    verifying its whole block (no measured step costs for this GPU)."""
    from runtime import modes, proposers
    from runtime.backends.rows import RowBlockDrafters, RowTargets
    from runtime.decode import Decoder
    from runtime.ngram import NGramProposer

    m = modes.parse(mode)
    if m.draft_source == modes.NO_DRAFTER:
        proposer = proposers.NoDrafts()
    elif m.draft_source == modes.LOOKUP:
        proposer = proposers.Lookup(NGramProposer)
    else:
        drafter = make_drafter(drafter_model, target_model, scaling if m.scaled else None,
                               window if m.needs_window else None, shared)
        proposer = proposers.Block(RowBlockDrafters(lambda: drafter),
                                   NGramProposer if m.ngram_assist else None)
    return Decoder(RowTargets(lambda: target, target.context_limit), proposer)


def shared_steps(model, feature_layers, buckets, steps, drafter_model, context_bucket=None):
    """The run's compiled steps (runtime/compiled.py: EngineSteps), made once and shared
    by every mode and context as a loaded engine's are (graphs captured once, KV buffers
    leased and given back); None: eager roles."""
    from runtime.compiled import EngineSteps

    if steps is None:
        return None
    return EngineSteps(model, feature_layers, buckets, steps, drafter=drafter_model,
                       context_bucket=context_bucket)


def make_target(model, feature_layers, shared):
    from runtime.backends.pytorch import TorchTarget

    return TorchTarget(model, feature_layers) if shared is None else shared.target()


def make_drafter(drafter_model, target_model, scaling, window, shared):
    from runtime.backends.pytorch import TorchDFlash

    if shared is None:
        return TorchDFlash(drafter_model, target_model, scaling, window)
    return shared.dflash(scaling, window)


def our_rows(target_dir, drafter_dir, device, dtype, contexts, new_tokens, steps, clock,
             modes=MODES) -> list[dict]:
    """Every mode at every context on the runtime's roles; the first run of each
    (mode, context) warms the graphs up and is not timed."""
    import torch

    from build.checkpoints import calibrated_scaling
    from plugins.scaling import PRESETS
    from runtime.compiled import load_dflash, load_target
    from runtime.ngram import NGramProposer

    model, tokenizer = load_target(target_dir, device, dtype)
    drafter = load_dflash(drafter_dir, device, dtype)
    drafter.config.check_target(model.config)
    scaling = calibrated_scaling(drafter_dir) or PRESETS["dflash"]
    window = drafter.config.training_max_length or 512
    block = drafter.config.block_size
    buckets = (1, NGramProposer().num_draft_tokens + 1, block)
    layer_ids = drafter.config.target_layer_ids
    shared = shared_steps(model, layer_ids, buckets, steps, drafter)
    target = make_target(model, layer_ids, shared)
    plain = None  # eager roles, where a step cannot run as a graph
    decoders = {}
    rows = []
    for context in contexts:
        prompt = prompt_ids(tokenizer, min(context, target.context_limit) - new_tokens)
        want = None  # target-only's tokens at this context
        for mode in modes:
            if clock.out():
                rows.append({"mode": mode, "context": context, "skipped": "section time budget spent"})
                continue
            try:
                row = decode_row(decoders, mode, prompt, new_tokens, device, steps,
                                 lambda: mode_decoder(mode, target, drafter, model, scaling, window, shared))
            except Exception as exc:  # a step that cannot be captured yet: say so, run eagerly
                if steps is None:
                    raise
                why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log(f"gpu_e2e: {mode} at {context}: {steps} steps failed ({why}); eager instead")
                plain = plain or make_target(model, layer_ids, None)
                row = decode_row(decoders, mode, prompt, new_tokens, device, None,
                                 lambda: mode_decoder(mode, plain, drafter, model, scaling, window, None))
                row["fallback"] = f"{steps} steps failed: {why}"
            tokens = row.pop("tokens")
            if mode == "target":
                want = tokens
            elif want is not None:  # greedy: lossless means target-only's tokens
                row["tokens_equal_target"] = tokens == want
            rows.append({"context": context} | row)
            log(f"gpu_e2e: {mode} at {context}: {row['tok_s']} tok/s, MAL {row['mal']}"
                + ("" if row.get("tokens_equal_target", True) else ", tokens DIFFER from target-only"))
    return rows


def decode_row(decoders, mode, prompt, new_tokens, device, steps, make) -> dict:
    """One timed run of `mode` after an untimed one of the same size (the same buffers,
    so every graph it needs exists before timing)."""
    import torch

    from runtime.decode import Request

    key = (mode, steps)
    decoder = decoders.get(key) or decoders.setdefault(key, make())
    decoder.generate(Request(prompt, new_tokens))
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen = decoder.generate(Request(prompt, new_tokens))
    # decode tok/s as transformers' rows count it: the first token is the prefill's, so
    # N - 1 tokens over the time after the prefill
    return {"mode": mode, "prompt_tokens": len(prompt), "new_tokens": len(gen.tokens),
            "tok_s": round((len(gen.tokens) - 1) / max(gen.decode_seconds, 1e-9), 2),
            "mal": round(gen.mean_accepted_length, 4),
            "prefill_s": round(gen.seconds["prefill"], 4), "steps": steps or "eager",
            "tokens": gen.tokens}


def transformers_rows(target_dir, device, dtype, contexts, new_tokens, clock) -> list[dict]:
    """transformers' own generate on the same model: greedy with a static cache (compiled
    by transformers itself where it does so), and prompt lookup (assisted generation; its
    cache is what transformers allows there). Decode tok/s = (N - 1) / (t(N) - t(1)): the
    prefill and first token taken out, as our rows take the prefill out."""
    import torch

    from runtime.models.target import load_hf_causal_lm

    model, tokenizer = load_hf_causal_lm(Path(target_dir), dtype)
    model = model.to(device)
    peers = {"transformers generate (static cache)": {"cache_implementation": "static"},
             "transformers prompt lookup": {"prompt_lookup_num_tokens": 4,
                                            "max_matching_ngram_size": 3}}
    rows = []
    for context in contexts:
        prompt = prompt_ids(tokenizer, min(context, model.config.max_position_embeddings) - new_tokens)
        ids = torch.tensor([prompt], device=device)
        for mode, kwargs in peers.items():
            if clock.out():
                rows.append({"mode": mode, "context": context, "skipped": "section time budget spent"})
                continue

            def timed(n):
                torch.cuda.synchronize() if device.type == "cuda" else None
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                     **kwargs)
                torch.cuda.synchronize() if device.type == "cuda" else None
                return time.perf_counter() - start, out.shape[1] - ids.shape[1]

            try:
                # warm-up of both calls: transformers compiles its static-cache step on the
                # first, and a cache sized for another length may compile again
                timed(new_tokens), timed(1)
                first, _ = timed(1)
                total, made = timed(new_tokens)
                if made < 2 or total <= first:
                    raise RuntimeError(f"{made} tokens in {total:.3f} s against {first:.3f} s for "
                                       "one: no decode time to measure")
            except Exception as exc:  # a peer transformers refuses is a row saying why
                rows.append({"mode": mode, "context": context, "error": str(exc).splitlines()[0][:200]})
                continue
            rows.append({"mode": mode, "context": context, "prompt_tokens": len(prompt),
                         "new_tokens": made, "tok_s": round((made - 1) / max(total - first, 1e-9), 2),
                         "mal": 1.0 if "static" in mode else None,
                         "transformers": __import__("transformers").__version__})
            log(f"gpu_e2e: {mode} at {context}: {rows[-1]['tok_s']} tok/s")
    return rows


def find_target(target) -> tuple[Path | None, str | None]:
    """The (a) target's transformers directory, or None and why not."""
    if target:
        path = Path(target)
        return (path, None) if (path / "config.json").is_file() else (None, f"{path} has no config.json")
    if (DEFAULT_TARGET_DIR / "config.json").is_file():
        index = DEFAULT_TARGET_DIR / "model.safetensors.index.json"
        if index.is_file():
            missing = sorted(set(json.loads(index.read_text())["weight_map"].values())
                             - {p.name for p in DEFAULT_TARGET_DIR.iterdir()})
            if missing:
                return None, (f"{DEFAULT_TARGET_DIR} lacks {len(missing)} shard(s) ({missing[0]}, ...): "
                              "carry the rest (scripts/convert_target.py)")
        return DEFAULT_TARGET_DIR, None
    try:
        import gguf  # noqa: F401
    except ImportError:
        return None, (f"no target: {DEFAULT_TARGET_DIR} is absent and the gguf package does not "
                      "import (write it with scripts/convert_target.py and carry its shards)")
    from build.checkpoints import prepare_target

    return prepare_target(None, progress=log)[0], None


# -- (b) Qwen3-8B-shaped step costs -------------------------------------------------------

def qwen3_8b_shaped(device, dtype, shape=QWEN3_8B):
    """A Qwen3-8B-shaped TargetModel and a DFlash-shaped drafter with random weights, made
    on the device (8B parameters never touch the host)."""
    import torch

    from runtime.models.dflash import DFlashConfig, DFlashDrafter
    from runtime.models.target import TargetConfig, TargetModel

    s = shape
    config = TargetConfig("qwen3", s["vocab"], s["hidden"], s["intermediate"], s["layers"], s["heads"],
                          s["kv_heads"], s["head_dim"], 1e-6, 1e6, 40960, False, True, False)
    n = s["layers"]
    ids = tuple(sorted({1 + round(i * (n - 4) / (s["draft_layers"] - 1)) for i in range(s["draft_layers"])}))
    dconfig = DFlashConfig(s["hidden"], s["intermediate"], s["draft_layers"], s["heads"], s["kv_heads"],
                           s["head_dim"], 1e-6, 1e6, s["vocab"], s["block"], s["vocab"] - 1, ids, n,
                           max_position_embeddings=40960)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target, drafter = TargetModel(config).eval(), DFlashDrafter(dconfig).eval()
    finally:
        torch.set_default_dtype(previous)
    return target, drafter


def time_call(fn, device, repeats: int) -> tuple[float, float]:
    """Median host ms (the call's own time, the GPU idle before it) and median GPU ms
    (events around it) of `fn()`."""
    import statistics

    import torch

    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize(device)
        gpu.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(gpu)


def step_cost_rows(device, dtype, contexts, clock, repeats: int = 20, shape=QWEN3_8B,
                   graphs=("eager", "cudagraph")) -> list[dict]:
    """Each step at each context, the caches filled to `context` (their contents do not
    change a step's cost) and rolled back after every call."""
    import torch

    from plugins.scaling import PRESETS

    target_model, drafter_model = qwen3_8b_shaped(device, dtype, shape)
    block = shape["block"]
    feature_size = drafter_model.fc.in_features
    rows = []
    with torch.inference_mode():
        for graph in graphs:
            # context_bucket = block: the drafter step timed is one block after one block's context
            shared = shared_steps(target_model, drafter_model.config.target_layer_ids, (1, block + 1),
                                  None if graph == "eager" else graph, drafter_model, context_bucket=block)
            target = make_target(target_model, drafter_model.config.target_layer_ids, shared)
            drafter = make_drafter(drafter_model, target_model, PRESETS["dflash"], None, shared)
            for context in contexts:
                if clock.out():
                    rows.append({"mode": f"steps ({graph})", "context": context,
                                 "skipped": "section time budget spent"})
                    continue
                target.prefill([0], context + 2 * block)
                target.cache.length = context
                drafter.reset(context + 2 * block)
                drafter.cache.length = context
                features = torch.zeros((block, feature_size), dtype=dtype, device=device)

                def verify(t):
                    target.verify([1] * t)
                    target.cache.length = context

                def draft():
                    drafter.draft(features, 1)
                    drafter.cache.length = context

                for name, fn in (("target decode (1 token)", lambda: verify(1)),
                                 (f"target verify ({block + 1} tokens)", lambda: verify(block + 1)),
                                 (f"drafter block ({block})", draft)):
                    try:
                        fn()  # graphs made (and kernels warmed) before timing
                        host, gpu = time_call(fn, device, repeats)
                    except Exception as exc:  # a step that cannot be captured yet: a row says why
                        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                        rows.append({"mode": f"{name}, {graph}", "context": context, "error": why})
                        log(f"gpu_e2e: {name}, {graph} at {context} failed: {why}")
                        continue
                    rows.append({"mode": f"{name}, {graph}", "context": context, "host_ms": round(host, 3),
                                 "gpu_ms": round(gpu, 3), "host_share": round(host / max(gpu, 1e-9), 3),
                                 "tok_s": None, "mal": None})
                    log(f"gpu_e2e: {rows[-1]['mode']} at {context}: host {host:.3f} ms, GPU {gpu:.3f} ms")
            del target, drafter, shared
            torch.cuda.empty_cache()
    return rows


# -- the section ---------------------------------------------------------------------------

def refusal() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "gpu_e2e needs a CUDA device; torch sees none here"


def run(out_dir, target=None, steps: str = "cudagraph", new_tokens: int = NEW_TOKENS,
        budget_s: float = BUDGET_S, command: str | None = None, device: str = "cuda") -> dict:
    """The section: (a) then (b), rows in out_dir/gpu_e2e.json, written again after each
    part (a run stopped at its time limit still leaves what it measured); the report as a
    dict with "status" passed / failed / not run (where not run, "reason") and "passed"
    (scripts/gpu_check.py's verdict). A part that raises is a note saying why, and the
    next part runs."""
    import torch

    report = {"section": "gpu_e2e", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "steps": steps, "rows": []}
    why = refusal() if device == "cuda" else None
    if why:
        return report | {"status": "not run", "passed": False, "reason": why, "device": "cpu"}
    device = torch.device(device)
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    report["versions"] = {"torch": torch.__version__}
    notes = report["notes"] = {}

    def save():
        if out_dir:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_e2e.json").write_text(json.dumps(report, indent=2) + "\n")

    def part(name, measure):
        try:
            report["rows"] += measure()
        except Exception as exc:  # this part's failure is a note; the next part still runs
            notes[name] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            log(f"gpu_e2e: {name} failed: {notes[name]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()

    clock = Clock(budget_s)
    try:  # the default GGUF's conversion can fail where its package is missing: (b) still runs
        target_dir, why = find_target(target)
    except Exception as exc:
        target_dir, why = None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    if target_dir is None:
        notes["real_target"] = f"not run: {why}"
    else:
        # a clock each, started as its part starts: our rows stop at 30% of the budget, so
        # they cannot starve transformers' (whose static-cache compile takes a while), and
        # transformers' leave (b) its share
        part("real_target", lambda: our_rows(target_dir, DRAFTER_DIR, device, torch.bfloat16, CONTEXTS_A,
                                             new_tokens, steps, Clock(RESERVE["ours"] * budget_s)))
        part("transformers", lambda: transformers_rows(
            target_dir, device, torch.bfloat16, CONTEXTS_A, new_tokens,
            Clock(clock.left() - RESERVE["step_costs"] * budget_s)))
    part("qwen3_8b_shaped", lambda: step_cost_rows(device, torch.bfloat16, CONTEXTS_B, clock))
    report["goals"] = goals(report["rows"])
    report |= verdict(report["rows"], notes)
    save()
    return report


def goals(rows: list[dict]) -> dict:
    """The issue's GPU goals as ratios of this run's rows, where both rows were measured:
    target-only over transformers' static-cache generate (goal >= 1.0) and SharpDraft +
    n-gram over target-only (goal > 1.0 at 8K), per context; host over GPU time of a
    1-token step under CUDA graphs (goal <= 0.1), per context of (b)."""
    def tok_s(mode, context):
        return next((r["tok_s"] for r in rows if r["mode"] == mode and r["context"] == context
                     and r.get("tok_s") and "fallback" not in r), None)

    out = {}
    for context in sorted({r["context"] for r in rows if "context" in r}):
        target = tok_s("target", context)
        peer = tok_s("transformers generate (static cache)", context)
        hybrid = tok_s("hybrid", context)
        if target and peer:
            out[f"target_vs_transformers_static_{context}"] = round(target / peer, 3)
        if target and hybrid:
            out[f"hybrid_vs_target_{context}"] = round(hybrid / target, 3)
        share = next((r["host_share"] for r in rows if r["context"] == context
                      and r["mode"] == "target decode (1 token), cudagraph" and "host_share" in r), None)
        if share is not None:
            out[f"host_share_decode_cudagraph_{context}"] = share
    return out


def verdict(rows: list[dict], notes: dict) -> dict:
    """passed: something was measured, and none of the runtime's own rows failed, fell back
    to eager steps or decoded other tokens than target-only (transformers' rows may fail:
    they say why); a part that raised fails the section."""
    ours = [r for r in rows if "transformers" not in r["mode"]]
    measured = [r for r in rows if "skipped" not in r and "error" not in r]
    broken = [r["mode"] for r in ours if "error" in r or "fallback" in r or r.get("tokens_equal_target") is False]
    raised = [name for name, note in notes.items() if note.startswith("failed")]
    passed = bool(measured) and not broken and not raised
    return {"status": "passed" if passed else "failed", "passed": passed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_e2e.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT"))
    p.add_argument("--target", metavar="DIR", help=f"transformers directory (default {DEFAULT_TARGET_DIR})")
    p.add_argument("--steps", choices=("cudagraph", "inductor"), default="cudagraph",
                   help="how the runtime's steps run: captured CUDA graphs (seconds to make) or "
                        "torch.compile + CUDA graphs (minutes)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = p.parse_args(argv)
    why = refusal()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    report = run(args.out, args.target, args.steps, args.new_tokens, args.budget_s)
    for row in report["rows"]:
        print(json.dumps(row))
    print(f"gpu_e2e: {report['status']}" + (f" ({report['notes']})" if report.get("notes") else ""))
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
