"""issue 69: the hook on the paths TensorRT-LLM's own code takes, on the stand-in package
(tests/trtllm_package.py): a drafter built twice (MetaInitMode's fallback) or dropped does
not refuse a good launch, a launch needs only its own family's structure, the hybrid-context
DFlash kernel is scaled, and the counts are never read while a CUDA graph is captured.
(Pipeline stages and a pool that forwards no environment run in real MPI workers:
tests/test_trtllm_workers.py; the class gate: tests/test_trtllm_release.py.)"""

import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import install, pins, proof, structure
from plugins.trtllm import launch as trtllm_launch
from plugins.trtllm import standins as k
from plugins.trtllm.hook import UnscalableDrafter
from tests.trtllm_package import CHECKOUT, draft_config, write_package

SCALING = QueryScaling(ref_keys=4, top_k=1, slope=1.0, max_log_scale=0.5)  # beta(7) is neither 1 nor the cap
DFLASH = {"speculative_config": {"decoding_type": "DFlash", "attention_backend": "VANILLA"}}


def drafter_dir(path, scaling=SCALING, **extra):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **extra} | (
        {pins.SHARPDRAFT_KEY: scaling.to_dict()} if scaling else {})))
    return path


def reference(q, cache, layer):
    """A stand-in DFlash layer's kernel call scaled exactly once: 7 keys per row."""
    return k.reference(k.flash_attn_with_kvcache, SCALING, q, cache[0][:, layer], cache[1][:, layer],
                       cache_seqlens=torch.tensor([7], dtype=torch.int32), causal=False, window_size=(-1, -1))


def query():
    return torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(3))


def view_config(launch):
    """The ModelConfig TensorRT-LLM builds the drafter from: the launch's drafter view."""
    llm = importlib.import_module("tensorrt_llm.llmapi.llm")
    return llm.draft_config(str(launch.view), "TRTLLM")


@pytest.mark.parametrize("first", ["garbage-collected", "alive-never-called"])
def test_a_drafter_built_dropped_and_built_again_passes_the_proof(standin, tmp_path, first):
    """The issue's reproduction: build a SharpDraft DFlash drafter, drop it, build it again,
    make one scaled call: require, request_counts and require_growth pass, and the output
    is the beta-scaled reference. The dropped build leaves its `wrapped` record behind."""
    write_package(standin)
    launch = trtllm_launch.Launch(SCALING, DFLASH, "dflash", drafter_dir(tmp_path / "d"), site=tmp_path)
    try:
        module = importlib.import_module(pins.DFLASH_MODULE)
        dropped = module.DFlashForCausalLM(view_config(launch), dflash_attention_backend="VANILLA")
        if first == "garbage-collected":
            del dropped
            gc.collect()
        serving = module.DFlashForCausalLM(view_config(launch), dflash_attention_backend="VANILLA")
        held = proof.require(launch.directory, SCALING)
        assert len([e for e in held if e["kind"] == "wrapped"]) == 2  # both builds recorded
        before = proof.request_counts(launch.directory, held, timeout=20)
        q, cache = query(), serving.pooled_cache()
        outs = serving.dflash_forward(q)  # one scaled call
        after = proof.request_counts(launch.directory, held, timeout=20)
        assert proof.require_growth(held, before, after) is after
        for layer, got in enumerate(outs):
            torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)
    finally:
        launch.close()


def test_a_drafter_with_one_layer_bypassed_is_still_refused(standin, tmp_path):
    """Ignoring a drafter none of whose layers counted must not hide one that skipped a layer."""
    write_package(standin)
    launch = trtllm_launch.Launch(SCALING, DFLASH, "dflash", drafter_dir(tmp_path / "d"), site=tmp_path)
    try:
        drafter = importlib.import_module(pins.DFLASH_MODULE).DFlashForCausalLM(view_config(launch))
        held = proof.require(launch.directory, SCALING)
        before = proof.request_counts(launch.directory, held, timeout=20)
        tally = vars(drafter)["_sharpdraft_tally"]
        tally.add(0, torch.zeros(1))  # layer 0 counted, layer 1 never
        after = proof.request_counts(launch.directory, held, timeout=20)
        with pytest.raises(proof.ProofError) as exc:
            proof.require_growth(held, before, after)
        assert "\n" not in str(exc.value) and "model.layers.1" in str(exc.value) and "that layer ran unscaled" in str(
            exc.value)
    finally:
        launch.close()


