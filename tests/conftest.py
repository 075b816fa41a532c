import os

# Tests run tiny models, in this process and in the ones they start (servers, CLI runs,
# MPI workers): one thread each, so that two pytest workers (make test: -n auto) and the
# processes they start do not contend for the same cores (two torch processes with a
# thread per core each run 10-30x slower on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# The Triton kernel runs on CPU through Triton's interpreter; the switch must be set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
import tempfile
from pathlib import Path

# A fresh inductor cache per test run: its cache key leaves out a custom op's fake
# implementation, so graphs compiled under an older `sharpdraft::attention` fake (other
# output strides) were replayed after the fake changed and failed their stride asserts.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="sharpdraft-inductor-"))

# Tests run tiny models: one thread avoids thread hand-off costs that dwarf the work.
torch.set_num_threads(1)

import pytest
from hypothesis import settings

# The two tiers (pytest.ini): property tests read their example counts from the profile
# through tests/tiers.py. `fast` is the default (make test); make test-all passes
# --hypothesis-profile full, which keeps every test's own count. Neither sets a deadline:
# the shared 2-core machines time examples unevenly.
settings.register_profile("fast", deadline=None)
settings.register_profile("full", deadline=None)
settings.load_profile("fast")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Back to one torch thread after every test: a test that runs a command's main() in
    this process (scripts/load_bound.py, loadtest, overhead) sets torch's thread count for
    the machine, and the worker's later tests then ran two threads beside the other
    worker's on 2 cores (one sampling-law test: 3.4 s alone, 14.7 s after such a test)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return tiny.make_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_target) -> Path:
    return tiny.make_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="session")
def trtllm_engine(tmp_path_factory, tiny_target, tiny_drafter) -> Path:
    """A SharpDraft engine for TensorRT-LLM (--backend trtllm: configuration and the
    drafter/ directory its hook keys on) over the tiny pair; read, never written, by the
    tests that share it."""
    import build_engine
    from runtime.cli import run

    out = tmp_path_factory.mktemp("trtllm") / "dflash-trtllm"
    assert run(build_engine.main, ["--drafter", "dflash", "--sharpdraft", "--ref-keys", "64", "--top-k", "8",
                                   "--backend", "trtllm", "--target", str(tiny_target), "--drafter-checkpoint",
                                   str(tiny_drafter), "--output", str(out)]) == 0
    return out


@pytest.fixture
def standin(tmp_path):
    """A directory on sys.path for a stand-in tensorrt_llm (tests/trtllm_package.py:
    write_package); the hook, its proof directory and every imported tensorrt_llm module
    are reset afterwards, whatever happens."""
    from plugins.trtllm import proof, uninstall
    from tests.trtllm_package import forget_tensorrt_llm

    root = tmp_path / "standin"
    root.mkdir()
    sys.path.insert(0, str(root))
    forget_tensorrt_llm()
    try:
        yield root
    finally:
        uninstall()
        proof.set_directory(None)
        proof.forget_tallies()
        forget_tensorrt_llm()
        sys.path.remove(str(root))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_target, tiny_drafter) -> Path:
    """A SharpDraft engine over the tiny pair, built by build_engine.py itself."""
    import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-sharpdraft"
    code = build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(tiny_drafter), "--ref-keys", "64",
                              "--top-k", "8", "--backend", "torch", *FIXED_COSTS, "--output", str(out)])
    assert code == 0
    return out


# The session engines record fixed step costs instead of this machine's timing (which would
# let a test see the drafter pay on one run and sit out on the next, and costs seconds per
# build): a free drafter and a verify that costs the same at any width, so every drafter
# step verifies its whole block.
FIXED_COSTS = ("--step-costs", "fixed")


@pytest.fixture(scope="session")
def long_target(tmp_path_factory) -> Path:
    """A tiny target with a 4096-token context, for checks at 3000 tokens of context."""
    return tiny.make_target(tmp_path_factory.mktemp("long-target"), context=4096)


@pytest.fixture(scope="session")
def long_drafter(tmp_path_factory, long_target) -> Path:
    """With a draft vocabulary (256 of 320 tokens): the ONNX engine's parity tests cover
    the reduced head's compact logits and the sampler's mapping of them; the torch-only
    engines keep the full head."""
    return tiny.make_drafter(tmp_path_factory.mktemp("long-drafter"), long_target, draft_vocab=256)


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory) -> Path:
    """Where tiny.shared_exports keeps the graphs exported so far in this run."""
    return tmp_path_factory.mktemp("export-cache")


