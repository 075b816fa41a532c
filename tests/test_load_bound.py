"""scripts/load_bound.py on the tiny engine: the default mode one request at a time and
all in flight through the serving scheduler, and each peer mode the same two ways in the
same run, tokens identical everywhere (greedy); a peer the engine lacks is one error line;
the code that measured is named by its commit (runtime.cli.code_commit)."""

import json
import subprocess
from pathlib import Path

import pytest

from runtime.cli import code_commit
from script_loader import load_script

REPO = Path(__file__).resolve().parent.parent


def script():
    return load_script("load_bound")


def test_the_default_and_its_peers_are_measured_alike(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in ("def f(x):\n    return x", "import os\n" * 6)))
    out = tmp_path / "bound.json"
    assert script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--requests", "4", "--max-new-tokens", "6", "--concurrency", "2",
                          "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens_identical"] and set(report["peers"]) == {"target", "ngram"}
    for figures in [report] + list(report["peers"].values()):
        assert figures["c1"]["tokens"] == figures["c2"]["tokens"] == 24
        assert figures["c2"]["errors"] == [] and figures["throughput_ratio"] > 0
    assert set(report["default_speedup"]["ngram"]) == {"c1", "c2"}
    assert report["commit"] == code_commit()
    assert "round 1/1 target: c1" in capsys.readouterr().err


def test_code_commit_names_the_checkout_and_whether_it_differs():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                              "--untracked-files=no"], capture_output=True, text=True).stdout
    assert code_commit() == head.stdout.strip() + ("-dirty" if changed.strip() else "")


def test_repeats_interleave_the_modes_and_report_medians(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "def f(x):\n    return x"}) + "\n")
    out = tmp_path / "bound.json"
    assert script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--requests", "2", "--max-new-tokens", "4", "--concurrency", "2",
                          "--threads", "1", "--peers", "target", "--repeats", "3",
                          "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    err = capsys.readouterr().err.splitlines()
    order = [line.split(":")[0] for line in err if line.startswith("round")]
    assert order == [f"round {r}/3 {m}" for r in (1, 2, 3) for m in ("default", "target")]
    assert report["repeats"] == 3 and len(report["rounds"]) == 3 and report["tokens_identical"]
    walls = sorted(r["default"]["c2"]["wall_s"] for r in report["rounds"])
    assert report["c2"]["wall_s"] == walls[1] and report["c2"]["tokens"] == 8


def test_a_peer_the_engine_lacks_is_refused_in_one_line(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "x = 1"}) + "\n")
    code = script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--peers", "target", "warp", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --peers warp: not a mode")


def test_backend_and_dtype_are_chosen_and_recorded(tiny_engine, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "def f(x):\n    return x"}) + "\n")
    out = tmp_path / "bound.json"
    assert script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--requests", "2", "--max-new-tokens", "4", "--concurrency", "2",
                          "--threads", "1", "--peers", "--backend", "torch", "--dtype", "float32",
                          "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["backend"], report["dtype"]) == ("torch", "float32") and report["tokens_identical"]
    assert report["prefill_dtype"] == "float32"


def test_a_prefill_dtype_the_backend_cannot_run_is_refused_in_one_line(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "x = 1"}) + "\n")
    code = script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--prefill-dtype", "bfloat16", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"error: {tiny_engine}: the torch backend prefills in the engine's dtype")
    assert not (tmp_path / "b.json").exists()
