"""A default for the load (runtime/modes.py: measured_default over by_batch): the build
times the modes at one stream and at a loaded batch, and a served request that names no
mode runs the fastest mode measured at the batch it joins -- tokens unchanged (every
mode is lossless), only the mode."""

import json
import shutil
import threading

import pytest

from runtime import modes
from runtime.__main__ import main
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.measure import loaded_choice
from runtime.sampling import Sampling
from runtime.serve.scheduler import StepScheduler
from test_scheduler import Outcome, prompts

LOADED = {"mode": "hybrid", "backend": "torch", "tokens_per_second": {},
          "by_batch": {"1": {"mode": "hybrid"}, "3": {"mode": "target"}}}


@pytest.fixture
def engine_copy(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    return copy


def _record(engine_dir, record):
    path = engine_dir / "engine.json"
    data = json.loads(path.read_text())
    data["extra"]["default_mode"] = record
    path.write_text(json.dumps(data))


def test_the_default_is_the_fastest_at_the_largest_measured_batch_not_above_the_load():
    runnable = (modes.Mode.TARGET, modes.Mode.SHARPDRAFT, modes.Mode.HYBRID)
    assert [modes.measured_default(LOADED, "torch", runnable, b) for b in (1, 2, 3, 8)] == \
        ["hybrid", "hybrid", "target", "target"]
    assert modes.measured_default(LOADED, "onnxruntime", runnable, 8) is None  # another backend
    old = {"mode": "hybrid", "backend": "torch"}  # recorded before by_batch: one stream only
    assert modes.measured_default(old, "torch", runnable, 8) == "hybrid"
    # a loaded choice this engine cannot run falls back to the rule, not to another entry
    assert modes.measured_default(LOADED, "torch", runnable[1:], 4) is None


def test_default_mode_records_one_stream_and_a_loaded_batch(engine_copy, capsys):
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--context", "60",
                 "--new-tokens", "6", "--repeats", "1", "--loaded-batch", "3"]) == 0
    recorded = json.loads((engine_copy / "engine.json").read_text())["extra"]["default_mode"]
    engine = Engine(open_spec(engine_copy))
    one, loaded = recorded["by_batch"]["1"], recorded["by_batch"]["3"]
    assert one["mode"] == recorded["mode"] and one["tokens_per_second"] == recorded["tokens_per_second"]
    assert list(loaded["tokens_per_second"]) == [str(m) for m in engine.spec.modes if not engine.spec.batch_refusal(m)]
    speeds = loaded["tokens_per_second"]
    assert all(v > 0 for v in speeds.values()) and loaded["mode"] == loaded_choice(speeds)
    assert engine.spec.default_mode_at(3) == loaded["mode"] and engine.spec.default_mode_at(1) == recorded["mode"]


def test_records_apply_only_where_they_were_measured(engine_copy, capsys):
    """Step costs and the default mode hold where they were timed (the build: the CPU, the
    engine's dtype, steps not compiled); the engine placed elsewhere (another dtype here,
    as a GPU or compiled steps would be) reads neither (whole blocks, the table's rule),
    and default-mode measured there records a default for that placement, beside the
    build's."""
    _record(engine_copy, LOADED)  # recorded before placements were kept: the build's
    as_built = Engine(open_spec(engine_copy))
    assert as_built.spec.placement == {"backend": "torch", "device": "cpu", "dtype": "float32", "steps": None}
    assert as_built.step_costs is not None and as_built.spec.default_mode_at(3) == "target"
    elsewhere = Engine(open_spec(engine_copy, dtype="bfloat16"))
    assert elsewhere.step_costs is None
    assert elsewhere.spec.default_mode_at(3) == elsewhere.spec.default_mode == elsewhere.spec.rule_default()
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--dtype", "bfloat16",
                 "--context", "40", "--new-tokens", "4", "--repeats", "1", "--loaded-batch", "1"]) == 0
    capsys.readouterr()
    extra = json.loads((engine_copy / "engine.json").read_text())["extra"]
    recorded = extra["default_mode"]
    assert recorded["dtype"] == "bfloat16" and recorded["device"] == "cpu"
    assert Engine(open_spec(engine_copy, dtype="bfloat16")).spec.default_mode == recorded["mode"]
    # one record per placement: the build's is kept beside it, and read where it applies
    assert extra["default_modes"] == [LOADED]
    assert Engine(open_spec(engine_copy)).spec.default_mode_at(3) == "target"
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--context", "40",
                 "--new-tokens", "4", "--repeats", "1", "--loaded-batch", "1"]) == 0
    capsys.readouterr()
    extra = json.loads((engine_copy / "engine.json").read_text())["extra"]
    assert extra["default_mode"]["dtype"] == "float32" and extra["default_modes"] == [recorded]


