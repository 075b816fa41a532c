"""Chunked prefill (runtime/serve/scheduler.py, Decoder.join): a joining prompt prefills a
chunk at a time between steps of the running rows -- the target's chunk, then the
drafter's read of its features -- and decoding stays lossless: the tokens are those of a
whole prefill and of `generate` alone, on the torch and ONNX Runtime backends, and a
drafter read in parts holds the cache it holds after one piece."""

import threading
from pathlib import Path

import pytest
import torch

from runtime import assembly
from runtime.backends.pytorch import (TorchBatchDFlash, TorchBatchEagle3, TorchBatchPARD,
                                      TorchBatchTarget)
from runtime.decode import Request
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.modes import Mode
from runtime.sampling import Sampler, Sampling
from runtime.serve.scheduler import StepScheduler
from runtime.tree import TreeShape
from speculative import (assert_chunked_join_drafts_as_whole, batch_decoder, chain_batch_decoder,
                         generate_target_only)
from test_batched import SCALING
from test_eagle3 import eagle_pair
from test_scheduler import Outcome, prompts
from test_speculative import tiny_pair
from tiny import float64_pard, float64_target

CHUNK = 32


# tiny_engine: the torch backend (512-token context); native_engine: ONNX Runtime's default
# graphs (4096 tokens). The parameters name the fixtures, so that tests/conftest.py sees
# which of these tests read graphs exported this run.
@pytest.fixture(scope="module", params=["tiny_engine", "native_engine"], ids=["torch", "onnxruntime"])
def engine(request):
    return Engine(open_spec(request.getfixturevalue(request.param)))


def _events(engine, mode, scheduler_kwargs, jobs):
    """Run `jobs` [(ids, n, mode, sampling, delay_steps)] through a scheduler; returns the
    outcomes and the log of ("step", rows), ("prefill", tokens) (the target's),
    ("draft", feature rows) (the block drafter's read of a joining sequence's features,
    its _read_joining) and ("join", 0) (a chunked join's last part: the target's
    join_prefilled) events in order."""
    log, lock = [], threading.Lock()
    decoder = engine.decoder(mode)
    decoder_type, target_type = type(decoder), type(decoder.target)
    step, prefill, more = decoder_type.step, target_type.prefill, target_type.prefill_more
    join_prefilled = target_type.join_prefilled

    def logged_join(self):
        log.append(("join", 0))
        return join_prefilled(self)
    drafter = getattr(decoder.proposer, "drafter", None)
    drafter_type = type(drafter) if drafter is not None else None
    read = getattr(drafter_type, "_read_joining", None)

    def logged_read(self, context, last):
        log.append(("draft", len(context)))
        return read(self, context, last)

    def logged_step(decoder, *aside):
        if decoder.active:
            with lock:
                log.append(("step", len(decoder.active)))
        return step(decoder, *aside)

    inside = []  # an ONNX prefill runs its loop through prefill_more: log the outer call

    def logged_prefill(self, ids, capacity):
        log.append(("prefill", len(ids)))
        inside.append(1)
        try:
            return prefill(self, ids, capacity)
        finally:
            inside.pop()

    def logged_more(self, ids):
        if not inside:
            log.append(("prefill", len(ids)))
        return more(self, ids)

    outcomes = [Outcome() for _ in jobs]
    scheduler = StepScheduler(engine, **scheduler_kwargs)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(decoder_type, "step", logged_step)
            m.setattr(target_type, "prefill", logged_prefill)
            m.setattr(target_type, "prefill_more", logged_more)
            if read is not None:
                m.setattr(drafter_type, "_read_joining", logged_read)
            m.setattr(target_type, "join_prefilled", logged_join)
            for outcome, (ids, n, job_mode, sampling, after_steps) in zip(outcomes, jobs):
                waited = 0
                while sum(e[0] == "step" for e in log) < after_steps:
                    assert waited < 60_000, f"no step {after_steps} came (earlier jobs failed?)"
                    threading.Event().wait(0.005)
                    waited += 1
                scheduler.submit(outcome.job(ids, n, job_mode, sampling, stop_ids=engine.stop_ids))
            assert all(o.finished.wait(300) for o in outcomes)
    finally:
        scheduler.close()
    return outcomes, log


