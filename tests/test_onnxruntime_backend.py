"""The onnxruntime backend behind the speculative loop: the same tokens and the same
drafts as the torch backend on one engine, with and without SharpDraft, in both
attention forms; engines whose files changed are refused; the overhead command."""

import json
import mmap
import shutil

import numpy as np
import pytest
import tiny
import torch

import speculative
from runtime.backends.roles import TokenRows
from runtime.__main__ import main as runtime_main
from runtime.backends import PrefillOnce
from runtime.backends.onnxruntime import (HOST_PREFILL_CHUNK, BoundBatchDFlash, BoundKVCache,
                                          OnnxBatchDFlash, open_session)
from runtime.backends.pytorch import TorchBatchDFlash
from runtime.cli import run
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.sampling import Sampler

PROMPT_LENGTHS = (17, 600)
NEW_TOKENS = 24


class RecordedDrafter:
    """Passes a batch block drafter through, keeping every block it proposed to its first
    row (greedy)."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, contexts, bonuses):
        logits, visible = self.inner.draft(contexts, bonuses)
        self.proposals.append(Sampler().propose(logits[0], self.inner.vocab)[0])  # target ids
        return logits, visible


def speculate(engine, drafter, prompt):
    """A request decoded alone (a batch of one) on the engine's batch target and a batch
    drafter, greedy: its tokens, per-step counts, N and beta, and the drafter's blocks."""
    recorded = RecordedDrafter(drafter)
    seq, = speculative.batch_decoder(engine.loaded.batch_target(), recorded).run(
        [Request(prompt=prompt, max_new_tokens=NEW_TOKENS)])
    gen = seq.gen
    return gen.tokens, gen.committed_per_step, gen.visible_per_step, gen.beta_per_step, \
        recorded.proposals


def drafter(engine, sharpdraft: bool = True, window: int | None = None):
    """The engine's batch drafter, SharpDraft or frozen."""
    return engine.loaded.batch_drafter(engine.scaling if sharpdraft else None, window)


def text_prompt(engine, n):
    ids = engine.encode(tiny.stdlib_text())
    return ids[:n]


# The plugin-form engine runs the drafters' portable graphs (cache as an input); the
# native-form one runs them over cache buffers (drafter-kv.onnx).
ORT_ENGINES = ["ort_engine", "native_ort_engine"]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("sharpdraft", [True, False], ids=["sharpdraft", "frozen"])
@pytest.mark.parametrize("engine", ORT_ENGINES)
def test_onnxruntime_drafts_and_generates_like_torch(length, sharpdraft, engine, torch_engine,
                                                     request):
    ort_engine = request.getfixturevalue(engine)
    prompt = text_prompt(torch_engine, length)
    ours = speculate(ort_engine, drafter(ort_engine, sharpdraft), prompt)
    theirs = speculate(torch_engine, drafter(torch_engine, sharpdraft), prompt)
    assert ours == theirs
    assert len(ours[0]) == NEW_TOKENS
    assert all(b > 1.0 for b in ours[3]) == (sharpdraft and length > 64)


@pytest.mark.parametrize("mode", ["sharpdraft", "frozen", "target", "hybrid"])
@pytest.mark.parametrize("engine", ORT_ENGINES)
def test_engine_generate_is_token_identical_across_backends(mode, engine, torch_engine, request):
    ort_engine = request.getfixturevalue(engine)
    prompt = text_prompt(torch_engine, 300)
    ours = ort_engine.generate(prompt, NEW_TOKENS, mode, stop=False)
    theirs = torch_engine.generate(prompt, NEW_TOKENS, mode, stop=False)
    assert ours.tokens == theirs.tokens and ours.committed_per_step == theirs.committed_per_step


@pytest.mark.parametrize("sharpdraft", [False, True], ids=["frozen", "sharpdraft"])
@pytest.mark.parametrize("window", [40, 5000])
def test_in_place_drafter_under_a_draft_window_drafts_like_torch(window, sharpdraft, torch_engine,
                                                                native_ort_engine):
    """drafter-kv.onnx's window input follows KVCache's rule (layers.window_mask, beta from
    the keys left): the same blocks as torch's drafter under the same window; a window
    wider than the context changes nothing, a narrow one changes the blocks."""
    prompt = text_prompt(torch_engine, 600)
    ours = speculate(native_ort_engine, drafter(native_ort_engine, sharpdraft, window), prompt)
    theirs = speculate(torch_engine, drafter(torch_engine, sharpdraft, window), prompt)
    assert ours == theirs
    whole = speculate(torch_engine, drafter(torch_engine, sharpdraft), prompt)
    assert (ours[4] == whole[4]) == (window > len(prompt) + NEW_TOKENS)


