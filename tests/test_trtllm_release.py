"""issue 63's must-holds on the stand-in package (tests/trtllm_package.py): the releases that
first shipped DFlash are accepted by structure alone, the autoloader's copy of the hook and a
launcher's copy live in one process in either order, and the proof counts scaled calls
where Python does not run (torch.compile fullgraph, as under CUDA-graph replay)."""

import importlib
import sys

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import autoload, pins, proof, structure
from plugins.trtllm import launch as trtllm_launch
from plugins.trtllm import standins as k
from plugins.trtllm.kernels import WRAPPED
from tests.trtllm_package import draft_config, write_package

SCALING = QueryScaling(ref_keys=4, top_k=1, slope=1.0, max_log_scale=0.5)  # beta(7) is neither 1 nor the cap


def drafter_dir(path, scaling):
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"} | (
        {pins.SHARPDRAFT_KEY: scaling.to_dict()} if scaling else {})))
    return path


def reference(q, cache, layer):
    """What a stand-in DFlash layer's kernel call must give when scaled exactly once: the
    stand-in kernel with beta applied to its logits from its own mask."""
    k_cache, v_cache = cache[0][:, layer], cache[1][:, layer]
    return k.reference(k.flash_attn_with_kvcache, SCALING, q, k_cache, v_cache,
                       cache_seqlens=torch.tensor([7], dtype=torch.int32), causal=False, window_size=(-1, -1))


def unscaled(q, cache, layer):
    return k.flash_attn_with_kvcache(q, cache[0][:, layer], cache[1][:, layer],
                                     cache_seqlens=torch.tensor([7], dtype=torch.int32))


def query():
    return torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("layout,drop_fa4", [("1.3", False), ("1.4", False), ("1.4", True)],
                         ids=["1.3-layout", "fa4-present", "fa4-name-gone"])
def test_release_1_3_0rc27_scales_a_sharpdraft_dflash_drafter_on_vanilla(standin, tmp_path, capsys, layout, drop_fa4):
    """1.3.0rc27: the older layout (DFlash inside modeling_speculative.py, no FA4
    kernel), and the newer layout with and without the FA4 kernel's name. A VANILLA launch
    needs no FA4: accepted, and the drafter's every layer is scaled exactly once."""
    write_package(standin, version="1.3.0rc27", layout=layout,
                  drop=("modeling_dflash.py", "_dflash_fa4_fwd") if drop_fa4 else None)
    config = {"speculative_config": {"decoding_type": "DFlash", "attention_backend": "VANILLA"}}
    launch = trtllm_launch.Launch(SCALING, config, "dflash", drafter_dir(tmp_path / "d", SCALING), site=tmp_path)
    try:
        assert capsys.readouterr().err == ""  # in the range read: nothing to say
        module = importlib.import_module(pins.SPECULATIVE_MODULE if layout == "1.3" else pins.DFLASH_MODULE)
        drafter = module.DFlashForCausalLM(draft_config(SCALING), dflash_attention_backend="VANILLA")
        assert getattr(drafter._dflash_flash_attention, WRAPPED, None) is not None
        q, cache = query(), drafter.pooled_cache()
        for layer, got in enumerate(drafter.dflash_forward(q)):
            torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)
            assert not torch.allclose(got, unscaled(q, cache, layer))  # beta is not 1 here: scaling shows
        assert "disabled" not in capsys.readouterr().err
    finally:
        launch.close()
    if layout == "1.3" or drop_fa4:  # a launch that uses FA4 needs its kernel: refused in one line naming it
        fa4 = {"speculative_config": {"decoding_type": "DFlash", "attention_backend": "FA4"}}
        with pytest.raises(trtllm_launch.LaunchError) as exc:
            trtllm_launch.Launch(SCALING, fa4, "dflash", drafter_dir(tmp_path / "d", SCALING), site=tmp_path)
        assert "\n" not in str(exc.value) and "_dflash_fa4_fwd (the FA4 kernel)" in str(exc.value)
        assert structure.missing_names(dflash_backend="VANILLA") == []


