"""TensorRT-LLM engines (`build_engine.py --backend trtllm`): the configuration that makes
TensorRT-LLM's own speculative decoding run a drafter, and the hook that makes that
drafter apply SharpDraft's beta.

An engine directory for this backend holds engine.json (target, drafter checkpoint,
QueryScaling, the drafter family's settings) and llm_api.yaml, the LLM-API arguments
(`LLM(**config)`, `trtllm-serve --config`, the llmapi Triton model's model.yaml). Field
names come only from plugins/trtllm/pins.py, which cites where each was read. Writing
them needs no TensorRT-LLM; running them does (`require_tensorrt_llm`).

TensorRT-LLM resolves relative paths against its own working directory, so the config
names checkpoints by absolute path; the runtime rebuilds it from engine.json at run time
(`llm_api_config`), so a moved checkout still runs, while llm_api.yaml in the engine
directory is the copy for using TensorRT-LLM directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from plugins.scaling import QueryScaling
from plugins.trtllm import autoload, pins
from runtime.manifest import Manifest

LLM_API_CONFIG = "llm_api.yaml"
FAMILIES = tuple(pins.SPECULATIVE_FIELDS)  # dflash, eagle3, pard


class ConfigFieldError(ValueError):
    """A field name outside the pinned LLM-API lists: a bug in a writer, caught before
    TensorRT-LLM would reject it at start-up on someone's GPU host."""


def family_settings(family: str, drafter_config: dict | None = None, attention_backend: str = "VANILLA") -> dict:
    """The drafter family's own speculative_config fields (no paths, no lengths), as
    engine.json keeps them."""
    if family == "dflash":
        if attention_backend not in pins.DFLASH_ATTENTION_BACKENDS:
            raise ValueError(f"DFlash attention backend must be one of "
                             f"{', '.join(pins.DFLASH_ATTENTION_BACKENDS)}, got {attention_backend!r}")
        return {"mask_token_id": int(drafter_config["mask_token_id"]),
                "target_layer_ids": [int(i) for i in drafter_config["target_layer_ids"]],
                "attention_backend": attention_backend}
    if family in ("eagle3", "pard"):
        return {}  # TensorRT-LLM reads the rest (layers to capture, mask token) from the checkpoint
    raise ValueError(f"TensorRT-LLM speculative decoding here supports {', '.join(FAMILIES)}, got {family!r}")


def llm_api_config(manifest: Manifest) -> dict:
    """LLM() arguments for an engine: target, backend, lengths, speculative_config."""
    settings = manifest.extra.get("trtllm", {})
    config = {
        "model": str(manifest.target_dir),
        "backend": "pytorch",
        "tensor_parallel_size": int(settings.get("tensor_parallel_size", 1)),
        "speculative_config": {
            "decoding_type": pins.DECODING_TYPES[manifest.drafter],
            # One target pass verifies [bonus, d1..dK]: K = block_size - 1 drafts.
            "max_draft_len": manifest.block_size - 1,
            "speculative_model": str(manifest.drafter_dir),
            **settings.get("speculative", {}),
        },
    }
    if manifest.extra.get("max_seq_len"):
        config["max_seq_len"] = int(manifest.extra["max_seq_len"])
    check_fields(config)
    return config


def check_fields(config: dict, triton: bool = False) -> None:
    """Every key is one of the pinned field names (plugins/trtllm/pins.py)."""
    allowed = set(pins.LLM_API_FIELDS) | ({"triton_config"} if triton else set())
    unknown = set(config) - allowed
    spec = config.get("speculative_config", {})
    family = next((f for f, t in pins.DECODING_TYPES.items() if t == spec.get("decoding_type")), None)
    if family is None:
        raise ConfigFieldError(f"speculative_config.decoding_type {spec.get('decoding_type')!r} is not one "
                               f"of {', '.join(pins.DECODING_TYPES.values())}")
    unknown |= {f"speculative_config.{k}" for k in set(spec) - set(pins.SPECULATIVE_FIELDS[family])}
    if triton:
        unknown |= {f"triton_config.{k}" for k in set(config.get("triton_config", {})) - set(pins.TRITON_CONFIG_FIELDS)}
    if unknown:
        raise ConfigFieldError(f"field(s) {', '.join(sorted(unknown))} are not in the pinned TensorRT-LLM "
                               f"{pins.PINNED} lists (plugins/trtllm/pins.py)")


