#!/usr/bin/env python3
"""GPU section `gpu_e2e`: decoding end to end on a GPU, the runtime's compiled torch path
beside HF transformers' own `generate` on the same GPU in the same run.

The real default target (SmolLM2-135M-Instruct) and the shipped DFlash drafter: every
everyday mode (target-only, n-gram, frozen, SharpDraft, SharpDraft + n-gram, window +
n-gram) at 8K and 4K context (descending), tok/s and MAL, beside transformers' `generate`
(one static cache, sized by the first and largest context, so it compiles once; prompt
lookup for the n-gram peer). The Qwen3-8B-shaped step costs are section gpu_steps.

What makes a row a measurement:
- tok_s is the median of at least 3 timed runs (after an untimed one that makes the
  graphs); every run's figure is kept. Decode speed on both sides: the N - 1 tokens after
  the prefill's first over the time after it (transformers: (N - 1) / (t(N) - t(1)),
  each t a median of 3).
- the prompt is tokenized once per context and the same ids are handed to both sides
  (each row records their sha256).
- transformers' rows record whether its static-cache step was compiled (its
  `_compiled_call`, dynamo's graph count before and after) and its first call's time.
- each drafting mode's greedy tokens are compared with target-only's at its context:
  `lossless` is true, false (with `first_differing_index`) or "unchecked" where the
  target-only row is missing -- never passed by default.

The target is read from a transformers directory: --target, else the one scripts/
gpu_target.py converted (build.checkpoints.prepare_target, with the carried wheels on
PYTHONPATH); without one the real-target part is "not run" with the reason, which fails
the section. On CPU (SHARPDRAFT_CPU=1: the rehearsal) the same target and drafter run
every row through the same code at short contexts, the steps compiled by inductor (CUDA
graphs need CUDA).

    python -m scripts.gpu_e2e --out DIR [--target DIR] [--steps cudagraph|inductor]

Rows go to DIR/gpu_e2e.json after every row (scripts/gpu_record.py). The section passes
when none of the runtime's rows failed, fell back to eager steps or decoded other tokens
than target-only; transformers' rows may fail (they say why).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_e2e ...")

import functools
import hashlib
import json
import statistics
import time
from pathlib import Path

from scripts.gpu_record import NotRun, SectionRecord, log, section_main

REPO = Path(__file__).resolve().parent.parent
SECTION = "gpu_e2e"
DEFAULT_TARGET_DIR = REPO / "engines" / "gpu" / "smollm2-135m-fp16"  # git-ignored: --target's default
DRAFTER_DIR = REPO / "checkpoints" / "dflash-smollm2-135m"
CONTEXTS = (8192, 4096)  # descending: transformers' static cache is sized once, by the first
NEW_TOKENS = 128
TIMED_RUNS = 3
MODES = ("target", "ngram", "frozen", "sharpdraft", "hybrid", "window-hybrid")
BUDGET_S = 100  # on the GPU: rows past it are skipped, saying so (the plan's estimate: scripts/gpu_travel.py)
OURS_SHARE = 0.4  # of BUDGET_S, the most our rows take: transformers' compile needs the rest
# on CPU (the rehearsal): one short context; inductor compiles each step shape (~1.5 min
# each on 2 shared cores), so our rows get most of the clock
CPU = dict(contexts=(160,), new_tokens=12, budget_s=1200, ours_share=0.8, steps="inductor")
PEERS = {"transformers generate (static cache)": {"cache_implementation": "static"},
         "transformers prompt lookup": {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}}


class Clock:
    """A time budget: what is left."""

    def __init__(self, budget_s: float):
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()

    def out(self) -> bool:
        return self.left() <= 0


def ids_digest(ids) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def first_difference(a, b) -> int | None:
    """The first index where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
    """The decode loop (runtime/decode.py) for `mode` over the compiled batch roles, put
    together as an engine's are (runtime/assembly.py), a batch of one per request: the
    proposer the engine would pick (runtime/modes.py's table), every drafter step
    verifying its whole block (no measured step costs for this GPU)."""
    from runtime import assembly, modes

    m = modes.parse(mode)
    roles = assembly.Roles(
        "block", lambda: target,
        drafter=lambda s: make_drafter(drafter_model, target_model, s.scaling, s.window, shared),
        block_size=drafter_model.config.block_size)
    setting = assembly.DraftSetting(scaling if m.scaled else None,
                                    window if m.needs_window else None, m.ngram_assist)
    return assembly.decoder(roles, m, setting=setting)


