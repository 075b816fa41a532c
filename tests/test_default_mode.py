"""The engine's measured default mode (runtime/commands/default_mode.py): `python -m runtime
default-mode` times every mode the engine lists and records the fastest in engine.json;
served requests that name no mode run it, `generate` keeps the table's rule, and a
record the engine cannot use falls back to that rule."""

import json
import shutil

import numpy as np
import pytest

from runtime.__main__ import main
from runtime.cli import run
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.serve import openai_api, protocol


@pytest.fixture
def engine_copy(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    return copy


def _no_mode_request():
    return protocol.parse({"prompt": np.array([b"def f(n):"], dtype=object),
                           "max_new_tokens": np.array([4], dtype=np.int32)})


def test_default_mode_measures_every_listed_mode_and_requests_run_the_fastest(engine_copy, capsys):
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--context", "120",
                 "--new-tokens", "8", "--repeats", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    recorded = json.loads((engine_copy / "engine.json").read_text())["extra"]["default_mode"]
    assert printed == recorded
    engine = Engine(open_spec(engine_copy))
    assert list(recorded["tokens_per_second"]) == [str(m) for m in engine.spec.modes]
    speeds = recorded["tokens_per_second"]
    assert all(v > 0 for v in speeds.values()) and recorded["mode"] == max(speeds, key=speeds.get)
    assert (recorded["backend"], recorded["context"], recorded["new_tokens"]) == ("torch", 120, 8)
    assert engine.spec.default_mode == recorded["mode"]
    assert _no_mode_request().mode(engine) == recorded["mode"]
    # generate's default stays the table's rule; sharpdraft true/false still choose by it
    assert engine.spec.rule_default() == "sharpdraft"
    on = protocol.parse({"prompt": np.array([b"x"], dtype=object),
                         "max_new_tokens": np.array([4], dtype=np.int32),
                         "sharpdraft": np.array([True])})
    assert on.mode(engine) == "sharpdraft"


def test_dry_run_changes_nothing(engine_copy, capsys):
    before = (engine_copy / "engine.json").read_text()
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--context", "60",
                 "--new-tokens", "4", "--repeats", "1", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"]
    assert (engine_copy / "engine.json").read_text() == before


def test_default_mode_measures_on_ones_own_prompts(engine_copy, tmp_path, capsys, monkeypatch):
    """--prompts-file: every mode decodes each prompt of the file (one stream), and the
    loaded batch's rows are those prompts in turn; the record names the file."""
    from runtime import measure

    texts = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n\n\ndef main(",
             "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"]
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    decoded, joined = [], []
    real_one, real_loaded = measure.decode_from_one_prefill, measure.measure_loaded
    monkeypatch.setattr(measure, "decode_from_one_prefill",
                        lambda engine, prompt, *a, **k: decoded.append(prompt) or real_one(engine, prompt, *a, **k))
    monkeypatch.setattr(measure, "measure_loaded",
                        lambda engine, rows, *a, **k: joined.append(rows) or real_loaded(engine, rows, *a, **k))
    assert main(["default-mode", "--engine-dir", str(engine_copy), "--prompts-file", str(path),
                 "--new-tokens", "6", "--repeats", "1", "--loaded-batch", "2", "--dry-run"]) == 0
    recorded = json.loads(capsys.readouterr().out)
    engine = Engine(open_spec(engine_copy))
    ids = [engine.encode(t) for t in texts]
    assert decoded == [ids[0]] + ids  # the warm-up, then each prompt
    assert joined == [ids]
    assert (recorded["document"], recorded["prompts"]) == (str(path), 3)
    assert recorded["context"] == sorted(map(len, ids))[1]
    assert list(recorded["tokens_per_second"]) == [str(m) for m in engine.spec.modes]
    assert recorded["by_batch"]["2"]["context"] == recorded["context"]


@pytest.mark.parametrize("record, expected", [
    ({"mode": "hybrid", "backend": "torch"}, "hybrid"),
    ({"mode": "hybrid", "backend": "onnxruntime"}, "sharpdraft"),  # measured on another backend
    ({"mode": "window", "backend": "torch"}, "sharpdraft"),  # a mode this engine cannot run
    ({"mode": "hybrid", "backend": "torch", "device": "cuda"}, "sharpdraft"),  # on a GPU
    ({"mode": "hybrid", "backend": "torch", "dtype": "bfloat16"}, "sharpdraft"),  # another dtype
    ({"mode": "hybrid", "backend": "torch", "steps": "inductor"}, "sharpdraft"),  # compiled steps
    (None, "sharpdraft"),  # built before the default was measured
])
def test_a_recorded_default_the_engine_cannot_use_falls_back_to_the_rule(engine_copy, record, expected):
    path = engine_copy / "engine.json"
    data = json.loads(path.read_text())
    data["extra"]["default_mode"] = record
    path.write_text(json.dumps(data))
    spec = open_spec(engine_copy)
    assert spec.default_mode == expected
    # the OpenAI endpoint's settings read the same spec, loading nothing, and name it too
    assert openai_api.Settings(spec, "m", "m-stream", "127.0.0.1:1", 64).default_mode == expected
    # ... and, opened as the engine is served, the default measured that way
    if record and len(record) > 2:
        served_as = {k: v for k, v in record.items() if k not in ("mode", "backend")}
        assert open_spec(engine_copy, record["backend"], **served_as).default_mode == "hybrid"


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--new-tokens", "600"], "leaves no room for a prompt and 600 new tokens"),
    (["--prompts-file", "/nonexistent.jsonl"], "prompt file /nonexistent.jsonl does not exist"),
])
def test_bad_default_mode_input_is_one_line(engine_copy, capsys, flags, message):
    code = run(main, ["default-mode", "--engine-dir", str(engine_copy)] + flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and err[-1].startswith("error: ")


def test_the_loaded_batch_reads_distinct_rows_and_prefers_target_only_on_a_near_tie():
    from runtime.measure import LOADED_CONTEXT, LOADED_MARGIN, loaded_choice, loaded_rows, loaded_sizes

    prompt = list(range(1000))
    rows = loaded_rows(prompt, 8)
    assert len(rows) == 8 and all(len(r) == LOADED_CONTEXT for r in rows)
    assert len({tuple(r) for r in rows}) == 8  # each row continues another point
    assert rows[0] == prompt[:LOADED_CONTEXT] and rows[-1] == prompt[-LOADED_CONTEXT:]
    assert loaded_rows(prompt[:100], 3) == [prompt[:100]] * 3  # shorter than a row: the prompt
    assert loaded_choice({"target": 100.0, "sharpdraft": 100.0 * LOADED_MARGIN - 0.1}) == "target"
    assert loaded_choice({"target": 100.0, "sharpdraft": 100.0 * LOADED_MARGIN + 0.1}) == "sharpdraft"
    assert loaded_choice({"target": 120.0, "ngram": 100.0}) == "target"
    assert loaded_choice({"ngram": 90.0, "sharpdraft": 95.0}) == "sharpdraft"  # no target listed
    # half the loaded batch and all of it: a batch of 4-7 rows runs the half's choice
    assert loaded_sizes(8) == [4, 8] and loaded_sizes(3) == [3] and loaded_sizes(1) == []