def to_yaml(data: dict, indent: int = 0) -> str:
    """A small YAML writer for nested dicts of scalars and lists (JSON scalars are YAML)."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def llm_api_yaml(config: dict, engine_dir: Path) -> str:
    return (f"# LLM-API arguments for engine {Path(engine_dir).resolve()} (TensorRT-LLM {pins.PINNED}).\n"
            "# Written by build_engine.py --backend trtllm: LLM(**this), trtllm-serve --config this.\n"
            "# SharpDraft needs its hook loaded too: python -m runtime trtllm-serve / generate, or\n"
            "# docs/trtllm.md.\n" + to_yaml(config))


def model_yaml(config: dict, engine_dir: Path, decoupled: bool = False) -> str:
    """The llmapi Triton model's model.yaml: the LLM() arguments plus triton_config."""
    data = dict(config) | {"triton_config": {"max_batch_size": 0, "decoupled": decoupled}}
    check_fields(data, triton=True)
    return (f"# TensorRT-LLM llmapi model configuration for engine {Path(engine_dir).resolve()}\n"
            "# Written by `python -m runtime serve --backend trtllm`. Every key but triton_config\n"
            "# is passed to tensorrt_llm.LLM(); SharpDraft's hook is installed by 1/model.py.\n"
            + to_yaml(data))


def scaling_env(scaling: QueryScaling | None) -> dict:
    """Environment for TensorRT-LLM processes: the .pth autoloader (plugins/trtllm/autoload.py)
    installs the hook in every worker when SHARPDRAFT_TRTLLM is set."""
    return {autoload.ENV: autoload.env_value(scaling)} if scaling else {}


def require_tensorrt_llm():
    """tensorrt_llm, or ImportError with one line on why it cannot run here."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        raise ImportError("TensorRT-LLM is not installed here (it needs an NVIDIA GPU and NVIDIA's "
                          f"package index; pinned: tensorrt_llm=={pins.PINNED}) — run trtllm engines "
                          "on a GPU host, see docs/trtllm.md")
    try:
        return importlib.import_module("tensorrt_llm")
    except Exception as exc:  # libcuda, MPI, mismatched wheels: say which, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ImportError(f"TensorRT-LLM is installed but cannot be imported here ({type(exc).__name__}: "
                          f"{first})") from None


def build_llm(manifest: Manifest, sharpdraft: bool = True, speculative: bool = True, **overrides):
    """tensorrt_llm.LLM for an engine, with SharpDraft's hook installed first (before the
    drafter is built) when the engine has a QueryScaling and `sharpdraft`."""
    from plugins.trtllm import install, uninstall

    config = llm_api_config(manifest)
    if not speculative:
        config.pop("speculative_config")
    tensorrt_llm = require_tensorrt_llm()  # one line, before anything changes, when it cannot run
    # The LLM API builds the model in an MPI worker by default, where this process's hook
    # does not reach; with one GPU it can stay in this process (TensorRT-LLM's own tests do
    # this). With the .pth autoloader installed, SHARPDRAFT_TRTLLM reaches workers instead.
    os.environ.setdefault(pins.SINGLE_PROCESS_ENV, "1")
    if sharpdraft and speculative and manifest.query_scaling is not None:
        os.environ.update(scaling_env(manifest.query_scaling))
        install(manifest.query_scaling)  # patches what is loaded now, hooks what loads later
    else:
        os.environ.pop(autoload.ENV, None)
        uninstall()
    return tensorrt_llm.LLM(**(config | overrides))


def generate(manifest: Manifest, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, sharpdraft: bool = True,
             speculative: bool = True) -> dict:
    """One prompt through TensorRT-LLM: text, token ids and its speculative statistics."""
    llm = build_llm(manifest, sharpdraft=sharpdraft, speculative=speculative)
    from tensorrt_llm import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            **({"seed": seed} if seed is not None else {}))
    try:
        output = llm.generate([prompt], params)[0]
    finally:
        llm.shutdown()
    completion = output.outputs[0]
    return {"text": completion.text, "tokens": list(completion.token_ids)}