def test_a_request_naming_no_mode_runs_the_default_for_the_load_it_joins(engine_copy):
    _record(engine_copy, LOADED)
    engine = Engine(open_spec(engine_copy))
    scheduler = StepScheduler(engine, max_batch=4)
    alone, burst = Outcome(), [Outcome() for _ in range(3)]
    ids = prompts([12, 30, 7, 20])
    jobs = []
    try:
        jobs.append(alone.job(ids[0], 8, mode=None, stop_ids=engine.stop_ids))
        scheduler.submit(jobs[0])
        assert alone.finished.wait(120)
        with scheduler.wake:  # three at once: they join a batch of three
            for outcome, p in zip(burst, ids[1:]):
                jobs.append(outcome.job(p, 8, mode=None, stop_ids=engine.stop_ids))
                scheduler.submit(jobs[-1])
        assert all(o.finished.wait(120) for o in burst)
    finally:
        scheduler.close()
    assert [j.mode for j in jobs] == ["hybrid", "target", "target", "target"]
    for job, outcome in zip(jobs, [alone] + burst):
        assert outcome.error is None
        assert outcome.gen.tokens == engine.generate(job.prompt, 8, "sharpdraft").tokens  # lossless


def test_requests_join_the_running_default_batch_and_it_steps_aside_under_load(engine_copy,
                                                                               monkeypatch):
    """A request naming no mode joins the default batch while it runs (one batch, not a
    half batch per mode), and each of that batch's steps follows the load it runs at: at
    three rows the recorded default is target-only, so those steps verify no drafts --
    and every request still gets exactly the target's tokens."""
    from runtime.decode import Decoder, DraftKind

    _record(engine_copy, LOADED)
    engine = Engine(open_spec(engine_copy))
    steps, real_step = [], Decoder.step

    def recording(self, aside=frozenset()):
        steps.append((len(self.active), aside))
        return real_step(self, aside)

    monkeypatch.setattr(Decoder, "step", recording)
    scheduler = StepScheduler(engine, max_batch=4)
    first, burst = Outcome(), [Outcome() for _ in range(3)]
    ids = prompts([12, 30, 7, 20])
    jobs = [first.job(ids[0], 40, mode=None, stop_ids=engine.stop_ids)]
    on_tokens = jobs[0].on_tokens

    def join_while_running(new):  # the scheduler thread: the first request is running
        on_tokens(new)
        if len(first.streamed) == 2:
            for outcome, p in zip(burst, ids[1:]):
                jobs.append(outcome.job(p, 8, mode=None, stop_ids=engine.stop_ids))
                scheduler.submit(jobs[-1])

    jobs[0].on_tokens = join_while_running
    try:
        scheduler.submit(jobs[0])
        assert first.finished.wait(120) and all(o.finished.wait(120) for o in burst)
    finally:
        scheduler.close()
    assert [j.mode for j in jobs] == ["hybrid"] * 4  # the running batch's, not target's
    every = {DraftKind.GREEDY, DraftKind.SAMPLED, DraftKind.ONE_HOT}
    assert {a for rows, a in steps if rows >= 3} == {frozenset(every)}  # target at 3+ rows
    assert {a for rows, a in steps if rows < 3} == {frozenset()}  # hybrid drafts alone
    assert any(rows == 4 for rows, _ in steps)
    for job, outcome in zip(jobs, [first] + burst):
        assert outcome.error is None
        assert outcome.gen.tokens == engine.generate(job.prompt, job.max_new_tokens, "target").tokens
