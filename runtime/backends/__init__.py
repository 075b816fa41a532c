"""The backends' registry: which backends exist, which of them this runtime runs, and for
each the loader that opens an engine directory with the options it declares. Light on
purpose (no torch, no onnxruntime): the command line reads its choices here
(runtime/cli.py), and a backend's modules are imported only when an engine is opened
with it.

A loader(engine_dir, manifest, drafting, **its declared options) hands back a Loaded
(runtime/backends/roles.py: the tokenizer, the batch target, the drafter for a drafting
setting, what the backend can run: runtime/modes.py BACKENDS). TensorRT-LLM is a backend
here like the others: its capability says it runs its own loop, and its loader
(runtime/backends/tensorrt_llm.py) hands out that loop, not roles.
Where the roles run (device) and in which dtype are loader options, not further
backends; an option a backend does not take is refused in one line, with the reason
this registry records (runtime/spec.py: open_spec). Nothing above this package compares
backend names: the spec looks its loader up here.

The roles themselves, and how the decode loop sees them: runtime/backends/roles.py."""

from __future__ import annotations

import dataclasses
import importlib

from runtime import modes
from runtime.placement import DEVICES, DTYPES, PREFILL_DTYPES, STEPS  # noqa: F401 -- the backends' names

# what an engine can be built for, and what runs in this runtime's decode loop (tensorrt:
# on a GPU; a backend with its own loop runs there): runtime/modes.py says what each runs
BACKENDS = tuple(modes.BACKENDS)
RUNNABLE_BACKENDS = tuple(name for name, can in modes.BACKENDS.items() if not can.own_loop)
# the backends whose engine serves itself (vLLM's OpenAI server: `python -m runtime vllm-serve`)
SERVES_ITSELF = tuple(name for name, can in modes.BACKENDS.items() if not can.triton)

# the choices' names live in runtime/placement.py (the command lines read them there);
# the torch backend resolves DEVICES and TORCH_DTYPES (runtime/backends/pytorch/placement.py),
# its compiled steps take STEPS (pytorch/compiled.py: compile_step). float64: the exactness
# tests' dtype (tests/test_loaders.py), not offered on the command line.
TORCH_DTYPES = (*DTYPES, "float64")
# The options an engine is opened with, the one key set every caller passes (Engine's
# keywords, serve's and the commands' --device / --dtype / --steps / --prefill-dtype):
# each loader declares which of them it takes (LOADERS). Where a record was measured is
# another set, runtime/manifest.py PLACEMENT (backend, device, dtype, steps).
OPTIONS = ("device", "dtype", "steps", "prefill_dtype")


@dataclasses.dataclass(frozen=True)
class Loader:
    """One backend's loader: `module`.`name` called as (engine_dir, manifest, drafting,
    **options) with only the `options` it declares; `refusals`: why it takes none of the
    other keywords the spec knows, said when one is asked for (`{value}`: the value
    given); `fixed`: the placement fields (device, dtype) its roles always run in."""

    backend: str
    module: str
    name: str
    options: tuple[str, ...]
    refusals: dict[str, str]
    fixed: dict = dataclasses.field(default_factory=dict)

    @property
    def can(self) -> modes.Backend:
        """What this backend runs (runtime/modes.py BACKENDS)."""
        return modes.BACKENDS[self.backend]

    def placement(self, manifest, options: dict) -> dict:
        """Where an engine opened with `options` runs its steps (runtime/manifest.py
        PLACEMENT): the device and dtype this backend fixes, else the ones asked for, else
        the cpu and engine.json's dtype; compiled steps (None: not compiled)."""
        where = {"device": "cpu", "dtype": manifest.dtype} | options | self.fixed
        return {"backend": self.backend, "device": str(where["device"]).split(":")[0],
                "dtype": where["dtype"], "steps": options.get("steps")}

    def takes_window(self, manifest) -> bool:
        """Whether this backend's DFlash drafter of `manifest`'s engine drafts under a draft
        window (the loaded class's answer from engine.json, nothing loaded)."""
        return getattr(importlib.import_module(self.module), self.name).takes_window(manifest)

    def refusal(self, backend: str, option: str, value) -> str | None:
        """Why `backend` (this loader's) does not take `option` (None: it does)."""
        if option in self.options:
            return None
        why = self.refusals.get(option, "the {backend} backend takes no --"
                                + option.replace("_", "-") + " ({value})")
        return why.format(backend=backend, value=value)

    def __call__(self, engine_dir, manifest, drafting, **options):
        bad = next((k for k in options if k not in self.options), None)
        if bad is not None:  # Engine refuses first; a direct call is held to the same rule
            raise TypeError(f"{self.module}.{self.name} takes no option {bad!r}")
        return getattr(importlib.import_module(self.module), self.name)(
            engine_dir, manifest, drafting, **options)


# backend name -> its loader; each imports its backend's modules only when an engine is
# opened with it.
LOADERS: dict[str, Loader] = {
    "torch": Loader(
        "torch", "runtime.backends.pytorch.loader", "TorchLoaded", ("device", "dtype", "steps"),
        {"prefill_dtype": "the torch backend prefills in the engine's dtype (--dtype), not "
                          "{value}; --prefill-dtype is the onnxruntime backend's"}),
    "onnxruntime": Loader(
        "onnxruntime", "runtime.backends.onnxruntime.loader", "OnnxEngine",
        ("device", "dtype", "prefill_dtype", "threads"),
        {"steps": "the onnxruntime backend runs exported graphs, not compiled torch steps "
                  "({value}) — pass --backend torch"},
        fixed={"device": "cpu", "dtype": "float32"}),
    "tensorrt": Loader(
        "tensorrt", "runtime.backends.tensorrt_plans", "TensorRTEngine", ("device", "dtype"),
        {"steps": "the tensorrt backend runs built plans, not compiled torch steps ({value}) "
                  "— pass --backend torch",
         "prefill_dtype": "the tensorrt backend prefills in its plans' dtype; --prefill-dtype "
                          "is the onnxruntime backend's"},
        fixed={"device": "cuda"}),
    # TensorRT-LLM runs the engine in its own loop and places it itself: no option of ours
    "trtllm": Loader(
        "trtllm", "runtime.backends.tensorrt_llm", "TensorRTLLMLoop", (),
        {option: "--" + option.replace("_", "-") + " ({value}) is for the backends that run our "
                 "loop; TensorRT-LLM places a {backend} engine itself"
         for option in OPTIONS}),
    # vLLM runs the engine in its own loop, in its own environment, and places it itself
    "vllm": Loader(
        "vllm", "runtime.backends.vllm", "VLLMLoop", (),
        {option: "--" + option.replace("_", "-") + " ({value}) is for the backends that run our "
                 "loop; vLLM places a {backend} engine itself"
         for option in OPTIONS}),
}
assert set(LOADERS) == set(modes.BACKENDS), "every backend of the table has a loader"
assert all(name == loader.backend for name, loader in LOADERS.items())
assert all(set(OPTIONS) <= set(loader.options) | set(loader.refusals)
           for loader in LOADERS.values()), "each loader takes, or says why it refuses, every option"

# the names the roles module holds, importable from here as before (imported on first use,
# so that reading the registry imports no torch)
_ROLES = ("PrefillOnce", "JoinInParts", "StyleAsBuilt", "style_as_built", "drafter_feature_layers",
          "load_tokenizer")


def __getattr__(name: str):
    if name in _ROLES:
        from runtime.backends import roles

        return getattr(roles, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
