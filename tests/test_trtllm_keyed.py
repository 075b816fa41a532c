"""The drafter artifact is the key (issue 56), on the stand-in TensorRT-LLM
(tests/trtllm_package.py):

- a stock drafter is never scaled, even while a SharpDraft launch is live in the same
  environment; a SharpDraft drafter is scaled with the parameters its own config.json
  carries, whatever the environment says;
- after `autoload install`, a process that builds no SharpDraft drafter gets none of our
  names, and one that does loads our code under one private name only;
- a release newer than the tested range with the pinned names is accepted with one line
  naming it untested; one with a moved name is refused in one line naming it;
- EAGLE-3 / PARD on FLASHINFER are refused before the model is built (launch) and when
  built (hook); a launch without CUDA graphs is proven by its first request, not refused;
- a known new drafter class (DFlashLagunaForCausalLM) is wrapped on the audited path and
  refused with an unaudited override; proof is per layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plugins.scaling import QueryScaling
from plugins.trtllm import autoload, install, pins, proof, structure
from plugins.trtllm import __main__ as trtllm_cli
from plugins.trtllm import config as trtllm_config
from plugins.trtllm import launch as trtllm_launch
from plugins.trtllm.hook import UnscalableDrafter
from plugins.trtllm.kernels import WRAPPED
from tests.trtllm_package import CHECKOUT, draft_config, write_package

SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)
OTHER = QueryScaling(ref_keys=4096, top_k=8, slope=1.0, max_log_scale=0.5)


def drafter_dir(root: Path, scaling: QueryScaling | None, **config) -> Path:
    """A drafter directory: a SharpDraft one (scaling given) or a stock one."""
    root.mkdir(parents=True, exist_ok=True)
    data = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}
    if scaling is not None:
        data[pins.SHARPDRAFT_KEY] = scaling.to_dict()
    (root / "config.json").write_text(json.dumps(data))
    return root


# --- a fresh interpreter with the .pth, as TensorRT-LLM's workers get it ----------------------

PROBE = textwrap.dedent("""
    import importlib.util, json, os, site, sys, types
    site.addsitedir(sys.argv[1])
    checkout = sys.argv[2]

    def ours(name):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        locations = list(spec.submodule_search_locations or []) + [spec.origin or ""] if spec else []
        return any(str(p).startswith(checkout) for p in locations)

    result = {"before": {n: ours(n) for n in ("plugins", "runtime", "build")}}
    if sys.argv[3] != "none":
        from tensorrt_llm._torch.models import modeling_speculative as spec

        def build(path):
            with open(os.path.join(path, "config.json")) as f:
                pretrained = types.SimpleNamespace(**json.load(f))
            return spec.PARDForCausalLM(types.SimpleNamespace(pretrained_config=pretrained, attn_backend="TRTLLM"))

        def scale(drafter):
            # one context request of one new token over 100 keys: its query times beta(100)
            import torch
            layer = next(m for m in drafter.modules() if type(m).__name__ == "Attention")
            meta = types.SimpleNamespace(seq_lens=torch.tensor([1], dtype=torch.int32),
                                         seq_lens_cuda=torch.tensor([1], dtype=torch.int32),
                                         kv_lens_cuda=torch.tensor([100], dtype=torch.int32), num_seqs=1,
                                         num_contexts=1, num_tokens=1, num_ctx_tokens=1,
                                         spec_decoding_position_offsets=None, use_spec_decoding=False)
            out = layer(torch.tensor([[99]]), torch.ones(1, layer.q_size + 16, dtype=torch.float64), meta)
            return float(out[0, 0])

        result["stock"] = scale(build(sys.argv[3]))
        if sys.argv[4] != "none":
            result["sharpdraft"] = scale(build(sys.argv[4]))
    result["after"] = {n: ours(n) for n in ("plugins", "runtime", "build")}
    result["loaded"] = sorted({m.split(".")[0] for m in sys.modules
                               if m.split(".")[0] in ("plugins", "runtime", "build", autoload_private)})
    print(json.dumps(result))
