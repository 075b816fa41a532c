"""Both CPU backends run batches in every mode, token-identical to each other and to each request's
own `Engine.generate` (a batch of one), with
requests joining and leaving mid-run."""

import pytest
import torch

from runtime.decode import Request
from runtime.modes import parse
from runtime.sampling import Sampling


def prompts(engine, lengths):
    g = torch.Generator().manual_seed(len(lengths))
    return [torch.randint(4, 320, (n,), generator=g).tolist() for n in lengths]


MODES = ["sharpdraft", "frozen", "target", "ngram", "hybrid", "window", "frozen-hybrid", "window-hybrid"]


@pytest.fixture(scope="module")
def native_torch_engine(native_engine):
    """native_engine's checkpoints on the torch backend: the torch side of the window modes
    (the engine records a draft window of 48; onnx_engine's records none). No build."""
    from runtime.engine import Engine
    from runtime.spec import open_spec

    return Engine(open_spec(native_engine, backend="torch"))


# the draft window needs drafter graphs over cache buffers: the native-form engine's;
# the preset swaps the drafter's scaling, which only torch does (onnx_engine on torch)
@pytest.mark.parametrize("engine, mode", [
    (e, m) for e in ("ort_engine", "native_ort_engine") for m in MODES
    if e == "native_ort_engine" or "window" not in m] + [("ort_engine", "preset")])
def test_batched_decoding_is_token_identical_across_backends_and_to_one_at_a_time(
        mode, engine, torch_engine, request):
    """Four sequences at 5, 90, 300 and 40 tokens (beta 1 and > 1 side by side; the draft
    window of 48 cuts three of them), two of them joining later, one with a short budget
    leaving early; on the drafters' portable graphs (plugin-form engine) and on their
    graphs over cache buffers (native form). Every drafter mode drafts in one batched pass
    per step (a window and the preset too), never one call per row."""
    ort_engine = request.getfixturevalue(engine)
    if "window" in mode:  # the torch side with the native engine's recorded window
        torch_engine = request.getfixturevalue("native_torch_engine")
    lengths, budgets, join_at = [5, 90, 300, 40], [24, 6, 24, 16], [0, 0, 1, 3]
    requests = [Request(prompt=p, max_new_tokens=n, stop_ids=torch_engine.stop_ids)
                for p, n in zip(prompts(torch_engine, lengths), budgets)]
    out, runs = {}, [e for e in (torch_engine, ort_engine) if e.spec.refusal(parse(mode)) is None]
    assert torch_engine in runs and (ort_engine in runs) == (mode != "preset")
    for engine in runs:
        decoder = engine.decoder(mode, adaptive=False)
        assert getattr(getattr(decoder.proposer, "drafter", None), "fused", True)
        out[engine] = [s.gen.tokens for s in decoder.run(requests, join_at=join_at)]
    assert out[runs[0]] == out[runs[-1]]
    for request, tokens in zip(requests, out[runs[-1]]):  # one at a time: ONNX Runtime's
        alone = runs[-1].generate(request.prompt, request.max_new_tokens, mode, adaptive=False)
        target = torch_engine.generate(request.prompt, request.max_new_tokens, "target")
        assert tokens == alone.tokens == target.tokens


def test_seeded_sampling_is_the_same_alone_and_batched_on_onnxruntime(ort_engine):
    requests = [Request(prompt=p, max_new_tokens=12, sampling=Sampling(0.8, 0.95, seed=i))
                for i, p in enumerate(prompts(ort_engine, [7, 120, 33]))]
    seqs = ort_engine.decoder("sharpdraft", adaptive=False).run(requests, join_at=[0, 1, 0])
    for request, seq in zip(requests, seqs):
        alone = ort_engine.generate(request.prompt, 12, "sharpdraft", request.sampling,
                                    stop=False, adaptive=False)
        assert seq.gen.tokens == alone.tokens



