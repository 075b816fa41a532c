"""`python -m runtime report` shows results/gpu/*.json (scripts/gpu_check.py's sections)
when present, with device, date, command and the named figures; nothing when absent."""

import json

from runtime.commands import report


def test_gpu_section_lists_each_file_with_its_named_figures(tmp_path):
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "gpu_kernel.json").write_text(json.dumps(dict(
        section="gpu_kernel", device="NVIDIA H200", date="2026-12-05T10:00:00+00:00",
        command="python scripts/gpu_check.py", status="passed", graph_capture_passed=True,
        host_us_per_call={"op": 25.0}, single_launch_vs_split={"b1_q16_kv8k": 1.04},
        decode_vs_sdpa={"b1_q1_kv8k": 1.02}, correctness=[{"case": "x"}])))
    lines = report.gpu_section(tmp_path)
    text = "\n".join(lines)
    assert lines[0] == "## GPU runs (scripts/gpu_check.py)"
    assert "- device: NVIDIA H200" in text and "- date: 2026-12-05T10:00:00+00:00" in text
    assert "- command: `python scripts/gpu_check.py`" in text
    assert "- graph_capture_passed: True" in text and "- host_us_per_call: op 25.0" in text
    assert "- single_launch_vs_split: b1_q16_kv8k 1.04" in text and "- decode_vs_sdpa: b1_q1_kv8k 1.02" in text
    assert "correctness" not in text  # lists of rows stay in the file


def test_gpu_e2e_rows_are_a_table_with_their_notes(tmp_path):
    """scripts/gpu_e2e.py's rows (the issue's one row per measurement) are shown, each
    with mode, context, tok/s, MAL, host and GPU time, and what went wrong where it did."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    rows = [{"mode": "target", "context": 4096, "tok_s": 310.5, "mal": 1.0},
            {"mode": "hybrid", "context": 4096, "tok_s": 702.1, "mal": 3.41, "tokens_equal_target": True},
            {"mode": "transformers prompt lookup", "context": 8192, "error": "refused"},
            {"mode": "target decode (1 token), cudagraph", "context": 32768, "host_ms": 0.21,
             "gpu_ms": 9.87, "tok_s": None, "mal": None},
            {"mode": "sharpdraft", "context": 8192, "skipped": "section time budget spent"}]
    (gpu / "gpu_e2e.json").write_text(json.dumps(dict(
        section="gpu_e2e", device="NVIDIA H200", date="2026-12-05T10:00:00+00:00",
        command="python scripts/gpu_check.py", status="passed", rows=rows)))
    lines = report.gpu_section(tmp_path)
    assert "| mode | context | tok/s | MAL | host ms | GPU ms | note |" in lines
    assert "| target | 4096 | 310.5 | 1.0 |  |  |  |" in lines
    assert "| hybrid | 4096 | 702.1 | 3.41 |  |  | tokens = target-only's |" in lines
    assert "| transformers prompt lookup | 8192 |  |  |  |  | error: refused |" in lines
    assert "| target decode (1 token), cudagraph | 32768 |  |  | 0.21 | 9.87 |  |" in lines
    assert "| sharpdraft | 8192 |  |  |  |  | skipped: section time budget spent |" in lines


def test_no_gpu_folder_no_section(tmp_path):
    assert report.gpu_section(tmp_path) == []
