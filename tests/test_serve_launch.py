"""runtime/serve/launch.py, the one way the serving tests (tests/served.py) and
scripts/chunked_prefill_ab.py start `python -m runtime serve`, on its failure path (the
serving tests cover the path where the server comes up): a serve that exits before its
JSON line is reported with its exit status, and nothing is left running."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

from runtime.serve.launch import NotReady, ServeProcess, free_ports

REPO = Path(__file__).resolve().parent.parent


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_serve_that_exits_before_ready_reports_its_status_and_leaves_nothing(tmp_path):
    server = ServeProcess(tmp_path / "no-engine", tmp_path / "repo", stderr=subprocess.DEVNULL)
    with pytest.raises(NotReady) as caught:
        server.wait_ready(120)
    assert caught.value.code == 1 and str(caught.value) == "serve exited with 1 before ready"
    assert server.stop(5) == (1, [])


def test_the_chunked_prefill_script_stops_in_one_line_when_serve_does(tmp_path):
    spec = importlib.util.spec_from_file_location("chunked_prefill_ab", REPO / "scripts" / "chunked_prefill_ab.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit, match=r"^error: serve --prefill-chunk 128 exited with 1 before ready$"):
        script.main(["--engine-dir", str(tmp_path / "no-engine"), "--prompts-file", str(prompts),
                     "--out", str(tmp_path / "out.json"), "--requests", "1"])