@pytest.mark.parametrize("mode", ["window", "window-hybrid"])
def test_window_modes_run_the_recorded_window_on_either_backend(mode, native_engine,
                                                                native_ort_engine):
    """build_engine.py --draft-window records the window modes' window; both backends run
    them (alone, or assisted by n-gram lookup), token-identical to target-only, and batch
    them (one windowed drafter pass for every row: tests/test_batched_engines.py)."""
    torch_side = Engine(open_spec(native_engine, backend="torch"))
    prompt = text_prompt(torch_side, 300)
    runs = {}
    for engine in (native_ort_engine, torch_side):
        assert engine.spec.draft_window == 48 and mode in engine.spec.modes
        assert engine.spec.batch_refusal(engine.spec.check_mode(mode)) is None
        runs[engine.backend] = engine.generate(prompt, NEW_TOKENS, mode, stop=False)
    target = native_ort_engine.generate(prompt, NEW_TOKENS, "target", stop=False)
    assert runs["onnxruntime"].tokens == runs["torch"].tokens == target.tokens
    assert runs["onnxruntime"].committed_per_step == runs["torch"].committed_per_step
    if mode == "window-hybrid":  # this source repeats itself: some steps verify lookups
        assert 0 < runs["torch"].ngram_steps < runs["torch"].verify_steps


def test_generate_window_flag_picks_the_windowed_drafter_or_refuses_in_one_line(native_engine,
                                                                                capsys):
    base = ["generate", "--engine-dir", str(native_engine), "--prompt", "def f(x):\n",
            "--max-new-tokens", "8", "--ignore-eos", "--json", "--window"]
    for extra, mode in (([], "window"), (["--hybrid"], "window-hybrid")):
        assert run(runtime_main, base + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["mode"] == mode and out["sharpdraft"] is None and len(out["tokens"]) == 8
    for extra in (["--ngram"], ["--target-only"]):
        assert run(runtime_main, base + extra) == 2
        err = capsys.readouterr().err
        assert "--window" in err and err.count("\n") == 1


def test_plugin_native_and_in_place_forms_draft_the_same_tokens(native_drafter_graph, torch_engine,
                                                                ort_engine, native_ort_engine):
    native = OnnxBatchDFlash(open_session(native_drafter_graph), ort_engine.loaded.block_size,
                             ort_engine.loaded.mask_token_id, ort_engine.scaling,
                             ort_engine.loaded.vocab)
    prompt = text_prompt(torch_engine, 600)  # beta > 1 all along
    plugin = speculate(ort_engine, drafter(ort_engine), prompt)
    assert speculate(ort_engine, native, prompt) == plugin
    assert speculate(ort_engine, drafter(native_ort_engine), prompt) == plugin


def test_generate_cli_runs_either_backend_on_one_engine(capsys, onnx_engine):
    outputs = {}
    for backend in ("onnxruntime", "torch"):
        code = run(runtime_main, ["generate", "--engine-dir", str(onnx_engine), "--backend",
                                  backend, "--prompt", "def wrap(text, width):",
                                  "--max-new-tokens", "12", "--ignore-eos", "--json"])
        assert code == 0
        outputs[backend] = json.loads(capsys.readouterr().out)
    assert outputs["onnxruntime"]["tokens"] == outputs["torch"]["tokens"]
    assert outputs["onnxruntime"]["sharpdraft"] == outputs["torch"]["sharpdraft"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_tampered_graph_is_refused_with_one_line_error(capsys, tmp_path, onnx_engine):
    engine_dir = tmp_path / "engine"
    shutil.copytree(onnx_engine, engine_dir)
    graph = engine_dir / "drafter.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the hash can tell
    graph.write_bytes(bytes(data))
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "x"])
    assert code == 1
    assert "drafter.onnx does not match the sha256" in one_line_error(capsys)


