"""scripts/gpu_trtllm.py (the GPU section gpu_trtllm) on CPU: it imports without CUDA,
refuses without a device in one line, and its cases — run eagerly here instead of
captured — hold, and fail when the wrapper under test is wrong."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_trtllm.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_trtllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_the_section_refuses_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal is for machines without one")
    section = load()
    with pytest.raises(section.NoCuda) as exc:
        section.run(tmp_path)
    assert "\n" not in str(exc.value) and not any(tmp_path.iterdir())
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: gpu_trtllm needs a CUDA device")


def test_every_case_checks_the_scaled_query_eagerly_on_cpu():
    report = load().check("cpu", graphs=False)
    names = [c["case"] for c in report["cases"]]
    assert len(names) == 5 and any(n.startswith("apply_rope") for n in names)
    assert report["passed"], report
    assert all("not installed" in c["kernel"] or "installed" in c["kernel"] for c in report["cases"])


def test_a_wrong_count_fails_the_section(monkeypatch):
    """The section can fail: with the rope wrapper reading the stale host seq_lens (the old
    count), the apply_rope case must not pass; with a kernel wrapper off by one key, its case
    must not pass."""
    from plugins.trtllm import kernels, pins

    section = load()
    monkeypatch.setitem(pins.METADATA, "seq_lens_cuda", "seq_lens")  # what the old code read
    report = section.check("cpu", graphs=False)
    monkeypatch.undo()
    failed = [c["case"] for c in report["cases"] if not c["passed"]]
    assert len(failed) == 1 and "apply_rope" in failed[0], report
    original = kernels.visible_keys
    monkeypatch.setattr(kernels, "visible_keys", lambda *a: original(*a) + 1)
    report = section.check("cpu", graphs=False)
    kernel_cases = [c for c in report["cases"] if "apply_rope" not in c["case"]]
    assert len(kernel_cases) == 4 and not any(c["passed"] for c in kernel_cases), report


def test_a_counter_that_does_not_count_fails_the_section(monkeypatch):
    """Every kernel case checks that the device counter of scaled calls grows with each
    replay: with the counter's add turned off, those cases fail."""
    from plugins.trtllm import proof

    monkeypatch.setattr(proof.Tally, "add", lambda self, index, like: None)
    report = load().check("cpu", graphs=False)
    kernel_cases = [c for c in report["cases"] if "apply_rope" not in c["case"]]
    assert len(kernel_cases) == 4 and not any(c["passed"] for c in kernel_cases)
    assert all(c["replays_counted"] == 0 for c in kernel_cases)