def shared_steps(model, feature_layers, widths, steps, drafter_model, context_span=None):
    """The run's compiled steps (runtime/backends/pytorch/compiled.py: EngineSteps), made once and shared
    by every mode and context as a loaded engine's are (graphs captured once, KV buffers
    leased and given back); None: eager roles."""
    from runtime.backends.pytorch.compiled import EngineSteps

    if steps is None:
        return None
    return EngineSteps(model, feature_layers, widths, steps, drafter=drafter_model,
                       context_span=context_span)


def make_target(model, feature_layers, shared):
    from runtime.backends.pytorch import TorchBatchTarget

    return TorchBatchTarget(model, feature_layers) if shared is None else shared.batch_target()


def make_drafter(drafter_model, target_model, scaling, window, shared):
    """The batch DFlash drafter, as the torch loader makes it: compiled, or eager under a
    draft window (a compiled block step spans the whole context)."""
    from runtime.backends.pytorch import TorchBatchDFlash

    if shared is None or window is not None:
        return TorchBatchDFlash(drafter_model, target_model, scaling, window)
    return shared.batch_dflash(scaling)


def our_rows(model, drafter, scaling, device, prompts, new_tokens, steps, clock, rows, save,
             modes=MODES):
    """Every mode at every context on the runtime's roles: an untimed run (graphs made),
    then TIMED_RUNS timed; rows appended (and saved) as they end."""
    from runtime.ngram import NGramProposer

    window = drafter.config.training_max_length or 512
    block = drafter.config.block_size
    widths = (1, NGramProposer().num_draft_tokens + 1, block)
    layer_ids = drafter.config.target_layer_ids
    shared = shared_steps(model, layer_ids, widths, steps, drafter)
    target = make_target(model, layer_ids, shared)
    plain = None  # eager roles, where a step cannot run as a graph
    decoders = {}
    for context, prompt in prompts.items():
        want = None  # target-only's tokens at this context
        for mode in modes:
            if clock.out():
                rows.append({"mode": mode, "context": context, "skipped": "section time budget spent",
                             "lossless": "unchecked"})
                save()
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
                row["tokens"] = tokens  # transformers' greedy tokens are compared with these
            elif want is None:  # target-only did not run here: nothing to compare with
                row["lossless"] = "unchecked"
            else:  # greedy: lossless means target-only's tokens, token for token
                at = first_difference(tokens, want)
                row["lossless"] = at is None
                if at is not None:
                    row["first_differing_index"] = at
            rows.append({"context": context} | row)
            save()
            log(f"gpu_e2e: {mode} at {context}: {row['tok_s']} tok/s (median of {len(row['runs_tok_s'])}), "
                f"MAL {row['mal']}" + ("" if row.get("lossless", True) is True else
                                       f", lossless {row.get('lossless')} at {row.get('first_differing_index')}"))


def decode_row(decoders, mode, prompt, new_tokens, device, steps, make) -> dict:
    """An untimed run of `mode` (the same buffers, so every graph it needs exists before
    timing), then TIMED_RUNS timed runs: their median tok/s and each run's."""
    import torch

    from runtime.decode import Request

    key = (mode, steps)
    decoder = decoders.get(key) or decoders.setdefault(key, make())
    decoder.generate(Request(prompt=prompt, max_new_tokens=new_tokens))
    runs = []
    for _ in range(TIMED_RUNS):
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append(decoder.generate(Request(prompt=prompt, max_new_tokens=new_tokens)))
    if any(r.tokens != runs[0].tokens for r in runs):
        raise RuntimeError(f"{mode}: greedy runs of one prompt decoded different tokens")
    gen = runs[0]
    # decode tok/s as transformers' rows count it: the first token is the prefill's, so
    # N - 1 tokens over the time after the prefill
    speeds = [round((len(r.tokens) - 1) / max(r.decode_seconds, 1e-9), 2) for r in runs]
    return {"mode": mode, "prompt_tokens": len(prompt), "prompt_sha256": ids_digest(prompt),
            "new_tokens": len(gen.tokens), "tok_s": statistics.median(speeds), "runs_tok_s": speeds,
            "mal": round(gen.mean_accepted_length, 4),
            "prefill_s": round(statistics.median(r.seconds["prefill"] for r in runs), 4),
            "steps": steps or "eager", "tokens": gen.tokens}


