"""The field's own clients against our served engine, unchanged, as a serving engineer
runs them against vLLM: guidellm (both OpenAI endpoints, streaming, its default request
bodies), NVIDIA's AIPerf (its server-metrics collection reading our vllm:spec_decode_*
counters) and lm-evaluation-harness (local-completions: a generate-until task and a
loglikelihood task, both from local jsonl files). Each client lives in its own venv under
.cache/ (heavy dependencies, never in requirements.txt); the server runs on free loopback
ports; the clients count tokens with a tokenizer directory written from the target (no
hub).

    .venv/bin/python scripts/field_clients.py [--engine-dir engines/dflash-sharpdraft] \
        [--out results/clients] [--requests 12] [--concurrency 4] [--tools "guidellm aiperf lm_eval"]

Writes OUT/<tool>/ (each tool's own summary and files) and OUT/summary.json: per run,
every request's success, the acceptance length the tool computed (AIPerf: from our
vLLM-named counters, 1 + accepted / drafts) and the server's own over the same run (its
sharpdraft_spec_* counters on Triton's metrics port, over the steps that drafted), which
must be equal. Exit status 1 if any request failed or they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (venv under .cache/, what pip installs, how the client is run). guidellm also
# gets the CPU torch the project pins (from the local wheel), not a CUDA build.
CLIENTS = {
    "guidellm": ("guidellm-venv", ["guidellm==0.8.1", "torch==2.13.0"], ["-m", "guidellm"]),
    "aiperf": ("aiperf-venv", ["aiperf==0.13.0"], ["-m", "aiperf"]),
    # its huggingface tokenizer backend needs transformers (not in lm_eval[api])
    "lm_eval": ("lmeval-venv", ["lm_eval[api]==0.4.13", "transformers==5.24.0"], ["-m", "lm_eval"]),
}
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 32  # guidellm's synthetic requests (FACTS.md) and AIPerf's


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def venv_python(name: str) -> Path:
    return ROOT / ".cache" / CLIENTS[name][0] / "bin" / "python"


def install(name: str, logs: Path) -> Path:
    """The client's venv, made and filled once (again when its pinned version is not the
    one installed)."""
    folder, packages, _ = CLIENTS[name]
    python = venv_python(name)
    package, version = packages[0].split("==")
    if python.exists():
        shown = subprocess.run([python, "-m", "pip", "show", package.split("[")[0]], capture_output=True, text=True)
        if f"Version: {version}" in shown.stdout:
            return python
    log(f"installing {packages[0]} into .cache/{folder} (log: {logs / f'install-{name}.log'})")
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(python.parent.parent)], check=True)
    with open(logs / f"install-{name}.log", "w") as out:
        subprocess.run([python, "-m", "pip", "install", *packages], stdout=out, stderr=subprocess.STDOUT, check=True)
    return python


def write_tokenizer(engine_dir: Path, out: Path) -> Path:
    """The target's tokenizer as a local directory every client loads (no hub)."""
    from runtime.engine import load_tokenizer
    from runtime.spec import open_spec

    load_tokenizer(open_spec(engine_dir, verify="skip").manifest.target_dir).save_pretrained(out)
    return out


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


class Counters:
    """Both views of the server's speculation over a run: vLLM's counters on the OpenAI
    endpoint's /metrics, and the sharpdraft_spec_* counters on Triton's metrics port."""

    VLLM = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")

    def __init__(self, front: str, triton: str):
        self.front, self.triton = front, triton
        self.before = self._read()

    def _read(self):
        from prometheus_client.parser import text_string_to_metric_families

        from runtime.metrics import read_speculation

        vllm = {name: 0.0 for name in self.VLLM}
        for family in text_string_to_metric_families(scrape(self.front)):
            for sample in family.samples:
                if sample.name in vllm:
                    vllm[sample.name] += sample.value
        return vllm, read_speculation(scrape(self.triton))

    def delta(self) -> dict:
        (vllm_before, spec_before), (vllm_after, spec_after) = self.before, self._read()
        drafts, draft_tokens, accepted = (vllm_after[n] - vllm_before[n] for n in self.VLLM)
        own = {k: sum(row[k] for row in spec_after.values()) - sum(row[k] for row in spec_before.values())
               for k in ("steps", "drafting_steps", "accepted_tokens", "draft_tokens")}
        return {"vllm_counters": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted},
                "vllm_acceptance_length": 1 + accepted / drafts if drafts else None,
                "sharpdraft_counters": own,
                # the server's own MAL over the steps that drafted, and over every step
                # (unrounded: they are compared with what the tools computed)
                "sharpdraft_mal_drafting": (own["accepted_tokens"] + own["drafting_steps"])
                / own["drafting_steps"] if own["drafting_steps"] else None,
                "sharpdraft_mal": (own["accepted_tokens"] + own["steps"]) / own["steps"] if own["steps"] else None}


class ToolFailed(RuntimeError):
    """A client exited non-zero: one line naming it and its log."""