@pytest.fixture(scope="session")
def onnx_engine(tmp_path_factory, long_target, long_drafter, export_cache) -> Path:
    """A SharpDraft engine of ONNX graphs (plugin form) over the long-context tiny pair,
    built by build_engine.py itself; ref_keys 64 puts beta > 1 from ~70 keys on."""
    import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-onnx"
    with tiny.shared_exports(export_cache):
        code = build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target",
                                  str(long_target), "--drafter-checkpoint", str(long_drafter),
                                  "--ref-keys", "64", "--top-k", "8", "--backend", "onnxruntime",
                                  "--attention", "plugin", *FIXED_COSTS, "--output", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def native_engine(tmp_path_factory, long_target, long_drafter, export_cache) -> Path:
    """onnx_engine's pair and scaling in ONNX Runtime's default form: beta in plain ONNX
    ops, and each drafter also over the runtime's cache buffers (drafter-kv.onnx,
    drafter-frozen-kv.onnx), the graphs the runtime then runs; a draft window of 48 context
    keys for the window mode (the tiny drafter records no training length)."""
    import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-native"
    with tiny.shared_exports(export_cache):
        code = build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target",
                                  str(long_target), "--drafter-checkpoint", str(long_drafter),
                                  "--ref-keys", "64", "--top-k", "8", "--backend", "onnxruntime",
                                  "--draft-window", "48", *FIXED_COSTS, "--output", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def native_ort_engine(native_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(native_engine))


@pytest.fixture(scope="session")
def native_drafter_graph(tmp_path_factory, onnx_engine, export_cache) -> Path:
    """onnx_engine's SharpDraft drafter exported again, with beta in plain ONNX ops."""
    from build import export
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(onnx_engine, backend="torch"))
    path = tmp_path_factory.mktemp("native") / "drafter-native.onnx"
    with tiny.shared_exports(export_cache):  # native_engine's drafter.onnx
        export.export_drafter(engine.drafter_model, engine.model, engine.scaling, "native", path)
    return path


@pytest.fixture(scope="session")
def torch_engine(onnx_engine):
    """The ONNX engine's checkpoints run by the torch backend: the reference side."""
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(onnx_engine, backend="torch"))


@pytest.fixture(scope="session")
def ort_engine(onnx_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(onnx_engine))


# Tests marked slow from here rather than in their files, which other changes are editing;
# an id that no longer exists marks nothing, so the test then runs in the fast tier (slower,
# never less covered). The fast tier keeps the stand-in TensorRT engine in its plugin form
# (test_tensorrt_engine_generates_the_onnxruntime_tokens[plugin]).
SLOW_IDS = {
    # the native form's graphs run on ONNX Runtime in the fast tier (test_onnxruntime_backend)
    "tests/test_tensorrt_engine.py::test_tensorrt_engine_generates_the_onnxruntime_tokens[native]",
    # scripts/gpu_check.py's TensorRT section builds two more engines on the stand-in
    "tests/test_tensorrt_engine.py::test_gpu_check_tensorrt_section_runs_on_the_stand_in",
    # the law through ONNX chains: the fast tier keeps the batched chains' law on torch
    # (test_pard.py), the verifier's at 100,000 draws (test_rejection_law.py) and these
    # chains' greedy equality (test_eagle3_onnx_chain.py)
    "tests/test_eagle3_onnx_chain.py::"
    "test_speculative_sampling_through_batched_onnx_chains_preserves_the_target_distribution",
    # the kernel against the reference at 16K keys: the fast tier keeps it at every pattern
    # and length Hypothesis draws (test_kernel_matches_reference_fp32)
    "tests/test_triton_kernel.py::test_kernel_matches_reference_with_paper_defaults_at_16k_keys",
    # a short scratch: the fast tier keeps the short counters' case ([1000000-0])
    "tests/test_triton_kernel.py::test_single_launch_takes_fewer_slices_when_scratch_is_short[0-1000000]",
    "tests/test_triton_kernel.py::test_single_launch_takes_fewer_slices_when_scratch_is_short[128-1000000]",
    # the proof gate through trtllm-serve: the fast tier keeps the same gate through generate
    # (test_without_the_autoloader_the_worker_runs_unscaled_and_the_launcher_refuses) and
    # trtllm-serve serving once proven
    "tests/test_trtllm_workers.py::test_trtllm_serve_refuses_to_serve_without_the_proof",
    # dynamo-compiled steps of PARD and EAGLE-3 chains (~7 s each): the fast tier keeps
    # DFlash's ([dflash]), an EAGLE-3 tree batch on the compiled steps
    # (test_an_eagle3_tree_batch_drafts_and_decodes_on_the_compiled_steps) and the compiled
    # step rows every family's batched roles call (test_gpu_e2e.py)
    "tests/test_compiled_batched.py::test_compiled_batched_steps_decode_the_eager_tokens[pard]",
    "tests/test_compiled_batched.py::test_compiled_batched_steps_decode_the_eager_tokens[eagle3]",
    # the 49152-row weight in float16 (slow on CPU): the fast tier keeps the four smaller
    # shapes at both dtypes and this shape in bfloat16 ([shape4-dtype0])
    "tests/test_row_invariant.py::test_a_linear_row_is_the_same_at_every_row_count[shape4-dtype1]",
}