def test_one_windowed_drafter_graph_call_gives_each_row_its_own_window(native_ort_engine):
    """drafter-kv.onnx stepping three sequences in one call (their capacities share a
    bucket, so one pass) under the draft window of 48: each row's logits and N equal that
    sequence's own windowed call alone (a batch of one); the window leaves the shortest
    row's context whole and cuts the others' (there the logits differ from an unwindowed
    call's)."""
    loaded, window = native_ort_engine.loaded, native_ort_engine.spec.draft_window
    lengths, news = [34, 50, 55], [3, 1, 5]
    size = native_ort_engine.manifest.extra["onnx"]["graphs"]["drafter"]["inputs"]
    size = next(i["shape"][-1] for i in size if i["name"] == "context")
    features = [torch.randn(n + c, size, generator=torch.Generator().manual_seed(n))
                for n, c in zip(lengths, news)]
    want, got = [], {}
    for f, n in zip(features, lengths):
        alone = loaded.batch_drafter(None, window)
        alone.add(n + 8, f[:n], 0)
        logits, visible = alone.draft([f[n:]], [5])
        want.append((logits[0], int(visible[0])))
    for w in (window, None):
        batch = loaded.batch_drafter(None, w)
        for f, n in zip(features, lengths):
            batch.add(n + 8, f[:n], 0)
        assert len(batch.groups) == 1
        got[w] = batch.draft([f[n:] for f, n in zip(features, lengths)], [5] * 3)
    logits, visible = got[window]
    assert visible.tolist() == [v for _, v in want] == [n + c + 4 for n, c in zip(lengths, news)]
    for row, (expected, _) in zip(logits, want):
        torch.testing.assert_close(row, expected, atol=1e-5, rtol=1e-5)
    cut = [not torch.allclose(a, b, atol=1e-5) for a, b in zip(logits, got[None][0])]
    assert cut == [n + c > window for n, c in zip(lengths, news)] == [False, True, True]


@pytest.mark.parametrize("engine, mode", [("ort_engine", "sharpdraft"),
                                          ("native_ort_engine", "window")])
def test_a_drafter_set_aside_reads_what_it_missed_on_onnxruntime(engine, mode, request):
    """ONNX Runtime's fused drafters (plugin-form graph; the native graph under the draft
    window): steps that set the drafter's drafts aside run no drafter pass, and the step
    that drafts again reads the rows' missed features a block at a time (rows of unequal
    backlogs: some passes read nothing for a row), then drafts as a drafter that ran every
    step does (N equal, logits to float32 rounding). (Not with n-gram assist: a step whose
    rows all verify 2+-token lookups runs no drafter pass either, so no arm there drafts
    every step; hybrid decoding's tokens are held by the cross-backend test above.)"""
    from runtime.decode import DraftKind

    engine = request.getfixturevalue(engine)
    requests = [Request(prompt=p, max_new_tokens=40) for p in prompts(engine, [9, 130, 60])]
    aside = frozenset({DraftKind.GREEDY, DraftKind.SAMPLED, DraftKind.ONE_HOT})
    runs = []
    for drafter_ignores_aside in (False, True):
        decoder = engine.decoder(mode, adaptive=False)
        if drafter_ignores_aside:  # as before: it drafts every step, the step drops them
            propose = decoder.proposer.propose
            decoder.proposer.propose = lambda batch, aside=frozenset(), p=propose: p(batch)
        decoder.add(requests[0])
        for _ in range(6):  # the first row's backlog grows before the others join
            decoder.step(aside)
        for r in requests[1:]:
            decoder.add(r)
        drafter = decoder.proposer.drafter
        passes, draft = [], drafter.draft
        drafter.draft = lambda *a, draft=draft: passes.append(draft(*a)) or passes[-1]
        for _ in range(13):
            decoder.step(aside)
        set_aside = len(passes)
        decoder.step()
        runs.append((set_aside, passes[set_aside:], [s.gen.tokens for s in decoder.active]))
    (skipped, resumed, tokens), (every_step, once, want_tokens) = runs
    block = engine.loaded.block_size
    assert skipped == 0 and every_step == 13
    assert len(resumed) == -(-20 // block) and len(once) == 1  # 19 missed + this step's
    assert resumed[-1][1].tolist() == once[0][1].tolist()
    torch.testing.assert_close(resumed[-1][0], once[0][0], atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
