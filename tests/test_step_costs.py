"""Step costs measured at build time: the fit, the draft-count rule, and `--backend auto`
picking the backend it measured fastest."""

import json

import pytest

import build_engine
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.cli import run
from runtime.step_costs import (AcceptanceRecord, HybridChoice, StepCosts, VerifyTable, _fit,
                                choose_draft_count, fixed_costs)


def test_fit_recovers_a_cost_that_is_linear_in_tokens_and_context():
    a, b, c, d = 0.02, 0.003, 1e-6, 4e-7
    rows = [(1.0, n, ctx, n * ctx) for ctx in (256, 2048) for n in (1, 2, 4, 8)]
    times = [a + b * n + c * ctx + d * n * ctx for _, n, ctx, _ in rows]
    assert _fit(rows, times) == pytest.approx((a, b, c, d), rel=1e-4, abs=1e-9)



# the default SmolLM2 target on the torch backend, 2 cores (seconds), before few_rows_linear
# (runtime/models/layers.py): a 1-token pass ran on a faster kernel than any wider one, and 3
# tokens cost more than 4
TORCH_TABLE = VerifyTable((512, 4096), (1, 2, 3, 4, 8),
                          ((0.058, 0.087, 0.098, 0.079, 0.079), (0.076, 0.113, 0.137, 0.109, 0.117)))


def test_the_table_prices_what_was_measured_and_lines_between_and_beyond():
    costs = StepCosts(_fit([(1.0, n, c, n * c) for c in (512, 4096) for n in (1, 2, 3, 4, 8)],
                           [t for row in TORCH_TABLE.seconds for t in row]), (0.016, 0.0), TORCH_TABLE)
    assert costs.verify_seconds(1, 4096) == pytest.approx(0.076)
    assert costs.verify_seconds(3, 512) == pytest.approx(0.098)
    assert costs.verify_seconds(6, 4096) == pytest.approx((0.109 + 0.117) / 2)  # between sizes
    assert costs.verify_seconds(1, 2304) == pytest.approx((0.058 + 0.076) / 2)  # between contexts
    assert costs.verify_seconds(1, 7680) == pytest.approx(0.076 + (0.076 - 0.058))  # past the last
    assert costs.verify_seconds(16, 4096) == pytest.approx(0.117 + 2 * (0.117 - 0.109))
    assert StepCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    old = {"verify": list(costs.verify), "draft": [0.016, 0.0]}  # an engine from before the table
    assert StepCosts.from_dict(old).table is None


def test_a_drafter_that_loses_on_the_measured_table_sits_out_where_the_fit_kept_it():
    """make demo's frozen drafter at 4,096 tokens accepted about 0.22 drafts a step, verifying
    one or two: priced by the line fitted through the torch table, its step (16 ms + a
    2-3 token verify) looked as fast as a plain one and it kept drafting (0.84x target-only);
    priced by the table it sits out."""
    rows = [(1.0, n, c, n * c) for c in TORCH_TABLE.contexts for n in TORCH_TABLE.sizes]
    fit = _fit(rows, [t for row in TORCH_TABLE.seconds for t in row])
    by_fit = HybridChoice(StepCosts(fit, (0.016, 0.0)))
    by_table = HybridChoice(StepCosts(fit, (0.016, 0.0), TORCH_TABLE))
    for step in range(40):
        for choice in (by_fit, by_table):
            choice.update(True, verified=1 + step % 2, accepted=int(step % 9 < 2), context=4096)
    assert by_fit.use_drafter(4096)
    assert not by_table.use_drafter(4096)


def test_each_drafter_step_is_priced_at_the_width_it_verified():
    """SharpDraft at 4,096 tokens on the torch table: steps that verify 7 drafts (8 tokens,
    117 ms) and accept 2, between steps whose drafts were all cut (1 token, 76 ms). The
    record holds each step's cost at its own width (the mean of 1.68 and 1.14 plain steps,
    the 11 ms draft included), not the mean width's; 2 tokens a step for 1.41 plain steps
    pays, so the drafter keeps drafting."""
    choice = HybridChoice(StepCosts((0.0, 0.0, 0.0, 0.0), (0.011, 0.0), TORCH_TABLE))
    for step in range(40):
        wide = step % 2 == 0
        choice.update(True, verified=7 if wide else 0, accepted=2 if wide else 0, context=4096)
    assert choice.cost / choice.steps == pytest.approx(
        ((0.011 + 0.117) / 0.076 + (0.011 + 0.076) / 0.076) / 2, rel=0.02)
    assert choice.use_drafter(4096)