def transformers_rows(model, tokenizer, device, prompts, new_tokens, clock, rows, save, ours=None):
    """transformers' own generate on the same weights and the same prompt ids: greedy with
    a static cache (compiled by transformers itself where it does so: on CUDA), and
    prompt lookup. Decode tok/s = (N - 1) / (t(N) - t(1)), each t the median of
    TIMED_RUNS calls after an untimed one; the first call's time (its compile) kept."""
    import torch

    try:
        from torch._dynamo.utils import counters
    except ImportError:
        counters = None

    def graphs() -> int | None:
        return None if counters is None else int(counters["stats"].get("unique_graphs", 0))

    for context, prompt in prompts.items():  # descending: the first sizes the static cache
        ids = torch.tensor([prompt], device=device)
        for mode, kwargs in PEERS.items():
            if clock.out():
                rows.append({"mode": mode, "context": context, "skipped": "section time budget spent"})
                save()
                continue

            def timed(n):
                torch.cuda.synchronize() if device.type == "cuda" else None
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False,
                                     pad_token_id=tokenizer.eos_token_id, **kwargs)
                torch.cuda.synchronize() if device.type == "cuda" else None
                return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

            row = {"mode": mode, "context": context, "prompt_tokens": len(prompt),
                   "prompt_sha256": ids_digest(prompt), "transformers": __import__("transformers").__version__}
            try:
                before = graphs()
                first, tokens = timed(new_tokens)  # compiles the static-cache step, where it does
                row.update(first_call_s=round(first, 3), compiled=hasattr(model, "_compiled_call"),
                           dynamo_graphs_first_call=None if before is None else graphs() - before)
                timed(1)  # warm: the one-token shape
                settled = graphs()
                ones = [timed(1)[0] for _ in range(TIMED_RUNS)]
                alls = [timed(new_tokens) for _ in range(TIMED_RUNS)]
                row["recompiled_while_timed"] = None if settled is None else graphs() != settled
                t1, tn = statistics.median(ones), statistics.median(t for t, _ in alls)
                made = len(alls[0][1])
                if made < 2 or tn <= t1:
                    raise RuntimeError(f"{made} tokens in {tn:.3f} s against {t1:.3f} s for one: "
                                       "no decode time to measure")
                row.update(new_tokens=made, tok_s=round((made - 1) / (tn - t1), 2),
                           t1_runs_s=[round(t, 4) for t in ones], tn_runs_s=[round(t, 4) for t, _ in alls],
                           mal=1.0 if "static" in mode else None)
                want = (ours or {}).get(context)
                if want is not None and "static" in mode:  # the same greedy tokens as ours?
                    at = first_difference(alls[0][1], want)
                    row["tokens_equal_ours"] = at is None
                    if at is not None:
                        row["first_differing_index"] = at
            except Exception as exc:  # a peer transformers refuses is a row saying why
                row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            rows.append(row)
            save()
            log(f"gpu_e2e: {mode} at {context}: " + (row.get("error") or f"{row['tok_s']} tok/s, "
                f"first call {row['first_call_s']} s, compiled {row['compiled']}"))


def find_target(target) -> tuple[Path | None, str | None, dict | None]:
    """The (a) target's transformers directory, or None and why not; and where it came
    from (the GGUF's path and sha256 when it was converted from one)."""
    if target:
        path = Path(target)
        if not (path / "config.json").is_file():
            return None, f"{path} has no config.json", None
        return path, None, {"kind": "transformers", "path": str(path)}
    if (DEFAULT_TARGET_DIR / "config.json").is_file():
        index = DEFAULT_TARGET_DIR / "model.safetensors.index.json"
        if index.is_file():
            missing = sorted(set(json.loads(index.read_text())["weight_map"].values())
                             - {p.name for p in DEFAULT_TARGET_DIR.iterdir()})
            if missing:
                return None, (f"{DEFAULT_TARGET_DIR} lacks {len(missing)} shard(s) ({missing[0]}, ...): "
                              "carry the rest (scripts/convert_target.py)"), None
        return DEFAULT_TARGET_DIR, None, {"kind": "transformers", "path": str(DEFAULT_TARGET_DIR)}
    try:
        import gguf  # noqa: F401
    except ImportError:
        return None, (f"no target: {DEFAULT_TARGET_DIR} is absent and the gguf package does not "
                      "import (the carried wheels are installed by gpu_target, before this section)"), None
    from build.checkpoints import prepare_target

    path, source = prepare_target(None, progress=log)
    return path, None, source