""").replace("autoload_private", repr(autoload.PRIVATE))


def probe(site: Path, standin: Path, stock: Path | None, sharp: Path | None, **env) -> dict:
    """Run PROBE in a clean interpreter: the checkout is not on its path (cwd elsewhere, no
    PYTHONPATH but the stand-in's), the site folder holds whatever .pth was installed."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(standin), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(site), str(CHECKOUT), str(stock or "none"),
                           str(sharp or "none")], cwd=site.parent, env=base | env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def test_a_stock_drafter_is_not_scaled_while_a_sharpdraft_launch_is_live_and_a_sharpdraft_one_uses_its_own(
        tmp_path, standin):
    """A SharpDraft launch of this environment is live (its Launch holds the hook, the proof
    directory and whatever it tells workers); a process of the same environment started
    meanwhile builds a stock drafter and a SharpDraft drafter whose directory carries OTHER:
    the stock one is untouched, the SharpDraft one is scaled with OTHER -- not with the
    launch's SCALING, nor with SCALING put in the environment."""
    write_package(standin)
    site = tmp_path / "site"
    site.mkdir()
    assert trtllm_cli.main(["autoload", "install", "--site-packages", str(site)]) == 0
    launch = trtllm_launch.Launch(SCALING, {"tensor_parallel_size": 1}, "pard",
                                  drafter_dir(tmp_path / "live-drafter", SCALING), site=site)
    try:
        env = {k: v for k, v in os.environ.items() if k.startswith(("TRTLLM", "SHARPDRAFT"))}
        env["SHARPDRAFT_TRTLLM"] = json.dumps(SCALING.to_dict())  # what the environment says: ignored
        out = probe(site, standin, drafter_dir(tmp_path / "stock", None), drafter_dir(tmp_path / "mine", OTHER),
                    **env)
    finally:
        launch.close()
    assert out["stock"] == 1.0  # beta never applied to the stock drafter's query
    assert out["sharpdraft"] == pytest.approx(OTHER.beta(100)) and OTHER.beta(100) != SCALING.beta(100)
    assert out["stderr"].count("PARDForCausalLM (pard), 2 layer(s) wrapped") == 1  # one startup line, one drafter


def test_after_autoload_install_no_process_gets_our_names_and_a_sharpdraft_one_loads_one_private_package(
        tmp_path, standin):
    write_package(standin)
    site = tmp_path / "site"
    site.mkdir()
    assert trtllm_cli.main(["autoload", "install", "--site-packages", str(site)]) == 0
    plain = probe(site, standin, None, None)
    assert plain["before"] == plain["after"] == {"plugins": False, "runtime": False, "build": False}
    assert plain["loaded"] == []  # nothing of ours loaded: no TensorRT-LLM drafter module imported
    stock = probe(site, standin, drafter_dir(tmp_path / "stock", None), None)
    assert stock["after"] == {"plugins": False, "runtime": False, "build": False} and stock["stock"] == 1.0
    sharp = probe(site, standin, drafter_dir(tmp_path / "stock", None), drafter_dir(tmp_path / "mine", SCALING))
    assert sharp["sharpdraft"] == pytest.approx(SCALING.beta(100))
    assert sharp["after"] == {"plugins": False, "runtime": False, "build": False}
    assert sharp["loaded"] == [autoload.PRIVATE]  # the hook, under one private name only
    assert trtllm_cli.main(["autoload", "uninstall", "--site-packages", str(site)]) == 0


def test_the_lazy_finder_watches_exactly_the_hooks_modules():
    assert autoload.WATCHED == pins.WATCHED


# --- compatibility by structure -----------------------------------------------------------

def test_a_newer_release_with_the_pinned_names_is_accepted_with_one_line(standin, tmp_path, capsys):
    write_package(standin, version="1.5.0")
    launch = trtllm_launch.Launch(SCALING, {}, "dflash", drafter_dir(tmp_path / "d", SCALING), site=tmp_path)
    launch.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1.5.0" in err and "untested" in err
    # the hook agrees on the loaded modules: wrapped, one line (the hook's own) naming it
    from tests.trtllm_package import draft_config as config_of

    install()
    module = __import__(pins.DFLASH_MODULE, fromlist=["DFlashForCausalLM"])
    drafter = module.DFlashForCausalLM(config_of(SCALING), dflash_attention_backend="VANILLA")
    assert getattr(drafter._dflash_flash_attention, WRAPPED, None) is not None
    assert "1.5.0" in capsys.readouterr().err


