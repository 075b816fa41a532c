"""The backends' registry: which backends exist, which of them this runtime runs, and for
each the loader that opens an engine directory with the options it declares. Light on
purpose (no torch, no onnxruntime): the command line reads its choices here
(runtime/cli.py), and a backend's modules are imported only when an engine is opened
with it.

A loader(engine_dir, manifest, drafting, **its declared options) hands back a Loaded
(runtime/backends/roles.py: the tokenizer, the batch target, the batch drafters for a
scaling and a draft window, the tree drafter, what the backend can run: runtime/modes.py
BACKENDS).
Where the roles run (device) and in which dtype are loader options, not further
backends; an option a backend does not take is refused in one line by Engine before
the loader is called, with the reason this registry records. Nothing above this
package compares backend names: Engine looks its loader up here. (trtllm engines are
configuration that TensorRT-LLM runs in its own loop: runtime/trtllm.py.)

The roles themselves, and how the decode loop sees them: runtime/backends/roles.py."""

from __future__ import annotations

import dataclasses
import importlib

from runtime import modes
from runtime.placement import DEVICES, DTYPES, PREFILL_DTYPES, STEPS  # noqa: F401 -- the backends' names

# what an engine can be built for, and what this runtime runs (tensorrt: on a GPU; trtllm
# engines run in TensorRT-LLM's own loop): runtime/modes.py says what each can run
BACKENDS = tuple(modes.BACKENDS)
RUNNABLE_BACKENDS = tuple(name for name, can in modes.BACKENDS.items() if not can.own_loop)

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
    other keywords Engine knows, said when one is asked for (`{value}`: the value given)."""

    module: str
    name: str
    options: tuple[str, ...]
    refusals: dict[str, str]

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
        "runtime.backends.pytorch.loader", "TorchLoaded", ("device", "dtype", "steps"),
        {"prefill_dtype": "the torch backend prefills in the engine's dtype (--dtype), not "
                          "{value}; --prefill-dtype is the onnxruntime backend's"}),
    "onnxruntime": Loader(
        "runtime.backends.onnxruntime.loader", "OnnxEngine", ("device", "dtype", "prefill_dtype", "threads"),
        {"steps": "the onnxruntime backend runs exported graphs, not compiled torch steps "
                  "({value}) — pass --backend torch"}),
    "tensorrt": Loader(
        "runtime.backends.tensorrt_plans", "TensorRTEngine", ("device", "dtype"),
        {"steps": "the tensorrt backend runs built plans, not compiled torch steps ({value}) "
                  "— pass --backend torch",
         "prefill_dtype": "the tensorrt backend prefills in its plans' dtype; --prefill-dtype "
                          "is the onnxruntime backend's"}),
}
assert set(LOADERS) == set(RUNNABLE_BACKENDS), "every runnable backend of the table has a loader"
assert all(set(OPTIONS) <= set(loader.options) | set(loader.refusals)
           for loader in LOADERS.values()), "each loader takes, or says why it refuses, every option"

# the names the roles module holds, importable from here as before (imported on first use,
# so that reading the registry imports no torch)
_ROLES = ("PrefillOnce", "JoinInParts", "Drafting", "drafting_of", "drafter_feature_layers",
          "load_tokenizer")


def __getattr__(name: str):
    if name in _ROLES:
        from runtime.backends import roles

        return getattr(roles, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
