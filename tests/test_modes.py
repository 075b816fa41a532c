"""The modes table (runtime/modes.py): which combinations each family and backend run,
what each mode needs, refusals that name what would work, and the commands that read it
(generate --mode and its alias flags, bench's rows, build_engine.py's refusals)."""

import json

import pytest

from runtime import modes
from build.calibrate import main as calibrate_main
from runtime.__main__ import main
from runtime.cli import run
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.modes import Mode


def allowed(drafting, backend, scaled=True, window=True) -> set[str]:
    return {m.value for m in Mode if modes.refusal(m, drafting, backend, scaled, window) is None}


# Written out by hand from the rules the issue and docs/modes.md state, not derived.
@pytest.mark.parametrize("drafting, backend, scaled, window, expected", [
    ("block", "torch", True, True, {"target", "ngram", "frozen", "window", "preset", "sharpdraft",
                                    "hybrid", "frozen-hybrid", "window-hybrid"}),
    ("block", "torch", False, False, {"target", "ngram", "frozen", "frozen-hybrid"}),
    ("block", "onnxruntime", True, True, {"target", "ngram", "frozen", "window", "sharpdraft",
                                          "hybrid", "frozen-hybrid", "window-hybrid"}),
    ("block", "tensorrt", True, True, {"target", "ngram", "frozen", "sharpdraft", "hybrid",
                                       "frozen-hybrid"}),
    ("block", "trtllm", True, True, {"target", "frozen", "sharpdraft"}),
    ("chain", "onnxruntime", True, False, {"target", "ngram", "frozen", "sharpdraft"}),
    ("tree", "torch", True, False, {"target", "ngram", "frozen", "preset", "sharpdraft"}),
    (None, "torch", False, False, {"target", "ngram"}),
])
def test_the_table_allows_exactly_these_modes(drafting, backend, scaled, window, expected):
    assert allowed(drafting, backend, scaled, window) == expected


def test_each_mode_is_one_distinct_combination_of_its_parts():
    assert len({m.value for m in Mode}) == len(Mode)
    for mode in Mode:
        assert modes.find(mode.draft_source, mode.attention, mode.ngram_assist, mode.scaling) is mode
    # the alias flags compose: the frozen drafter's attention swapped for the window
    assert modes.find(modes.MODEL, modes.WINDOWED, ngram_assist=True) is Mode.WINDOW_HYBRID
    assert modes.find(modes.LOOKUP, ngram_assist=True) is None  # lookup assisting lookup: none


def test_the_predicates_split_the_modes_as_documented():
    assert {m.value for m in Mode if m.scaled} == {"preset", "sharpdraft", "hybrid"}
    assert {m.value for m in Mode if m.ngram_assist} == {"hybrid", "frozen-hybrid", "window-hybrid"}
    assert {m.value for m in Mode if m.study} == {"preset"}
    assert [m.value for m in modes.SCALED] == ["preset", "sharpdraft"]


@pytest.mark.parametrize("mode, drafting, backend, names", [
    (Mode.WINDOW, "block", "tensorrt", "--backend torch or onnxruntime"),
    (Mode.PRESET, "block", "onnxruntime", "--backend torch"),
    (Mode.FROZEN_HYBRID, "chain", "torch", "DFlash"),
    (Mode.HYBRID, "block", "trtllm", "TensorRT-LLM"),
    (Mode.FROZEN, None, "torch", "n-gram engine"),
])
def test_a_refusal_is_one_line_naming_what_would_work(mode, drafting, backend, names):
    why = modes.refusal(mode, drafting, backend, scaled=True, window=True)
    assert names in why and "\n" not in why


def test_batching_follows_the_table():
    """Every mode and family batches (one loop), so the refusal depends on the backend
    alone; only a backend that holds one target (TensorRT plans) does not batch."""
    assert modes.batch_refusal("onnxruntime") is None
    assert modes.batch_refusal("torch") is None
    assert "torch and onnxruntime" in modes.batch_refusal("tensorrt")


def test_the_backend_registries_are_the_table():
    from plugins.onnx import ATTENTION_FORMS
    from runtime.backends import BACKENDS, RUNNABLE_BACKENDS
    from runtime.manifest import DRAFTERS

    assert BACKENDS == ("torch", "onnxruntime", "tensorrt", "trtllm", "vllm")
    assert RUNNABLE_BACKENDS == ("torch", "onnxruntime", "tensorrt")  # trtllm: its own loop
    assert DRAFTERS == ("dflash", "eagle3", "ngram", "pard")
    for can in modes.BACKENDS.values():
        assert set(can.attention_forms) <= set(ATTENTION_FORMS)