@pytest.mark.parametrize("confidence, verify, expected", [
    ([0.9, 0.9, 0.9], (1.0, 0.0, 0.0, 0.0), 3),  # verifying is free: take every draft
    ([0.9, 0.9, 0.9], (0.0, 10.0, 0.0, 0.0), 0),  # each token costs a whole step: none
    ([0.9, 0.1, 0.9], (1.0, 0.2, 0.0, 0.0), 1),  # 1.9/1.4 = 1.36 beats 1.99/1.6 and 2.07/1.8
    ([0.0, 1.0], (1.0, 0.0, 0.0, 0.0), 0),  # a sure rejection first: the rest cannot land
])
def test_draft_count_maximises_expected_tokens_per_second(confidence, verify, expected):
    assert choose_draft_count(confidence, 100, StepCosts(verify, (0.0, 0.0))) == expected


def test_a_confidently_wrong_drafter_stops_being_verified_then_is_retested():
    """Confidence 0.9 but every first draft rejected: within a few steps the record scales
    it down until verifying drafts no longer pays; positions never tested keep their raw
    confidence, a drafter as good as its word keeps it, and counts fade, so steps that
    verify nothing bring the written-off drafter back to a retest."""
    costs = StepCosts((1.0, 0.5, 0.0, 0.0), (0.0, 0.0))
    wrong, right = AcceptanceRecord(), AcceptanceRecord(forget=1.0)
    assert choose_draft_count(wrong.calibrate([0.9, 0.9]), 100, costs) == 2
    for _ in range(6):
        wrong.update([0.9, 0.9], verified=2, accepted=0)  # draft 2 never tested
        right.update([0.5, 0.5], verified=2, accepted=1)  # draft 1 accepted, draft 2 not
        right.update([0.5, 0.5], verified=2, accepted=0)
    seen = 0.9 * sum(0.9 ** i for i in range(6))
    assert wrong.predicted == [pytest.approx(seen)] and wrong.accepted == [0.0]
    assert wrong.calibrate([0.9, 0.9]) == [pytest.approx(0.9 * 2 / (seen + 2)), 0.9]
    assert choose_draft_count(wrong.calibrate([0.9, 0.9]), 100, costs) == 0
    assert right.calibrate([0.5, 0.5]) == pytest.approx([0.5, 0.5 * 2 / 5])  # 6 of 12; 0 of 6
    for _ in range(20):
        wrong.update([0.9, 0.9], verified=0, accepted=0)
    assert choose_draft_count(wrong.calibrate([0.9, 0.9]), 100, costs) >= 1


# the default engine's measured ONNX Runtime costs (seconds), as engine.json keeps them
ENGINE_COSTS = StepCosts((0.027, 0.0016, 3.7e-6, 6.35e-7), (0.0034, 5e-7))


def test_hybrid_choice_drops_a_drafter_that_does_not_pay_and_retries_it_later():
    """Priced as the default engine at 7,680 tokens of context (a 1-token decode 62 ms, the
    drafter's step 7 ms plus a wider verify): a drafter accepting 0.25 drafts a step loses
    to a plain decode step, one accepting 1.5 wins; lookup steps teach nothing about it,
    and a drafter left alone fades back toward the prior and is tried again."""
    costs = ENGINE_COSTS
    context = 7680
    poor, good = HybridChoice(costs), HybridChoice(costs)
    assert poor.use_drafter(context)  # the prior: a drafter worth a try
    for step in range(30):
        poor.update(True, verified=2, accepted=int(step % 4 == 0), context=context)
        good.update(True, verified=3, accepted=1 + step % 2, context=context)
    assert not poor.use_drafter(context)
    assert good.use_drafter(context)
    for _ in range(10):
        poor.update(False, strong=False, offered=4, verified=4, accepted=3)
    assert not poor.use_drafter(context)
    for _ in range(40):
        poor.update(False)  # plain decode steps
    assert not poor.use_drafter(context)  # a retry costs: not at every fade
    for _ in range(40):
        poor.update(False)
    assert poor.use_drafter(context)


