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
# never less covered).
SLOW_IDS = {
    # scripts/gpu_check.py's TensorRT section builds (and exports) two engines of its own on
    # the stand-in: the full tier, with every test that reads graphs exported this run
    "tests/test_tensorrt_engine.py::test_gpu_check_tensorrt_section_runs_on_the_stand_in",
    # the kernel against the reference at 16K keys: the fast tier keeps it at every pattern
    # and length Hypothesis draws (test_kernel_matches_reference_fp32)
    "tests/test_triton_kernel.py::test_kernel_matches_reference_with_paper_defaults_at_16k_keys",
    # a short scratch: the fast tier keeps the short counters' case ([1000000-0])
    "tests/test_triton_kernel.py::"
    "test_single_launch_takes_fewer_slices_when_scratch_is_short[0-1000000]",
    "tests/test_triton_kernel.py::"
    "test_single_launch_takes_fewer_slices_when_scratch_is_short[128-1000000]",
    # The launcher's gate through real processes (trtllm-serve and generate, proof missing or
    # given, several GPUs without the autoloader; ~4 s each, fresh interpreters): the fast
    # tier keeps one real MPI launch, its workers' proof seen by the launcher
    # (test_drafters_built_in_real_mpi_workers_are_wrapped_and_the_launcher_sees_it), the gate
    # refusing an unscaled drafter in process (test_trtllm_release.py:
    # test_the_gate_refuses_a_server_whose_drafter_runs_unscaled, every rank's proof:
    # test_trtllm_hook.py) and the wrapper's plan for one GPU and each parallel alias
    # (test_trtllm_config.py)
    "tests/test_trtllm_workers.py::test_trtllm_serve_refuses_to_serve_without_the_proof",
    "tests/test_trtllm_workers.py::"
    "test_trtllm_serve_one_gpu_serves_once_the_in_process_drafter_is_proven",
    "tests/test_trtllm_workers.py::"
    "test_without_the_autoloader_the_worker_runs_unscaled_and_the_launcher_refuses",
    "tests/test_trtllm_workers.py::"
    "test_several_gpus_without_the_autoloader_are_refused_before_anything_starts",
    # dynamo-compiled steps (3-9 s each): every family and mode in batches, an EAGLE-3 tree
    # batch, the CLI's --steps, the op's first call in a fresh process. The fast tier keeps
    # DFlash's compiled steps decoding alone and batched, seeded and as a chunked join
    # (test_compiled.py), PARD's compiled chain step compiling once (test_compiled.py), the
    # loader's steps option (test_loaders.py), packed trees verified on the compiled batch
    # target (test_compiled_batched.py), the compiled step rows every family's batched
    # roles call (test_gpu_e2e.py) and the op compiling into one graph (test_capturable.py)
    "tests/test_compiled_batched.py::test_compiled_batched_steps_decode_the_eager_tokens[dflash]",
    "tests/test_compiled_batched.py::test_compiled_batched_steps_decode_the_eager_tokens[pard]",
    "tests/test_compiled_batched.py::test_compiled_batched_steps_decode_the_eager_tokens[eagle3]",
    "tests/test_compiled_batched.py::"
    "test_the_batched_chain_steps_run_compiled_per_slot_and_width_bucket",
    "tests/test_compiled_batched.py::"
    "test_an_eagle3_tree_batch_drafts_and_decodes_on_the_compiled_steps[eager-4]",
    "tests/test_cli.py::test_generate_with_compiled_steps_gives_the_eager_tokens",
    "tests/test_capturable.py::test_a_fresh_processs_first_caller_of_the_op_compiles_in_one_graph",
    # the GPU scripts on CPU in fresh interpreters (~2.5 s each): the fast tier keeps the
    # TensorRT-LLM section's refusal without CUDA in a real process
    # (test_trtllm_gpu_section.py), gpu_check's (test_gpu_check.py) and the kernel
    # benchmark's in process (test_bench_kernel.py: test_full_run_without_cuda_refuses_in_one_line,
    # test_the_json_is_saved_after_every_shape)
    "tests/test_gpu_e2e.py::test_gpu_sections_refuse_without_cuda_in_one_line",
    "tests/test_bench_kernel.py::test_smoke_run_writes_json_with_named_figures_and_plot",
    # a full queue through Triton's gRPC and generate endpoints: the fast tier keeps its
    # HTTP endpoint's and the OpenAI endpoint's (each variant decodes ~1 s)
    "tests/test_openai.py::"
    "test_a_full_queue_refuses_plain_requests_and_the_others_finish[grpc-StatusCode.UNAVAILABLE]",
    "tests/test_openai.py::"
    "test_a_full_queue_refuses_plain_requests_and_the_others_finish[generate-400]",
    # the 49152-row weight in float16 (slow on CPU): the fast tier keeps the four smaller
    # shapes at both dtypes and this shape in bfloat16 ([shape4-dtype0])
    "tests/test_row_invariant.py::test_a_linear_row_is_the_same_at_every_row_count[shape4-dtype1]",
}


