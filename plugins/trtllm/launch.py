"""SharpDraft launches of TensorRT-LLM (our generate, trtllm-serve and Triton llmapi model):
everything checked before TensorRT-LLM builds anything, the proof checked after.

Before (`Launch(...)`, each refusal one line, a LaunchError):
- the release, by structure alone (plugins/trtllm/structure.py): any release whose
  installed source lacks a name, signature or metadata field the hook reads, or the DFlash
  kernel of the attention backend this launch uses, is refused naming it; one outside the
  range we read (pins.READ_RANGE) but structurally the same is accepted, one line on stderr
  naming it untested. No version number is refused;
- configurations whose visible-key count is not exact (refuse_inexact), and attention
  backends the generic Attention path was not audited on (EAGLE-3 / PARD with
  attn_backend other than TRTLLM: FLASHINFER's draft view among them);
- the drafter directory must carry SharpDraft's parameters, equal to the engine's
  QueryScaling (the directory, not this launch, is what the hook keys on);
- with more than one rank, the .pth autoloader must be installed (the workers build the
  drafter; nothing of this process reaches them otherwise). On one GPU without it, the
  executor is kept in this process (TLLM_WORKER_USE_SINGLE_PROCESS=1, said on stderr with
  the reason); with it, TensorRT-LLM keeps its own worker process.
- with pipeline parallelism, a release whose Mapping cannot tell the stage that runs the
  drafter (pins.MAPPING_STAGE).
The hook is installed in this process too (single-process executor, Triton stub). The proof
directory travels in the drafter's own config: TensorRT-LLM is handed this launch's view of
the drafter directory (`llm_config`), whose config.json names it -- no environment variable.
Servers gate the LLM class itself (`gate`), so no binding of it goes around the proof.

After (plugins/trtllm/proof.py): once the LLM is built, `require()` -- every rank that holds
a drafter wrapped it (or, where its config allows, runs it frozen), and the device counts
of scaled calls as they stand after warm-up and capture; after the first requests,
`require_running()` -- every wrapped layer of every rank counted more scaled calls, with or
without CUDA graphs (the counters are tensor ops inside the captured region). A launch whose
count stays put is refused in one line. Servers (trtllm-serve, Triton) send one short
request of their own (`probe`) before they serve. A build TensorRT-LLM stopped because a
SharpDraft drafter could not be scaled is reported as the hook's one line (`built`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import config as trtllm_config
from . import pins, proof, structure, versions
from . import autoload

__all__ = ["LaunchError", "Launch", "installed_version", "require_tensorrt_llm", "refuse_inexact",
           "check_release", "dflash_backend", "single_process_env", "build_llm", "generate"]


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
                          f"package index; configuration written for tensorrt_llm {pins.PINNED}) — "
                          "run trtllm engines on a GPU host, see docs/trtllm.md")
    try:
        return importlib.import_module("tensorrt_llm")
    except Exception as exc:  # libcuda, MPI, mismatched wheels: say which, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ImportError(f"TensorRT-LLM is installed but cannot be imported here ({type(exc).__name__}: "
                          f"{first})") from None


def family_of(config: dict, family: str | None) -> str | None:
    """The drafter family of a launch: given, or from speculative_config.decoding_type."""
    if family is not None:
        return family
    decoding = (config.get("speculative_config") or {}).get("decoding_type")
    return next((f for f, t in pins.DECODING_TYPES.items() if t == decoding), None)


def check_release(version: str | None, root: Path | None = None, dflash_backend: str | None = None,
                  family: str | None = None) -> str | None:
    """The release, if SharpDraft may run on it (LaunchError in one line otherwise): decided
    by structure alone -- every name, signature and metadata field the hook reads present in
    its source, and the DFlash kernel of `dflash_backend` (the launch's attention backend;
    None: no DFlash). A release outside the range we read writes one line naming it untested."""
    missing = structure.missing_names(root, dflash_backend=dflash_backend, family=family)
    label = version if version is not None else "(version unknown)"
    if missing:
        raise LaunchError(f"TensorRT-LLM {label} moved what SharpDraft's hook relies on: "
                          f"{'; '.join(missing)} not found (pinned in plugins/trtllm/pins.py) — run with "
                          "--no-sharpdraft")
    if version is None or not versions.is_tested(version, *pins.READ_RANGE):
        os.environ[proof.UNTESTED_ENV] = label  # the hook, here and in the workers, need not say it again
        sys.stderr.write(f"sharpdraft: TensorRT-LLM {label} is untested (read: "
                         f"{versions.describe_range(*pins.READ_RANGE)}); accepted because every name "
                         "SharpDraft reads is present\n")
    return version


def dflash_backend(config: dict, family: str | None) -> str | None:
    """The DFlash attention backend this launch uses (DFlashDecodingConfig.attention_backend,
    VANILLA by default), None for another drafter family."""
    speculative = config.get("speculative_config") or {}
    if family != "dflash" and speculative.get("decoding_type") != pins.DECODING_TYPES["dflash"]:
        return None
    return str(speculative.get("attention_backend") or "VANILLA").upper()


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
        with launch.built():
            llm = tensorrt_llm.LLM(**launch.llm_config(config))  # the drafter view; a stopped build: our line
        applied = launch.require()                               # wrapped on every rank
        ... first requests (servers: launch.probe(llm)) ...
        applied = launch.require_running()                       # the counts grew
        launch.close()
    """

    PROBE_PROMPT = "SharpDraft probe: count to five. One, two,"
    PROBE_TOKENS = 8

    def __init__(self, scaling, config: dict, family: str | None = None, drafter_dir: Path | None = None,
                 site: Path | None = None):
        from .hook import install

        self.scaling = scaling
        self._untested_before = os.environ.get(proof.UNTESTED_ENV)
        try:
            self._check(config, family, drafter_dir, site)
        except BaseException:
            self._restore_untested()
            raise
        self.held: list[dict] = []
        self.before: dict[int, dict] = {}
        self._gated = None
        self.directory = Path(tempfile.mkdtemp(prefix="sharpdraft-proof-"))
        self.view = self._drafter_view()
        install()  # this process (single-process executor, Triton stub, serve process)

    def _drafter_view(self) -> Path:
        """This launch's view of the drafter directory, what TensorRT-LLM is handed as
        speculative_model: config.json with the proof directory added to its SharpDraft
        parameters (pins.PROOF_KEY), every other entry a symlink to the original's. So the
        proof's location reaches the process that builds the drafter in the config it builds
        from: no environment variable, which MPI may not forward (older MpiPoolSession
        copies pass no env=; a variable set after MPI started does not reach spawned
        workers), and concurrent launches of one engine never share a directory."""
        import json

        source = Path(self.drafter_dir).resolve()
        view = self.directory / "drafter"
        view.mkdir()
        config = json.loads((source / "config.json").read_text())
        config[pins.SHARPDRAFT_KEY] = dict(config[pins.SHARPDRAFT_KEY], **{pins.PROOF_KEY: str(self.directory)})
        (view / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for entry in source.iterdir():
            if entry.name != "config.json":
                (view / entry.name).symlink_to(entry.resolve())
        return view

    def llm_config(self, config: dict) -> dict:
        """LLM() arguments with this launch's drafter view as speculative_model."""
        speculative = dict(config.get("speculative_config") or {})
        speculative["speculative_model"] = str(self.view)
        return dict(config, speculative_config=speculative)

    def gate(self, probe: bool = True) -> None:
        """Gate TensorRT-LLM's LLM class itself (pins.LLM_CLASS): every name bound to it --
        tensorrt_llm.LLM, commands.serve.PyTorchLLM, a serving module's own `from
        tensorrt_llm import LLM as ...` made before this call -- is the same class object,
        so no import order goes around it. While this launch lives, an LLM handed this
        launch's drafter directory builds from the drafter view, a build the hook stopped
        reports the hook's line, and (probe) the proof is checked before the LLM returns:
        wrapped on every rank, one short request, every counted layer grown. close() puts
        the class back. ImportError (one line) where the class is not there."""
        import importlib

        module_name, class_name = pins.LLM_CLASS
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            raise ImportError(f"TensorRT-LLM has no {module_name}.{class_name} (the LLM class every server "
                              "builds), where SharpDraft checks its proof — run with --no-sharpdraft") from None
        original = cls.__dict__.get("__init__")
        inherited = cls.__init__
        launch = self

        def __init__(llm, *args, **kwargs):
            spec = kwargs.get("speculative_config")
            if isinstance(spec, dict) and launch.owns(spec.get("speculative_model")):
                kwargs = launch.llm_config(kwargs)
            with launch.built():
                inherited(llm, *args, **kwargs)
            if probe:
                try:
                    applied = launch.probe(llm)
                except Exception:
                    llm.shutdown()
                    raise
                sys.stderr.write(json.dumps({"sharpdraft_applied": applied}) + "\n")

        cls.__init__ = functools.wraps(inherited)(__init__)
        self._gated = (cls, original)

    def owns(self, speculative_model) -> bool:
        """Whether speculative_model is this launch's drafter (its directory or its view)."""
        if not speculative_model:
            return False
        path = Path(speculative_model).resolve()
        return path in (Path(self.drafter_dir).resolve(), self.view.resolve())

    def _check(self, config: dict, family: str | None, drafter_dir, site) -> None:
        """Everything refused before TensorRT-LLM builds anything (one line each)."""
        self.version = check_release(installed_version(), dflash_backend=dflash_backend(config, family),
                                     family=family_of(config, family))
        refuse_inexact(config, family, drafter_dir)
        drafter_dir = drafter_dir or (config.get("speculative_config") or {}).get("speculative_model")
        self.drafter_dir = drafter_dir
        carried = trtllm_config.drafter_parameters(drafter_dir)
        policy = carried.get(pins.IF_UNSCALABLE) if isinstance(carried, dict) else None
        parameters = {k: v for k, v in carried.items() if k != pins.IF_UNSCALABLE} if isinstance(carried, dict) \
            else carried
        if parameters != self.scaling.to_dict():
            raise LaunchError(f"the drafter directory {drafter_dir} carries "
                              + ("no SharpDraft parameters" if carried is None else f"SharpDraft parameters {carried}")
                              + f", not this engine's {self.scaling.to_dict()} — rebuild it with build_engine.py "
                              "--backend trtllm --sharpdraft")
        self.frozen_allowed = policy == proof.FROZEN
        self.site = site if site is not None else autoload.find_site()
        sizes = trtllm_config.world_sizes(config)
        self.world = sizes["tp"] * sizes["pp"] * sizes["cp"]
        self.pipeline = sizes["pp"]
        self.graphs = cuda_graphs(config)
        if self.pipeline > 1 and structure.mapping_missing():
            raise LaunchError(f"pp={self.pipeline}: this TensorRT-LLM's mapping has no "
                              f"{pins.MAPPING_MODULE}.Mapping.{' / '.join(pins.MAPPING_STAGE)}, from which SharpDraft "
                              "tells the stage that runs the drafter — run with pp=1, or --no-sharpdraft")
        if self.world > 1 and self.site is None:
            raise LaunchError(f"tp={sizes['tp']} pp={sizes['pp']} run TensorRT-LLM's model in MPI worker "
                              "processes, which this process's hook does not reach — run `python -m "
                              "plugins.trtllm autoload install` first (docs/trtllm.md)")

    def _restore_untested(self) -> None:
        if self._untested_before is None:
            os.environ.pop(proof.UNTESTED_ENV, None)
        else:
            os.environ[proof.UNTESTED_ENV] = self._untested_before

    def env(self, announce=lambda line: sys.stderr.write(line + "\n")) -> dict:
        """Environment for this launch's TensorRT-LLM: the single-process executor only where
        it is needed -- one GPU and no autoloader, so that the drafter is built in this
        process, where the hook is -- said in one line with the reason."""
        return single_process_env(self.world, self.site is not None, announce)

    @contextlib.contextmanager
    def built(self):
        """Around TensorRT-LLM's build: where a SharpDraft drafter's constructor stopped it,
        the error becomes the hook's one line (a LaunchError), whatever TensorRT-LLM wrapped it in."""
        try:
            yield
        except BaseException as exc:
            refused = [e for e in proof.read(self.directory) if e["kind"] == "refused"]
            if refused and not isinstance(exc, KeyboardInterrupt):
                first = refused[0]
                raise LaunchError(f"sharpdraft: {first.get('drafter')} carries SharpDraft's parameters but cannot "
                                  f"be scaled (pid {first['pid']} rank {first.get('rank', 0)}): "
                                  f"{first.get('reason', '?')}") from None
            raise

    def require(self) -> dict:
        """What was applied (proof.summary) once the LLM is built, or proof.ProofError in one
        line, unless every rank holding a drafter wrapped it; reads the device counts as they
        stand after warm-up (the baseline require_running compares against)."""
        self.held = proof.require(self.directory, self.scaling, world=self.world, pipeline=self.pipeline,
                                  frozen_allowed=self.frozen_allowed)
        self.before = proof.request_counts(self.directory, self.held) if self._wrapped() else {}
        return proof.summary(self.held, self.before if self._wrapped() else None)

    def require_running(self) -> dict:
        """After the first requests: proof.ProofError in one line unless every wrapped layer of
        every rank counted more scaled calls than at require()."""
        if not self.held:
            self.require()
        if not self._wrapped():
            return proof.summary(self.held)
        after = proof.request_counts(self.directory, self.held)
        return proof.summary(self.held, proof.require_growth(self.held, self.before, after))

    def probe(self, llm) -> dict:
        """A server's own first request, before it serves: require(), one short generation,
        require_running()."""
        self.require()
        from tensorrt_llm import SamplingParams

        llm.generate([self.PROBE_PROMPT], SamplingParams(max_tokens=self.PROBE_TOKENS, temperature=0.0))
        return self.require_running()

    def _wrapped(self) -> bool:
        return any(e["kind"] == "wrapped" for e in self.held)

    def close(self) -> None:
        if self._gated is not None:
            cls, original = self._gated
            if original is None:
                del cls.__init__  # it was inherited
            else:
                cls.__init__ = original
            self._gated = None
        self._restore_untested()
        shutil.rmtree(self.directory, ignore_errors=True)


def single_process_env(world: int, autoloader: bool, announce) -> dict:
    """{TLLM_WORKER_USE_SINGLE_PROCESS: "1"} where SharpDraft needs the executor in this
    process (one rank, no autoloader to reach TensorRT-LLM's worker), with one line saying
    why; {} where it does not, or where the variable is set already (yours wins)."""
    if world != 1 or autoloader or pins.SINGLE_PROCESS_ENV in os.environ:
        return {}
    announce(f"sharpdraft: {pins.SINGLE_PROCESS_ENV}=1: one GPU and no autoloader, so TensorRT-LLM's executor "
             "stays in this process, where SharpDraft's hook is (TensorRT-LLM notes it may slow streaming; "
             "`python -m plugins.trtllm autoload install` keeps its worker process instead)")
    return {pins.SINGLE_PROCESS_ENV: "1"}


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
        config = launch.llm_config(config)  # the drafter view: the proof directory travels in its config
        for key, value in launch.env().items():
            os.environ.setdefault(key, value)
    try:
        if launch is None:
            llm = tensorrt_llm.LLM(**config)
        else:
            with launch.built():
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
            applied = launch.require_running()  # the first request's draft steps counted up, every layer
    finally:
        llm.shutdown()
        if launch is not None:
            launch.close()
    completion = output.outputs[0]
    return {"text": completion.text, "tokens": list(completion.token_ids), "sharpdraft_applied": applied}