def run_tool(cmd: list, out: Path, name: str, env: dict | None = None, cwd: Path | None = None) -> None:
    log(f"running {name}: {' '.join(map(str, cmd))}")
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as stream:
        code = subprocess.run(cmd, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    log(f"  {name} exited {code} after {time.perf_counter() - start:.0f} s")
    if code != 0:
        raise ToolFailed(f"{name} exited with {code}; see {out / f'{name}.log'}")


def clean_env(**extra) -> dict:
    """The caller's environment without its Python settings and hub switches: each tool
    says offline itself where it can load a local directory so (AIPerf cannot: offline, it
    takes the tokenizer directory for a hub name; a caller that ran runtime.cli in-process,
    as a test worker does, has HF_HUB_OFFLINE set)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} | extra


def guidellm(base: str, model: str, tokenizer: Path, out: Path, requests: int, concurrency: int) -> dict:
    """guidellm on each endpoint with its default bodies (FACTS.md has the command)."""
    runs = {}
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        tag = "chat" if "chat" in endpoint else "completions"
        report = out / f"guidellm-{tag}.json"
        cmd = [venv_python("guidellm"), *CLIENTS["guidellm"][2], "run",
               "--backend", f"kind=openai_http,target={base},model={model},request_format={endpoint}",
               "--profile", f"kind=concurrent,streams={concurrency}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--output", f"kind=json,path={report}"]
        counters = COUNTERS()
        run_tool(cmd, out, f"guidellm-{tag}", clean_env(HF_HUB_OFFLINE="1"), cwd=out)
        bench = json.loads(report.read_text())["benchmarks"][0]
        outcomes = [{"request_id": r["request_id"], "ok": kind == "successful",
                     "output_tokens": r.get("output_tokens")}
                    for kind in ("successful", "errored", "incomplete") for r in bench["requests"][kind]]
        runs[tag] = {"requests": outcomes, "successful": sum(o["ok"] for o in outcomes),
                     "errored": len(bench["requests"]["errored"]),
                     "incomplete": len(bench["requests"]["incomplete"]),
                     # guidellm computes no acceptance: the server's, over the same run
                     "acceptance_length": None, "server": counters.delta()}
    return runs


def aiperf(base: str, model: str, tokenizer: Path, out: Path, requests: int, concurrency: int) -> dict:
    """AIPerf on completions, streaming, output held at its length by ignore_eos; its
    server-metrics collection scrapes BASE/metrics (our vLLM-named counters) and its own
    report code turns them into the acceptance length."""
    artifacts = out / "aiperf"
    shutil.rmtree(artifacts, ignore_errors=True)
    cmd = [venv_python("aiperf"), *CLIENTS["aiperf"][2], "profile", "--url", base,
           "--endpoint-type", "completions", "--streaming", "--model-names", model,
           "--tokenizer", str(tokenizer), "--concurrency", str(concurrency),
           "--request-count", str(requests), "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--extra-inputs", '{"ignore_eos": true}',
           "--artifact-dir", str(artifacts), "--ui-type", "none"]
    counters = COUNTERS()
    # a local tokenizer path loads with no hub call; AIPerf's offline mode would look it
    # up in the hub cache instead, so it is not set
    run_tool(cmd, out, "aiperf", clean_env(), cwd=out)
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines() if line]
    outcomes = [{"request_id": r["metadata"].get("x_request_id"), "ok": not r.get("error"),
                 "output_tokens": r["metrics"].get("usage_completion_tokens", {}).get("value"),
                 "error": r.get("error")} for r in records]
    computed = subprocess.run(
        [venv_python("aiperf"), "-c", "import json, sys\n"
         "from aiperf.analysis.speed_bench_report import extract_accept_length, extract_accept_rate\n"
         "m = json.load(open(sys.argv[1]))\n"
         "print(json.dumps([extract_accept_length(m), extract_accept_rate(m)]))",
         str(artifacts / "server_metrics_export.json")], capture_output=True, text=True, check=True)
    length, rate = json.loads(computed.stdout)
    return {"completions": {"requests": outcomes, "successful": sum(o["ok"] for o in outcomes),
                            "errored": sum(not o["ok"] for o in outcomes),
                            "acceptance_length": length, "acceptance_rate": rate,
                            "server": counters.delta()}}


TASKS = {  # task -> (output type, its YAML beyond the data file); docs in DOCS
    "sharpdraft_generate": ("generate_until",
                            "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                            "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 16\n  do_sample: false\n"
                            "metric_list:\n  - metric: exact_match\n"),
    "sharpdraft_loglikelihood": ("multiple_choice",
                                 "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                                 "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"),
}
DOCS = [
    {"question": "def add(a, b):\n    return", "answer": " a + b", "choices": [" a + b", " print"], "label": 0},
    {"question": "The capital of France is", "answer": " Paris", "choices": [" Paris", " blue"], "label": 0},
    {"question": "1, 2, 3, 4,", "answer": " 5", "choices": [" 9", " 5"], "label": 1},
    {"question": "import numpy as", "answer": " np", "choices": [" np", " pd"], "label": 0},
]


def lm_eval(base: str, model: str, tokenizer: Path, out: Path, requests: int, concurrency: int) -> dict:
    """lm-evaluation-harness local-completions on two local tasks: one that generates
    (completions with stop sequences), one that scores (echo + logprobs: loglikelihood)."""
    tasks = out / "lm_eval_tasks"
    tasks.mkdir(exist_ok=True)
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, (kind, body) in TASKS.items():
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\n{body}")
    results = out / "lm_eval"
    shutil.rmtree(results, ignore_errors=True)
    args = (f"model={model},base_url={base}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer},tokenized_requests=False,num_concurrent={concurrency},max_retries=1")
    cmd = [venv_python("lm_eval"), *CLIENTS["lm_eval"][2], "--model", "local-completions",
           "--model_args", args, "--tasks", ",".join(TASKS), "--include_path", str(tasks),
           "--output_path", str(results), "--log_samples"]
    counters = COUNTERS()
    run_tool(cmd, out, "lm_eval", clean_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"), cwd=out)
    summary = json.loads(next(results.rglob("results_*.json")).read_text())
    runs = {}
    for name, (kind, _) in TASKS.items():
        samples = [json.loads(line) for path in results.rglob(f"samples_{name}_*.jsonl")
                   for line in path.read_text().splitlines() if line]
        outcomes = [{"doc_id": s["doc_id"], "ok": bool(s.get("resps")) and all(r for r in s["resps"])}
                    for s in samples]
        runs[name] = {"output_type": kind, "requests": outcomes, "successful": sum(o["ok"] for o in outcomes),
                      "errored": sum(not o["ok"] for o in outcomes), "results": summary["results"].get(name),
                      "acceptance_length": None}
    runs["server"] = counters.delta()
    return runs


TOOLS = {"guidellm": guidellm, "aiperf": aiperf, "lm_eval": lm_eval}
COUNTERS = None  # set by main: a Counters over this run's server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "dflash-sharpdraft")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "clients")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tools", default=" ".join(TOOLS))
    parser.add_argument("--serve-flags", default="", help="more flags for serve (one string)")
    args = parser.parse_args(argv)
    tools = args.tools.split()
    if unknown := [t for t in tools if t not in TOOLS]:
        print(f"error: unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    from runtime.manifest import MANIFEST

    if not (args.engine_dir / MANIFEST).is_file():
        print(f"error: {args.engine_dir} has no {MANIFEST} — build one first (make engine, or "
              "build_engine.py --drafter dflash --sharpdraft)", file=sys.stderr)
        return 2
    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        install(tool, logs)
    # what the run needs but is not a result: the tokenizer and the model repository
    work = Path(tempfile.mkdtemp(prefix="field-clients-"))
    tokenizer = write_tokenizer(args.engine_dir, work / "tokenizer")

    global COUNTERS
    from runtime.serve.launch import NotReady, ServeProcess, free_ports

    port, = free_ports(1)
    with open(logs / "serve.log", "w") as err:
        server = ServeProcess(args.engine_dir.resolve(), work / "repository", "--openai-port", str(port),
                              "--max-batch", str(args.concurrency), *args.serve_flags.split(), stderr=err)
    summary = {"engine": str(args.engine_dir), "requests": args.requests, "concurrency": args.concurrency}
    try:
        try:
            info = server.wait_ready(600)
        except NotReady as exc:
            print(f"error: the server did not start ({exc}); see {logs / 'serve.log'}", file=sys.stderr)
            return 1
        base, model = info["openai"].removesuffix("/v1"), info["models"][0]
        summary |= {"model": model, "default_mode": json.loads(scrape(info["openai"] + "/models"))["data"][0]
                    ["sharpdraft"]["default_mode"]}
        COUNTERS = lambda: Counters(base + "/metrics", info["metrics"])  # noqa: E731
        for tool in tools:
            summary[tool] = TOOLS[tool](base, model, tokenizer, out, args.requests, args.concurrency)
    except ToolFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        code, _ = server.stop(90)
        summary["server_exit"] = code
        shutil.rmtree(work, ignore_errors=True)
    ok = True
    for tool in tools:
        for run, result in summary[tool].items():
            if run == "server":
                continue
            ok &= result["errored"] == 0 and result["successful"] == len(result["requests"]) > 0
    aiperf_run = summary.get("aiperf", {}).get("completions")
    if aiperf_run:
        summary["aiperf_acceptance_equals_server_mal"] = (
            aiperf_run["acceptance_length"] is not None and
            abs(aiperf_run["acceptance_length"] - aiperf_run["server"]["sharpdraft_mal_drafting"]) < 1e-9)
        ok &= summary["aiperf_acceptance_equals_server_mal"]
    summary["ok"] = bool(ok)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("ok", "model", "default_mode") if k in summary}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