def test_release_1_3_0rc27_launch_is_proven_by_its_counts(trtllm_engine, standin, monkeypatch):
    """generate at 1.3.0rc27 on the older layout, end to end in one process: built, wrapped,
    counted, and the first request's draft steps counted on every layer."""
    from runtime.manifest import read_manifest

    write_package(standin, version="1.3.0rc27", layout="1.3")
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    result = trtllm_launch.generate(read_manifest(trtllm_engine), "def f():", 4)
    applied = result["sharpdraft_applied"]
    assert applied["drafters"] == ["DFlashForCausalLM"] and applied["metrics"]["sharpdraft_scaled_calls"] > 0


def test_a_launch_whose_count_stays_at_zero_after_its_first_requests_is_refused_in_one_line(
        trtllm_engine, standin, monkeypatch):
    """The drafter is wrapped (construction passes) but its draft steps take a path around
    the wrapped kernel: no count grows, and generate refuses in one line."""
    from runtime.manifest import read_manifest

    write_package(standin)
    path = standin / "tensorrt_llm/_torch/models/modeling_dflash.py"
    path.write_text(path.read_text().replace("outs.append(self.layer_kernel(", "outs.append((lambda *a: None)("))
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    with pytest.raises(proof.ProofError) as exc:
        trtllm_launch.generate(read_manifest(trtllm_engine), "def f():", 4, cuda_graph_config=None)
    text = str(exc.value)
    assert "\n" not in text and "stayed at 0 after the first requests" in text and "model.layers.0" in text


def test_an_unscalable_sharpdraft_drafter_stops_the_build_with_our_one_line(trtllm_engine, standin, monkeypatch):
    """What the structure check cannot see from the files (here: the kernel's signature, an
    outside package) stops the build when the drafter is built; the launcher reports only
    the hook's line, whatever TensorRT-LLM wrapped it in."""
    from runtime.manifest import read_manifest

    def moved(q, k_cache, v_cache, lengths=None):  # cache_seqlens renamed
        raise AssertionError("never called")

    write_package(standin)
    monkeypatch.setattr(k, "flash_attn_with_kvcache", moved)
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_launch.build_llm(read_manifest(trtllm_engine))
    text = str(exc.value)
    assert "\n" not in text and text.startswith("sharpdraft: DFlashForCausalLM") and "cache_seqlens" in text


def test_a_moved_metadata_field_is_refused_before_the_build_and_when_the_drafter_is_built(standin, tmp_path):
    write_package(standin, drop=("attention_backend/trtllm.py", "kv_lens_cuda"))
    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_launch.Launch(SCALING, {}, "pard", drafter_dir(tmp_path / "d", SCALING), site=tmp_path)
    assert "\n" not in str(exc.value) and "AttentionMetadata.kv_lens_cuda" in str(exc.value)
    from plugins.trtllm import install
    from plugins.trtllm.hook import UnscalableDrafter

    install()  # whoever builds it (a plain trtllm-serve with the autoloader): the build stops
    spec = importlib.import_module(pins.SPECULATIVE_MODULE)
    with pytest.raises(UnscalableDrafter) as exc:
        spec.PARDForCausalLM(draft_config(SCALING))
    assert "\n" not in str(exc.value) and "kv_lens_cuda" in str(exc.value)
    spec.PARDForCausalLM(draft_config())  # a stock drafter builds as ever


def test_the_stale_pth_gives_one_line_not_a_traceback(tmp_path):
    import subprocess

    line = autoload.pth_line(tmp_path).replace(autoload.__file__, str(tmp_path / "moved" / "autoload.py"))
    (tmp_path / autoload.PTH_NAME).write_text(line)
    done = subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(tmp_path)!r}); print('ok')"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "ok\n" and done.stderr.count("\n") == 1 and "is gone" in done.stderr, done.stderr


# --- one hook per process ---------------------------------------------------------------------

def private_hook():
    """The autoloader's private copy, loaded as the .pth's lazy finder loads it."""
    return autoload.load_private().hook