@pytest.mark.parametrize("mode", ["sharpdraft", "hybrid", "target"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill_and_of_generate(engine, mode):
    short, long_ = prompts([9, 300])
    jobs = [(short, 40, mode, Sampling(), 0),
            (long_, 12, mode, Sampling(), 2),  # joins while the first one decodes
            (prompts([70])[0], 10, mode, Sampling(0.8, 1.0, seed=3), 3)]
    chunked, _ = _events(engine, mode, {"max_batch": 4, "prefill_chunk": CHUNK}, jobs)
    whole, _ = _events(engine, mode, {"max_batch": 4, "prefill_chunk": 0}, jobs)
    for (ids, n, job_mode, sampling, _), a, b in zip(jobs, chunked, whole):
        assert a.error is None and b.error is None
        alone = engine.generate(ids, n, job_mode, sampling)
        assert a.gen.tokens == b.gen.tokens == alone.tokens == sum(a.streamed, [])
        assert a.gen.verify_steps == alone.verify_steps


def test_a_long_prompt_joins_a_chunk_at_a_time_between_steps(engine):
    """While a row decodes, a 300-token prompt never prefills more than one chunk between
    two of its steps, the target's or the drafter's (the old scheduler prefilled it whole:
    300 tokens at once; then the target chunked and the drafter read all 300 feature
    rows in the join's last part): the drafter reads each chunk's features right after
    the target's chunk, in the same turn between steps, and the join's last part has a
    turn of its own (it ran right after the last chunk)."""
    short, long_ = prompts([9, 300])
    outcomes, log = _events(engine, "sharpdraft", {"max_batch": 4, "prefill_chunk": CHUNK},
                            [(short, 60, "sharpdraft", Sampling(), 0),
                             (long_, 6, "sharpdraft", Sampling(), 2)])
    assert all(o.error is None for o in outcomes)
    first = next(i for i, e in enumerate(log) if e == ("prefill", CHUNK))
    joined = log.index(("step", 2), first)  # the joining row's first step
    joining = log[first:joined]
    chunks = [n for kind, n in joining if kind == "prefill"]
    assert sum(chunks) == 300 and max(chunks) <= CHUNK
    # the drafter's prefill: one read per target chunk, of its features, right after it
    # (so nothing is left for the join's last part)
    assert [n for kind, n in joining if kind == "draft"] == chunks, joining
    for at, (kind, n) in enumerate(joining):
        if kind == "prefill":
            assert joining[at + 1] == ("draft", n), joining
    # between two steps of the running row, at most one chunk of the joining prompt, or
    # the join's last part alone
    assert joining[-2:] == [("step", 1), ("join", 0)], joining
    since_step = {"prefill": 0, "draft": 0}
    for kind, value in joining[:-1]:
        if kind == "step":
            since_step = dict.fromkeys(since_step, 0)
        else:
            since_step[kind] += value
            assert since_step[kind] <= CHUNK, log


def test_the_scheduler_times_every_turn_the_running_rows_wait_on(engine):
    """on_turn hears each turn by kind: the first prompt prefilled with no row running, the
    long one's chunks and last part while a row ran, and every step (what the served
    metrics export)."""
    short, long_ = prompts([9, 300])
    heard = []
    outcomes, log = _events(engine, "sharpdraft",
                            {"max_batch": 4, "prefill_chunk": CHUNK,
                             "on_turn": lambda kind, seconds: heard.append((kind, seconds))},
                            [(short, 60, "sharpdraft", Sampling(), 0),
                             (long_, 6, "sharpdraft", Sampling(), 2)])
    assert all(o.error is None for o in outcomes)
    kinds = [kind for kind, _ in heard]
    assert kinds[0] == "prefill" and kinds.count("prefill") == 1
    assert kinds.count("chunk") == -(-300 // CHUNK) and kinds.count("join") == 1
    assert kinds.index("join") > max(i for i, kind in enumerate(kinds) if kind == "chunk")
    assert kinds.count("step") == sum(kind == "step" for kind, _ in log)
    assert all(seconds > 0 for _, seconds in heard)


def test_a_bad_request_fails_alone_while_another_prefills_in_chunks(engine):
    short, long_ = prompts([9, 300])
    jobs = [(short, 30, "sharpdraft", Sampling(), 0), (long_, 8, "sharpdraft", Sampling(), 1),
            ([7] * (engine.context_limit + 5), 4, "sharpdraft", Sampling(), 1),
            ([], 4, "sharpdraft", Sampling(), 2)]
    outcomes, _ = _events(engine, "sharpdraft", {"max_batch": 4, "prefill_chunk": CHUNK}, jobs)
    assert isinstance(outcomes[2].error, ValueError) and isinstance(outcomes[3].error, ValueError)
    for (ids, n, mode, sampling, _), o in zip(jobs[:2], outcomes[:2]):
        assert o.error is None and o.gen.tokens == engine.generate(ids, n, mode, sampling).tokens


# ---- the drafter's prefill in parts ----------------------------------------------------

def assert_parts_leave_one_pieces_cache(make, features, new, last: int, capacity: int,
                                        parts: list[int], tolerance: float) -> None:
    """A batch block drafter fed the prompt's `features` in `parts` (prefill, prefill_more,
    join_prefilled) hands back the features it left unread and drafts its next blocks
    (contexts `new`, a row at a time) as one fed them whole (add) does: the same visible
    keys (so the same committed length) and logits within `tolerance` (0: bitwise), which
    the committed keys decide."""
    assert sum(parts) == len(features) and len(parts) > 1
    whole, chunked = make(), make()
    first = whole.add(capacity, features, last)
    chunked.prefill(capacity, features[:parts[0]], last)
    at = parts[0]
    for n in parts[1:]:
        chunked.prefill_more(features[at:at + n], last)
        at += n
    assert torch.equal(chunked.join_prefilled(), first)
    close = dict(rtol=tolerance, atol=tolerance)
    contexts = [torch.cat([first, new[:1]])] + [new[i:i + 1] for i in range(1, len(new))]
    for i, context in enumerate(contexts):
        (want, want_n), (got, got_n) = (d.draft([context], [7 + i]) for d in (whole, chunked))
        assert torch.equal(got_n, want_n)
        torch.testing.assert_close(got, want, **close)
    assert int(want_n[0]) == len(features) + len(new) + whole.block_size  # every row read is cached


@pytest.mark.parametrize("window", [None, 5])
def test_a_drafter_read_in_parts_holds_the_cache_of_one_piece(window):
    """Float64 torch DFlash (TorchBatchDFlash), with and without a draft window: parts of
    1, 12 and 17 rows leave the cache one piece of 30 leaves, to rounding (not bitwise: a
    part's projections are matmuls of another shape, and differ from one piece's in the
    last bit, ~1e-15)."""
    target, drafter = tiny_pair(5, vocab=40, block=4, context=256)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(32, drafter.fc.in_features, generator=g, dtype=torch.float64)
    assert_parts_leave_one_pieces_cache(lambda: TorchBatchDFlash(drafter, target, SCALING, window),
                                        features[:30], features[30:], 3, 64, [1, 12, 17], 1e-12)


def setting_of(engine, mode) -> tuple:
    """The (scaling, window) a mode's drafter runs under (EngineSpec.setting)."""
    setting = engine.spec.setting(mode)
    return setting.scaling, setting.window


def _engine_features(engine, n: int):
    """The engine target's features of a prompt of n tokens, and the prompt."""
    prompt = prompts([n])[0]
    _, features = engine.loaded.batch_target().add(prompt, n + 8)
    return prompt, features


def test_an_engines_drafter_read_in_parts_holds_the_cache_of_one_piece(engine):
    """The engine's own drafters (torch: TorchBatchDFlash over float32; ONNX Runtime:
    BoundBatchDFlash, drafter-kv.onnx), SharpDraft and the window mode where the engine
    has one: 70 prompt rows read as 1 + 31 + 32 + 6 leave the cache of one piece
    (float32: within 1e-5)."""
    prompt, features = _engine_features(engine, 72)
    for mode in [Mode.SHARPDRAFT] + ([Mode.WINDOW] if Mode.WINDOW in engine.spec.modes else []):
        make = lambda: engine.loaded.batch_drafter(*setting_of(engine, mode))  # noqa: E731
        assert_parts_leave_one_pieces_cache(make, features[:70], features[70:], prompt[69], 90,
                                            [1, 31, 32, 6], 1e-5)


def test_a_host_cache_drafter_read_in_parts_holds_the_cache_of_one_piece(ort_engine):
    """ONNX Runtime's drafter.onnx over a HostKVCache (OnnxBatchDFlash: the plugin-form
    engine), likewise."""
    assert type(ort_engine.loaded.batch_drafter(*setting_of(ort_engine, Mode.SHARPDRAFT))).__name__ == "OnnxBatchDFlash"
    prompt, features = _engine_features(ort_engine, 72)
    assert_parts_leave_one_pieces_cache(lambda: ort_engine.loaded.batch_drafter(*setting_of(ort_engine, Mode.SHARPDRAFT)),
                                        features[:70], features[70:], prompt[69], 90,
                                        [1, 31, 32, 6], 1e-5)


def join_between_steps(decoder, request: Request, chunk: int):
    """Decoder.join with the batch stepping between its parts, as the scheduler runs it;
    the joined Sequence."""
    joining = decoder.join(request, chunk)
    while True:
        try:
            next(joining)
        except StopIteration as joined:
            return joined.value
        decoder.step()


def _block_pair():
    target, drafter = tiny_pair(3, vocab=40, block=4, context=256)
    return batch_decoder(TorchBatchTarget(target, drafter.config.target_layer_ids),
                         TorchBatchDFlash(drafter, target, SCALING)), target, drafter


def _pard_pair():
    target = float64_target(4, 40, context=256)
    drafter = float64_pard(5, 40, context=256)
    return chain_batch_decoder(TorchBatchTarget(target, ()),
                               TorchBatchPARD(drafter, 40, 3, SCALING)), target, drafter


def _eagle3_chain_pair():
    target, drafter = eagle_pair(6, 40)
    layers = drafter.config.feature_layers(target.config.num_layers)
    return chain_batch_decoder(TorchBatchTarget(target, layers),
                               TorchBatchEagle3(drafter, SCALING, 3)), target, drafter


def _eagle3_tree_pair():
    target, drafter = eagle_pair(7, 40)
    layers = drafter.config.feature_layers(target.config.num_layers)
    roles = assembly.Roles("tree", lambda: TorchBatchTarget(target, layers),
                           drafter=lambda setting: TorchBatchEagle3(drafter, SCALING, 3, TreeShape(2, 3, 6)),
                           tree_shape=TreeShape(2, 3, 6))
    return assembly.decoder(roles, Mode.FROZEN), target, drafter


@pytest.mark.parametrize("pair", [_block_pair, _pard_pair, _eagle3_chain_pair, _eagle3_tree_pair],
                         ids=["dflash", "pard", "eagle3-chain", "eagle3-tree"])
def test_a_prompt_joining_in_chunks_decodes_the_target_only_tokens_on_every_drafter(pair):
    """Float64 torch roles, greedy: a 50-token prompt joining in chunks of 8 while another
    row decodes (every drafter reads each chunk right after the target's) gets the
    target's own tokens, as does the row it joins."""
    decoder, target, _ = pair()
    other, prompt = prompts([6, 50])
    other, prompt = [t % 39 for t in other], [t % 39 for t in prompt]
    running = decoder.add(Request(prompt=other, max_new_tokens=30))
    decoder.step()
    joined = join_between_steps(decoder, Request(prompt=prompt, max_new_tokens=20), chunk=8)
    while decoder.active:
        decoder.step()
    alone = TorchBatchTarget(target, ())
    for seq, ids, n in ((running, other, 30), (joined, prompt, 20)):
        assert seq.error is None
        assert seq.gen.tokens == generate_target_only(alone, ids, n, Sampler()).tokens


@pytest.mark.parametrize("pair, reader, sampling", [
    (_pard_pair, TorchBatchPARD, Sampling(1.0, 1.0, seed=3)),
    (_eagle3_chain_pair, TorchBatchEagle3, Sampling(1.0, 1.0, seed=3)),
    (_eagle3_tree_pair, TorchBatchEagle3, Sampling())], ids=["pard", "eagle3-chain", "eagle3-tree"])
@pytest.mark.parametrize("chunk", [1, 8])
def test_chain_and_tree_drafters_read_a_chunked_prompt_a_part_at_a_time(pair, reader, sampling, chunk):
    """Float64 torch roles: a 50-token prompt joining in parts has the PARD or EAGLE-3
    drafter read each part right after the target's (EAGLE-3 holding each part's newest
    feature row until its token comes; one token alone waits for the next part), none in
    the join's last part, and then draft as after one read of the whole prompt."""
    prompt = [t % 39 for t in prompts([50])[0]]  # the pairs' vocabulary: 40 tokens
    assert_chunked_join_drafts_as_whole(lambda: pair()[0], prompt, chunk, sampling, 1e-12, reader)


def test_the_ab_scripts_bound_times_a_chunks_turn_and_the_joins_last_part(tiny_engine):
    """scripts/chunked_prefill_ab.py --bound, in process on the tiny engine: a full
    chunk's turn of a chunked join (target + drafter), one step, their sum, and the join's
    last part; a prompt that joins in one piece is reported, not timed."""
    import argparse
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "chunked_prefill_ab.py"
    spec = importlib.util.spec_from_file_location("chunked_prefill_ab", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = argparse.Namespace(engine_dir=str(tiny_engine), mode="sharpdraft", chunk=32,
                              concurrency=2, max_new_tokens=8)
    engine = Engine(open_spec(tiny_engine))
    turns = script.timed_join(engine.decoder("sharpdraft"), Request(prompt=prompts([100])[0], max_new_tokens=8), 32)
    assert len(turns) == 4 + 1  # 32 + 32 + 32 + 4 tokens, then the last part
    got = script.bound(args, prompts([100])[0])
    assert set(got) == {"chunk_prefill_ms", "step_ms", "bound_ms", "join_last_part_ms"}
    assert all(v > 0 for v in got.values())
    assert abs(got["bound_ms"] - got["chunk_prefill_ms"] - got["step_ms"]) <= 0.11
    assert "does not join in chunks of 32" in script.bound(args, prompts([32])[0])["error"]
    # served_bound: the chunked arm's longest chunk + longest step, from the server's turns
    arm = {"worst_gap_while_joining_ms": 130.0,
           "turns_ms": {"chunk": {"count": 4, "mean": 80.0, "longest": 100.0},
                        "join": {"count": 1, "mean": 5.0, "longest": 5.0},
                        "step": {"count": 9, "mean": 20.0, "longest": 40.0}}}
    assert script.served_bound(arm) == {"longest_chunk_ms": 100.0, "longest_step_ms": 40.0,
                                        "longest_join_ms": 5.0, "bound_ms": 140.0,
                                        "worst_gap_while_joining_ms": 130.0, "holds": True}
    assert script.served_bound(arm | {"worst_gap_while_joining_ms": 141.0})["holds"] is False
    assert script.served_bound(arm | {"worst_gap_while_joining_ms": None})["holds"] is None
