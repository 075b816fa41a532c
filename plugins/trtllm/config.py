"""TensorRT-LLM engines (`build_engine.py --backend trtllm`): the configuration that makes
TensorRT-LLM's own speculative decoding run a drafter, and the SharpDraft drafter
directory that makes the hook scale it.

An engine directory for this backend holds engine.json (target, drafter, QueryScaling, the
drafter family's settings), llm_api.yaml (the LLM-API arguments: `LLM(**config)`,
`trtllm-serve --config`, the llmapi Triton model's model.yaml) and, for a SharpDraft
engine, `drafter/`: the directory TensorRT-LLM loads as `speculative_model`, whose
config.json is the checkpoint's plus `"sharpdraft": {QueryScaling}` (the weights are
relative symlinks to the checkpoint's files). That config is the switch: TensorRT-LLM
hands it to the drafter's constructor as `draft_config.pretrained_config`, and the hook
scales a drafter iff it carries those parameters (plugins/trtllm/hook.py). A frozen run of
the same engine points speculative_model at the stock checkpoint instead.

Field names come only from plugins/trtllm/pins.py, which cites where each was read.
Writing them needs no TensorRT-LLM. The manifest is duck-typed (runtime.manifest.Manifest:
target_dir, drafter_dir, drafter, block_size, query_scaling, extra): plugins/ import
nothing from runtime/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import pins

LLM_API_CONFIG = "llm_api.yaml"
DRAFTER_DIR = "drafter"  # the SharpDraft drafter directory inside an engine directory
FAMILIES = tuple(pins.SPECULATIVE_FIELDS)  # dflash, eagle3, pard
CHECKOUT = Path(__file__).resolve().parents[2]


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


def write_drafter_dir(checkpoint: Path, out: Path, scaling, files: list[str]) -> Path:
    """`out`: the SharpDraft drafter directory for `checkpoint` -- its config.json with
    SharpDraft's parameters added under pins.SHARPDRAFT_KEY, every other file of `files`
    a relative symlink to the checkpoint's (moving the checkout with both keeps it whole)."""
    checkpoint, out = Path(checkpoint).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    if pins.SHARPDRAFT_KEY in config:
        raise ValueError(f"{checkpoint}/config.json already carries {pins.SHARPDRAFT_KEY!r}: pass the stock "
                         "checkpoint, not a SharpDraft drafter directory")
    config[pins.SHARPDRAFT_KEY] = scaling.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in files:
        if name == "config.json":
            continue
        link = out / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(checkpoint / name, link.parent.resolve()))
    return out


def drafter_parameters(drafter_dir: Path | None) -> dict | None:
    """The SharpDraft parameters a drafter directory's config.json carries (None: stock, or
    no readable config)."""
    if drafter_dir is None:
        return None
    try:
        return json.loads((Path(drafter_dir) / "config.json").read_text()).get(pins.SHARPDRAFT_KEY)
    except (OSError, ValueError, AttributeError):
        return None


def stock_drafter_dir(manifest) -> Path | None:
    """The checkpoint a frozen run loads: engine.json's extra.trtllm.stock_drafter for a
    SharpDraft engine (stored as the manifest stores paths: relative to the checkout when
    inside it), else the manifest's drafter directory."""
    stored = (manifest.extra.get("trtllm") or {}).get("stock_drafter")
    if not stored:
        return manifest.drafter_dir
    path = Path(stored)
    return path if path.is_absolute() else CHECKOUT / path


def llm_api_config(manifest, sharpdraft: bool = True) -> dict:
    """LLM() arguments for an engine: target, backend, lengths, speculative_config. With
    `sharpdraft` the engine's own drafter directory (SharpDraft's, for a SharpDraft engine);
    without, the stock checkpoint (the frozen drafter)."""
    settings = manifest.extra.get("trtllm", {})
    drafter = manifest.drafter_dir if sharpdraft else stock_drafter_dir(manifest)
    config = {
        "model": str(manifest.target_dir),
        "backend": "pytorch",
        "tensor_parallel_size": int(settings.get("tensor_parallel_size", 1)),
        **({"pipeline_parallel_size": int(settings["pipeline_parallel_size"])}
           if settings.get("pipeline_parallel_size") else {}),
        "speculative_config": {
            "decoding_type": pins.DECODING_TYPES[manifest.drafter],
            # One target pass verifies [bonus, d1..dK]: K = block_size - 1 drafts.
            "max_draft_len": manifest.block_size - 1,
            "speculative_model": str(drafter),
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
    if spec.get("use_dynamic_tree") and "dynamic_tree_max_topK" not in spec:
        raise ConfigFieldError("speculative_config.use_dynamic_tree needs dynamic_tree_max_topK beside it "
                               "(TensorRT-LLM rejects it alone)")


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
            "# A SharpDraft drafter directory needs the hook where TensorRT-LLM builds the drafter:\n"
            "# python -m plugins.trtllm autoload install, or our launchers (docs/trtllm.md).\n"
            + to_yaml(config))


def model_yaml(config: dict, engine_dir: Path, decoupled: bool = False) -> str:
    """The llmapi Triton model's model.yaml: the LLM() arguments plus triton_config."""
    data = dict(config) | {"triton_config": {"max_batch_size": 0, "decoupled": decoupled}}
    check_fields(data, triton=True)
    return (f"# TensorRT-LLM llmapi model configuration for engine {Path(engine_dir).resolve()}\n"
            "# Written by `python -m runtime serve --backend trtllm`. Every key but triton_config\n"
            "# is passed to tensorrt_llm.LLM(); SharpDraft's hook is installed by 1/model.py.\n"
            + to_yaml(data))


def world_sizes(config: dict) -> dict:
    """{tp, pp, cp} of an LLM-API configuration (missing: 1)."""
    return {k: int(config.get(field) or 1) for k, field in pins.PARALLEL_FIELDS.items()}
