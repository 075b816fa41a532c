"""The TensorRT engine path end to end on a machine without TensorRT or a GPU:
build_engine.py --backend tensorrt -> engine.json -> python -m runtime generate, against the
stand-in tensorrt module (tests/fake_tensorrt.py says what that can and cannot prove), with
tokens compared to the onnxruntime backend on the same engine; honest detection for
--backend auto; one-line refusals of bad input."""

import json
import shutil
import sys

import pytest
import torch
from onnx import TensorProto

import build_engine
import fake_tensorrt
import tiny
from build import tensorrt_build as trt_build
from runtime.backends.roles import TokenRows
from plugins import tensorrt as trt_plugin
from plugins.scaling import QueryScaling
from runtime.__main__ import main as runtime_main
from runtime.backends import tensorrt_plans as trt_backend
from runtime.cli import run
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError
from test_tensorrt import REPO, write_attention_graph

MAX_SEQ_LEN = 1024  # the plans' profile: caches of up to 1024 tokens
PROMPT_TOKENS = 600  # two prefill chunks; beta > 1 from ~70 keys on (ref_keys 64)
NEW_TOKENS = 16


def stand_in(patch: pytest.MonkeyPatch, gpu: bool = True, version: str = fake_tensorrt.VERSION):
    """The stand-in tensorrt; with `gpu`, the backend's device (gpu()) is the CPU."""
    trtp = fake_tensorrt.install(patch, gpu=gpu, version=version)
    patch.setattr(trt_plugin, "_registered", False)  # register with this stand-in afresh
    if gpu:
        patch.setattr(trt_backend, "gpu", lambda: torch.device("cpu"))
    return trtp


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory, long_target):
    from runtime.engine import load_tokenizer

    ids = load_tokenizer(long_target).encode(tiny.stdlib_text(), add_special_tokens=False)
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text(load_tokenizer(long_target).decode(ids[:PROMPT_TOKENS]))
    return path


def build(out, target, drafter, attention):
    return run(build_engine.main, [
        "--drafter", "dflash", "--sharpdraft", "--target", str(target), "--drafter-checkpoint",
        str(drafter), "--ref-keys", "64", "--top-k", "8", "--backend", "tensorrt", "--attention",
        attention, "--max-seq-len", str(MAX_SEQ_LEN), "--output", str(out)])


@pytest.fixture(scope="module")
def trt_engines(tmp_path_factory, long_target, long_drafter, export_cache):
    """form -> engine dir, built (once per form) by build_engine.py for the stand-in TensorRT
    (its graphs are onnx_engine's and native_engine's: exported once, tiny.shared_exports)."""
    built = {}

    def engine(form: str):
        if form not in built:
            out = tmp_path_factory.mktemp("trt") / f"tiny-trt-{form}"
            with pytest.MonkeyPatch.context() as patch, tiny.shared_exports(export_cache):
                stand_in(patch)
                assert build(out, long_target, long_drafter, form) == 0
                assert fake_tensorrt.MISSING == []
            built[form] = out
        return built[form]

    return engine


def generate(capsys, engine_dir, prompt_file, *flags):
    capsys.readouterr()  # what fixtures printed
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt-file",
                              str(prompt_file), "--max-new-tokens", str(NEW_TOKENS), "--json",
                              "--ignore-eos", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("form", ["plugin", "native"])
def test_tensorrt_engine_generates_the_onnxruntime_tokens(form, trt_engines, prompt_file, capsys,
                                                          monkeypatch):
    engine_dir = trt_engines(form)
    manifest = json.loads((engine_dir / "engine.json").read_text())
    record = manifest["extra"]["tensorrt"]
    assert manifest["backend"] == "tensorrt"
    assert set(record["plans"]) == {"target_kv", "drafter", "drafter_frozen"}
    for plan in record["plans"].values():  # every plan says what built it and for which GPU
        assert (plan["tensorrt"], plan["gpu"]) == (fake_tensorrt.VERSION, "cpu")
        assert (engine_dir / plan["file"]).is_file() and plan["file"] in manifest["artifacts"]
    assert record["plans"]["drafter"]["plugin_nodes"] == (1 if form == "plugin" else 0)

    stand_in(monkeypatch)
    code, out, err = generate(capsys, engine_dir, prompt_file)  # engine.json names tensorrt
    assert code == 0, err
    ours = json.loads(out)
    assert fake_tensorrt.MISSING == []
    code, out, err = generate(capsys, engine_dir, prompt_file, "--backend", "onnxruntime")
    assert code == 0, err
    theirs = json.loads(out)
    assert ours["backend"] == "tensorrt" and theirs["backend"] == "onnxruntime"
    assert ours["mode"] == "sharpdraft" and len(ours["tokens"]) == NEW_TOKENS
    assert ours["tokens"] == theirs["tokens"]
    assert ours["mean_accepted_length"] == theirs["mean_accepted_length"]


