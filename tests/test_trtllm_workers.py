"""SharpDraft reaches the process where TensorRT-LLM builds the drafter, and the launcher
sees the proof — with real processes: a stand-in `tensorrt_llm` (tests/trtllm_package.py)
that starts its workers as TensorRT-LLM does, through mpi4py's MPIPoolExecutor(max_workers,
path=sys.path) over the MPI runtime `make setup` installs (requirements.txt), with no
variable of ours in any environment: the hook arrives through the .pth's lazy import hook
and scales the drafter because its directory (the engine's drafter/) carries SharpDraft's
parameters.

Each test runs a fresh interpreter of a throwaway virtual environment layered on the
project's (so the .pth written there touches nothing else): `python -m runtime generate`
on a trtllm engine, and the generated Triton llmapi model's initialize(); with the
autoloader the proof comes from the worker processes (other pids), without it the
launcher refuses in one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from plugins.trtllm import autoload, pins, proof
from plugins.trtllm import config as trtllm_config
from runtime.cli import run
from tests.trtllm_package import CHECKOUT, write_package

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                                reason="mpi4py is not installed (make setup installs it)")
HEAD = "SharpDraft was requested but no drafter was wrapped in the worker processes"
BIN = Path(sys.executable).parent  # mpiexec of the MPI runtime wheel sits beside python


def make_venv(root: Path, autoloader: bool) -> Path:
    """A virtual environment whose site-packages reach the project's (a .pth line), with
    or without our autoloader .pth; its python is what TensorRT-LLM would spawn."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    (site / "00_project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if autoloader:
        done = subprocess.run([str(python), "-m", "plugins.trtllm", "autoload", "install"], cwd=CHECKOUT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and (site / autoload.PTH_NAME).is_file(), done.stderr
    return python


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    root = tmp_path_factory.mktemp("venvs")
    return {"autoload": make_venv(root / "with", True), "plain": make_venv(root / "without", False)}


@pytest.fixture(scope="module")
def engine(trtllm_engine):
    return trtllm_engine


def environment(standin: Path, single_process: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARPDRAFT", "TLLM", "PYTEST"))}
    # The MPI runtime wheel's mpiexec and libmpi live in the project venv's bin/ and lib/
    # (a TensorRT-LLM container has them on the system paths).
    lib = f"{Path(sys.prefix) / 'lib'}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(Path(sys.prefix) / "lib")
    # mpi4py's pool polls its workers every millisecond by default, and each poll drives
    # MPICH's progress engine: the waiting launcher then takes most of a core from the
    # workers it waits for (on 2 cores this file ran 101 s, 88 s of CPU; with 50 ms
    # between polls 85 s, 74 s). mpi4py's own knob; nothing of ours.
    env |= {"PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", "PYTHONPATH": f"{standin}:{CHECKOUT}",
            "LD_LIBRARY_PATH": lib, "OMP_NUM_THREADS": "1", "MPI4PY_FUTURES_BACKOFF": "0.05"}
    if single_process is not None:
        env[pins.SINGLE_PROCESS_ENV] = single_process
    return env


def generate(python: Path, engine: Path, standin: Path, *flags, single_process="0"):
    """`python -m runtime generate --json` on the engine; the result carries the launcher's pid."""
    process = subprocess.Popen([str(python), "-m", "runtime", "generate", "--engine-dir", str(engine), "--prompt",
                                "def f():", "--json", *flags], cwd=standin, env=environment(standin, single_process),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=240)
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    done.pid = process.pid
    return done


def site_of(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())


def test_drafters_built_in_real_mpi_workers_are_wrapped_and_the_launcher_sees_it(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = generate(venvs["autoload"], engine, standin, single_process="0")  # TP1: one spawned worker
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    applied = result["sharpdraft_applied"]
    assert applied["scaling"]["ref_keys"] == 64 and applied["drafters"] == ["DFlashForCausalLM"]
    # the proof came from another process than the launcher: the MPI worker it spawned
    assert len(applied["processes"]) == 1 and applied["processes"] != [done.pid]


@pytest.mark.slow  # the fast tier: test_drafters_built_in_real_mpi_workers_are_wrapped_and_the_launcher_sees_it
# (a real worker's proof) and test_trtllm_hook.py's test_every_rank_of_the_world_must_prove_it_wrapped_its_drafter
def test_tensor_parallel_workers_each_report(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    python = venvs["autoload"]
    probe = textwrap.dedent(f"""
        import json, os, sys
        from plugins.trtllm import config as trtllm_config, launch as trtllm
        from runtime.manifest import read_manifest
        llm, launch = trtllm.build_llm(read_manifest({str(engine)!r}), tensor_parallel_size=2)
        print(json.dumps({{"launcher": os.getpid(), "workers": llm.worker_pids, "applied": launch.require()}}))
        llm.shutdown(); launch.close()
        """)
    done = subprocess.run([str(python), "-c", probe], cwd=standin, env=environment(standin, None),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(set(out["workers"])) == 2 and out["launcher"] not in out["workers"]
    assert sorted(out["applied"]["processes"]) == sorted(out["workers"])  # both ranks wrapped their drafter


@pytest.mark.slow  # the fast tier, in process: test_trtllm_keyed.py's
# test_pipeline_parallel_requires_the_last_stage_from_the_drafters_own_mapping
def test_pipeline_stages_in_real_mpi_workers_only_the_last_stage_must_count(venvs, engine, tmp_path):
    """pp=2 in two MPI workers: both stages build and wrap a drafter (SpecDecOneEngineForCausalLM
    does on every rank), each record says its stage from TensorRT-LLM's own Mapping, only the
    last stage runs its drafter, and the launch is proven without rank 0's counts growing."""
    standin = write_package(tmp_path / "pkg")
    probe = textwrap.dedent(f"""
        import json
        from plugins.trtllm import launch as trtllm, proof
        from runtime.manifest import read_manifest
        llm, launch = trtllm.build_llm(read_manifest({str(engine)!r}), pipeline_parallel_size=2)
        held = launch.held
        llm.generate(["x"], None)
        applied = launch.require_running()
        print(json.dumps({{"workers": llm.worker_pids, "applied": applied,
                          "stages": {{e["rank"]: e["stage"] for e in held}}}}))
        llm.shutdown(); launch.close()
        """)
    done = subprocess.run([str(venvs["autoload"]), "-c", probe], cwd=standin, env=environment(standin, None),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert sorted(out["applied"]["processes"]) == sorted(out["workers"]) and len(set(out["workers"])) == 2
    assert out["stages"] == {"0": {"pp_rank": 0, "pp_size": 2, "last": False},
                             "1": {"pp_rank": 1, "pp_size": 2, "last": True}}
    counts = out["applied"]["counts"]
    grown = {pid for pid, c in counts.items() if all(v > 0 for v in c.values())}
    assert len(grown) == 1  # the last stage's drafter ran; the first stage's never did


@pytest.mark.slow  # the fast tier: test_trtllm_release.py's gate test (records arrive through the view's config only)
def test_the_proof_reaches_workers_of_a_pool_that_forwards_no_environment(venvs, engine, tmp_path):
    """Older MpiPoolSession copies pass no env=, and a variable set after MPI started does not
    reach spawned workers (Open MPI): here the worker holds none of the launcher's
    TRTLLM_SHARPDRAFT_* variables, and the proof still arrives -- its directory is in the
    drafter view's config the worker builds the drafter from."""
    standin = write_package(tmp_path / "pkg", forward_env=False)
    done = generate(venvs["autoload"], engine, standin, single_process="0")
    assert done.returncode == 0, done.stderr
    applied = json.loads(done.stdout)["sharpdraft_applied"]
    assert applied["drafters"] == ["DFlashForCausalLM"] and applied["processes"] != [done.pid]


def test_without_the_autoloader_the_worker_runs_unscaled_and_the_launcher_refuses(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = generate(venvs["plain"], engine, standin, single_process="0")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == ""
    assert len(err) == 1 and err[0].startswith(f"error: {HEAD}: no proof"), done.stderr


@pytest.mark.slow  # the fast tier: test_trtllm_release.py's test_release_1_3_0rc27_launch_is_proven_by_its_counts
def test_one_gpu_without_the_autoloader_keeps_the_drafter_in_process_and_proves_it(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = generate(venvs["plain"], engine, standin, single_process=None)  # generate sets it to 1
    assert done.returncode == 0, done.stderr
    applied = json.loads(done.stdout)["sharpdraft_applied"]
    assert applied["drafters"] == ["DFlashForCausalLM"]


def test_several_gpus_without_the_autoloader_are_refused_before_anything_starts(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    probe = textwrap.dedent(f"""
        import sys
        from plugins.trtllm import config as trtllm_config, launch as trtllm
        from runtime.cli import run
        from runtime.manifest import read_manifest
        sys.exit(run(lambda argv: trtllm.build_llm(read_manifest({str(engine)!r}), pipeline_parallel_size=2), []))
        """)
    done = subprocess.run([str(venvs["plain"]), "-c", probe], cwd=standin, env=environment(standin, None),
                          capture_output=True, text=True, timeout=240)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(err) == 1 and "autoload install" in err[0]  # a LaunchError (ValueError)


@pytest.mark.slow  # the fast tier: test_trtllm_keyed.py's newer release accepted with one line, in process
def test_a_newer_release_with_the_pinned_names_runs_scaled_in_its_workers_with_one_untested_line(
        venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg", version="1.5.0")
    done = generate(venvs["autoload"], engine, standin, single_process="0")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sharpdraft_applied"]["drafters"] == ["DFlashForCausalLM"]
    assert done.stderr.count("TensorRT-LLM 1.5.0 is untested") == 1  # the launcher's line
    moved = write_package(tmp_path / "moved", version="1.5.0", drop=("modeling_dflash.py", "DFlashForCausalLM"))
    refused = generate(venvs["autoload"], engine, moved, single_process="0")
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(err) == 1 and "modeling_dflash.DFlashForCausalLM" in err[0], refused.stderr


# --- Triton's llmapi model -------------------------------------------------------------------

STOCK_MODEL = '''
import os

import yaml

LLM = None


class TritonPythonModel:
    """TensorRT-LLM's llmapi model.py @ 044a90d2, reduced to what matters here: initialize()
    imports tensorrt_llm (deferred to here on purpose) and builds LLM(**model.yaml less
    triton_config), which starts the worker that builds the drafter; finalize() stops it."""

    def initialize(self, args):
        global LLM
        from tensorrt_llm import LLM

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(here, "model.yaml")) as f:
            config = yaml.safe_load(f)
        config.pop("triton_config")
        self.llm = LLM(**config)

    def finalize(self):
        self.llm.shutdown()
'''


@pytest.fixture(scope="module")
def repository(engine, tmp_path_factory):
    from runtime.__main__ import main as runtime_main

    stock = tmp_path_factory.mktemp("stock") / "tensorrt_llm"
    (stock / "1").mkdir(parents=True)
    (stock / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    (stock / "1" / "model.py").write_text(STOCK_MODEL)
    repo = tmp_path_factory.mktemp("repo")
    assert run(runtime_main, ["serve", "--engine-dir", str(engine), "--model-repository", str(repo),
                              "--llmapi-model", str(stock)]) == 0
    return repo / "tensorrt_llm" / "1"


def initialize(python: Path, version_dir: Path, standin: Path):
    probe = textwrap.dedent(f"""
        import importlib.util, json, os, sys
        spec = importlib.util.spec_from_file_location("model", {str(version_dir / "model.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        try:
            model.initialize({{}})
        except Exception as exc:
            sys.stderr.write(f"refused: {{exc}}\\n")
            sys.exit(3)
        print(json.dumps({{"applied": model.sharpdraft_applied, "stub": os.getpid(),
                          "workers": model.llm.worker_pids}}))
        model.finalize()
        """)
    return subprocess.run([str(python), "-c", probe], cwd=standin, env=environment(standin, "0"),
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # the fast tier: test_trtllm_config.py's
# test_serve_backend_trtllm_writes_the_llmapi_layout_whose_model_installs_the_hook_first and the real worker's proof above and test_drafters_built_in_real_mpi_workers_are_wrapped_and_the_launcher_sees_it
def test_triton_llmapi_model_serves_when_the_worker_wrapped_the_drafter(venvs, repository, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = initialize(venvs["autoload"], repository, standin)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["applied"]["processes"] == out["workers"] and out["stub"] not in out["workers"]
    assert json.loads((repository / "sharpdraft_applied.json").read_text())["scaling"]["ref_keys"] == 64


@pytest.mark.slow  # the fast tier: the gate's refusal in process (test_trtllm_release.py:
# test_the_gate_refuses_a_server_whose_drafter_runs_unscaled)
def test_triton_llmapi_model_refuses_to_load_when_no_drafter_was_wrapped(venvs, repository, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = initialize(venvs["plain"], repository, standin)
    lines = [line for line in done.stderr.splitlines() if line.startswith("refused: ")]
    assert done.returncode == 3 and len(lines) == 1 and lines[0].startswith(f"refused: {HEAD}"), done.stderr


# --- runtime trtllm-serve --------------------------------------------------------------------

def serve(python: Path, engine: Path, standin: Path, *serve_args, single_process=None):
    return subprocess.run([str(python), "-m", "runtime", "trtllm-serve", "--engine-dir", str(engine), "--",
                           "--port", "9", *serve_args], cwd=standin, env=environment(standin, single_process),
                          capture_output=True, text=True, timeout=240)


def test_trtllm_serve_one_gpu_serves_once_the_in_process_drafter_is_proven(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = serve(venvs["plain"], engine, standin, "--tp_size", "1")
    assert done.returncode == 0 and "serving on localhost:9" in done.stdout, done.stderr
    applied = [json.loads(line)["sharpdraft_applied"] for line in done.stderr.splitlines()
               if line.startswith('{"sharpdraft_applied"')]
    assert len(applied) == 1 and applied[0]["drafters"] == ["DFlashForCausalLM"]


@pytest.mark.slow  # the fast tier: the wrapper's plan for each parallel alias (test_trtllm_config.py)
# and a real MPI worker's proof (test_drafters_built_in_real_mpi_workers_are_wrapped_and_the_launcher_sees_it)
def test_trtllm_serve_tensor_parallel_workers_are_reached_through_the_autoloader(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = serve(venvs["autoload"], engine, standin, "--tp_size=2")
    assert done.returncode == 0 and "serving on" in done.stdout, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith('{"sharpdraft_applied"')]
    assert len(json.loads(line)["sharpdraft_applied"]["processes"]) == 2


def test_trtllm_serve_refuses_to_serve_without_the_proof(venvs, engine, tmp_path):
    standin = write_package(tmp_path / "pkg")
    done = serve(venvs["plain"], engine, standin, single_process="0")  # a worker our hook cannot reach
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "serving" not in done.stdout
    assert err[-1].startswith(f"error: {HEAD}: no proof"), done.stderr


# --- a dead launch leaves nothing behind; every rank must prove it -------------------------

@pytest.mark.slow  # the fast tier: test_trtllm_keyed.py's stock drafter beside a live SharpDraft launch, in process
def test_stock_and_frozen_runs_beside_a_live_sharpdraft_launch_are_never_scaled(venvs, engine, tmp_path):
    """A SharpDraft launch is live in this environment (its launcher holds the hook and its
    proof directory); a stock LLM() of TensorRT-LLM's own on the stock checkpoint, a frozen
    and a target-only run through our launcher start meanwhile: their MPI workers build their drafters
    unscaled (no startup line, no record anywhere), and the live launch is undisturbed."""
    import signal

    from runtime.manifest import read_manifest

    standin = write_package(tmp_path / "pkg")
    python = venvs["autoload"]
    stock_dir = trtllm_config.stock_drafter_dir(read_manifest(engine))
    hold = textwrap.dedent(f"""
        import time
        from plugins.trtllm import config as trtllm_config, launch as trtllm
        from runtime.manifest import read_manifest
        manifest = read_manifest({str(engine)!r})
        launch = trtllm.Launch(manifest.query_scaling, trtllm_config.llm_api_config(manifest), manifest.drafter,
                               manifest.drafter_dir)
        print(launch.directory, flush=True)
        time.sleep(600)
        """)
    launcher = subprocess.Popen([str(python), "-c", hold], cwd=standin, env=environment(standin, None),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proof_dir = launcher.stdout.readline().strip()
        probe = textwrap.dedent(f"""
            import json
            from tensorrt_llm import LLM
            llm = LLM(model="m", speculative_config={{"decoding_type": "DFlash", "speculative_model": {str(stock_dir)!r}}})
            print(json.dumps(llm.worker_pids)); llm.shutdown()
            """)
        stock = subprocess.run([str(python), "-c", probe], cwd=standin, env=environment(standin, "0"),
                               capture_output=True, text=True, timeout=240)
        frozen = generate(python, engine, standin, "--no-sharpdraft", single_process="0")
        target = generate(python, engine, standin, "--target-only", single_process="0")
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
    assert stock.returncode == 0, stock.stderr
    assert frozen.returncode == 0 and json.loads(frozen.stdout)["sharpdraft_applied"] is None, frozen.stderr
    assert target.returncode == 0 and json.loads(target.stdout)["mode"] == "target", target.stderr
    for run_ in (stock, frozen, target):
        assert "layer(s) wrapped" not in run_.stderr  # no drafter of theirs was wrapped, in any process
    assert proof.read(proof_dir) == []  # and nothing reached the live launch's proof


@pytest.mark.slow  # the fast tier: every rank must prove it wrapped (test_trtllm_hook.py:
# test_every_rank_of_the_world_must_prove_it_wrapped_its_drafter)
def test_tensor_parallel_launch_with_one_rank_unhooked_is_refused_naming_the_rank(venvs, engine, tmp_path):
    """TP=2 where rank 1 runs without the hook (a rank started without the autoloader, or
    elsewhere): one wrapped record is not enough, the launcher refuses naming rank 1."""
    standin = write_package(tmp_path / "pkg", unhooked_rank=1)
    probe = textwrap.dedent(f"""
        import sys
        from plugins.trtllm import config as trtllm_config, launch as trtllm
        from runtime.cli import run
        from runtime.manifest import read_manifest
        sys.exit(run(lambda argv: trtllm.build_llm(read_manifest({str(engine)!r}), tensor_parallel_size=2), []))
        """)
    done = subprocess.run([str(venvs["autoload"]), "-c", probe], cwd=standin, env=environment(standin, None),
                          capture_output=True, text=True, timeout=240)
    err = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(err) == 1, done.stderr
    assert err[0].startswith(f"error: {HEAD} of rank(s) 1 of 2 (wrapped: rank 0 pid "), err[0]


@pytest.mark.slow  # the fast tier: test_trtllm_config.py's llmapi layout test and test_trtllm_keyed.py's live-launch test
def test_triton_model_loads_while_another_launch_is_live_on_the_same_host(venvs, repository, engine, tmp_path):
    """Triton with instance count > 1 (or every rank's initialize() under mpirun): another
    SharpDraft launch is live in the environment; this instance's initialize() must still
    load, and its worker must report to this instance's proof, not the other's."""
    import signal

    standin = write_package(tmp_path / "pkg")
    python = venvs["autoload"]
    hold = textwrap.dedent(f"""
        import time
        from plugins.trtllm import config as trtllm_config, launch as trtllm
        from runtime.manifest import read_manifest
        manifest = read_manifest({str(engine)!r})
        launch = trtllm.Launch(manifest.query_scaling, trtllm_config.llm_api_config(manifest))
        print(launch.directory, flush=True)
        time.sleep(600)
        """)
    other = subprocess.Popen([str(python), "-c", hold], cwd=standin, env=environment(standin, None),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        other_proof = other.stdout.readline().strip()
        done = initialize(python, repository, standin)
    finally:
        os.kill(other.pid, signal.SIGTERM)
        other.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["applied"]["processes"] == out["workers"]
    assert proof.read(other_proof) == []  # nothing of this instance's went to the other launch


@pytest.mark.slow  # the fast tier: tests/test_trtllm_release.py (the build stops in process; the error pickles)
def test_a_sharpdraft_drafter_a_worker_cannot_scale_stops_a_plain_launch_with_our_line(venvs, engine, tmp_path):
    """TensorRT-LLM's own LLM() (what a plain trtllm-serve builds) with the autoloader, the
    drafter built in an MPI worker where the hook cannot scale it (its kernel's signature
    moved): the launch stops, and the error it reports ends with one line of ours."""
    standin = write_package(tmp_path / "pkg")
    path = standin / "tensorrt_llm/_torch/models/modeling_dflash.py"
    path.write_text(path.read_text().replace("self._dflash_flash_attention = k.flash_attn_with_kvcache",
                                             "self._dflash_flash_attention = lambda q, k_cache, v_cache, lens=None: q"))
    probe = textwrap.dedent(f"""
        from tensorrt_llm import LLM
        LLM(model="m", speculative_config={{"decoding_type": "DFlash", "speculative_model": {str(engine / trtllm_config.DRAFTER_DIR)!r}}})
        print("served")
        """)
    done = subprocess.run([str(venvs["autoload"]), "-c", probe], cwd=standin, env=environment(standin, "0"),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode != 0 and "served" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "sharpdraft: DFlashForCausalLM carries SharpDraft's parameters but cannot be scaled" in last, done.stderr
    assert "cache_seqlens" in last
