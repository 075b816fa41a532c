"""`python -m runtime demo` (make demo's main job): its refusals, and a small run on the tiny
SharpDraft engine that decodes only the modes asked for."""

from runtime.__main__ import main as runtime_main
from runtime.cli import run


def test_a_missing_engine_is_one_line_naming_make_demo(tmp_path, capsys):
    assert run(runtime_main, ["demo", "--engine-dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "make demo" in err[0]


def test_modes_the_engine_does_not_run_are_one_line(tiny_engine, capsys):
    assert run(runtime_main, ["demo", "--engine-dir", str(tiny_engine), "--modes", "sharpdraft",
                              "no-such-mode"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--modes: no-such-mode not run by" in err[0]


def test_the_demo_decodes_target_only_and_the_modes_asked_for(tiny_engine, capsys):
    assert run(runtime_main, ["demo", "--engine-dir", str(tiny_engine), "--context", "96",
                              "--new-tokens", "6", "--repeats", "1", "--modes", "ngram",
                              "sharpdraft"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("same tokens"):out.index("first lines generated")]
    rows = [line.split()[0] for line in table.strip().splitlines()[1:]]
    assert rows[0] == "target" and len(rows) == 3
    assert all(line.rstrip().endswith(("yes", "-")) for line in table.strip().splitlines()[1:])
