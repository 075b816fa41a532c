"""--backend vllm: an engine directory of configuration that vLLM runs in its own loop,
the own-loop builder build/backends.py registers for the vllm backend (docs/vllm.md). vLLM
is not needed to write it."""

from __future__ import annotations

from pathlib import Path

from build import checkpoints, families
from build.engine_dirs import engine_dir, seal
from build.query_scaling import choose_scaling
from runtime.cli import UsageError, progress
from runtime.families import preset
from runtime.manifest import MANIFEST, Manifest, dependency_record, portable_path
from runtime.models.target import checkpoint_files


def configure(args, overrides: dict, out: Path) -> int:
    """--backend vllm: an engine directory vLLM serves (docs/vllm.md): engine.json naming the
    target directory vLLM loads as `model` (target.path) and the drafter it loads as the
    speculative model, with the speculative_config recorded (extra.vllm). With --sharpdraft,
    `drafter/`: the checkpoint's config.json naming the plugin's architecture and carrying
    the QueryScaling, the weights linked -- the switch for plugins/vllm/. vLLM is not needed
    to write it. Stages: load (configs; DFlash: our loader's checks), check, write."""
    from plugins.vllm import launch as vllm

    family = families.FAMILIES[args.drafter]
    progress("[1/3] load: checkpoint configs (vLLM loads the weights where it runs)")
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    context = checkpoints.target_context(target_dir)
    drafter_dir = checkpoints.drafter_checkpoint(args.drafter, args.drafter_checkpoint)
    drafted = family.vllm(args, drafter_dir)
    if args.sharpdraft and drafted.unscalable:
        raise UsageError(f"--sharpdraft --backend vllm: {drafted.unscalable}; build it without "
                         "--sharpdraft (vLLM's own drafter, frozen) or with --backend torch")
    scaling, scaling_source = choose_scaling(args, args.drafter, drafter_dir, overrides)
    max_seq_len = args.max_seq_len or context
    if not 1 < max_seq_len <= context:
        raise UsageError(f"--max-seq-len must be in [2, {context}] (the target's context), got {max_seq_len}")
    progress(f"      target {target_dir}; {args.drafter} drafter {drafter_dir}, vLLM method "
             f"{drafted.method}, {drafted.num_tokens} drafts per step")

    with engine_dir(out) as partial:
        progress("[2/3] check: the drafter directory vLLM loads")
        extra = {"max_seq_len": max_seq_len,
                 "vllm": {"read_in": vllm.pins.READ_IN, "stock_drafter": portable_path(drafter_dir),
                          "speculative": vllm.speculative_config(drafted.method, None, drafted.num_tokens,
                                                                 drafted.parallel)}}
        drafter_record = dependency_record(drafter_dir, drafted.files)
        if scaling:
            extra |= {"query_scaling_source": scaling_source, "family_preset": preset(args.drafter).to_dict()}
            written = vllm.write_drafter_dir(drafter_dir, partial / "drafter", scaling, drafted.files)
            drafter_record = dependency_record(written, drafted.files) | {
                "path": portable_path(out.resolve() / "drafter")}
        progress(f"[3/3] write: {MANIFEST}" + (", drafter/ (the SharpDraft drafter vLLM loads)" if scaling else ""))
        manifest = Manifest(drafter=args.drafter, backend=args.backend,
                            target=dependency_record(target_dir, checkpoint_files(target_dir)) | {"source": source},
                            drafter_checkpoint=drafter_record, query_scaling=scaling,
                            block_size=drafted.num_tokens + 1, dtype="float32", extra=extra)
        seal(partial, out, manifest)
    beta = (f"SharpDraft on: {scaling.describe()}, {scaling_source}" if scaling
            else "SharpDraft off (vLLM's own drafter)")
    print(f"engine written to {out} (backend vllm; {beta})")
    print(f"next: python -m runtime vllm-serve --engine-dir {out}   (docs/vllm.md)")
    return 0