def test_hybrid_choice_prices_the_context():
    """The same outcomes: at 512 tokens the drafter's step costs little next to a decode
    step and pays; at 7,680 its wider verify costs more than its drafts bring."""
    for context, pays in ((512, True), (7680, False)):
        choice = HybridChoice(ENGINE_COSTS)
        for _ in range(30):
            choice.update(True, verified=4, accepted=0, context=context)
            choice.update(True, verified=4, accepted=1, context=context)
        assert choice.use_drafter(context) is pays


def test_hybrid_choice_verifies_the_lookup_drafts_that_land():
    """Lookup drafts are one-hot (confidence 1): at first every offered draft is verified;
    once 2+-token matches have landed their first draft and missed their second for a
    while, only the first is (positions never tested take the last tested one's rate);
    1-token matches keep their own record."""
    costs = ENGINE_COSTS
    choice = HybridChoice(costs)
    assert choice.lookup_drafts(4, strong=True, context=7680) == 4
    assert choice.lookup_drafts(0, strong=True, context=7680) == 0
    for _ in range(30):
        choice.update(False, strong=True, offered=4, verified=4, accepted=1)
    assert choice.lookup_drafts(4, strong=True, context=7680) == 1
    assert choice.lookup_drafts(4, strong=False, context=7680) == 4


def test_context_makes_long_verifies_dearer():
    costs = StepCosts((0.05, 0.01, 0.0, 1e-4), (0.0, 0.0))
    assert choose_draft_count([0.5] * 6, 10, costs) > choose_draft_count([0.5] * 6, 5000, costs)


@pytest.mark.slow  # exports the graphs and times both backends; --step-costs fixed: below
def test_auto_backend_is_the_fastest_measured(tiny_target, tiny_drafter, tmp_path):
    out = tmp_path / "auto"
    assert build_engine.main(["--sharpdraft", "--target", str(tiny_target), "--drafter-checkpoint",
                              str(tiny_drafter), "--backend", "auto", "--output", str(out)]) == 0
    manifest = json.loads((out / "engine.json").read_text())
    choice = manifest["extra"]["backend_choice"]
    assert set(choice["decode_ms"]) == {"torch", "onnxruntime"}
    assert manifest["backend"] == choice["picked"] == min(choice["decode_ms"], key=choice["decode_ms"].get)
    for backend in ("torch", "onnxruntime"):
        costs = StepCosts.from_dict(manifest["extra"]["step_costs"][backend])
        assert costs.verify_seconds(1, 64) > 0 and costs.draft_seconds(64) >= 0
        assert Engine(open_spec(out, backend=backend)).step_costs == costs
    # then every mode decoded on the picked backend: the fastest is the served default
    default = manifest["extra"]["default_mode"]
    assert default["backend"] == manifest["backend"]
    assert list(default["tokens_per_second"]) == [str(m) for m in Engine(open_spec(out)).spec.modes]
    assert Engine(open_spec(out)).spec.default_mode == default["mode"]


def test_the_drafter_step_is_timed_as_decoding_runs_it(tiny_engine, monkeypatch):
    """Each timed drafter step follows a target pass of DRAFTER_AFTER_VERIFY tokens (as in
    decoding, where the target's weights have just gone through the caches) and reads
    DRAFTER_ROWS rows of features; only the drafter step is inside the timer."""
    import time
    import types

    import runtime.step_costs as step_costs

    engine = Engine(open_spec(tiny_engine))
    drafter_type = type(engine.drafter(scaled=False))
    target_type = type(engine.loaded.batch_target())
    log, timing = [], []
    real_verify, real_draft = target_type.verify, drafter_type.draft

    def verify(self, rows):
        log.append(("verify", len(rows.row(0)), bool(timing)))
        return real_verify(self, rows)

    def draft(self, contexts, bonuses):
        log.append(("draft", contexts[0].shape[0], bool(timing)))
        return real_draft(self, contexts, bonuses)

    real_clock = time.perf_counter

    def clock():  # timer on at the first read of a pair, off at the second
        timing.append(1) if not timing else timing.clear()
        return real_clock()

    monkeypatch.setattr(target_type, "verify", verify)
    monkeypatch.setattr(drafter_type, "draft", draft)
    monkeypatch.setattr(step_costs, "time", types.SimpleNamespace(perf_counter=clock))
    costs = step_costs.measure(engine, contexts=(24,), sizes=(1, 2), repeats=3)
    assert costs.draft is not None
    drafts = [i for i, (kind, _, _) in enumerate(log) if kind == "draft"]
    timed = [i for i in drafts if log[i][2]]
    assert len(timed) == 3  # the repeats; the fill and warm-up steps are untimed
    for i in timed:
        assert log[i][1] == step_costs.DRAFTER_ROWS
        assert log[i - 1] == ("verify", step_costs.DRAFTER_AFTER_VERIFY, False)


