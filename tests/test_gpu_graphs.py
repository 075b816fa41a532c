"""scripts/gpu_graphs.py, the first thing the GPU run does (a decode step captured as a
CUDA graph against eager), on CPU: the comparison itself runs over dynamo's eager backend
(the compiled stand-in a CPU has) and catches a step that differs; the capture part is
skipped as GPU-only, with its reason, and stated in the section's last line."""

import json

import pytest
import torch

from scripts import gpu_graphs


def test_the_compiled_decode_step_is_compared_with_eager_as_lengths_advance_in_place():
    result = gpu_graphs.compare_decode(torch.device("cpu"), torch.float32, "eager")
    assert result["passed"]
    widths = [c["width"] for c in result["calls"]]
    assert widths == [1] * gpu_graphs.DECODES + [gpu_graphs.VERIFY]
    lengths = [c["lengths"] for c in result["calls"]]
    assert lengths[0] == list(gpu_graphs.LENGTHS) and lengths[1] == [n + 1 for n in gpu_graphs.LENGTHS]
    assert all(set(c["max_abs_error"]) == {"logits", "features", "keys"} for c in result["calls"])


def test_a_compiled_step_that_differs_from_eager_fails(monkeypatch):
    """A step whose logits are off (as a graph replaying stale lengths would be) fails."""
    from runtime.backends.pytorch import compiled

    real = compiled.compile_step

    def off(step, static, device, backend="inductor"):
        made = real(step, static, device, backend)
        return lambda *args: (made(*args)[0] + 1e-2, made(*args)[1])

    monkeypatch.setattr(compiled, "compile_step", off)
    result = gpu_graphs.compare_decode(torch.device("cpu"), torch.float32, "eager")
    assert not result["passed"] and all(c["max_abs_error"]["logits"] >= 1e-2 for c in result["calls"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run, where capture is GPU-only")
def test_on_cpu_the_capture_is_named_gpu_only_and_the_section_passes(tmp_path, capsys):
    data = gpu_graphs.run(tmp_path, on_cpu=True)
    assert data["status"] == "passed"
    assert data["parts"]["dynamo_eager"]["status"] == "passed"
    assert data["skipped"] == {"cudagraph_decode": "GPU-only: capturing a decode step as a CUDA graph and "
                                                   "replaying it needs CUDA"}
    assert json.loads((tmp_path / "gpu_graphs.json").read_text())["skipped"] == data["skipped"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gpu_graphs: CUDA-graph capture of a decode step: skipped")
