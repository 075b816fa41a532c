"""--backend trtllm: an engine directory of configuration for TensorRT-LLM's own
speculative decoding (its own loop), the own-loop builder build/backends.py registers for
the trtllm backend. TensorRT-LLM is not needed to write it."""

from __future__ import annotations

from pathlib import Path

from build import checkpoints, families
from build.engine_dirs import engine_dir, seal
from build.query_scaling import choose_scaling
from plugins.trtllm import config as trtllm
from plugins.trtllm import pins
from runtime.cli import UsageError, progress
from runtime.families import preset
from runtime.manifest import MANIFEST, Manifest, dependency_record, portable_path
from runtime.models.target import checkpoint_files


def configure(args, overrides: dict, out: Path) -> int:
    """--backend trtllm: an engine directory of configuration (engine.json + llm_api.yaml)
    for TensorRT-LLM's own speculative decoding and, with --sharpdraft, the drafter
    directory TensorRT-LLM loads (drafter/: the checkpoint's config.json plus SharpDraft's
    parameters, the weights linked), which is what switches the hook on for that drafter
    (plugins/trtllm/config.py). TensorRT-LLM is not needed to write it.
    Stages: load (configs only, no weights), check, write."""
    if args.drafter not in checkpoints.DEFAULT_DRAFTERS and not args.drafter_checkpoint:
        raise UsageError(f"--drafter {args.drafter} needs --drafter-checkpoint DIR (a checkpoint "
                         "TensorRT-LLM loads; this repository ships none)")
    progress("[1/3] load: checkpoint configs (TensorRT-LLM loads the weights where it runs)")
    target_dir, source = checkpoints.prepare_target(args.target, progress)
    context = checkpoints.target_context(target_dir)
    drafter_dir = checkpoints.drafter_checkpoint(args.drafter, args.drafter_checkpoint)
    drafter_files, block_size, settings = families.trtllm_config(args.drafter)(args, drafter_dir)
    scaling, scaling_source = choose_scaling(args, args.drafter, drafter_dir, overrides)
    max_seq_len = args.max_seq_len or context
    if not 1 < max_seq_len <= context:
        raise UsageError(f"--max-seq-len must be in [2, {context}] (the target's context), got {max_seq_len}")
    progress(f"      target {target_dir}; {args.drafter} drafter {drafter_dir}, {block_size - 1} drafts per step")

    with engine_dir(out) as partial:
        extra = {"max_seq_len": max_seq_len,
                 "trtllm": {"version": pins.PINNED, "speculative": settings,
                            "tensor_parallel_size": 1, "llm_api_config": trtllm.LLM_API_CONFIG}}
        drafter_record = dependency_record(drafter_dir, drafter_files)
        if scaling:
            extra |= {"query_scaling_source": scaling_source, "family_preset": preset(args.drafter).to_dict()}
            # The drafter TensorRT-LLM loads carries the QueryScaling in its own config.json;
            # frozen runs of this engine load the stock checkpoint (extra.trtllm.stock_drafter).
            written = trtllm.write_drafter_dir(drafter_dir, partial / trtllm.DRAFTER_DIR, scaling, drafter_files)
            drafter_record = dependency_record(written, drafter_files) | {
                "path": portable_path(out.resolve() / trtllm.DRAFTER_DIR)}
            extra["trtllm"]["stock_drafter"] = portable_path(drafter_dir)
        manifest = Manifest(drafter=args.drafter, backend=args.backend,
                            target=dependency_record(target_dir, checkpoint_files(target_dir)) | {"source": source},
                            drafter_checkpoint=drafter_record,
                            query_scaling=scaling, block_size=block_size, dtype="auto", extra=extra)
        progress(f"[2/3] check: speculative_config fields against TensorRT-LLM {pins.PINNED}")
        config_text = trtllm.llm_api_yaml(trtllm.llm_api_config(manifest), out)
        progress(f"[3/3] write: {trtllm.LLM_API_CONFIG}, {MANIFEST}"
                 + (f", {trtllm.DRAFTER_DIR}/ (the SharpDraft drafter TensorRT-LLM loads)" if scaling else ""))
        (partial / trtllm.LLM_API_CONFIG).write_text(config_text)
        seal(partial, out, manifest)
    beta = (f"SharpDraft on: {scaling.describe()}, {scaling_source}" if scaling
            else "SharpDraft off (frozen drafter)")
    print(f"engine written to {out} (backend trtllm, TensorRT-LLM {pins.PINNED}; {beta})")
    print(f"next (on a GPU host with TensorRT-LLM): python -m runtime generate --engine-dir {out} "
          "--prompt 'def fib(n):' --max-new-tokens 64")
    return 0