@pytest.fixture
def private(standin):
    yield
    module = sys.modules.get(autoload.PRIVATE + ".trtllm.hook")
    if module is not None:
        module.uninstall()
    for name in [n for n in sys.modules if n == autoload.PRIVATE or n.startswith(autoload.PRIVATE + ".")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_sharpdraft_lazy", False)]


@pytest.mark.parametrize("order", ["autoloader-first", "launcher-first"])
def test_autoloader_and_launcher_copies_in_one_process_scale_once_without_recursion(standin, private, order):
    """The issue's reproduction: the autoloader installed, modeling_speculative imported (its
    private copy takes over), then `from plugins.trtllm import install; install()`, then
    modeling_dflash imported -- and the other order. No RecursionError; the drafter is
    wrapped once and its output is the reference scaled once."""
    from plugins.trtllm import install, installed

    write_package(standin)
    autoload.activate()
    if order == "autoloader-first":
        importlib.import_module(pins.SPECULATIVE_MODULE)  # the lazy finder wakes: private copy installed
        assert private_hook().installed()
        install()  # the launcher's copy defers
    else:
        install()
        importlib.import_module(pins.SPECULATIVE_MODULE)  # the lazy finder stands aside
        assert autoload.PRIVATE not in sys.modules
    assert installed()
    finders = [f for f in sys.meta_path if getattr(f, "_sharpdraft_hook", False)]
    assert len(finders) == 1
    dflash = importlib.import_module(pins.DFLASH_MODULE)  # RecursionError here before
    drafter = dflash.DFlashForCausalLM(draft_config(SCALING), dflash_attention_backend="VANILLA")
    kernel = drafter._dflash_flash_attention
    assert getattr(kernel, WRAPPED) is k.flash_attn_with_kvcache  # wrapped once, around the kernel itself
    q, cache = query(), drafter.pooled_cache()
    for layer, got in enumerate(drafter.dflash_forward(q)):
        torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)


# --- the proof counts where Python does not run -------------------------------------------------

def test_a_compiled_drafter_step_counts_every_call_on_the_device(standin):
    """torch.compile(fullgraph=True): as under CUDA-graph replay, Python side effects run only
    while tracing, yet the count grows with every call -- it is a tensor op of the scaling."""
    from plugins.trtllm import install

    write_package(standin)
    install()
    dflash = importlib.import_module(pins.DFLASH_MODULE)
    drafter = dflash.DFlashForCausalLM(draft_config(SCALING), dflash_attention_backend="VANILLA")
    graphs = []

    def backend(gm, inputs):  # runs once per compilation, never per call
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(lambda q: drafter.dflash_forward(q), fullgraph=True, backend=backend)
    mine = [u for u in proof.counts() if u.startswith(f"{type(drafter).__name__}#")][-2:]
    start = [proof.counts()[u] for u in mine]
    q = query()
    for call in range(1, 4):
        out = compiled(q)
        assert [proof.counts()[u] - s for u, s in zip(mine, start)] == [call, call]  # one per layer per call
    assert len(graphs) == 1 and "add_" in graphs[0]  # one graph, the counter's add inside it
    cache = drafter.pooled_cache()
    for layer, got in enumerate(out):
        torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)


def test_the_unscalable_error_crosses_a_process_boundary_as_our_line():
    """A worker's error reaches a launcher that never loaded the hook's (private) copy: it
    pickles as a plain RuntimeError carrying the same one line."""
    import pickle

    from plugins.trtllm.hook import UnscalableDrafter

    line = "sharpdraft: DFlashForCausalLM carries SharpDraft's parameters but cannot be scaled: x"
    back = pickle.loads(pickle.dumps(UnscalableDrafter(line)))
    assert type(back) is RuntimeError and str(back) == line


def test_a_drafter_whose_config_asks_to_run_frozen_is_served_frozen_and_the_launch_says_so(
        standin, tmp_path, monkeypatch, capsys):
    import json

    # a DFlash subclass with an override nobody audited: unscalable
    write_package(standin, laguna_extra="def gate_path(self):\n    return None\n")
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    directory = drafter_dir(tmp_path / "d", SCALING)
    carried = json.loads((directory / "config.json").read_text())
    carried[pins.SHARPDRAFT_KEY][pins.IF_UNSCALABLE] = proof.FROZEN
    carried["architectures"] = ["LagunaDFlashDraft"]
    (directory / "config.json").write_text(json.dumps(carried))
    config = {"model": "m", "speculative_config": {"decoding_type": "DFlash", "speculative_model": str(directory),
                                                   "attention_backend": "VANILLA"}}
    launch = trtllm_launch.Launch(SCALING, config, "dflash", directory, site=tmp_path)
    try:
        import tensorrt_llm

        with launch.built():
            llm = tensorrt_llm.LLM(**launch.llm_config(config))
        applied = launch.require()
        llm.generate(["x"], None)
        assert launch.require_running() == applied
        llm.shutdown()
    finally:
        launch.close()
    assert applied["metrics"]["sharpdraft_frozen_drafters"] == 1 and not applied["sharpdraft"]
    assert "gate_path" in applied["frozen"][0]["reason"]
    err = capsys.readouterr().err
    assert err.count("runs FROZEN") == 1


