"""scripts/gpu_check.py's plumbing, on CPU: sections are modules with run(out_dir); a
missing one is skipped with a note, a failing one is recorded and the run goes on, each
one that ran leaves <section>.json with device, date and command."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def section(run):
    return types.SimpleNamespace(run=run)


def test_sections_run_in_order_keep_going_after_a_failure_and_skip_missing_ones(tmp_path, capsys):
    ran = []

    def raising(out_dir):
        ran.append("raising")
        raise RuntimeError("kernel mismatch\nsecond line")

    modules = {"a_raises": section(raising),
               "b_fails": section(lambda out_dir: ran.append("b") or {"passed": False, "host_us_per_call": 12}),
               "c_missing": None,
               "d_passes": section(lambda out_dir: ran.append("d") or {"passed": True, "graph_capture_passed": True})}
    statuses = gpu_check.run_sections(list(modules), tmp_path, device="H200", command="gpu_check.py",
                                      loader=modules.__getitem__)
    assert ran == ["raising", "b", "d"]
    assert [s["status"] for s in statuses.values()] == ["failed", "failed", "not run", "passed"]
    assert statuses["a_raises"]["reason"] == "RuntimeError: kernel mismatch"
    assert "does not exist yet" in statuses["c_missing"]["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_raises.json", "b_fails.json", "d_passes.json"]
    for name in ("a_raises", "b_fails", "d_passes"):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["device"] == "H200" and record["command"] == "gpu_check.py" and record["date"]
        assert record["status"] == statuses[name]["status"]
    assert json.loads((tmp_path / "d_passes.json").read_text())["graph_capture_passed"] is True
    assert json.loads((tmp_path / "b_fails.json").read_text())["host_us_per_call"] == 12
    assert "gpu_check FAILED (3 of 4 sections ran" in gpu_check.summary(statuses, 1.0)


def test_section_modules_in_scripts_expose_run():
    assert gpu_check.SECTIONS == ["gpu_kernel", "gpu_trtllm", "gpu_e2e"]
    kernel = gpu_check.load_section("gpu_kernel")
    assert callable(kernel.run)
    assert gpu_check.load_section("no_such_section") is None


def test_dry_run_on_cpu_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path / "gpu")],
                          capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "gpu_kernel: not run (dry run: would run)"
    assert lines[-1].startswith("gpu_check passed (0 of 3 sections ran")
    assert not (tmp_path / "gpu").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_gpu_check_without_cuda_exits_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=SCRIPT.parent.parent)
    assert done.returncode == 1
    assert done.stdout == "" and done.stderr.startswith("error: no CUDA device")
    assert done.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_the_version_check_names_test_files_and_tests_that_exist():
    """scripts/gpu_versions.sh runs named test files (and one named test) under the GPU
    machine's library versions: a rename here would make it run nothing of that file."""
    import re

    text = (SCRIPT.parent / "gpu_versions.sh").read_text()
    named = re.findall(r"tests/(test_\w+\.py)(?:::(\w+))?", text)
    assert len(named) >= 10
    for file, test in named:
        path = SCRIPT.parent.parent / "tests" / file
        assert path.is_file(), file
        assert not test or f"def {test}(" in path.read_text(), test
