"""Engine directory in, Triton model repository out: <name>/config.pbtxt (tensors from
protocol.py, the engine and limits as parameters) and <name>/1/model.py (the
Python-backend model), plus <name>-stream (decoupled) with --streaming. For GPU hosts it
also writes TensorRT-LLM's `llmapi` model.yaml with a DFlash speculative_config."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from runtime.manifest import read_manifest
from runtime.serve import protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_TEMPLATE = Path(__file__).with_name("model.py")
STREAM_SUFFIX = "-stream"
# Triton takes the directory name as the model name and puts it in URLs
# (/v2/models/<name>/generate): keep it to characters that need no escaping.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def model_name(engine_dir: Path, name: str | None) -> str:
    name = name or Path(engine_dir).resolve().name
    if not NAME.match(name):
        raise ValueError(f"model name {name!r} may hold only letters, digits, '_', '.', '-' "
                         "(and start with a letter or digit) — pass --model-name")
    return name


def _tensor_block(kind: str, tensors) -> str:
    entries = []
    for t in tensors:
        lines = [f'    name: "{t.name}"', f"    data_type: {t.triton_type}",
                 f"    dims: [ {', '.join(str(d) for d in t.dims)} ]"]
        if t.optional:
            lines.append("    optional: true")
        entries.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


def config_pbtxt(name: str, model_dir: Path, engine_dir: Path, instances: int, streaming: bool,
                 max_new_tokens_limit: int, threads: str = "auto", backend: str | None = None) -> str:
    # Paths relative to the model's own directory (model.py resolves them against the
    # model_repository path Triton hands it), so a copied or moved checkout still serves.
    def relative(path: Path) -> str:
        return os.path.relpath(Path(path).resolve(), Path(model_dir).resolve())

    params = {"engine_dir": relative(engine_dir), "repo_root": relative(REPO_ROOT),
              "max_new_tokens_limit": str(max_new_tokens_limit), "threads": threads}
    if backend:  # else the backend engine.json names
        params["backend"] = backend
    text = [f'# Written by `python -m runtime serve`; regenerate rather than edit.\n'
            f'name: "{name}"\nbackend: "python"\n'
            # One request per execute(): speculative decoding runs one sequence at a time.
            "max_batch_size: 0\n"]
    if streaming:
        text.append("model_transaction_policy {\n  decoupled: true\n}\n")
    text.append(_tensor_block("input", protocol.INPUTS))
    text.append(_tensor_block("output", protocol.OUTPUTS))
    text.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n")
    for key, value in params.items():
        text.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: {json.dumps(value)} }}\n}}\n')
    return "".join(text)


def write_model(out: Path, name: str, engine_dir: Path, instances: int, streaming: bool,
                max_new_tokens_limit: int, threads: str = "auto", backend: str | None = None) -> Path:
    model_dir = out / name
    if model_dir.exists():  # a previous run's model of the same name: replace it whole
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(
        config_pbtxt(name, model_dir, engine_dir, instances, streaming, max_new_tokens_limit, threads,
                     backend))
    shutil.copyfile(MODEL_TEMPLATE, model_dir / "1" / "model.py")
    return model_dir


def write_repository(engine_dir: str | Path, out: str | Path, name: str | None = None,
                     instances: int = 1, streaming: bool = False,
                     max_new_tokens_limit: int = protocol.DEFAULT_MAX_NEW_TOKENS_LIMIT,
                     threads: str = "auto", verify: str = "quick", backend: str | None = None) -> list[str]:
    """Write the model(s) for `engine_dir` into the repository `out`; returns their names."""
    engine_dir = Path(engine_dir)
    read_manifest(engine_dir, verify)  # refuse a missing or stale engine now, not at server start
    if instances < 1:
        raise ValueError(f"--instances must be >= 1, got {instances}")
    if max_new_tokens_limit < 1:
        raise ValueError(f"--max-new-tokens-limit must be >= 1, got {max_new_tokens_limit}")
    if threads != "auto" and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(f"--threads must be 'auto' or a whole number >= 1, got {threads!r}")
    name = model_name(engine_dir, name)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    names = [name] + ([name + STREAM_SUFFIX] if streaming else [])
    for n in names:
        write_model(out, n, engine_dir, instances, n != name, max_new_tokens_limit, threads, backend)
    return names


# --- TensorRT-LLM (GPU hosts) -----------------------------------------------------------

TRTLLM_MODEL = "tensorrt_llm"  # the llmapi model's directory name in its repository


def trtllm_settings(engine_dir: str | Path) -> dict:
    """What the llmapi model.yaml needs, read from the engine's manifest and checkpoints.

    Key names follow tensorrt_llm.llmapi.LLM arguments and DFlashDecodingConfig:
    speculative_config {decoding_type: DFlash, max_draft_len, speculative_model,
    mask_token_id, target_layer_ids}. TensorRT-LLM loads transformers directories, so
    a GGUF target is given as the directory build_engine.py converted it into.
    """
    manifest = read_manifest(Path(engine_dir))
    if manifest.drafter != "dflash":
        raise ValueError(f"--trtllm writes a DFlash speculative_config; this engine's drafter "
                         f"is {manifest.drafter!r}")
    from runtime.models.dflash import read_dflash_config

    drafter = read_dflash_config(manifest.drafter_dir)
    return {
        # TensorRT-LLM resolves paths against its own working directory: give absolute ones.
        "model": str(manifest.target_dir),
        "block_size": manifest.block_size,
        "speculative_config": {
            "decoding_type": "DFlash",
            # One target pass verifies [bonus, d1..dK]: K = block_size - 1 drafts.
            "max_draft_len": manifest.block_size - 1,
            "speculative_model": str(manifest.drafter_dir),
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
        },
        "sharpdraft": manifest.query_scaling.to_dict() if manifest.query_scaling else None,
    }


def trtllm_model_yaml(settings: dict, engine_dir: Path) -> str:
    spec = settings["speculative_config"]
    ids = ", ".join(str(i) for i in spec["target_layer_ids"])
    return (
        f"# TensorRT-LLM llmapi model configuration for engine {Path(engine_dir).resolve()}\n"
        "# Written by `python -m runtime serve --trtllm`. Every key but triton_config is passed\n"
        "# to tensorrt_llm.LLM(); see docs/serving.md (GPU deployment) for how to use it.\n"
        f"model: {json.dumps(settings['model'])}\n"
        'backend: "pytorch"\n'
        "tensor_parallel_size: 1\n"
        "pipeline_parallel_size: 1\n"
        "speculative_config:\n"
        f"  decoding_type: {spec['decoding_type']}\n"
        f"  max_draft_len: {spec['max_draft_len']}\n"
        f"  speculative_model: {json.dumps(spec['speculative_model'])}\n"
        f"  mask_token_id: {spec['mask_token_id']}\n"
        f"  target_layer_ids: [{ids}]\n"
        "triton_config:\n"
        "  max_batch_size: 0\n"
        "  decoupled: False\n"
    )


def write_trtllm(engine_dir: str | Path, out: str | Path) -> list[Path]:
    """<out>/tensorrt_llm/1/model.yaml and <out>/tensorrt_llm/1/sharpdraft.json.

    LLM() rejects unknown keys, so the SharpDraft parameters live beside model.yaml, not
    in it: they are what a SharpDraft-enabled drafter attention reads; stock TensorRT-LLM
    ignores the file and runs the drafter unscaled.
    """
    settings = trtllm_settings(engine_dir)
    version_dir = Path(out) / TRTLLM_MODEL / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    yaml_path = version_dir / "model.yaml"
    yaml_path.write_text(trtllm_model_yaml(settings, Path(engine_dir)))
    sharp_path = version_dir / "sharpdraft.json"
    sharp_path.write_text(json.dumps({
        "engine_dir": str(Path(engine_dir).resolve()),
        "drafter": "dflash",
        "block_size": settings["block_size"],
        # DFlash's block is bidirectional: every query of a block sees context + block keys.
        "visible_keys": "context + block_size",
        "query_scaling": settings["sharpdraft"],
        "enabled": settings["sharpdraft"] is not None,
    }, indent=2) + "\n")
    return [yaml_path, sharp_path]
