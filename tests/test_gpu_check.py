"""scripts/gpu_check.py, one call of the prepared GPU run, on CPU: each section in a process
of its own under its own timeout; a section that raises, is killed by its timeout (SIGTERM,
then SIGKILL) or crashes its process leaves every other section's file and its own partial
one; the call's summary and log are written whatever happens. And the rehearsal
(scripts/gpu_travel.py rehearse): the plan's calls run here in smoke mode, within the
GPU machine's limits."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_check, gpu_travel

REPO = Path(__file__).resolve().parent.parent

# A section's shape, in miniature: a record saved after its first part, then `END` (each
# test section ends its own way). The partial file is what must survive the ending.
SECTION = r"""
import os, signal, sys, time
from scripts import gpu_record
gpu_record.HANDLE_SIGTERM = True
out = sys.argv[sys.argv.index("--out") + 1]
record = gpu_record.SectionRecord(out, NAME, smoke=True)
record.part("first", lambda part: part.update(measured=42))
record.data["parts"]["second"] = {"status": "running"}
record.save()
END
"""
ENDINGS = {
    "passes": "record.part('second', lambda part: part.update(measured=7)); record.finish()",
    "raises": "raise RuntimeError('a CUDA error, say: illegal memory access')",
    "hangs": "time.sleep(600)",  # killed by its timeout: SIGTERM, its handler writes
    "ignores_sigterm": "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",  # SIGKILL
    "crashes": "os.abort()",  # the process dies without a word (SIGABRT)
}


def sections(timeout_s=60):
    return [(name, [sys.executable, "-c", SECTION.replace("NAME", repr(name)).replace("END", end)],
             timeout_s if name not in ("hangs", "ignores_sigterm") else 4)
            for name, end in ENDINGS.items()]


def test_a_section_that_raises_times_out_or_crashes_leaves_every_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_S", 2)
    order = ["hangs", "raises", "passes", "crashes", "ignores_sigterm"]
    planned = sorted(sections(), key=lambda s: order.index(s[0]))  # the killed one first
    results = gpu_check.run_sections(planned, tmp_path, env=gpu_check.section_env(None), echo=lambda line: None)
    assert list(results) == order
    status = {name: r["status"] for name, r in results.items()}
    assert status["passes"] == "passed" and results["passes"]["exit"] == 0
    assert status["hangs"] == "killed: SIGTERM (timeout)" and results["hangs"]["timed_out"]
    assert results["hangs"]["exit"] == 124  # its own handler's exit
    assert status["ignores_sigterm"].startswith("killed: timed out") and results["ignores_sigterm"]["exit"] == -9
    assert status["raises"] == "crashed: exit 1"
    assert status["crashes"] == "crashed: exit -6 (signal 6)"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([f"{n}.json" for n in order] + ["gpu_check.json", "gpu_check.log"])
    for name in order:  # every section's file, its first part's figures kept
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["parts"]["first"] == {"status": "passed", "measured": 42, "seconds": record["parts"]["first"]["seconds"]}
        assert record["status"] == status[name]
    assert json.loads((tmp_path / "passes.json").read_text())["parts"]["second"]["measured"] == 7
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in summary["sections"].items()} == status
    log = (tmp_path / "gpu_check.log").read_text()
    assert "RuntimeError: a CUDA error, say: illegal memory access" in log  # the traceback is kept


def test_a_section_that_dies_before_its_first_save_still_leaves_a_file(tmp_path):
    results = gpu_check.run_sections([("early", [sys.executable, "-c", "import os; os._exit(3)"], 30)],
                                     tmp_path, echo=lambda line: None)
    assert results["early"]["status"] == "crashed: exit 3"
    assert json.loads((tmp_path / "early.json").read_text())["status"] == "crashed: exit 3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_gpu_check_without_a_gpu_exits_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--call", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: no NVIDIA device") and done.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_the_plan_fits_the_machines_limits_and_every_call_does_gpu_work():
    plan = gpu_travel.plan(REPO)
    assert plan["problems"] == []
    assert plan["estimate_s"] <= gpu_travel.MAX_MACHINE_S == 600
    assert gpu_travel.BUDGET["machine_start"] == 120  # counted in the estimate
    for call in plan["calls"]:
        assert call["carry_bytes"] <= 64 * 2**20 and call["timeout_s"] <= 600
        assert set(call["sections"]) - gpu_travel.NOT_GPU
        assert call["command"] == f'python3 -m scripts.gpu_check --call {call["call"]} --out "$OUT"'
    # call 1 needs nothing carried before it; the real-target rows come last
    assert plan["calls"][0]["sections"] == ["gpu_kernel"] and plan["calls"][-1]["sections"][-1] == "gpu_e2e"
    names = [Path(c).name for call in plan["calls"] for c in call["carry"]]
    assert names[0] == "manifest.json" and len(names) == len(set(names))


def test_the_plan_names_a_broken_limit(monkeypatch):
    monkeypatch.setitem(gpu_travel.BUDGET, "gpu_e2e", 400)
    monkeypatch.setitem(gpu_travel.SECTIONS, "gpu_steps", ("scripts.gpu_steps", 700))
    problems = gpu_travel.plan(REPO)["problems"]
    assert any(p.startswith("estimated GPU machine time") and "over 600 s" in p for p in problems)
    assert any("call 2's timeout" in p for p in problems)


def test_files_back_names_each_broken_limit_of_the_tool(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}.json").write_text("{}")
    assert gpu_travel.files_back(tmp_path) == ([f"f{i}.json" for i in range(8)], [])
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.json").write_text("{}")
    (tmp_path / "bad name.txt").write_text("")
    _, broken = gpu_travel.files_back(tmp_path)
    assert any(b.startswith("10 files") for b in broken)
    assert any("3 folders down" in b for b in broken)
    assert any("'bad name.txt'" in b for b in broken)


def test_rehearsal_runs_the_plans_calls_on_cpu_within_the_limits(tmp_path):
    """The fast rehearsal: every call's command as the plan prints it, here, sections in
    smoke mode; the last line is the verdict."""
    done = subprocess.run([sys.executable, "scripts/gpu_travel.py", "rehearse", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.fullmatch(r"rehearsal: (\d+) calls, estimated GPU machine time (\d+) s, files back (\d+), "
                         r"limits ok", last)
    assert match, last
    calls, seconds, back = map(int, match.groups())
    assert calls == len(gpu_travel.CALL_SECTIONS) and seconds <= 600
    for call, names in enumerate(gpu_travel.CALL_SECTIONS, 1):
        out = tmp_path / f"call{call}"
        assert {f"{n}.json" for n in names} | {"gpu_check.json", "gpu_check.log"} <= {p.name for p in out.iterdir()}
        for name in names:
            assert json.loads((out / f"{name}.json").read_text())["smoke"] is True
    assert back == sum(len(list((tmp_path / f"call{c}").iterdir())) for c in range(1, calls + 1))


def test_the_version_check_names_test_files_and_tests_that_exist():
    """scripts/gpu_versions.sh runs named test files (and one named test) under the GPU
    machine's library versions: a rename here would make it run nothing of that file."""
    text = (REPO / "scripts" / "gpu_versions.sh").read_text()
    named = re.findall(r"tests/(test_\w+\.py)(?:::(\w+))?", text)
    assert len(named) >= 10
    for file, test in named:
        path = REPO / "tests" / file
        assert path.is_file(), file
        assert not test or f"def {test}(" in path.read_text(), test


def test_the_rehearsal_names_the_first_broken_limit_and_exits_1(tmp_path, monkeypatch):
    """A call whose command leaves nine files under $OUT (the tool returns eight) and no
    summary: the rehearsal's last line names it, exit 1."""
    fake = {"calls": [{"call": 1, "command": 'for i in 1 2 3 4 5 6 7 8 9; do echo {} > "$OUT/f$i.json"; done',
                       "carry": [], "sections": [], "carry_bytes": 1, "timeout_s": 30}],
            "estimate_s": 300, "problems": []}
    monkeypatch.setattr(gpu_travel, "plan", lambda repo: fake)
    lines = []
    assert gpu_travel.rehearse(tmp_path, echo=lines.append) == 1
    assert lines[-1] == ("rehearsal: 1 calls, estimated GPU machine time 300 s, files back 9, "
                         "broken: call 1: 9 files (at most 8 come back)")
    assert "broken: call 1 left no gpu_check.json" in lines
