"""The field's clients against vLLM serving a SharpDraft engine: `python -m runtime
vllm-serve` (the plugin proven first) on loopback, then guidellm (in its own venv, as
scripts/field_clients.py installs it) and the `openai` client, unchanged, with vLLM's own
speculative-decoding counters read from its /metrics before and after (MAL = 1 + accepted /
drafts, as AIPerf computes it).

    .venv/bin/python -m scripts.vllm_clients [--engine-dir engines/dflash-sharpdraft-vllm] \
        [--requests 12] [--concurrency 4] [--out results/vllm/clients]

Writes OUT/summary.json (and guidellm's report); exit 1 with one line when a client fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.serve.launch import free_ports
from scripts import field_clients as fc

ROOT = Path(__file__).resolve().parent.parent
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")


def counters(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    values = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(fc.scrape(base + "/metrics")):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


def delta(before: dict, after: dict) -> dict:
    drafts, tokens, accepted = (after[n] - before[n] for n in COUNTERS)
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else None}


def start(engine_dir: Path, port: int, name: str, logs: Path) -> tuple[subprocess.Popen, dict]:
    """vllm-serve, waited for until it prints its proof and 'serving'."""
    err = logs / "vllm-serve.err"
    with open(err, "w") as stream:
        server = subprocess.Popen([sys.executable, "-m", "runtime", "vllm-serve", "--engine-dir", str(engine_dir),
                                   "--port", str(port), "--served-model-name", name, "--log",
                                   str(logs / "vllm.log")], cwd=ROOT, stderr=stream, start_new_session=True)
    deadline = time.monotonic() + 900
    while "serving " not in err.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise fc.ToolFailed(f"vllm-serve did not start: {(err.read_text().strip().splitlines() or ['?'])[-1]}")
        time.sleep(1)
    applied = next(json.loads(line) for line in err.read_text().splitlines() if "sharpdraft_applied" in line)
    return server, applied["sharpdraft_applied"]


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(90)


def openai_client(base: str, name: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    text = (ROOT / "runtime" / "decode.py").read_text()[:2000]
    done = client.completions.create(model=name, prompt=text, max_tokens=32, temperature=0)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Write a haiku."}],
                                          max_tokens=16, temperature=0)
    return {"completion_tokens": done.usage.completion_tokens, "chat_tokens": chat.usage.completion_tokens,
            "ok": done.usage.completion_tokens == 32 and bool(chat.choices[0].message.content)}


def guidellm(base: str, name: str, tokenizer: Path, out: Path, requests: int, concurrency: int) -> dict:
    report = out / "guidellm-completions.json"
    cmd = [fc.venv_python("guidellm"), *fc.CLIENTS["guidellm"][2], "run",
           "--backend", f"kind=openai_http,target={base},model={name},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={concurrency}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--data", f"kind=synthetic_text,prompt_tokens={fc.PROMPT_TOKENS},output_tokens={fc.OUTPUT_TOKENS}",
           "--output", f"kind=json,path={report}"]
    fc.run_tool(cmd, out, "guidellm-completions", fc.clean_env(HF_HUB_OFFLINE="1"), cwd=out)
    bench = json.loads(report.read_text())["benchmarks"][0]
    return {kind: len(bench["requests"][kind]) for kind in ("successful", "errored", "incomplete")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "dflash-sharpdraft-vllm")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "vllm" / "clients")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fc.install("guidellm", logs)
    work = Path(tempfile.mkdtemp(prefix="vllm-clients-"))
    tokenizer = fc.write_tokenizer(args.engine_dir, work / "tokenizer")
    port, = free_ports(1)
    name, base = "sharpdraft", f"http://127.0.0.1:{port}"
    summary = {"engine": str(args.engine_dir), "requests": args.requests, "concurrency": args.concurrency}
    try:
        server, summary["sharpdraft_applied"] = start(args.engine_dir.resolve(), port, name, logs)
        try:
            before = counters(base)
            summary["openai"] = openai_client(base, name)
            summary["guidellm"] = guidellm(base, name, tokenizer, out, args.requests, args.concurrency)
            summary["vllm_counters"] = delta(before, counters(base))
        finally:
            stop(server)
    except fc.ToolFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = (summary["openai"]["ok"] and summary["guidellm"]["errored"] == 0
          and summary["guidellm"]["successful"] == args.requests and summary["vllm_counters"]["drafts"] > 0)
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("openai", "guidellm", "vllm_counters", "ok")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
