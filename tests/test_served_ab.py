"""scripts/served_ab.py: the per-arm medians it reports, and an arm whose server does not
start (run by the arm's own checkout and interpreter: ServeProcess's root and python)
ending the A/B in one line."""

import json
from pathlib import Path

from runtime.cli import run
from script_loader import load_script

REPO = Path(__file__).resolve().parent.parent


def _script():
    return load_script("served_ab")


def _round(arm, default, target):
    level = lambda tok_s: {"tokens_per_second": tok_s}
    return {"arm": arm, "commit": arm + "-c", "token_mismatches": 0,
            "runs": {"default": {"1": level(default[0]), "8": level(default[1])},
                     "target": {"1": level(target[0]), "8": level(target[1])}}}


def test_summary_takes_medians_over_rounds_per_arm():
    rounds = [_round("a", (10, 20), (5, 10)), _round("b", (10, 15), (5, 5)),
              _round("a", (12, 18), (6, 6)), _round("a", (8, 40), (4, 12)),
              _round("b", (20, 20), (5, 5))]
    summary = _script().summary(rounds, [1, 8])
    assert summary["a"]["default"] == {"tokens_per_second": {"1": 10, "8": 20},
                                       "c8_over_c1": 2.0}  # ratios 2.0, 1.5, 5.0
    assert summary["a"]["target"]["c8_over_c1"] == 2.0  # 2.0, 1.0, 3.0
    assert summary["b"]["default"] == {"tokens_per_second": {"1": 15, "8": 17.5},
                                       "c8_over_c1": 1.25}
    assert summary["b"]["commit"] == "b-c" and summary["a"]["token_mismatches"] == 0


def test_an_arm_whose_server_does_not_start_ends_the_ab_in_one_line(tmp_path, capsys):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine.json").write_text(json.dumps({"not": "an engine"}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    code = run(_script().main, ["--arm", f"here={REPO}", "--engine-dir", str(engine),
                                "--prompts-file", str(prompts), "--rounds", "1",
                                "--out", str(tmp_path / "ab.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[0] == f"round 1: here ({REPO})"  # progress, then one error line
    assert len(err) == 2 and err[1].startswith(f"error: the {REPO} server did not start")
    assert "see /tmp/" in err[1]
    assert not (tmp_path / "ab.json").exists()


def test_arm_flags_reach_that_arms_server_and_its_in_process_check(tmp_path, monkeypatch):
    """--arm-flags NAME=FLAGS: one checkout served two ways. The flags go to that arm's
    serve and to loadtest's in-process reference (so it loads the engine as the server
    does), and to no other arm."""
    script = _script()
    served, commands = {}, []

    class Server:
        grpc_port, metrics_port = 1, 2

        def stop(self, grace):
            pass

    def start_server(code, engine_dir, repo, log, flags=()):
        served[repo.name.split("-")[-2]] = list(flags)
        return Server()

    real_run = script.subprocess.run

    def fake_run(command, **kwargs):
        if "loadtest" not in command:  # git, for the arm's commit
            return real_run(command, **kwargs)
        commands.append(command)
        levels = [{"concurrency": int(c), "tokens_per_second": 1.0}
                  for c in command[command.index("--concurrency") + 1:command.index("--requests")]]
        return type("Done", (), {"returncode": 0, "stdout": json.dumps(
            {"levels": levels, "token_mismatches": 0}), "stderr": ""})()

    monkeypatch.setattr(script, "start_server", start_server)
    monkeypatch.setattr(script, "get", lambda url: "")
    monkeypatch.setattr(script.subprocess, "run", fake_run)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine.json").write_text("{}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    assert script.main(["--arm", f"plain={REPO}", "--arm", f"bf16={REPO}",
                        "--arm-flags", "bf16=--prefill-dtype bfloat16", "--engine-dir", str(engine),
                        "--prompts-file", str(prompts), "--rounds", "1",
                        "--out", str(tmp_path / "ab.json")]) == 0
    assert served == {"plain": [], "bf16": ["--prefill-dtype", "bfloat16"]}
    checks = [c for c in commands if "--engine-dir" in c]
    assert len(checks) == 2  # one in-process check per arm
    assert "--prefill-dtype" not in checks[0] and checks[1][-2:] == ["--prefill-dtype", "bfloat16"]
    assert json.loads((tmp_path / "ab.json").read_text())["arm_flags"] == {
        "bf16": ["--prefill-dtype", "bfloat16"]}
