"""Backends as loaders (runtime/backends/__init__.py: LOADERS): one registry entry per
backend of the table, the device and dtype as a loader's parameters (the torch
loader's flow into the models it loads), and engines no loader opens refused in one line."""

import json
import shutil

import pytest
import torch

from runtime import modes
from runtime.backends import LOADERS, RUNNABLE_BACKENDS
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError


def test_every_backend_of_the_table_has_a_loader_that_says_what_it_runs():
    """TensorRT-LLM included: a backend like the others, whose capability is its own loop."""
    assert set(LOADERS) == set(modes.BACKENDS)
    assert all(loader.can is modes.BACKENDS[name] for name, loader in LOADERS.items())
    assert set(RUNNABLE_BACKENDS) == {name for name, loader in LOADERS.items() if not loader.can.own_loop}
    assert set(LOADERS) - set(RUNNABLE_BACKENDS) == {"trtllm", "vllm"}


def test_the_torch_loaders_dtype_reaches_the_models_and_decoding_stays_lossless(tiny_engine):
    engine = Engine(open_spec(tiny_engine, dtype="float64"))
    assert engine.loaded.dtype == "float64" and engine.loaded.device == "cpu"
    assert next(engine.model.parameters()).dtype == torch.float64
    assert next(engine.drafter_model.parameters()).dtype == torch.float64
    prompt = engine.encode("def fibonacci(n):\n    ")
    want = engine.generate(prompt, 16, mode="target", stop=False).tokens
    assert engine.generate(prompt, 16, mode="sharpdraft", stop=False).tokens == want
    default = Engine(open_spec(tiny_engine))  # engine.json's dtype, on the cpu
    assert default.loaded.dtype == default.manifest.dtype == "float32"
    assert next(default.model.parameters()).device.type == "cpu"


def test_the_onnxruntime_loader_refuses_another_device_or_dtype_in_one_line(tmp_path):
    from runtime.backends.onnxruntime import OnnxEngine

    for options in ({"device": "cuda"}, {"dtype": "float16"}):
        with pytest.raises(EngineError) as info:
            OnnxEngine(tmp_path, None, **options)
        assert "onnxruntime backend runs float32 graphs on the cpu" in str(info.value)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("backend, says", [
    ("trtllm", "is configuration for TensorRT-LLM"),
    ("vllm", "is configuration for vLLM"),
    ("vulkan", "backend 'vulkan' cannot run here (this runtime has torch, onnxruntime, tensorrt)")])
def test_an_engine_no_loader_opens_is_refused_in_one_line(tiny_engine, tmp_path, backend, says):
    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine_dir)
    with pytest.raises(EngineError) as info:
        Engine(open_spec(engine_dir, backend=backend))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_family_the_backend_cannot_draft_is_refused_before_loading(tiny_engine, tmp_path):
    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine_dir)
    data = json.loads((engine_dir / "engine.json").read_text())
    data["drafter"], data["extra"]["eagle3"] = "eagle3", {"top_k": 2, "depth": 2, "total_tokens": 4}
    (engine_dir / "engine.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="EAGLE-3 runs on the torch and onnxruntime and trtllm and vllm "
                                          "backends, not tensorrt — pass --backend onnxruntime"):
        Engine(open_spec(engine_dir, backend="tensorrt", verify="skip"))


def test_the_torch_loaders_compiled_steps_decode_the_eager_tokens(tiny_engine):
    """steps="eager" (dynamo alone: the fast tier's compiler) puts CompiledBatchTarget /
    CompiledBatchDFlash where TorchBatchTarget / TorchBatchDFlash were (a draft window
    stays eager: a compiled block step spans the whole context); greedy tokens stay the
    eager engine's, target-only and speculative."""
    from runtime.backends.pytorch import TorchBatchDFlash, TorchBatchTarget
    from runtime.backends.pytorch.compiled import CompiledBatchDFlash, CompiledBatchTarget

    eager, compiled = Engine(open_spec(tiny_engine)), Engine(open_spec(tiny_engine, steps="eager"))
    assert type(eager.loaded.batch_target()) is TorchBatchTarget and eager.loaded.steps is None
    target = compiled.loaded.batch_target()
    assert isinstance(target, CompiledBatchTarget)
    assert target.steps.widths == tuple(sorted({1, compiled.spec.ngram_settings["num_draft_tokens"] + 1,
                                                 compiled.manifest.block_size}))
    assert isinstance(compiled.loaded.batch_drafter(compiled.scaling), CompiledBatchDFlash)
    assert type(compiled.loaded.batch_drafter(compiled.scaling, window=8)) is TorchBatchDFlash
    prompt = eager.encode("def fibonacci(n):\n    ")
    want = eager.generate(prompt, 24, mode="target", stop=False).tokens
    assert compiled.generate(prompt, 24, mode="target", stop=False).tokens == want
    assert compiled.generate(prompt, 24, mode="sharpdraft", stop=False).tokens == want
    assert eager.generate(prompt, 24, mode="sharpdraft", stop=False).tokens == want


def test_the_torch_loader_refuses_unknown_steps_in_one_line(tiny_engine):
    from runtime.models.target import ModelError

    with pytest.raises(ModelError) as info:
        Engine(open_spec(tiny_engine, steps="tensorrt"))
    assert "steps 'tensorrt' is not one of eager, inductor, cudagraph" in str(info.value)
    assert "\n" not in str(info.value)


def test_each_loader_takes_only_the_options_it_declares(tiny_engine):
    """No shared **options a loader must refuse: the registry declares each backend's,
    Engine refuses any other in one line before the loader runs (with the reason the
    registry records), and a loader called directly is never handed a foreign one."""
    for backend, says in (("onnxruntime", "the onnxruntime backend runs exported graphs"),
                          ("tensorrt", "the tensorrt backend runs built plans")):
        why = LOADERS[backend].refusal(backend, "steps", "eager")
        assert says in why and "--backend torch" in why and "\n" not in why
        with pytest.raises(TypeError, match="takes no option 'steps'"):
            LOADERS[backend](tiny_engine, None, None, steps="eager")
    assert LOADERS["torch"].refusal("torch", "steps", "eager") is None
    with pytest.raises(EngineError) as info:
        Engine(open_spec(tiny_engine, prefill_dtype="bfloat16"))  # torch's engine; the option is ORT's
    assert "--prefill-dtype is the onnxruntime backend's" in str(info.value)
    assert "\n" not in str(info.value)


def test_the_registry_is_read_without_importing_torch():
    """runtime/cli.py reads the backends' choices from the registry: no torch imported."""
    import subprocess
    import sys

    code = ("import sys; import runtime.backends as b; "
            "assert b.STEPS and b.DEVICES and b.TORCH_DTYPES and b.PREFILL_DTYPES; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
