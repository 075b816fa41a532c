"""How the build makes an engine for each backend (runtime/modes.py BACKENDS: what each
runs; runtime/backends/__init__.py LOADERS: how each opens one): one record per backend,
which build_engine.py asks instead of comparing backend names. A backend that runs our
loop gets graphs exported (or runs the checkpoints as they are), plans built from them
where its plans are built here, and its step costs timed here where it runs here; a
backend that runs its own loop (TensorRT-LLM, vLLM) gets its configuration written by its own
builder, so a second own-loop backend is one more record here."""

from __future__ import annotations

import dataclasses
import importlib

from runtime import modes


@dataclasses.dataclass(frozen=True)
class BackendBuild:
    """What the build does for one backend."""

    # the ONNX graphs are exported for it (float32 here); else it runs the checkpoints
    exports: bool = False
    # "module:function" (engine_dir, onnx record, max_seq_len, progress, block_size) ->
    # engine.json's record of the device plans built from the graphs; plans are timed
    # where they run, not at build time
    plans: str | None = None
    # "module:function" () -> None where this host can build it, else why not (one line)
    usable: str | None = None
    # an own-loop backend's builder, "module:function" (args, scaling overrides, out) ->
    # exit code: writes the engine directory of configuration its loop reads
    configure: str | None = None
    # an own-loop backend's "module:function" (family name) -> how it configures that
    # family's drafter, or None where it refuses the family (build/families.py)
    configures: str | None = None

    @property
    def timed_here(self) -> bool:
        """Whether its step costs are measured on the building machine (stage 5)."""
        return self.plans is None and self.configure is None

    def why_unusable(self) -> str | None:
        return _call(self.usable) if self.usable else None

    def build_plans(self, *args):
        return _call(self.plans, *args)

    def write_configuration(self, args, overrides: dict, out) -> int:
        return _call(self.configure, args, overrides, out)

    def configures_family(self, family: str) -> bool:
        """Whether this own-loop backend configures the family's drafter."""
        return _call(self.configures, family) is not None


def _call(where: str, *args):
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)(*args)


def tensorrt_usable() -> str | None:
    """None when TensorRT engines can be built here, else why not (one line): tensorrt
    imports, a CUDA device is visible and TensorRT can create a builder on it
    (build/tensorrt_build.py: tensorrt_available)."""
    from build import tensorrt_build

    usable, why = tensorrt_build.tensorrt_available()
    return None if usable else why


BUILDS: dict[str, BackendBuild] = {
    "torch": BackendBuild(),
    "onnxruntime": BackendBuild(exports=True),
    "tensorrt": BackendBuild(exports=True, plans="build.tensorrt_build:build",
                             usable="build.backends:tensorrt_usable"),
    "trtllm": BackendBuild(configure="build.trtllm:configure",
                           configures="build.families:trtllm_config"),
    "vllm": BackendBuild(configure="build.vllm:configure", configures="build.families:vllm_config"),
}
# --backend auto: the first of these this host can build and whose drafters draft the
# family's style; elsewhere the engine's graphs are exported and stage 5 measures the
# backends timed here, picking the fastest
AUTO = ("tensorrt", "onnxruntime")

assert set(BUILDS) == set(modes.BACKENDS), "every backend of the table has a build record"
assert all((b.configure is not None) == modes.BACKENDS[name].own_loop
           for name, b in BUILDS.items()), "an own-loop backend is built by its configure"