def generate_argv(engine_dir, *flags) -> list[str]:
    return ["generate", "--engine-dir", str(engine_dir), "--prompt", "def add(a, b):\n    return",
            "--max-new-tokens", "12", "--ignore-eos", "--json", *flags]


@pytest.mark.parametrize("alias, mode", [
    ([], "sharpdraft"), (["--no-sharpdraft"], "frozen"), (["--target-only"], "target"),
    (["--ngram"], "ngram"), (["--hybrid"], "hybrid"),
])
def test_generate_mode_equals_its_alias_flag(tiny_engine, capsys, alias, mode):
    outputs = []
    for flags in (alias, ["--mode", mode]):
        assert run(main, generate_argv(tiny_engine, *flags)) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    by_alias, by_name = outputs
    assert by_alias["mode"] == by_name["mode"] == mode
    assert by_alias["tokens"] == by_name["tokens"] and len(by_name["tokens"]) == 12
    assert by_alias["verify_steps"] == by_name["verify_steps"]


def test_generate_refuses_a_mode_the_engine_cannot_run_in_one_line(tiny_engine, capsys):
    # the tiny drafter records no training length, so the engine has no draft window
    assert run(main, generate_argv(tiny_engine, "--mode", "window")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "cannot run 'window'" in err
    assert "it runs target, ngram, frozen, sharpdraft, hybrid, frozen-hybrid" in err
    assert run(main, generate_argv(tiny_engine, "--mode", "bogus")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "frozen-hybrid" in err  # argparse lists the table's names


def test_frozen_hybrid_is_lossless_and_verifies_lookups(tiny_engine):
    engine = Engine(open_spec(tiny_engine))
    assert Mode.FROZEN_HYBRID in engine.spec.modes
    # a prompt that repeats itself, so n-gram lookup finds proposals
    prompt = engine.encode("def f(x):\n    return x + 1\n" * 12)
    target = engine.generate(prompt, 24, Mode.TARGET, stop=False)
    frozen = engine.generate(prompt, 24, Mode.FROZEN, stop=False)
    assisted = engine.generate(prompt, 24, Mode.FROZEN_HYBRID, stop=False)
    assert assisted.tokens == frozen.tokens == target.tokens
    assert assisted.ngram_steps > 0
    assert set(assisted.beta_per_step) <= {1.0}  # its drafter steps run unscaled


def test_preset_runs_through_run_mode_on_torch(tiny_engine, capsys):
    engine = Engine(open_spec(tiny_engine))
    assert Mode.PRESET not in engine.spec.modes and engine.spec.refusal(Mode.PRESET) is None  # a study
    assert run(main, generate_argv(tiny_engine, "--mode", "preset")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sharpdraft"] == engine.spec.family_preset.to_dict() != engine.scaling.to_dict()
    target = engine.generate(engine.encode("def add(a, b):\n    return"), 12, Mode.TARGET,
                             stop=False)
    assert out["tokens"] == target.tokens


def test_bench_rows_and_styles_come_from_the_table():
    from runtime.commands import bench
    from runtime.commands.styles import STYLES

    drafting = [m for m in Mode if m != Mode.TARGET]
    assert list(STYLES) == list(Mode)  # every mode drawn, in the table's order
    assert list(bench.STYLE) == drafting
    assert bench.STYLE[Mode.FROZEN_HYBRID] == STYLES[Mode.FROZEN_HYBRID][:2]
    assert len({color for color, _ in bench.STYLE.values()}) == len(drafting)  # tell lines apart
    assert len({s.label for s in STYLES.values()}) == len({s.word for s in STYLES.values()}) == len(Mode)
    assert not hasattr(Mode.FROZEN, "color")  # presentation lives with the commands that draw
    assert bench.SCALED_MODES == modes.SCALED


def test_build_refuses_a_family_the_backend_cannot_draft_naming_the_ones_that_can(capsys):
    import build_engine

    with pytest.raises(Exception) as err:
        build_engine.refuse_family_on("pard", "tensorrt")
    assert "torch and onnxruntime" in str(err.value) and "--backend onnxruntime" in str(err.value)
    build_engine.refuse_family_on("dflash", "tensorrt")  # DFlash blocks build there
    build_engine.refuse_family_on("ngram", "tensorrt")  # no drafter model to refuse


def test_calibrate_refuses_an_engine_without_the_sharpdraft_mode_saying_why(tiny_target, tmp_path,
                                                                            capsys):
    import build_engine

    out = tmp_path / "ngram"
    assert build_engine.main(["--drafter", "ngram", "--target", str(tiny_target), "--backend",
                              "torch", "--step-costs", "fixed", "--output", str(out)]) == 0
    capsys.readouterr()
    assert run(calibrate_main, ["--engine-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to calibrate" in err and "n-gram engine" in err