# Tests that read ONNX graphs exported this run (the export_cache fixture: DFlash's engines
# in both forms, the PARD, n-gram and EAGLE-3 graphs) run in the full tier, marked slow
# here by the fixtures they read: each graph costs 3.5-7 s of exporting (torch.export and
# the exporter's second trace, at any model size), DFlash's two engines about 45 s, with
# their tests a third of make test's time. So make test runs no exported graph on ONNX
# Runtime or the stand-in TensorRT; make test-all (CI) runs them all. Only the n-gram
# engine on torch (no graphs) stays fast. The fast tier's cover around the graphs:
#   the modules the exporter traces, on torch: every family's steps, batched and alone,
#     greedy and sampled (test_dflash.py, test_pard.py, test_eagle3*.py, test_batched*.py);
#   the plugin node's ONNX form and fields (test_tensorrt.py) and TensorRT's own creator
#     code on our plugin (test_tensorrt_sources.py);
#   the ONNX Runtime loader's refusals and cache buffers (test_loaders.py,
#     test_onnxruntime_backend.py) and the backend registry (test_engine_spec.py).
EXPORTS_NOTHING = {("ngram_engine", "torch")}


def exports_nothing(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name) == value for name, value in EXPORTS_NOTHING)


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


# The groups that take longest, longest first: handed out before the short files, so the
# last group to start is a short one and neither worker idles at the end (run in collection
# order, test_trtllm_workers.py once started last and ran 72 s after the other worker had
# finished). Seconds of one run on 2 idle cores, pytest's durations summed per group
# (2026-12-08): make test's first, then make test-all's where the full tier adds much.
# Rough weights are enough: the order is what counts. A file missing here runs after
# these, in collection order.
LONGEST_FIRST = (
    "exports-dflash",                   # ~12 s; full tier: + DFlash's exports (~45 s), ONNX tests
    "tests/test_serving.py",            # full tier only, ~25 s: a server with four model instances
    "tests/test_openai.py",             # ~24 s: a real Triton server
    "tests/test_compiled_batched.py",   # ~1 s; full tier ~25 s: every family's compiled batches
    "tests/test_triton_kernel.py",      # ~9 s: the kernel under Triton's interpreter
    "tests/test_trtllm_workers.py",     # ~8 s: a real MPI launch, fresh interpreters
    "tests/test_compiled.py",           # ~8 s
    "tests/test_trtllm_paths.py",       # ~7 s
    "tests/test_gpu_e2e.py",            # ~7 s
    "tests/test_pard.py",               # ~7 s
    "tests/test_gpu_check.py",          # ~4 s: sections killed by their timeouts
    "tests/test_layering.py",           # ~5 s: two fresh interpreters
    "exports-chain",
)


def run_order(nodeid: str) -> int:
    group = group_of(nodeid)
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return next((group for group, files in EXPORT_GROUPS.items() if path in files), path)


def fixtures_read(item) -> set[str]:
    """The fixtures a test reads: its own and, for a test that asks for a fixture its
    parameter names (request.getfixturevalue(engine)), that one too, with everything each
    of them asks for."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    todo = list(getattr(item, "fixturenames", ())) + [v for v in params.values() if isinstance(v, str)]
    manager, found = item.session._fixturemanager, set()
    while todo:
        name = todo.pop()
        definitions = name not in found and manager.getfixturedefs(name, item)
        if definitions:  # a parameter's value that names no fixture is skipped
            found.add(name)
            todo += definitions[-1].argnames
    return found


def export_group_needed(item) -> str | None:
    """The export group a test's fixtures put it in (None: it reads no exports)."""
    names = fixtures_read(item)
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
        needed = export_group_needed(item)  # a test that reads exports is slow (above)
        if item.nodeid in SLOW_IDS or (needed is not None and not exports_nothing(item)):
            item.add_marker(pytest.mark.slow)
        if needed is not None and group_of(item.nodeid) != needed:
            raise pytest.UsageError(f"{item.nodeid} reads graphs exported this run: list its "
                                    f"file under {needed} in tests/conftest.py EXPORT_GROUPS")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: run_order(item.nodeid))  # stable: files keep their order
