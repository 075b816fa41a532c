"""The field's own clients against our server, unchanged (scripts/field_clients.py):
guidellm on both endpoints at concurrency 4, AIPerf with its server-metrics collection,
lm-evaluation-harness on a generate-until and a loglikelihood task. Slow: each client is
installed in its own venv under .cache/ on first use (minutes) and each run starts real
processes. The fast tier checks what they send against the same server shape
(tests/test_openai.py: guidellm's bodies, running usage, logprobs, echo, vLLM's
/metrics), and here the script's refusals."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "field_clients.py"


def test_the_script_refuses_a_missing_engine_and_an_unknown_tool_in_one_line(tmp_path):
    for args, message in ((["--engine-dir", str(tmp_path)], "has no engine.json"),
                          (["--tools", "wrk"], "unknown tool(s) wrk")):
        run = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr, run.stderr
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1


@pytest.mark.slow
def test_guidellm_aiperf_and_lm_eval_run_against_the_server_without_an_error(tiny_engine, tmp_path):
    """Every request of every tool succeeds (guidellm: 12 at concurrency 4 on each
    endpoint, streaming, its default bodies), and the acceptance length AIPerf computes
    from our vLLM-named counters is the server's own MAL over the steps that drafted."""
    out = tmp_path / "clients"
    run = subprocess.run([sys.executable, str(SCRIPT), "--engine-dir", str(tiny_engine), "--out", str(out)],
                         capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["server_exit"] == 0
    for endpoint in ("completions", "chat"):
        result = summary["guidellm"][endpoint]
        assert (result["successful"], result["errored"], result["incomplete"]) == (12, 0, 0)
        assert all(r["output_tokens"] == 32 for r in result["requests"])  # ignore_eos held the length
    aiperf = summary["aiperf"]["completions"]
    assert aiperf["successful"] == 12 and aiperf["errored"] == 0
    assert aiperf["acceptance_length"] == pytest.approx(aiperf["server"]["sharpdraft_mal_drafting"], abs=1e-9)
    assert aiperf["server"]["vllm_counters"]["drafts"] == aiperf["server"]["sharpdraft_counters"]["drafting_steps"] > 0
    for task in ("sharpdraft_generate", "sharpdraft_loglikelihood"):
        assert summary["lm_eval"][task]["successful"] == 4 and summary["lm_eval"][task]["errored"] == 0