def run(out_dir, on_cpu: bool = False, args=None) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not on_cpu
    if not on_cpu and not cuda:
        raise SystemExit("error: gpu_e2e needs a CUDA device; SHARPDRAFT_CPU=1 runs it on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    steps = getattr(args, "steps", None) or ("cudagraph" if cuda else CPU["steps"])
    contexts = CPU["contexts"] if on_cpu else CONTEXTS
    new_tokens = CPU["new_tokens"] if on_cpu else getattr(args, "new_tokens", None) or NEW_TOKENS
    budget = CPU["budget_s"] if on_cpu else getattr(args, "budget_s", None) or BUDGET_S
    share = CPU["ours_share"] if on_cpu else OURS_SHARE
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu,
                           device=torch.cuda.get_device_name() if cuda else "cpu")
    record.data.update(steps=steps, contexts=contexts, new_tokens=new_tokens, budget_s=budget,
                       timed_runs=TIMED_RUNS, rows=[],
                       versions={"torch": torch.__version__,
                                 "transformers": __import__("transformers").__version__})
    if on_cpu:
        record.data["cpu_why"] = ("short contexts and few tokens: a 2-core CPU decodes the 135M target "
                                  "at ~85 ms a step at 4K; inductor instead of CUDA graphs")
    rows = record.data["rows"]
    clock = Clock(budget)
    loaded = {}

    def target(part):
        from runtime.backends.pytorch.placement import load_dflash, load_target

        target_dir, why, source = find_target(getattr(args, "target", None))
        if target_dir is None:
            raise NotRun(why)
        drafter_dir = DRAFTER_DIR
        dtype = torch.bfloat16 if cuda else torch.float32
        model, tokenizer = load_target(target_dir, device, dtype)
        drafter = load_dflash(drafter_dir, device, dtype)
        drafter.config.check_target(model.config)
        from build.checkpoints import calibrated_scaling
        from runtime.families import preset

        scaling = calibrated_scaling(drafter_dir) or preset("dflash")
        part.update(target=str(target_dir), drafter=str(drafter_dir), dtype=str(dtype),
                    target_source=source)
        limit = model.config.max_position_embeddings
        # one tokenization per context: these very ids go to both sides
        prompts = {c: prompt_ids(tokenizer, min(c, limit) - new_tokens) for c in contexts}
        part["prompt_sha256"] = {c: ids_digest(p) for c, p in prompts.items()}
        loaded.update(model=model, tokenizer=tokenizer, drafter=drafter, scaling=scaling, prompts=prompts,
                      target_dir=target_dir, dtype=dtype)

    def ours(part):
        if not loaded:
            raise NotRun("no target loaded")
        our_rows(loaded["model"], loaded["drafter"], loaded["scaling"], device, loaded["prompts"],
                 new_tokens, steps, Clock(min(clock.left(), share * budget)), rows, record.save)

    def peers(part):
        if not loaded:
            raise NotRun("no target loaded")
        from runtime.models.target import load_hf_causal_lm

        del loaded["model"], loaded["drafter"]  # our roles' buffers given back first
        if cuda:
            torch.cuda.empty_cache()
        model, _ = load_hf_causal_lm(Path(loaded["target_dir"]), loaded["dtype"])
        model = model.to(device)
        want = {r["context"]: r["tokens"] for r in rows if r.get("mode") == "target" and "tokens" in r}
        transformers_rows(model, loaded["tokenizer"], device, loaded["prompts"], new_tokens, clock, rows,
                          record.save, ours=want)

    record.part("target", target)
    record.part("ours", ours)
    record.part("transformers", peers)
    record.data["goals"] = goals(rows)
    broken = verdict(rows)
    if broken:
        record.data["broken_rows"] = broken
        record.data["parts"]["ours"]["status"] = "failed"
    return record.finish()


def goals(rows: list[dict]) -> dict:
    """The issue's GPU goals as ratios of this run's rows, where both rows were measured:
    target-only over transformers' static-cache generate (goal >= 1.0) and SharpDraft +
    n-gram over target-only (goal > 1.0 at 8K), per context."""
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
    return out


def verdict(rows: list[dict]) -> list[str]:
    """Our rows that fail the section: an error, a fall-back to eager steps, tokens other
    than target-only's ("unchecked" is not a failure, and not a pass: it stays in the row)."""
    return [f"{r['mode']} at {r['context']}" for r in rows if "transformers" not in r["mode"]
            and ("error" in r or "fallback" in r or r.get("lossless") is False)]


def main(argv=None) -> int:
    def extra(p):
        p.add_argument("--target", metavar="DIR", help="transformers directory (default: the converted "
                       "default target)")
        p.add_argument("--steps", choices=("cudagraph", "inductor"), default=None,
                       help="how the runtime's steps run on CUDA (default cudagraph)")
        p.add_argument("--new-tokens", type=int, default=None)
        p.add_argument("--budget-s", type=float, default=None)

    return section_main(SECTION, run, argv, extra)


if __name__ == "__main__":
    sys.exit(main())