def test_fixed_step_costs_time_nothing_and_verify_whole_blocks(tiny_engine, tiny_target, tiny_drafter,
                                                               tmp_path, monkeypatch, capsys):
    """build_engine.py --step-costs fixed (the tests' session engines): stage 5 times
    nothing, engine.json records fixed_costs, under which a drafter step verifies its whole
    block at any confidence; --backend auto, which picks by measured costs, refuses it."""
    manifest = json.loads((tiny_engine / "engine.json").read_text())
    assert manifest["extra"]["step_costs"] == {"torch": fixed_costs(True).to_dict() | {
        "backend": "torch", "device": "cpu", "dtype": "float32", "steps": None}}
    assert "default_mode" not in manifest["extra"]  # nor timed the modes: the rule's default
    assert choose_draft_count([0.01] * 7, 4000, Engine(open_spec(tiny_engine)).step_costs) == 7

    import runtime.step_costs

    def timed(*args, **kwargs):
        raise AssertionError("--step-costs fixed timed a step")

    monkeypatch.setattr(runtime.step_costs, "measure", timed)
    argv = ["--sharpdraft", "--target", str(tiny_target), "--drafter-checkpoint", str(tiny_drafter),
            "--step-costs", "fixed"]
    assert build_engine.main(argv + ["--backend", "torch", "--output", str(tmp_path / "e")]) == 0
    assert run(build_engine.main, argv + ["--backend", "auto", "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --backend auto picks the backend by measured step costs")


def test_the_rows_whose_verify_runs_faster_transposed_are_chosen_and_applied(tiny_engine, monkeypatch):
    """choose_transposed_rows times each row count's verify with F.linear and with weight
    @ x.T, interleaved, and keeps the row counts where the transposed pass is faster by
    more than TRANSPOSED_MARGIN; the models are left with that choice. Here a fake clock
    makes 2 and 3 rows 10% faster transposed and 5 rows 2% faster (noise: kept F.linear)."""
    import runtime.step_costs as step_costs
    from runtime.models.layers import FEW_ROWS, Linear

    engine = Engine(open_spec(tiny_engine))
    target = engine.loaded.batch_target()
    layer = next(m for m in engine.model.modules() if isinstance(m, Linear))
    width = []
    real_verify = type(target).verify

    def verify(self, rows):
        width.append(len(rows.row(0)))
        return real_verify(self, rows)

    def fake_seconds(step, repeats, before=None):
        step()
        n, transposed = width[-1], bool(layer.transposed_rows)
        return {2: 0.9, 3: 0.9, 5: 0.98}.get(n, 1.0) if transposed else 1.0

    monkeypatch.setattr(type(target), "verify", verify)
    monkeypatch.setattr(step_costs, "_fastest_seconds", fake_seconds)
    chosen = step_costs.choose_transposed_rows(engine, target, engine.tokenizer.vocab_size, 24, 2)
    assert chosen == (2, 3)
    assert set(width) == set(range(1, FEW_ROWS + 1))
    assert {m.transposed_rows for m in engine.drafter_model.modules() if isinstance(m, Linear)} == {frozenset({2, 3})}
    assert StepCosts.from_dict(StepCosts((1.0, 0, 0, 0), None, None, chosen).to_dict()).transposed_rows == (2, 3)


def test_models_that_would_not_take_the_transposed_path_keep_f_linear(tiny_engine):
    """bfloat16 (row-invariant linear layers) is not timed: () and nothing applied."""
    from runtime.step_costs import choose_transposed_rows

    engine = Engine(open_spec(tiny_engine, dtype="bfloat16"))
    target = engine.loaded.batch_target()
    assert choose_transposed_rows(engine, target, engine.tokenizer.vocab_size, 24, 1) == ()
    assert not any(getattr(m, "transposed_rows", None) for m in engine.model.modules())
