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
    engine = Engine(engine_copy)
    one, loaded = recorded["by_batch"]["1"], recorded["by_batch"]["3"]
    assert one["mode"] == recorded["mode"] and one["tokens_per_second"] == recorded["tokens_per_second"]
    assert list(loaded["tokens_per_second"]) == [str(m) for m in engine.modes if not engine.batch_refusal(m)]
    speeds = loaded["tokens_per_second"]
    assert all(v > 0 for v in speeds.values()) and loaded["mode"] == max(speeds, key=speeds.get)
    assert engine.default_mode_at(3) == loaded["mode"] and engine.default_mode_at(1) == recorded["mode"]


def test_a_request_naming_no_mode_runs_the_default_for_the_load_it_joins(engine_copy):
    _record(engine_copy, LOADED)
    engine = Engine(engine_copy)
    scheduler = StepScheduler(engine, max_batch=4)
    alone, burst = Outcome(), [Outcome() for _ in range(3)]
    ids = prompts([12, 30, 7, 20])
    jobs = []
    try:
        jobs.append(alone.job(ids[0], 8, mode=None))
        scheduler.submit(jobs[0])
        assert alone.finished.wait(120)
        with scheduler.wake:  # three at once: they join a batch of three
            for outcome, p in zip(burst, ids[1:]):
                jobs.append(outcome.job(p, 8, mode=None))
                scheduler.submit(jobs[-1])
        assert all(o.finished.wait(120) for o in burst)
    finally:
        scheduler.close()
    assert [j.mode for j in jobs] == ["hybrid", "target", "target", "target"]
    for job, outcome in zip(jobs, [alone] + burst):
        assert outcome.error is None
        assert outcome.gen.tokens == engine.generate(job.ids, 8, "sharpdraft").tokens  # lossless