def feature_size(engine) -> int:
    """The width of the target features an engine's drafter graph reads."""
    inputs = engine.manifest.extra["onnx"]["graphs"]["drafter"]["inputs"]
    return next(i["shape"][-1] for i in inputs if i["name"] == "context")


def empty_rows(capacity: int, width: int, *drafters):
    """Batch block drafters of one row each with nothing read yet (a draft then reads its
    whole context, as a step after the prompt's does); `width`: the features' size."""
    for drafter in drafters:
        drafter.add(capacity, torch.zeros(0, width), 0)
    return drafters


def test_tensorrt_frozen_and_target_only_match_onnxruntime(trt_engines, prompt_file, monkeypatch):
    stand_in(monkeypatch)
    engine_dir = trt_engines("plugin")
    ours, theirs = Engine(open_spec(engine_dir)), Engine(open_spec(engine_dir, backend="onnxruntime"))
    prompt = ours.encode(prompt_file.read_text())
    for mode in ("frozen", "target"):
        a = ours.generate(prompt, NEW_TOKENS, mode, stop=False)
        b = theirs.generate(prompt, NEW_TOKENS, mode, stop=False)
        assert a.tokens == b.tokens and a.committed_per_step == b.committed_per_step, mode
    # The plan writes the drafter's new keys straight into its cache: the committed rows
    # are the keys ONNX Runtime's drafter appends to its own.
    drafter, reference = empty_rows(64, feature_size(theirs), ours.drafter(), theirs.drafter())
    context = torch.randn(5, feature_size(theirs), generator=torch.Generator().manual_seed(0))
    for bonus in (3, 7):
        got, visible = drafter.draft([context], [bonus])
        want, want_visible = reference.draft([context], [bonus])
        assert torch.equal(got, want) and torch.equal(visible, want_visible)
    assert drafter.length == reference.lengths[0] == 10
    assert torch.equal(drafter.cache[0][:10], torch.from_numpy(reference.cache.k[:10]))
    assert torch.equal(drafter.cache[1][:10], torch.from_numpy(reference.cache.v[:10]))
    assert fake_tensorrt.MISSING == []


# --- honest detection: what --backend auto may pick -------------------------------------

def test_auto_without_tensorrt_builds_for_onnxruntime(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails
    reason = build_engine.tensorrt_usable()
    assert reason == trt_plugin.TENSORRT_MISSING
    assert build_engine.pick_backend("auto") == "onnxruntime"
    with pytest.raises(EngineError, match="not installed"):
        build_engine.pick_backend("tensorrt")


def test_auto_with_tensorrt_but_no_gpu_builds_for_onnxruntime(monkeypatch):
    stand_in(monkeypatch, gpu=False)
    monkeypatch.setattr(trt_backend, "gpu", lambda: None)  # no CUDA device visible
    reason = build_engine.tensorrt_usable()
    assert "no CUDA GPU is visible" in reason and "\n" not in reason
    assert build_engine.pick_backend("auto") == "onnxruntime"
    # A device, but TensorRT cannot create a builder on it (no working CUDA driver).
    monkeypatch.setattr(trt_backend, "gpu", lambda: torch.device("cpu"))
    reason = build_engine.tensorrt_usable()
    assert "cannot create a builder" in reason and "CUDA initialization failure" in reason
    assert build_engine.pick_backend("auto") == "onnxruntime"
    with pytest.raises(EngineError, match="cannot create a builder"):
        build_engine.pick_backend("tensorrt")
    assert fake_tensorrt.MISSING == []


def test_auto_with_tensorrt_and_a_gpu_builds_for_tensorrt(monkeypatch):
    stand_in(monkeypatch)
    assert build_engine.tensorrt_usable() is None
    assert build_engine.pick_backend("auto") == "tensorrt"
    assert trt_build.tensorrt_available() == (True, f"TensorRT {fake_tensorrt.VERSION} on cpu")
    assert fake_tensorrt.MISSING == []


def test_stand_in_refuses_what_it_does_not_implement(monkeypatch):
    stand_in(monkeypatch)
    import tensorrt

    with pytest.raises(AttributeError):
        tensorrt.Refitter
    with pytest.raises(AttributeError):
        tensorrt.Builder(tensorrt.Logger()).build_engine_with_config
    assert fake_tensorrt.MISSING == ["tensorrt.Refitter", "Builder.build_engine_with_config"]


# --- bad input: one line each ------------------------------------------------------------

def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_tensorrt_without_a_gpu_is_one_line(trt_engines, capsys, monkeypatch, long_target,
                                            long_drafter, tmp_path):
    engine_dir = trt_engines("plugin")
    capsys.readouterr()
    stand_in(monkeypatch, gpu=False)
    monkeypatch.setattr(trt_backend, "gpu", lambda: None)
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "x",
                              "--backend", "tensorrt"])
    assert code == 1 and "no CUDA GPU is visible" in one_line_error(capsys)
    code = build(tmp_path / "e", long_target, long_drafter, "plugin")
    assert code == 1 and "no CUDA GPU is visible" in one_line_error(capsys)
    assert not (tmp_path / "e").exists()