def test_a_module_that_bound_llm_before_the_gate_still_goes_through_it(standin, tmp_path, monkeypatch, capsys):
    """issue 69: the OpenEngine server does `from tensorrt_llm import LLM as PyTorchLLM` when
    it is imported, a name no binding list held. Imported BEFORE the gate, it still builds a
    checked LLM: the gate is on the class, so the probe runs and the counts are proven before
    its build returns, and its LLM is handed the launch's drafter view. Closing the launch puts
    the class back."""
    import json

    write_package(standin)
    import tensorrt_llm

    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    server = importlib.import_module("tensorrt_llm.serve.openengine_server")  # binds LLM now
    stock_init = tensorrt_llm.LLM.__dict__["__init__"]
    directory = drafter_dir(tmp_path / "d", SCALING)
    config = {"model": "m", "speculative_config": {"decoding_type": "DFlash", "speculative_model": str(directory),
                                                   "attention_backend": "VANILLA"}}
    launch = trtllm_launch.Launch(SCALING, config, "dflash", directory, site=tmp_path)
    try:
        launch.gate()
        assert server.PyTorchLLM is tensorrt_llm.LLM  # the name bound before the gate, unchanged
        server.serve(**config).shutdown()
    finally:
        launch.close()
    assert tensorrt_llm.LLM.__dict__["__init__"] is stock_init
    [line] = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith('{"sharpdraft_applied"')]
    counted = line["sharpdraft_applied"]["counts"]
    assert counted and all(c > 0 for per_pid in counted.values() for c in per_pid.values())


def test_the_gate_refuses_a_server_whose_drafter_runs_unscaled(standin, tmp_path, monkeypatch):
    """The same server, without the hook where the drafter is built: its build does not
    return a serving LLM; the refusal is one line."""
    write_package(standin)
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    server = importlib.import_module("tensorrt_llm.serve.openengine_server")
    directory = drafter_dir(tmp_path / "d", SCALING)
    config = {"model": "m", "speculative_config": {"decoding_type": "DFlash", "speculative_model": str(directory),
                                                   "attention_backend": "VANILLA"}}
    launch = trtllm_launch.Launch(SCALING, config, "dflash", directory, site=tmp_path)
    try:
        launch.gate()
        from plugins.trtllm import uninstall

        uninstall()  # the drafter is built where no hook runs
        with pytest.raises(proof.ProofError) as exc:
            server.serve(**config)
    finally:
        launch.close()
    assert "\n" not in str(exc.value) and "no proof" in str(exc.value)


def test_a_trtllm_serve_subcommand_outside_the_gate_is_refused():
    from plugins.trtllm import serve as trtllm_serve

    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_serve.parallel_sizes(["disaggregated", "-c", "x.yaml"])
    assert "\n" not in str(exc.value) and "disaggregated" in str(exc.value)


def test_check_shows_a_proof_directorys_counts(standin, tmp_path, capsys):
    from plugins.trtllm import __main__ as trtllm_cli
    from plugins.trtllm import install

    write_package(standin)
    proof.set_directory(tmp_path / "proof")
    try:
        install()
        drafter = importlib.import_module(pins.DFLASH_MODULE).DFlashForCausalLM(draft_config(SCALING))
        drafter.draft_step()
        drafter.draft_step()
        held = proof.require(tmp_path / "proof", SCALING)
        proof.request_counts(tmp_path / "proof", held, timeout=10)
    finally:
        proof.set_directory(None)
    capsys.readouterr()
    assert trtllm_cli.main(["check", "--proof", str(tmp_path / "proof")]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if "scaled calls" in x]
    assert ".model.layers.0 2" in line and ".model.layers.1 2" in line