# Tests that read these exports run in the full tier (marked slow here, by the fixtures
# they ask for): each family's ONNX graphs cost 5-12 s of exporting (torch.export and the
# exporter's re-decomposition, at any model size), and make test keeps one family's graphs
# in every form the runtime and TensorRT read -- DFlash's (onnx_engine, native_engine).
# The fast tier's cover for the graphs dropped here:
#   n-gram engines on ONNX Runtime (ngram_engine[onnxruntime]): the n-gram engine on torch
#     (test_ngram_engine.py[torch]); target graphs on ONNX Runtime: DFlash's target graphs
#     run every mode's verify there (test_onnxruntime_backend.py, test_batched_engines.py);
#   PARD's drafter graph (pard_onnx_engine): PARD chains on torch, batched and alone, greedy
#     and sampled (test_pard.py, test_pard_engine.py's torch engine), and the plugin node's
#     per-row N on DFlash's drafter graph (test_step_metadata.py);
#   EAGLE-3's step and tree graphs: test_eagle3_onnx_chain.py says its own (a file-wide mark).
SLOW_FIXTURES = {"pard_onnx_engine"}
SLOW_PARAMS = {("ngram_engine", "onnxruntime")}


def reads_slow_exports(item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool(SLOW_FIXTURES & names) or any(params.get(name) == value for name, value in SLOW_PARAMS)


# make test's workers (pytest-xdist, --dist loadgroup): tests run in groups, one group
# to a worker. A file's tests stay together, so its module fixtures (a served engine,
# venvs) are made once. The files that read ONNX graphs exported this run (the
# export_cache fixture) form two groups, one per set of graphs they share, so each graph
# is exported once, not once per worker, and the two groups run side by side: the
# n-gram and PARD engines' target graphs (no features), and the DFlash long pair's.
# (xdist's own xdist_group marks do not work with this pytest: xdist renames a node's
# `_nodeid`, which pytest 9 no longer reads.)
EXPORT_GROUPS = {
    "exports-chain": {"tests/test_ngram_engine.py", "tests/test_pard_engine.py"},
    "exports-dflash": {"tests/test_batched_buckets.py", "tests/test_batched_engines.py",
                       "tests/test_bf16_prefill.py", "tests/test_chunked_prefill.py",
                       "tests/test_export.py",
                       "tests/test_onnxruntime_backend.py", "tests/test_step_metadata.py",
                       "tests/test_tensorrt_engine.py"},
}


# The groups that take longest, longest first (seconds of one make test run on 2 idle cores,
# pytest's durations summed per group; 2026-12-07, reweighed when the PARD, n-gram and
# EAGLE-3 graphs moved to the full tier): handed out before the short files, so the last
# group to start is a short one and neither worker idles at the end (run in collection
# order, test_trtllm_workers.py once started last and ran 72 s after the other worker had
# finished). Rough weights are enough: the order is what counts. A file missing here runs
# after these, in collection order.
LONGEST_FIRST = (
    "exports-dflash",                   # ~58 s: both DFlash engines' graph exports + the ONNX tests
    "tests/test_serving.py",            # ~20 s: a Triton server with four model instances
    "tests/test_openai.py",             # ~20 s
    "tests/test_compiled_batched.py",   # ~18 s: three families' engines and compiled steps
    "tests/test_trtllm_workers.py",     # ~13 s: real MPI workers, fresh interpreters
    "tests/test_gpu_e2e.py",            # ~9 s
    "tests/test_triton_kernel.py",      # ~7 s: the kernel under Triton's interpreter
    "tests/test_trtllm_paths.py",       # ~6 s
    "tests/test_compiled.py",           # ~6 s
    "tests/test_gpu_check.py",          # ~6 s: sections killed by their timeouts
    "tests/test_layering.py",           # ~4 s: two fresh interpreters
    "exports-chain",                    # ~3 s in the fast tier (its ONNX engines are slow)
)


def run_order(nodeid: str) -> int:
    group = group_of(nodeid)
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return next((group for group, files in EXPORT_GROUPS.items() if path in files), path)


def export_group_needed(item) -> str | None:
    """The export group a test's fixtures put it in (None: it reads no exports)."""
    names = set(getattr(item, "fixturenames", ()))
    if "export_cache" not in names:
        return None
    return "exports-chain" if {"ngram_engine", "pard_onnx_engine"} & names else "exports-dflash"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    # hand groups out in the order the workers collected them: longest first (below)
    config.option.loadscopereorder = False
    return Groups(config, log)


def pytest_collection_modifyitems(config, items):
    stale = [g for g in LONGEST_FIRST if g not in EXPORT_GROUPS and not (REPO / g).is_file()]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no such file: {stale}")
    for item in items:
        if item.nodeid in SLOW_IDS or reads_slow_exports(item):
            item.add_marker(pytest.mark.slow)
        needed = export_group_needed(item)
        if needed is not None and group_of(item.nodeid) != needed:
            raise pytest.UsageError(f"{item.nodeid} reads graphs exported this run: list its "
                                    f"file under {needed} in tests/conftest.py EXPORT_GROUPS")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: run_order(item.nodeid))  # stable: files keep their order