@pytest.mark.parametrize("drop,family,named", [
    (("modeling_dflash.py", "DFlashForCausalLM"), "dflash", "DFlashForCausalLM"),
    (("modules/attention.py", "apply_rope"), "eagle3", "Attention.apply_rope")])
def test_a_release_that_moved_a_pinned_name_is_refused_in_one_line_naming_it(standin, tmp_path, drop, family, named):
    write_package(standin, version="1.5.0", drop=drop)
    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_launch.Launch(SCALING, {}, family, drafter_dir(tmp_path / "d", SCALING), site=tmp_path)
    text = str(exc.value)
    assert "\n" not in text and "1.5.0" in text and named in text


def test_structure_reads_the_installed_files_without_importing_them(standin):
    write_package(standin)
    assert structure.missing_names() == [] and "tensorrt_llm" not in sys.modules


# --- attention backends and warm-ups ------------------------------------------------------

@pytest.mark.parametrize("family", ["eagle3", "pard"])
def test_flashinfer_is_refused_before_the_model_is_built(standin, tmp_path, family):
    write_package(standin)
    with pytest.raises(trtllm_launch.LaunchError) as exc:
        trtllm_launch.Launch(SCALING, {"attn_backend": "FLASHINFER"}, family, drafter_dir(tmp_path / "d", SCALING),
                             site=tmp_path)
    assert "\n" not in str(exc.value) and "FLASHINFER" in str(exc.value)
    assert "tensorrt_llm._torch.models.modeling_speculative" not in sys.modules  # nothing was built


def test_flashinfer_is_refused_by_the_hook_when_the_drafter_is_built(standin, tmp_path):
    """Whoever builds the LLM (not our launchers): the drafter on FLASHINFER stops its build
    with one line of ours, and the refusal is recorded."""
    write_package(standin)
    proof.set_directory(tmp_path / "proof")
    install()
    spec = __import__(pins.SPECULATIVE_MODULE, fromlist=["Eagle3ForCausalLM"])
    with pytest.raises(UnscalableDrafter) as exc:  # the build stops: never scaled from the wrong lengths
        spec.Eagle3ForCausalLM(draft_config(SCALING, attn_backend="FLASHINFER"))
    assert "\n" not in str(exc.value) and "FLASHINFER" in str(exc.value)
    [record] = proof.read(tmp_path / "proof")
    assert record["kind"] == "refused" and "FLASHINFER" in record["reason"]


def test_dflash_on_a_flashinfer_target_is_not_refused(standin, tmp_path):
    """DFlash's drafter calls its own kernels with its own lengths (pins.DFLASH_KERNELS):
    the target's attention backend does not decide its count."""
    write_package(standin)
    trtllm_launch.Launch(SCALING, {"attn_backend": "FLASHINFER"}, "dflash", drafter_dir(tmp_path / "d", SCALING),
                         site=tmp_path).close()


@pytest.fixture(scope="module")
def engine(trtllm_engine):
    return trtllm_engine


