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
import shutil
import tempfile
from pathlib import Path

from plugins.scaling import QueryScaling
from plugins.trtllm import autoload, pins, proof, versions
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
        **({"pipeline_parallel_size": int(settings["pipeline_parallel_size"])}
           if settings.get("pipeline_parallel_size") else {}),
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
    """Environment for TensorRT-LLM processes of your own launches: the .pth autoloader
    (plugins/trtllm/autoload.py) installs the hook where SHARPDRAFT_TRTLLM is set. Our
    launchers do not rely on it (workers need not inherit it): see `Launch`."""
    return {autoload.ENV: autoload.env_value(scaling)} if scaling else {}


def installed_version() -> str | None:
    """TensorRT-LLM's version: from its distribution metadata (no import needed), else from
    tensorrt_llm.version where the package is importable without metadata (a source tree)."""
    import importlib
    from importlib import metadata

    try:
        return metadata.version(pins.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module(pins.VERSION_MODULE)
    except Exception:  # not installed, or needs a GPU driver to import
        return None
    version = getattr(module, "__version__", None)
    return None if version is None else str(version)


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


def world_sizes(config: dict) -> dict:
    """{tp, pp, cp} of an LLM-API configuration (missing: 1)."""
    return {k: int(config.get(field) or 1) for k, field in pins.PARALLEL_FIELDS.items()}


def refuse_inexact(config: dict, family: str | None, drafter_dir: Path | None = None) -> None:
    """One line (UsageError) for a configuration whose visible-key count SharpDraft cannot
    derive exactly: KV compression / sparse attention, a global attention window, context
    parallelism; for EAGLE-3 / PARD also a drafter checkpoint with sliding-window or chunked
    attention (DFlash's kernels are handed their window and count it)."""
    from runtime.cli import UsageError

    if config.get(pins.SPARSE_ATTENTION):
        raise UsageError(f"SharpDraft cannot count visible keys under {pins.SPARSE_ATTENTION} (KV "
                         "compression): drop it or run with --no-sharpdraft")
    if (config.get("kv_cache_config") or {}).get("max_attention_window"):
        raise UsageError("SharpDraft cannot count visible keys under kv_cache_config.max_attention_window "
                         "(sliding windows set outside the model): drop it or run with --no-sharpdraft")
    if world_sizes(config)["cp"] > 1:
        raise UsageError("SharpDraft with context parallelism (cp > 1) is not supported: a rank's KV length "
                         "is not the count a query sees — use tp/pp, or --no-sharpdraft")
    if family in ("eagle3", "pard") and drafter_dir is not None:
        path = Path(drafter_dir) / "config.json"
        try:
            drafter = json.loads(path.read_text())
        except (OSError, ValueError):
            drafter = {}
        # Qwen2-style configs carry sliding_window with use_sliding_window: false (unused);
        # Mistral-style ones carry sliding_window alone (used).
        windowed = (drafter.get("use_sliding_window") is True
                    or "sliding_attention" in (drafter.get("layer_types") or ())
                    or (bool(drafter.get("sliding_window")) and "use_sliding_window" not in drafter))
        if drafter.get(pins.CHUNK_ATTRIBUTE) or windowed:
            raise UsageError(f"{path}: sliding-window / chunked attention in a {family} drafter — SharpDraft "
                             "counts keys there from the metadata only without a window; run with "
                             "--no-sharpdraft")


class Launch:
    """SharpDraft for one launch: the version guard and the refusals before TensorRT-LLM
    builds anything, the hook in this process, the activation file that reaches worker
    processes through the .pth autoloader, and the proof check once the model is built.

        launch = Launch(scaling, config, family, drafter_dir)   # refuses in one line
        llm = tensorrt_llm.LLM(**config)
        applied = launch.require()                               # refuses in one line
        ...
        launch.close()
    """

    def __init__(self, scaling: QueryScaling, config: dict, family: str | None = None,
                 drafter_dir: Path | None = None, site: Path | None = None):
        from runtime.cli import UsageError

        self.scaling = scaling
        version = installed_version()
        if version is None:
            raise UsageError("cannot read TensorRT-LLM's version (no tensorrt_llm distribution metadata "
                             "or tensorrt_llm.version): SharpDraft's hook cannot vouch for it — "
                             "run with --no-sharpdraft")
        else:
            if not versions.is_tested(version, pins.MIN_VERSION, pins.MAX_VERSION):
                raise UsageError(f"SharpDraft's TensorRT-LLM hook was tested on "
                                 f"{versions.describe_range(pins.MIN_VERSION, pins.MAX_VERSION)}; this "
                                 f"environment has {version} — run with --no-sharpdraft, or a tested release")
        refuse_inexact(config, family, drafter_dir)
        self.site = site if site is not None else autoload.find_site()
        sizes = world_sizes(config)
        self.world = sizes["tp"] * sizes["pp"] * sizes["cp"]
        if self.world > 1 and self.site is None:
            raise UsageError(f"tp={sizes['tp']} pp={sizes['pp']} run TensorRT-LLM's model in MPI worker "
                             "processes, which this process's hook does not reach — run `python -m "
                             "plugins.trtllm autoload install` first (docs/trtllm.md)")
        self.directory = Path(tempfile.mkdtemp(prefix="sharpdraft-proof-"))
        self.activation = None
        self._nonce_before = os.environ.get(autoload.NONCE_ENV)
        if self.site is not None:
            self.activation = autoload.activate(self.site, scaling, self.directory)
            # TRTLLM_-prefixed: MpiPoolSession forwards it, so this launch's workers take
            # this launch's file and no other.
            os.environ[autoload.NONCE_ENV] = self.activation.stem
        from plugins.trtllm import install

        proof.set_directory(self.directory)
        install(scaling)  # the process itself (single-process executor, Triton stub, serve process)

    def env(self) -> dict:
        """Environment for this launch's TensorRT-LLM: one GPU keeps the executor in this
        process unless the caller chose otherwise."""
        return {pins.SINGLE_PROCESS_ENV: "1"} if self.world == 1 else {}

    def require(self, ran: bool = True) -> dict:
        """Once TensorRT-LLM has built the model (its warm-up has run the drafter): what was
        applied (proof.summary), or proof.ProofError in one line — unless every rank of the
        world wrapped its drafter and (`ran`) every wrapped layer / kernel ran scaled."""
        return proof.summary(proof.require(self.directory, self.scaling, world=self.world, ran=ran))

    def close(self) -> None:
        if self.activation is not None:
            autoload.deactivate(self.activation)
            self.activation = None
            if self._nonce_before is None:
                os.environ.pop(autoload.NONCE_ENV, None)
            else:
                os.environ[autoload.NONCE_ENV] = self._nonce_before
        proof.set_directory(None)
        shutil.rmtree(self.directory, ignore_errors=True)


def stand_down(site: Path | None = None) -> None:
    """Before a frozen / target-only / stock launch: no hook here, and none in its workers.
    Activation files of dead launches are removed (one line each); the workers are told to
    ignore every activation (NONCE_ENV=off, forwarded by MpiPoolSession); a live SharpDraft
    launch in the same environment is refused in one line (workers that do not get the
    variable would take its file)."""
    from plugins.trtllm import uninstall
    from runtime.cli import UsageError

    os.environ.pop(autoload.ENV, None)
    os.environ[autoload.NONCE_ENV] = autoload.OFF
    uninstall()
    site = site if site is not None else autoload.find_site()
    if site is None:
        return
    live = autoload.live_launches(autoload.activation_path(site))
    if live:
        raise UsageError(f"a SharpDraft launch (pid {live[0][1].get('launcher')}) is running in this "
                         f"environment ({live[0][0]}): an unscaled run here could have its workers scaled "
                         "— wait for it to end, or use another environment")


def build_llm(manifest: Manifest, sharpdraft: bool = True, speculative: bool = True, **overrides):
    """(tensorrt_llm.LLM for an engine, Launch or None). With the engine's QueryScaling and
    `sharpdraft`, the launch is checked before the LLM is built and the proof after: either
    refuses in one line. Frozen and target-only runs need no proof."""
    config = llm_api_config(manifest) | overrides
    if not speculative:
        config.pop("speculative_config")
    tensorrt_llm = require_tensorrt_llm()  # one line, before anything changes, when it cannot run
    launch = None
    if sharpdraft and speculative and manifest.query_scaling is not None:
        launch = Launch(manifest.query_scaling, config, manifest.drafter, manifest.drafter_dir)
        for key, value in launch.env().items():
            os.environ.setdefault(key, value)
    else:
        stand_down()
    try:
        llm = tensorrt_llm.LLM(**config)
    except BaseException:
        if launch is not None:
            launch.close()
        raise
    if launch is not None:
        try:
            launch.require()
        except proof.ProofError:
            llm.shutdown()
            launch.close()
            raise
    return llm, launch


def generate(manifest: Manifest, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, sharpdraft: bool = True,
             speculative: bool = True) -> dict:
    """One prompt through TensorRT-LLM: text, token ids and its speculative statistics."""
    llm, launch = build_llm(manifest, sharpdraft=sharpdraft, speculative=speculative)
    from tensorrt_llm import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            **({"seed": seed} if seed is not None else {}))
    applied = launch.require() if launch is not None else None
    try:
        output = llm.generate([prompt], params)[0]
        if launch is not None:
            applied = launch.require()  # after the first request too: every wrapped unit ran scaled
    finally:
        llm.shutdown()
        if launch is not None:
            launch.close()
    completion = output.outputs[0]
    return {"text": completion.text, "tokens": list(completion.token_ids), "sharpdraft_applied": applied}
