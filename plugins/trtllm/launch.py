"""SharpDraft launches of TensorRT-LLM (our generate, trtllm-serve and Triton llmapi model):
everything checked before TensorRT-LLM builds anything, the proof checked after.

Before (`Launch(...)`, each refusal one line, a LaunchError):
- the release: older than pins.MIN_VERSION refused; any release whose installed source
  lacks a pinned name refused, naming it (plugins/trtllm/structure.py); newer than the
  tested range but structurally the same: accepted, one line on stderr names it untested;
- configurations whose visible-key count is not exact (refuse_inexact), and attention
  backends the generic Attention path was not audited on (EAGLE-3 / PARD with
  attn_backend other than TRTLLM: FLASHINFER's draft view among them);
- the drafter directory must carry SharpDraft's parameters, equal to the engine's
  QueryScaling (the directory, not this launch, is what the hook keys on);
- with more than one rank, the .pth autoloader must be installed (the workers build the
  drafter; nothing of this process reaches them otherwise).
The hook is installed in this process too (single-process executor, Triton stub) and the
proof directory is exported in TRTLLM_SHARPDRAFT_PROOF, which MpiPoolSession forwards.

After (`launch.require()`): plugins/trtllm/proof.py. With CUDA graphs (TensorRT-LLM's
default) the warm-up captures the drafter, so every wrapped layer's `ran` record is
required once the LLM is built; without them (`cuda_graph_config: null`) only the
`wrapped` records are, and `generate` requires `ran` after the first request -- the
drafter's first generation step is the proof. A SharpDraft drafter directory loaded where
the hook is not installed builds an unscaled drafter and leaves no record: this check is
what refuses it (TensorRT-LLM's loading code offers no hook-free way to fail on it; see
docs/trtllm.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import config as trtllm_config
from . import pins, proof, structure, versions
from . import autoload

__all__ = ["LaunchError", "Launch", "installed_version", "require_tensorrt_llm", "refuse_inexact",
           "check_release", "build_llm", "generate"]


class LaunchError(ValueError):
    """A SharpDraft launch refused before (or right after) TensorRT-LLM builds the model:
    one line. A ValueError, so the command line's one-line handling applies."""


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
                          f"package index; tested: tensorrt_llm {pins.MIN_VERSION} to {pins.MAX_VERSION}) — "
                          "run trtllm engines on a GPU host, see docs/trtllm.md")
    try:
        return importlib.import_module("tensorrt_llm")
    except Exception as exc:  # libcuda, MPI, mismatched wheels: say which, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ImportError(f"TensorRT-LLM is installed but cannot be imported here ({type(exc).__name__}: "
                          f"{first})") from None


def check_release(version: str | None, root: Path | None = None) -> str:
    """The release, if SharpDraft may run on it (LaunchError in one line otherwise): at
    least MIN_VERSION, and every pinned name present in its source; a release newer than
    the tested range writes one line on stderr naming it untested."""
    if version is None:
        raise LaunchError("cannot read TensorRT-LLM's version (no tensorrt_llm distribution metadata "
                          "or tensorrt_llm.version): SharpDraft's hook cannot vouch for it — "
                          "run with --no-sharpdraft")
    try:
        older = versions.parse(version) < versions.parse(pins.MIN_VERSION)
    except ValueError:
        raise LaunchError(f"TensorRT-LLM's version {version!r} is not a version number — run with "
                          "--no-sharpdraft") from None
    if older:
        raise LaunchError(f"TensorRT-LLM {version} is older than {pins.MIN_VERSION}, the first release with "
                          "the drafters SharpDraft's hook wraps — run with --no-sharpdraft")
    missing = structure.missing_names(root)
    if missing:
        raise LaunchError(f"TensorRT-LLM {version} moved what SharpDraft's hook relies on: "
                          f"{'; '.join(missing)} not found (pinned in plugins/trtllm/pins.py) — run with "
                          "--no-sharpdraft")
    if not versions.is_tested(version, pins.MIN_VERSION, pins.MAX_VERSION):
        sys.stderr.write(f"sharpdraft: TensorRT-LLM {version} is untested (tested: "
                         f"{versions.describe_range(pins.MIN_VERSION, pins.MAX_VERSION)}); accepted because "
                         "every pinned name is present\n")
    return version


def refuse_inexact(config: dict, family: str | None, drafter_dir: Path | None = None) -> None:
    """One line (LaunchError) for a configuration whose visible-key count SharpDraft cannot
    derive exactly: KV compression / sparse attention, a global attention window, context
    parallelism; for EAGLE-3 / PARD also an attention backend other than TRTLLM (FLASHINFER
    drafts on its own draft view, pins.SOURCES["attention_flashinfer"]) and a drafter
    checkpoint with sliding-window or chunked attention (DFlash's kernels are handed their
    window and lengths and count them, whatever the target's attention backend)."""
    import json

    if config.get(pins.SPARSE_ATTENTION):
        raise LaunchError(f"SharpDraft cannot count visible keys under {pins.SPARSE_ATTENTION} (KV "
                          "compression): drop it or run with --no-sharpdraft")
    if (config.get("kv_cache_config") or {}).get("max_attention_window"):
        raise LaunchError("SharpDraft cannot count visible keys under kv_cache_config.max_attention_window "
                          "(sliding windows set outside the model): drop it or run with --no-sharpdraft")
    if trtllm_config.world_sizes(config)["cp"] > 1:
        raise LaunchError("SharpDraft with context parallelism (cp > 1) is not supported: a rank's KV length "
                          "is not the count a query sees — use tp/pp, or --no-sharpdraft")
    backend = str(config.get(pins.ATTN_BACKEND_FIELD) or pins.AUDITED_ATTN_BACKENDS[0]).upper()
    if family in ("eagle3", "pard") and backend not in pins.AUDITED_ATTN_BACKENDS:
        raise LaunchError(f"SharpDraft's {family} drafter counts visible keys from the "
                          f"{', '.join(pins.AUDITED_ATTN_BACKENDS)} attention backend's metadata; "
                          f"attn_backend {backend} is refused (FLASHINFER drafts on a separate draft view) — "
                          "use attn_backend TRTLLM, or --no-sharpdraft")
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
            raise LaunchError(f"{path}: sliding-window / chunked attention in a {family} drafter — SharpDraft "
                              "counts keys there from the metadata only without a window; run with "
                              "--no-sharpdraft")