def test_drafter_graphs_return_draft_vocabulary_logits_and_name_their_columns(tmp_path,
                                                                              native_engine):
    """The long pair's drafter drafts over 256 of 320 tokens: every DFlash graph returns
    256 columns, and draft-vocab.npy (an engine artifact) says which target token each
    is -- the drafter's own d2t, read back; a file that is not such a list is refused."""
    from runtime.manifest import EngineError, read_draft_vocab

    record = json.loads((native_engine / "engine.json").read_text())["extra"]["onnx"]
    vocab = read_draft_vocab(native_engine, record)
    ids = Engine(open_spec(native_engine, backend="torch")).drafter_model.draft_token_ids()
    assert torch.equal(vocab.ids, ids) and vocab.size == 320
    for name in ("drafter", "drafter_frozen", "drafter_kv", "drafter_frozen_kv"):
        assert record["graphs"][name]["outputs"][0]["shape"][-1] == 256, name
    for bad in (np.array([3, 3, 5]), np.array([1.0, 2.0]), np.array([0, 320])):
        np.save(tmp_path / record["draft_vocab"]["file"], bad)
        with pytest.raises(EngineError, match="not a draft vocabulary"):
            read_draft_vocab(tmp_path, record)


def test_unknown_engine_format_is_refused_with_one_line_error(capsys, tmp_path, onnx_engine):
    engine_dir = tmp_path / "engine"
    shutil.copytree(onnx_engine, engine_dir)
    manifest = engine_dir / "engine.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"format_version": 99}))
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "x"])
    assert code == 1 and "format_version 99" in one_line_error(capsys)