def test_the_engine_carries_its_sharpdraft_drafter_and_frozen_runs_load_the_stock_one(engine, tiny_drafter):
    from runtime.manifest import read_manifest

    manifest = read_manifest(engine)
    assert manifest.drafter_dir == engine / trtllm_config.DRAFTER_DIR
    assert trtllm_config.drafter_parameters(manifest.drafter_dir) == manifest.query_scaling.to_dict()
    assert trtllm_config.drafter_parameters(tiny_drafter) is None  # the checkpoint is left as it was
    scaled = trtllm_config.llm_api_config(manifest)
    frozen = trtllm_config.llm_api_config(manifest, sharpdraft=False)
    assert scaled["speculative_config"]["speculative_model"] == str(engine / trtllm_config.DRAFTER_DIR)
    assert Path(frozen["speculative_config"]["speculative_model"]).resolve() == tiny_drafter.resolve()


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "no-cuda-graphs"])
def test_a_launch_is_proven_by_counts_that_grow_with_its_first_request(engine, standin, monkeypatch, graphs):
    """With CUDA graphs (the warm-up drafts) and without (cuda_graph_config: null, nothing
    drafted before a request): the device counts read after the build are the baseline, and
    the first request must make every draft layer's count grow; a launch whose count stays
    put is refused in one line."""
    from runtime.manifest import read_manifest

    write_package(standin)
    monkeypatch.setenv(pins.SINGLE_PROCESS_ENV, "1")
    manifest = read_manifest(engine)
    overrides = {} if graphs else {"cuda_graph_config": None}
    llm, launch = trtllm_launch.build_llm(manifest, **overrides)
    try:
        [record] = [r for r in proof.read(launch.directory) if r["kind"] == "wrapped"]
        assert [u.split(".", 1)[1] for u in record["units"]] == ["model.layers.0", "model.layers.1"]
        baseline = launch.before[os.getpid()]
        assert {baseline[u] for u in record["units"]} == ({1} if graphs else {0})  # the warm-up's draft step, or none
        with pytest.raises(proof.ProofError) as exc:  # no request yet: nothing grew
            launch.require_running()
        assert "\n" not in str(exc.value) and "stayed at" in str(exc.value)
        llm.generate(["def f():"], None)
        applied = launch.require_running()
        counted = applied["counts"][str(os.getpid())]
        assert {counted[u] for u in record["units"]} == ({2} if graphs else {1})
        assert applied["scaling"] == manifest.query_scaling.to_dict()
    finally:
        llm.shutdown()
        launch.close()
    result = trtllm_launch.generate(manifest, "def f():", 4, **overrides)
    assert result["sharpdraft_applied"]["scaling"] == manifest.query_scaling.to_dict()
    assert result["sharpdraft_applied"]["metrics"]["sharpdraft_scaled_calls"] > 0


def test_pipeline_parallel_requires_the_last_stage_from_the_drafters_own_mapping(tmp_path):
    """Every stage builds a drafter, the last one runs it: with pp=2 over world 2 only rank 1
    (the last stage, TensorRT-LLM's pp_rank = rank // (tp * cp)) must have wrapped one, and a
    record that cannot say its stage is refused rather than guessed."""
    def write(rank, stage):
        (tmp_path / f"wrapped-{7 + rank}-1.json").write_text(json.dumps(
            {"kind": "wrapped", "pid": 7 + rank, "rank": rank, "drafter": "Eagle3ForCausalLM", "units": [],
             "scaling": SCALING.to_dict(), "stage": stage}))

    write(1, {"pp_rank": 1, "pp_size": 2, "last": True})
    with pytest.raises(proof.ProofError, match="rank"):
        proof.require(tmp_path, SCALING, world=2)  # tensor parallel: every rank builds one
    assert proof.require(tmp_path, SCALING, world=2, pipeline=2)  # the last stage holds it
    write(0, None)
    with pytest.raises(proof.ProofError, match="could not read TensorRT-LLM's mapping"):
        proof.require(tmp_path, SCALING, world=2, pipeline=2)


# --- known new drafter classes --------------------------------------------------------------

def test_dflash_laguna_is_wrapped_on_the_audited_path(standin, tmp_path):
    write_package(standin)
    proof.set_directory(tmp_path)
    install()
    module = __import__(pins.DFLASH_MODULE, fromlist=["build_dflash_draft"])
    drafter = module.build_dflash_draft(draft_config(SCALING, architectures=["LagunaDFlashDraft"]), "VANILLA")
    assert type(drafter).__name__ == "DFlashLagunaForCausalLM"
    assert getattr(drafter._dflash_flash_attention, WRAPPED, None) is not None
    drafter.draft_step()
    [record] = [r for r in proof.read(tmp_path) if r["kind"] == "wrapped"]
    assert record["drafter"] == "DFlashLagunaForCausalLM" and len(record["units"]) == 2
    assert {proof.counts()[u] for u in record["units"]} == {1}


def test_dflash_laguna_with_an_unaudited_override_is_refused(standin, tmp_path):
    write_package(standin, laguna_extra="def layer_kernel(self, q, k_cache, v_cache):\n    return None\n")
    proof.set_directory(tmp_path)
    install()
    module = __import__(pins.DFLASH_MODULE, fromlist=["build_dflash_draft"])
    with pytest.raises(UnscalableDrafter, match="layer_kernel"):
        module.build_dflash_draft(draft_config(SCALING, architectures=["LagunaDFlashDraft"]), "VANILLA")
    [record] = proof.read(tmp_path)
    assert record["kind"] == "refused" and "layer_kernel" in record["reason"]