def test_a_graph_of_another_dtype_is_one_line(tmp_path, capsys, monkeypatch, long_target,
                                              long_drafter, trt_engines):
    engine_dir = trt_engines("plugin")
    capsys.readouterr()
    stand_in(monkeypatch)
    # The builder: a float16 graph for a float32 engine (networks are strongly typed).
    graph = write_attention_graph(tmp_path / "half.onnx", QueryScaling(), TensorProto.FLOAT16)
    profile = trt_build.context_profile({"k": (1, 2, "context", 64), "v": (1, 2, "context", 64)}, 256)
    with pytest.raises(trt_build.EngineBuildError, match="export the ONNX graph at the engine's dtype") as caught:
        trt_build.build_engine(graph, tmp_path / "half.plan", [profile], "float32")
    assert "\n" not in str(caught.value)
    # The command line: this build exports float32 graphs only.
    code = run(build_engine.main, ["--drafter", "dflash", "--target", str(long_target),
                                   "--drafter-checkpoint", str(long_drafter), "--backend",
                                   "tensorrt", "--dtype", "float16", "--output", str(tmp_path / "e")])
    assert code == 2 and "exports float32 graphs" in one_line_error(capsys)
    # The runtime: plans whose tensors are not the dtype engine.json names.
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest["dtype"] = "float16"
    (copy / "engine.json").write_text(json.dumps(manifest))
    code = run(runtime_main, ["generate", "--engine-dir", str(copy), "--prompt", "x"])
    err = one_line_error(capsys)
    assert code == 1 and "is float32 but the engine is float16" in err