def test_overhead_command_reports_medians_and_ratio(capsys, onnx_engine):
    code = run(runtime_main, ["overhead", "--engine-dir", str(onnx_engine), "--context", "16",
                              "700", "--repeats", "3", "--warmup", "1", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "context 700" in captured.err
    result = json.loads(captured.out)
    assert result["backend"] == "onnxruntime" and result["attention"] == "plugin"
    rows = {r["context"]: r for r in result["results"]}
    assert rows[16]["beta"] == 1.0 and rows[700]["beta"] > 1.0
    assert rows[700]["visible_keys"] == 700 + 1 + 4
    for r in rows.values():
        assert r["sharpdraft_ms"] > 0 and r["frozen_ms"] > 0
        assert r["ratio"] == pytest.approx(r["sharpdraft_ms"] / r["frozen_ms"], rel=1e-2)


def random_prompt(n, seed=0):
    return torch.randint(4, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("rows", [1, 4])
def test_target_rows_step_in_their_bound_buffers_in_place(rows, torch_engine, ort_engine):
    """A batch of one and of four: the group's buffers stay where they are; a verify
    writes only its tokens' keys, at each row's committed length (every prompt's keys
    stay as they were), a rollback is a length change the next verify writes over, and
    the logits and features are torch's batch target's."""
    prompts = [random_prompt(40 - 3 * r, seed=r) for r in range(rows)]
    ours, theirs = ort_engine.loaded.batch_target(), torch_engine.loaded.batch_target()
    for target in (ours, theirs):
        for p in prompts:
            target.add(p, len(p) + 8)
    group, = ours.groups
    cache = group.cache
    address = cache.k.ctypes.data, cache.v.ctypes.data
    prefixes = [cache.k[:, i, :, :len(p)].copy() for i, p in enumerate(prompts)]
    steps = []
    for target in (ours, theirs):
        target.verify(TokenRows.of([random_prompt(5, seed=10 + r) for r in range(rows)]))
        target.rollback([len(p) + 2 for p in prompts])
        steps.append(target.verify(TokenRows.of([random_prompt(1, seed=20 + r) for r in range(rows)])))
    assert group.cache is cache and (cache.k.ctypes.data, cache.v.ctypes.data) == address
    for i, prefix in enumerate(prefixes):
        np.testing.assert_array_equal(cache.k[:, i, :, :prefix.shape[-2]], prefix)
    assert ours.lengths == [len(p) + 3 for p in prompts]
    for got, want in zip(*steps):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def vm_flags(array: np.ndarray) -> list[str]:
    """The kernel's VmFlags of the mapping holding the middle of `array` (/proc/self/smaps;
    numpy advises from the first whole page on, so its first page is a mapping apart)."""
    address, inside = array.ctypes.data + array.nbytes // 2, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no madvise(MADV_NOHUGEPAGE) here")
def test_kv_buffers_are_zeroed_writable_and_kept_off_huge_pages():
    cache = BoundKVCache(capacity=512, layers=30, kv_heads=3, head_dim=64, batch=8)  # 94 MiB each
    for buffer in (cache.k, cache.v):
        assert buffer.flags.c_contiguous and buffer.flags.writeable and not buffer.any()
        assert "nh" in vm_flags(buffer)  # madvise(MADV_NOHUGEPAGE) took
        buffer[3, 5, 1, 7, 9] = 2.0
        assert buffer.sum() == 2.0
    assert "nh" not in vm_flags(np.zeros(cache.k.shape, np.float32))  # numpy's own: no advice


@pytest.mark.parametrize("length", [HOST_PREFILL_CHUNK, 2 * HOST_PREFILL_CHUNK + 1])
def test_chunked_prefill_and_a_full_cache_match_torch(length, torch_engine, ort_engine):
    """A prompt of one and of more than two host chunks prefills as torch's batch target
    does; a verify that fills its row exactly runs, one past it is refused."""
    ids = random_prompt(length)
    runs = {}
    for name, engine in (("torch", torch_engine), ("ort", ort_engine)):
        target = engine.loaded.batch_target()
        last, features = target.add(ids, length + 3)
        step, step_features = target.verify(TokenRows.of([random_prompt(3, seed=1)]))  # fills it exactly
        with pytest.raises(ValueError, match="holds"):
            target.verify(TokenRows.of([[5]]))
        runs[name] = (last, features, step[0], step_features[0])
    assert runs["ort"][1].shape == (length, runs["torch"][1].shape[1])
    for ours, theirs in zip(runs["ort"], runs["torch"]):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_held_prefill_joins_again_from_its_snapshot(ort_engine):
    """A sequence prefilled in two parts and held aside (prefill, prefill_more) joins
    from a snapshot, restored twice into two batches (one with a row already in it): each
    verifies as the sequence prefilled whole and joined at once (add)."""
    ids, other = random_prompt(60), random_prompt(30, seed=3)
    whole = ort_engine.loaded.batch_target()
    whole.add(ids, 70)
    want = whole.verify(TokenRows.of([[7, 8]]))
    held = ort_engine.loaded.batch_target()
    held.prefill(ids[:25], 70)
    held.prefill_more(ids[25:])
    snap = held.snapshot()
    assert held.lengths == []  # held aside: no row yet
    held.restore(snap)
    held.join_prefilled()
    again = ort_engine.loaded.batch_target()
    again.add(other, 40)
    again.restore(snap)
    again.join_prefilled()
    for batch, row in ((held, 0), (again, 1)):
        assert batch.lengths[row] == 60
        logits, features = batch.verify(TokenRows.of([[7, 8]] * len(batch.lengths)))
        torch.testing.assert_close(logits[row], want[0][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(features[row], want[1][0], atol=1e-4, rtol=0)


def test_prefill_once_replays_the_same_prefill_on_either_backend(torch_engine, ort_engine):
    """PrefillOnce restores a snapshot into a fresh cache: target-only, then block
    speculation, then target-only again, all from one prefill, agree across backends."""
    prompt = text_prompt(torch_engine, 300)
    tokens = {}
    for name, engine in (("torch", torch_engine), ("ort", ort_engine)):
        once = PrefillOnce(engine.loaded.batch_target(), prompt)
        first = speculative.generate_target_only(once, prompt, NEW_TOKENS, Sampler()).tokens
        block = speculative.generate_block(once, engine.drafter(True), prompt, NEW_TOKENS,
                                           Sampler()).tokens
        again = speculative.generate_target_only(once, prompt, NEW_TOKENS, Sampler()).tokens
        assert first == again
        tokens[name] = (first, block)
    assert tokens["ort"] == tokens["torch"]


def test_engine_from_the_previous_exporter_is_refused_with_one_line_error(capsys, tmp_path,
                                                                         onnx_engine):
    """Graphs whose target takes its cache as an input (export version 1) need a rebuild."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(onnx_engine, engine_dir)
    manifest = engine_dir / "engine.json"
    data = json.loads(manifest.read_text())
    record = data["extra"]["onnx"]
    del record["export_version"]
    (engine_dir / record["graphs"].pop("target_kv")["file"]).unlink()
    data["artifacts"] = {k: v for k, v in data["artifacts"].items() if (engine_dir / k).exists()}
    manifest.write_text(json.dumps(data))
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "x"])
    error = one_line_error(capsys)
    assert code == 1 and "export version 1" in error and "rebuild" in error


def test_engine_from_export_version_2_is_refused_with_one_line_error(capsys, tmp_path, onnx_engine):
    """Version 2 graphs derive lengths from shapes (one sequence per step): rebuild."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(onnx_engine, engine_dir)
    manifest = engine_dir / "engine.json"
    data = json.loads(manifest.read_text())
    data["extra"]["onnx"]["export_version"] = 2
    manifest.write_text(json.dumps(data))
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "x"])
    error = one_line_error(capsys)
    assert code == 1 and "export version 2" in error and "rebuild" in error


@pytest.mark.parametrize("rows", [1, 4])
def test_in_place_drafter_rows_step_in_their_bound_buffers_in_place(rows, torch_engine,
                                                                   native_ort_engine):
    """BoundBatchDFlash at batch 1 and 4: the group's buffers stay where they are; a step
    adds only its rows' context keys (the block's are scratch), at each row's committed
    length, and drafts what torch's batch drafter drafts; a step past a row's capacity
    is refused."""
    ours = native_ort_engine.loaded.batch_drafter(native_ort_engine.scaling)
    theirs = torch_engine.loaded.batch_drafter(torch_engine.scaling)
    g = torch.Generator().manual_seed(6)
    size = torch_engine.drafter_model.fc.in_features
    features = [torch.randn(46, size, generator=g) for _ in range(rows)]
    for drafter in (ours, theirs):
        for f in features:
            drafter.add(46, f[:40], 3)
    group, = ours.groups
    cache = group.cache
    address = cache.k.ctypes.data, cache.v.ctypes.data
    prefix = cache.k[:, :rows, :, :40].copy()
    steps = []
    for drafter in (ours, theirs):
        drafter.draft([f[40:43] for f in features], [5] * rows)
        steps.append(drafter.draft([f[43:45] for f in features], [8] * rows))
    assert steps[0][1].tolist() == steps[1][1].tolist() == [45 + ours.block_size] * rows
    torch.testing.assert_close(steps[0][0], steps[1][0], atol=1e-4, rtol=0)
    assert group.cache is cache and (cache.k.ctypes.data, cache.v.ctypes.data) == address
    np.testing.assert_array_equal(cache.k[:, :rows, :, :40], prefix)
    assert ours.lengths == [45] * rows
    assert not cache.k[:, :rows, :, 45:].any()  # the blocks' keys never reach the cache
    with pytest.raises(ValueError, match="holds"):
        ours.draft([f[:2] for f in features], [1] * rows)  # 45 + 2 > 46


def test_engine_without_in_place_drafter_graphs_runs_its_portable_ones(tmp_path, native_engine,
                                                                      native_ort_engine):
    """A native-form engine built before drafter-kv.onnx (no *_kv drafter graphs) still
    loads, runs drafter.onnx, and decodes the same tokens."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(native_engine, engine_dir)
    manifest = engine_dir / "engine.json"
    data = json.loads(manifest.read_text())
    graphs = data["extra"]["onnx"]["graphs"]
    for name in ("drafter_kv", "drafter_frozen_kv"):
        (engine_dir / graphs.pop(name)["file"]).unlink()
    data["artifacts"] = {k: v for k, v in data["artifacts"].items() if (engine_dir / k).exists()}
    manifest.write_text(json.dumps(data))
    older = Engine(open_spec(engine_dir))
    assert isinstance(older.loaded.batch_drafter(older.scaling), OnnxBatchDFlash)
    assert isinstance(native_ort_engine.loaded.batch_drafter(native_ort_engine.scaling),
                      BoundBatchDFlash)
    prompt = text_prompt(native_ort_engine, 300)
    for mode in ("sharpdraft", "frozen"):
        ours = older.generate(prompt, NEW_TOKENS, mode, stop=False)
        theirs = native_ort_engine.generate(prompt, NEW_TOKENS, mode, stop=False)
        assert ours.tokens == theirs.tokens and ours.committed_per_step == theirs.committed_per_step


def test_calibrating_a_native_engine_rescales_the_graph_it_runs(tmp_path, native_engine,
                                                                torch_engine):
    """calibrate re-exports drafter-kv.onnx with the chosen values, not only drafter.onnx:
    the in-place drafter then drafts what torch's drafter drafts with them."""
    from plugins.scaling import QueryScaling
    from build import calibrate

    engine_dir = tmp_path / "engine"
    shutil.copytree(native_engine, engine_dir)
    chosen = QueryScaling(ref_keys=16, top_k=8, slope=2.0)
    calibrate.apply(engine_dir, Engine(open_spec(engine_dir, backend="torch")), chosen, {"chosen": "test"})
    ours = Engine(open_spec(engine_dir)).loaded.batch_drafter(chosen)
    assert isinstance(ours, BoundBatchDFlash) and ours.scaling == chosen
    theirs = TorchBatchDFlash(torch_engine.drafter_model, torch_engine.model, chosen)
    features = torch.randn(201, torch_engine.drafter_model.fc.in_features,
                           generator=torch.Generator().manual_seed(7))
    for drafter in (ours, theirs):
        drafter.add(201, features[:200], 3)
    got, want = ours.draft([features[200:]], [5]), theirs.draft([features[200:]], [5])
    assert got[1].tolist() == want[1].tolist() == [201 + ours.block_size]
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