def cuda_graphs(config: dict) -> bool:
    """CUDA graphs are on unless the configuration sets cuda_graph_config to null
    (TensorRT-LLM's default is CudaGraphConfig())."""
    return config.get("cuda_graph_config", "default") is not None


class Launch:
    """SharpDraft for one launch (see the module docstring).

        launch = Launch(scaling, config, family, drafter_dir)   # refuses in one line
        llm = tensorrt_llm.LLM(**config)
        applied = launch.require()                               # refuses in one line
        ...
        launch.close()
    """

    def __init__(self, scaling, config: dict, family: str | None = None, drafter_dir: Path | None = None,
                 site: Path | None = None):
        from .hook import install

        self.scaling = scaling
        self.version = check_release(installed_version())
        refuse_inexact(config, family, drafter_dir)
        drafter_dir = drafter_dir or (config.get("speculative_config") or {}).get("speculative_model")
        carried = trtllm_config.drafter_parameters(drafter_dir)
        if carried != scaling.to_dict():
            raise LaunchError(f"the drafter directory {drafter_dir} carries "
                              + ("no SharpDraft parameters" if carried is None else f"SharpDraft parameters {carried}")
                              + f", not this engine's {scaling.to_dict()} — rebuild it with build_engine.py "
                              "--backend trtllm --sharpdraft")
        self.site = site if site is not None else autoload.find_site()
        sizes = trtllm_config.world_sizes(config)
        self.world = sizes["tp"] * sizes["pp"] * sizes["cp"]
        self.pipeline = sizes["pp"]
        self.graphs = cuda_graphs(config)
        if self.world > 1 and self.site is None:
            raise LaunchError(f"tp={sizes['tp']} pp={sizes['pp']} run TensorRT-LLM's model in MPI worker "
                              "processes, which this process's hook does not reach — run `python -m "
                              "plugins.trtllm autoload install` first (docs/trtllm.md)")
        self.directory = Path(tempfile.mkdtemp(prefix="sharpdraft-proof-"))
        self._proof_before = os.environ.get(proof.PROOF_ENV)
        os.environ[proof.PROOF_ENV] = str(self.directory)  # TRTLLM_-prefixed: forwarded to workers
        proof.set_directory(self.directory)
        install()  # this process (single-process executor, Triton stub, serve process)

    def env(self) -> dict:
        """Environment for this launch's TensorRT-LLM: one GPU keeps the executor in this
        process unless the caller chose otherwise."""
        return {pins.SINGLE_PROCESS_ENV: "1"} if self.world == 1 else {}

    def require(self, ran: bool | None = None) -> dict:
        """What was applied (proof.summary), or proof.ProofError in one line, unless every
        rank holding a drafter wrapped it; with `ran` (default: whether CUDA graphs are on,
        whose warm-up captures the drafter) also unless every wrapped layer ran scaled."""
        ran = self.graphs if ran is None else ran
        return proof.summary(proof.require(self.directory, self.scaling, world=self.world, ran=ran,
                                           pipeline=self.pipeline))

    def close(self) -> None:
        if self._proof_before is None:
            os.environ.pop(proof.PROOF_ENV, None)
        else:
            os.environ[proof.PROOF_ENV] = self._proof_before
        proof.set_directory(None)
        shutil.rmtree(self.directory, ignore_errors=True)


def build_llm(manifest, sharpdraft: bool = True, speculative: bool = True, **overrides):
    """(tensorrt_llm.LLM for an engine, Launch or None). With the engine's QueryScaling and
    `sharpdraft`, the launch is checked before the LLM is built and the proof after: either
    refuses in one line. Frozen runs load the stock checkpoint, target-only runs no drafter:
    neither needs a proof, and no hook anywhere scales them."""
    scaled = sharpdraft and speculative and manifest.query_scaling is not None
    config = trtllm_config.llm_api_config(manifest, sharpdraft=scaled) | overrides
    if not speculative:
        config.pop("speculative_config")
    tensorrt_llm = require_tensorrt_llm()  # one line, before anything changes, when it cannot run
    launch = None
    if scaled:
        launch = Launch(manifest.query_scaling, config, manifest.drafter, manifest.drafter_dir)
        for key, value in launch.env().items():
            os.environ.setdefault(key, value)
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


def generate(manifest, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, sharpdraft: bool = True, speculative: bool = True, **overrides) -> dict:
    """One prompt through TensorRT-LLM: text, token ids and its speculative statistics."""
    llm, launch = build_llm(manifest, sharpdraft=sharpdraft, speculative=speculative, **overrides)
    from tensorrt_llm import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            **({"seed": seed} if seed is not None else {}))
    applied = None
    try:
        output = llm.generate([prompt], params)[0]
        if launch is not None:
            applied = launch.require(ran=True)  # the first request ran every wrapped layer scaled
    finally:
        llm.shutdown()
        if launch is not None:
            launch.close()
    completion = output.outputs[0]
    return {"text": completion.text, "tokens": list(completion.token_ids), "sharpdraft_applied": applied}