def test_a_context_past_the_profile_is_one_line(trt_engines, tmp_path, capsys, monkeypatch):
    engine_dir = trt_engines("plugin")
    stand_in(monkeypatch)
    engine = Engine(open_spec(engine_dir))
    with pytest.raises(EngineError, match=f"past the plan's profile \\({MAX_SEQ_LEN}\\)"):
        engine.loaded.batch_target().add([1, 2, 3], MAX_SEQ_LEN + 1)
    with pytest.raises(EngineError, match="past the plan's profile"):
        engine.drafter().reset(MAX_SEQ_LEN + 1)
    # An engine.json that promises more context than its plans were built for.
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest["extra"]["max_seq_len"] = 4096
    (copy / "engine.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    ids = engine.encode(tiny.stdlib_text())[:1500]  # past the plans' 1024, inside 4096
    text = engine.decode(ids)
    code = run(runtime_main, ["generate", "--engine-dir", str(copy), "--prompt", text,
                              "--max-new-tokens", "4"])
    err = one_line_error(capsys)
    assert code == 1 and "past the plan's profile" in err and "--max-seq-len" in err


# --- the other commands -------------------------------------------------------------------

def test_bench_and_serve_accept_backend_tensorrt(trt_engines, tmp_path, capsys, monkeypatch):
    engine_dir = trt_engines("plugin")
    stand_in(monkeypatch)
    capsys.readouterr()
    # bench replays one prefill per document (PrefillOnce: the target's snapshot/restore).
    code = run(runtime_main, ["bench", "--engine-dir", str(engine_dir), "--backend", "tensorrt",
                              "--lengths", "200", "--new-tokens", "8", "--repeats", "1",
                              "--max-docs", "1", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["backend"] == "tensorrt"
    assert fake_tensorrt.MISSING == []
    code = run(runtime_main, ["serve", "--engine-dir", str(engine_dir), "--model-repository",
                              str(tmp_path / "repo"), "--backend", "tensorrt", "--json"])
    assert code == 0, capsys.readouterr().err
    config = (tmp_path / "repo" / engine_dir.name / "config.pbtxt").read_text()
    assert 'key: "backend"\n  value: { string_value: "tensorrt" }' in config


# --- scripts/gpu_kernel.py's TensorRT engine check (a gpu_check section's part) -----------

def load_gpu_kernel():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kernel", REPO / "scripts" / "gpu_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_reports_a_section_that_cannot_run_as_not_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    gpu_kernel = load_gpu_kernel()
    report = {}
    assert gpu_kernel.tensorrt_plugin(report)  # nothing failed ...
    # ... and nothing calls it passed
    assert report["tensorrt_engine"] == {"status": "not run", "reason": trt_plugin.TENSORRT_MISSING}
    assert "tensorrt engine: not run (TensorRT is not installed" in capsys.readouterr().out


def test_gpu_check_tensorrt_section_runs_on_the_stand_in(monkeypatch):
    # The script's own code path (build, generate with both backends, compare), with the
    # stand-in's plans: on a GPU host the same lines run real TensorRT.
    stand_in(monkeypatch)
    report = {}
    gpu_kernel = load_gpu_kernel()
    assert gpu_kernel.tensorrt_plugin(report)
    assert report["tensorrt_engine"]["status"] == "passed" and report["tensorrt_engine"]["passed"]
    assert report["tensorrt_engine"]["version"] == fake_tensorrt.VERSION
    assert len(report["tensorrt_engine"]["tokens"]["tensorrt"]) == 32
    assert fake_tensorrt.MISSING == []


# --- bound addresses: 256-byte aligned, whatever the capacity and slice start ------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (2, 16), (1, 8)])
def test_target_cache_layers_start_aligned_for_every_capacity(dtype, kv_heads, head_dim):
    # SmolLM2-135M: 3 KV heads x 64 x fp16 = 384 bytes a position: odd capacities put every
    # other layer 128 bytes off a boundary in a dense [layers, ...] buffer.
    for capacity in range(1, 40):
        cache = trt_backend.DeviceKVCache(capacity, 5, kv_heads, head_dim, dtype, "cpu")
        for buffer in (cache.k, cache.v):
            assert tuple(buffer.shape) == (5, 1, kv_heads, capacity, head_dim)
            for layer in buffer:
                assert layer.is_contiguous() and layer.data_ptr() % trt_backend.ALIGNMENT == 0
                assert not layer.any()
        # Layers are distinct memory: writing one leaves the others as they were.
        cache.k[1].fill_(1)
        assert cache.k[1].all() and not cache.k[0].any() and not cache.k[2:].any()


def test_every_address_the_backend_binds_is_aligned(trt_engines, prompt_file, monkeypatch):
    # The stand-in refuses an unaligned address as setTensorAddress's contract says; here
    # every address bound is also checked, over an odd target capacity and a drafter cache
    # written from every start 0..16 and more (the tiny models keep 64 bytes a position).
    stand_in(monkeypatch)
    engine_dir = trt_engines("plugin")
    ours, theirs = Engine(open_spec(engine_dir)), Engine(open_spec(engine_dir, backend="onnxruntime"))
    prompt = ours.encode(prompt_file.read_text())[:101]
    a = ours.generate(prompt, 6, "sharpdraft", stop=False)
    b = theirs.generate(prompt, 6, "sharpdraft", stop=False)
    assert a.tokens == b.tokens
    target = ours.loaded.batch_target()
    target.add(prompt[:30], 33)  # an odd capacity
    target.verify(TokenRows.of([[5, 6, 7]]))
    drafter, reference = empty_rows(63, feature_size(theirs), ours.drafter(), theirs.drafter())
    generator = torch.Generator().manual_seed(1)
    starts = set()
    for size in [1] * 16 + [3, 2, 5]:  # every start 0..16, then 19 and 21
        starts.add(drafter.length)
        context = torch.randn(size, feature_size(theirs), generator=generator)
        got, _ = drafter.draft([context], [3])
        want, _ = reference.draft([context], [3])
        assert torch.equal(got, want)
    assert starts == set(range(17)) | {19, 21} and drafter.length == 26
    length = drafter.length
    assert torch.equal(drafter.cache[0][:length], torch.from_numpy(reference.cache.k[:length]))
    assert fake_tensorrt.BOUND and all(address % 256 == 0 for _, address in fake_tensorrt.BOUND)
    bound = {name for name, _ in fake_tensorrt.BOUND}
    assert {"cache_keys_0", "cache_keys_2", "present_keys", "past_keys", "logits"} <= bound


def test_plan_refuses_an_unaligned_address_in_one_line(trt_engines, monkeypatch):
    stand_in(monkeypatch)
    engine = Engine(open_spec(trt_engines("plugin")))
    drafter = engine.drafter()
    drafter.reset(16)
    keys, values = drafter.cache
    plan = drafter.plan
    feeds = {"block_ids": torch.zeros(1, drafter.block_size, dtype=torch.int64),
             "context": torch.zeros(1, 1, drafter.plan.profile["context"][0][2]),
             "context_lens": torch.ones(1, dtype=torch.int64), "past_keys": keys[:0],
             "past_values": values[:0], "past_lens": torch.zeros(1, dtype=torch.int64)}
    feeds = {name: trt_backend.aligned(t) for name, t in feeds.items()}
    raw = torch.zeros(64 + 1, dtype=torch.int64)
    skip = (-raw.data_ptr() % 256) // 8 + 1  # 8 bytes past a boundary
    feeds["context_lens"] = raw[skip:skip + 1]
    with pytest.raises(EngineError, match="256-byte alignment") as caught:
        plan.run(feeds)
    assert "\n" not in str(caught.value)


# --- TensorRT 10: the same build and run on the 10.x flavour -----------------------------

def test_tensorrt_10_builds_the_plugin_drafter_and_matches_onnxruntime(tmp_path, trt_engines, monkeypatch):
    # The plugin drafter's graph through the 10.x flavour: its creator converts fields with
    # int(f.data) unless they are NDArray-typed, and a TensorRT 10 network is strongly typed
    # only with the flag build/tensorrt_build.py sets. Then the plan drafts what ONNX Runtime does.
    engine_dir = trt_engines("plugin")
    manifest = json.loads((engine_dir / "engine.json").read_text())
    graph = manifest["extra"]["onnx"]["graphs"]["drafter"]
    trtp = stand_in(monkeypatch, version="10.16.1")
    import tensorrt as trt

    profile = trt_build.graph_profile(graph["inputs"], trt_build.dimension_ranges(MAX_SEQ_LEN, 4))
    built = trt_build.build_engine(engine_dir / graph["file"], tmp_path / "drafter.plan", [profile], "float32")
    assert built["tensorrt"] == "10.16.1" and built["plugin_nodes"] == 1
    assert (("sharpdraft::SharpDraftAttention", "register") in trtp.registered
            and fake_tensorrt.MISSING == [])
    plan = trt_backend.Plan(trt, trt.Runtime(trt.Logger()), tmp_path / "drafter.plan",
                            trt_backend.Device(torch.device("cpu")))
    theirs = Engine(open_spec(engine_dir, backend="onnxruntime"))
    reference = theirs.drafter()
    drafter = trt_backend.TensorRTDFlash(plan, reference.block_size, reference.mask_token_id,
                                         reference.scaling, torch.float32)
    drafter, reference = empty_rows(32, feature_size(theirs), drafter, reference)
    context = torch.randn(5, feature_size(theirs), generator=torch.Generator().manual_seed(2))
    for bonus in (3, 7):
        got, visible = drafter.draft([context], [bonus])
        want, want_visible = reference.draft([context], [bonus])
        assert torch.equal(got, want) and torch.equal(visible, want_visible)


def test_tensorrt_without_aot_plugins_refuses_before_registering(tmp_path, monkeypatch):
    trtp = stand_in(monkeypatch, version="10.8.0")
    graph = write_attention_graph(tmp_path / "a.onnx", QueryScaling())
    profile = trt_build.context_profile({"k": (1, 2, "context", 64), "v": (1, 2, "context", 64)}, 256)
    for _ in range(2):  # a retry says the same, not "already has a definition"
        with pytest.raises(trt_plugin.TensorRTUnavailable) as caught:
            trt_build.build_engine(graph, tmp_path / "a.plan", [profile], "float32")
        message = str(caught.value)
        assert "TensorRT 10.8.0 has no ahead-of-time Python plugins" in message
        assert "--attention native" in message and "\n" not in message
    assert trtp.registered == {} and not (tmp_path / "a.plan").exists()
    assert fake_tensorrt.MISSING == ["tensorrt.QuickPluginCreationRequest"] * 2


def test_registration_is_idempotent_even_after_a_reload(monkeypatch):
    trtp = stand_in(monkeypatch)
    assert trt_plugin.register_plugin() == trt_plugin.register_plugin()
    monkeypatch.setattr(trt_plugin, "_registered", False)  # as after importlib.reload
    assert trt_plugin.register_plugin() == "sharpdraft::SharpDraftAttention"
    assert list(trtp.registered) == [("sharpdraft::SharpDraftAttention", "register"),
                                     ("sharpdraft::SharpDraftAttention", "aot_impl")]