@pytest.mark.slow  # the fast tier: test_a_drafter_built_dropped_and_built_again_passes_the_proof
def test_the_loaders_meta_init_fallback_builds_twice_and_the_launch_is_proven(trtllm_engine, standin, monkeypatch,
                                                                              capsys):
    """generate end to end in one process, the model loader building the model under
    MetaInitMode, failing after the drafter was built, and building it again."""
    from runtime.manifest import read_manifest

    write_package(standin, meta_init_fails=True)
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    result = trtllm_launch.generate(read_manifest(trtllm_engine), "def f():", 4)
    applied = result["sharpdraft_applied"]
    assert capsys.readouterr().err.count("layer(s) wrapped") == 2  # built twice, the first dropped
    assert applied["metrics"]["sharpdraft_scaled_calls"] > 0


def test_check_accepts_a_dflash_launch_with_the_eagle3_class_renamed_and_names_that_apart(standin, tmp_path):
    write_package(standin, drop=("modeling_speculative.py", "Eagle3ForCausalLM"))
    env = dict(os.environ, PYTHONPATH=f"{standin}:{CHECKOUT}")
    done = subprocess.run([sys.executable, "-m", "plugins.trtllm", "check", "--backend", "VANILLA"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("dflash launch, DFlash backend VANILLA: every name SharpDraft reads is present: accepted" in x
               for x in lines), done.stdout
    [eagle] = [x for x in lines if "other family eagle3" in x]
    assert "Eagle3ForCausalLM not found" in eagle
    trtllm_launch.Launch(SCALING, DFLASH, "dflash", drafter_dir(tmp_path / "d"), site=tmp_path).close()
    with pytest.raises(trtllm_launch.LaunchError) as exc:  # an EAGLE-3 launch there is refused
        trtllm_launch.Launch(SCALING, {}, "eagle3", drafter_dir(tmp_path / "d"), site=tmp_path)
    assert "Eagle3ForCausalLM not found" in str(exc.value)


@pytest.mark.parametrize("layout", ["1.3", "1.4"])
def test_a_dflash_drafter_scales_with_the_eagle3_class_renamed_away(standin, tmp_path, layout):
    """The hook agrees with the launch check: a moved EAGLE-3 name refuses EAGLE-3 drafters
    only. In the older layout DFlash lives in the very module whose EAGLE-3 class moved."""
    write_package(standin, layout=layout, drop=("modeling_speculative.py", "Eagle3ForCausalLM"))
    proof.set_directory(tmp_path)
    install()
    module = importlib.import_module(pins.SPECULATIVE_MODULE if layout == "1.3" else pins.DFLASH_MODULE)
    drafter = module.DFlashForCausalLM(draft_config(SCALING), dflash_attention_backend="VANILLA")
    q, cache = query(), drafter.pooled_cache()
    for layer, got in enumerate(drafter.dflash_forward(q)):
        torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)
    speculative = importlib.import_module(pins.SPECULATIVE_MODULE)
    with pytest.raises(UnscalableDrafter) as exc:  # a PARD drafter beside it is fine, an EAGLE-3 one is not
        speculative._removed_Eagle3ForCausalLM(draft_config(SCALING))
    assert "\n" not in str(exc.value)
    speculative.PARDForCausalLM(draft_config(SCALING))


# --- the hybrid-context DFlash kernel ------------------------------------------------------

def test_the_hybrid_context_kernel_is_scaled_and_counted(standin, tmp_path):
    write_package(standin, hybrid=True)
    proof.set_directory(tmp_path)
    install()
    module = importlib.import_module(pins.DFLASH_MODULE)
    drafter = module.DFlashForCausalLM(draft_config(SCALING, dflash_hybrid=True))
    q, cache = query(), drafter.pooled_cache()
    outs = drafter.dflash_forward(q)
    for layer, got in enumerate(outs):
        torch.testing.assert_close(got, reference(q, cache, layer), rtol=1e-5, atol=1e-6)
    [record] = [r for r in proof.read(tmp_path) if r["kind"] == "wrapped"]
    assert [proof.counts()[u] for u in record["units"]] == [1, 1]
    hybrid = importlib.import_module(pins.DFLASH_HYBRID_MODULE)
    assert module.dflash_ctx_paged_attention is hybrid.dflash_ctx_paged_attention is k.dflash_ctx_paged_attention
    stock = module.DFlashForCausalLM(draft_config(None, dflash_hybrid=True))  # a stock drafter: untouched
    for layer, got in enumerate(stock.dflash_forward(q)):
        torch.testing.assert_close(got, k.flash_attn_with_kvcache(q, cache[0][:, layer], cache[1][:, layer],
                                                                  cache_seqlens=torch.tensor([7])))


def test_an_unknown_kernel_in_the_hybrid_module_is_refused_by_name(standin, tmp_path):
    write_package(standin, hybrid=True)
    path = standin / "tensorrt_llm/_torch/speculative/dflash_hybrid_attn.py"
    path.write_text(path.read_text() + "\n\ndef dflash_ctx_paged_attention_v2(q, *args):\n    return q\n")
    assert any("dflash_ctx_paged_attention_v2" in m for m in structure.missing_names(dflash_backend="VANILLA"))
    proof.set_directory(tmp_path)
    install()
    with pytest.raises(UnscalableDrafter) as exc:
        importlib.import_module(pins.DFLASH_MODULE).DFlashForCausalLM(draft_config(SCALING))
    assert "dflash_ctx_paged_attention_v2" in str(exc.value) and "\n" not in str(exc.value)


# --- counts read outside any capture -------------------------------------------------------

def test_counts_are_never_read_while_a_cuda_graph_is_captured(standin, tmp_path, monkeypatch):
    """A stand-in of CUDAGraphRunner capturing a new batch size while serving, through torch's
    CUDAGraph.capture_begin / capture_end (here recording instead of capturing: this torch has
    no CUDA). The launcher asks for the counts meanwhile: the reader waits for the capture to
    end; with the guard taken off, the same read lands inside the capture."""
    from torch.cuda import graphs

    state = {"capturing": False, "inside": 0, "reads": 0}
    monkeypatch.setattr(graphs.CUDAGraph, "capture_begin", lambda self, *a, **kw: state.update(capturing=True))
    monkeypatch.setattr(graphs.CUDAGraph, "capture_end", lambda self: state.update(capturing=False))
    read = proof.Tally.read

    def watched(tally):
        state["reads"] += 1
        state["inside"] += state["capturing"]
        return read(tally)

    monkeypatch.setattr(proof.Tally, "read", watched)
    proof.unguard_captures()  # guard what this test put on the class
    write_package(standin)
    proof.set_directory(tmp_path)
    install()
    drafter = importlib.import_module(pins.DFLASH_MODULE).DFlashForCausalLM(draft_config(SCALING))
    held = proof.require(tmp_path, SCALING)

    def capture_while_serving(seconds):  # CUDAGraphRunner: maybe_get_cuda_graph -> capture
        graph = types.SimpleNamespace()
        graphs.CUDAGraph.capture_begin(graph)
        try:
            drafter.draft_step()
            time.sleep(seconds)
        finally:
            graphs.CUDAGraph.capture_end(graph)

    try:
        for guarded in (True, False):
            if not guarded:
                proof.unguard_captures()
            state.update(inside=0, reads=0)
            runner = threading.Thread(target=capture_while_serving, args=(1.0,))
            runner.start()
            time.sleep(0.1)  # the capture is under way
            proof.request_counts(tmp_path, held, timeout=20)
            runner.join()
            assert state["reads"] > 0
            assert (state["inside"] == 0) is guarded, state
    finally:
        proof.unguard_captures()


def test_bench_wrapper_times_every_backend_and_refuses_bad_counts_in_one_line(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "-m", "plugins.trtllm", "bench-wrapper", "--calls", "2", "--rounds", "1",
                           "--json", str(out)], cwd=CHECKOUT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert sorted(report["backends"]) == ["FA4", "TRTLLM context", "TRTLLM decode", "VANILLA"]
    assert all(f["kernel_unwrapped_us"] > 0 and f["kernel_wrapped_us"] > 0 for f in report["backends"].values())
    bad = subprocess.run([sys.executable, "-m", "plugins.trtllm", "bench-wrapper", "--calls", "0"], cwd=CHECKOUT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "positive" in bad.stderr


def test_pipeline_parallelism_is_refused_before_anything_is_built_where_the_mapping_cannot_tell_the_stage(
        standin, tmp_path):
    write_package(standin)
    config = dict(DFLASH, pipeline_parallel_size=2)
    path = standin / "tensorrt_llm/mapping.py"
    stock = path.read_text()
    path.write_text(stock.replace("is_last_pp_rank", "is_final_stage"))
    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_launch.Launch(SCALING, config, "dflash", drafter_dir(tmp_path / "d"), site=tmp_path)
    assert "\n" not in str(exc.value) and "pp=2" in str(exc.value) and "is_last_pp_rank" in str(exc.value)
    assert "tensorrt_llm.mapping" not in sys.modules  # refused from the files, before anything was built
    path.write_text(stock)
    trtllm_launch.Launch(SCALING, config, "dflash", drafter_dir(tmp_path / "d"), site=tmp_path).close()
