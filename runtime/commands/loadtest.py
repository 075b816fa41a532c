"""`python -m runtime loadtest`: C concurrent clients send R requests to a served model
(HTTP or gRPC) and report throughput, latency percentiles, errors and mean accepted
length; with --engine-dir the same prompts also run in-process, one after another, for
the serving overhead and a token-by-token comparison (greedy)."""

from __future__ import annotations

import json
import sys
import threading
import time
from urllib.parse import urlparse

from runtime.cli import UsageError, progress

# Short prompts in the register both the tiny test tokenizer (CPython sources) and a chat
# target handle; request i gets PROMPTS[i % len(PROMPTS)].
PROMPTS = [
    "def fib(n):", "import os\n\n\ndef main():", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "with open(path) as f:", "def parse_args(argv):",
    "try:\n    import json\nexcept ImportError:", "return sorted(items, key=",
]


def add_parser(sub):
    p = sub.add_parser("loadtest", help="load a served model: throughput, latency, MAL")
    p.add_argument("--url", required=True,
                   help="http://HOST:PORT (HTTP) or grpc://HOST:PORT (gRPC)")
    p.add_argument("--model", help="default: the server's only non-streaming model")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts-file", help="one prompt per line (default: built-in code prompts)")
    p.add_argument("--engine-dir", help="also run the prompts in-process on this engine")
    p.add_argument("--threads", type=int,
                   help="torch threads for the in-process run (default: torch's, one per core); "
                        "1 matches a server instance on a shared machine")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(latencies: list[float], wall: float, tokens: int, mals: list[float],
              errors: int) -> dict:
    done = len(latencies)
    return {
        "requests": done + errors, "ok": done, "errors": errors,
        "wall_seconds": round(wall, 3),
        "requests_per_second": round(done / wall, 3) if wall > 0 else 0.0,
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "latency_ms": {f"p{q}": round(percentile(latencies, q) * 1000, 1) for q in (50, 95, 99)},
        "mean_accepted_length": round(sum(mals) / len(mals), 4) if mals else 0.0,
    }


class Client:
    """One connection, HTTP or gRPC, to one model; call() returns (token_ids, MAL)."""

    def __init__(self, url: str, model: str, timeout: float):
        import numpy as np

        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme not in ("http", "grpc") or not parsed.hostname or not parsed.port:
            raise UsageError(f"--url must be http://HOST:PORT or grpc://HOST:PORT, got {url!r}")
        self.np, self.model, self.timeout = np, model, timeout
        target = f"{parsed.hostname}:{parsed.port}"
        if parsed.scheme == "grpc":
            import tritonclient.grpc as triton
        else:
            import tritonclient.http as triton
        self.triton, self.grpc = triton, parsed.scheme == "grpc"
        self.client = (triton.InferenceServerClient(target) if self.grpc else
                       triton.InferenceServerClient(target, connection_timeout=timeout,
                                                    network_timeout=timeout))

    def models(self) -> list[str]:
        index = self.client.get_model_repository_index(**({"as_json": True} if self.grpc else {}))
        entries = index.get("models", []) if self.grpc else index
        return [m["name"] for m in entries if m.get("state") == "READY"]

    def decoupled(self, name: str) -> bool:
        config = self.client.get_model_config(name, **({"as_json": True} if self.grpc else {}))
        config = config.get("config", config)
        return bool(config.get("model_transaction_policy", config.get("modelTransactionPolicy", {}))
                    .get("decoupled"))

    def call(self, prompt: str, max_new_tokens: int, temperature: float):
        np, t = self.np, self.triton
        inputs = [t.InferInput("prompt", [1], "BYTES"), t.InferInput("max_new_tokens", [1], "INT32"),
                  t.InferInput("temperature", [1], "FP32")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([max_new_tokens], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([temperature], dtype=np.float32))
        kwargs = {"client_timeout": self.timeout} if self.grpc else {}
        result = self.client.infer(self.model, inputs, **kwargs)
        return (result.as_numpy("token_ids").tolist(),
                float(result.as_numpy("mean_accepted_length")[0]))

    def close(self):
        self.client.close()


def pick_model(client: Client) -> str:
    ready = client.models()
    plain = [m for m in ready if not client.decoupled(m)]
    if len(plain) != 1:
        raise UsageError(f"the server has {len(plain)} ready non-streaming models "
                         f"({', '.join(plain) or 'none'}) — pass --model")
    return plain[0]


def run_server(args, prompts: list[str], model: str) -> tuple[dict, dict]:
    """Returns (summary, {request index: token_ids})."""
    lock = threading.Lock()
    next_index = iter(range(args.requests))
    latencies, mals, outputs, failures = [], [], {}, []

    def worker():
        try:
            client = Client(args.url, model, args.timeout)
        except Exception as exc:  # the server is down: every request this worker owed fails
            with lock:
                failures.append(f"connect: {exc}")
            return
        try:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                start = time.perf_counter()
                try:
                    ids, mal = client.call(prompts[i % len(prompts)], args.max_new_tokens,
                                           args.temperature)
                except Exception as exc:
                    with lock:
                        failures.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    continue
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    mals.append(mal)
                    outputs[i] = ids
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    errors = args.requests - len(latencies)
    summary = summarize(latencies, wall, sum(len(v) for v in outputs.values()), mals, errors)
    if failures:
        summary["first_error"] = failures[0]
    return summary, outputs


def run_in_process(args, prompts: list[str]) -> tuple[dict, dict]:
    import torch

    from runtime.engine import Engine
    from runtime.sampling import Sampling

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(args.engine_dir)
    mode = "sharpdraft" if engine.scaling is not None else "frozen"
    latencies, mals, outputs = [], [], {}
    start = time.perf_counter()
    for i in range(args.requests):
        t0 = time.perf_counter()
        gen = engine.generate(engine.encode(prompts[i % len(prompts)]), args.max_new_tokens, mode,
                              Sampling(args.temperature))
        latencies.append(time.perf_counter() - t0)
        mals.append(gen.mean_accepted_length)
        outputs[i] = gen.tokens
    wall = time.perf_counter() - start
    return summarize(latencies, wall, sum(len(v) for v in outputs.values()), mals, 0), outputs


def run(args) -> int:
    for name in ("concurrency", "requests", "max_new_tokens", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts_file:
        from pathlib import Path

        path = Path(args.prompts_file)
        if not path.is_file():
            raise UsageError(f"prompt file {path} does not exist")
        prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"prompt file {path} has no prompts")
    else:
        prompts = PROMPTS
    probe = Client(args.url, args.model or "", args.timeout)
    try:
        model = args.model or pick_model(probe)
    except UsageError:
        raise
    except Exception as exc:
        sys.stderr.write(f"error: cannot reach a Triton server at {args.url} "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})\n")
        return 1
    finally:
        probe.close()

    progress(f"{args.requests} requests, {args.concurrency} concurrent, to {model} at {args.url}")
    served, served_outputs = run_server(args, prompts, model)
    report = {"url": args.url, "model": model, "concurrency": args.concurrency,
              "max_new_tokens": args.max_new_tokens, "server": served}
    if args.engine_dir:
        progress(f"the same {args.requests} prompts in-process, one at a time")
        local, local_outputs = run_in_process(args, prompts)
        report["in_process"] = local
        if args.temperature == 0:  # greedy: the server must give the same tokens
            report["token_mismatches"] = sum(served_outputs[i] != local_outputs[i]
                                             for i in served_outputs)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0 if served["errors"] == 0 and not report.get("token_mismatches") else 1


def format_report(report: dict) -> str:
    rows = [("server", report["server"])] + ([("in-process", report["in_process"])]
                                             if "in_process" in report else [])
    lines = [f"{report['model']} at {report['url']}: concurrency {report['concurrency']}, "
             f"max_new_tokens {report['max_new_tokens']}",
             f"{'':11} {'ok':>5} {'errors':>6} {'req/s':>7} {'tok/s':>8} "
             f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'MAL':>6}"]
    for label, s in rows:
        lat = s["latency_ms"]
        lines.append(f"{label:11} {s['ok']:>5} {s['errors']:>6} {s['requests_per_second']:>7.2f} "
                     f"{s['tokens_per_second']:>8.1f} {lat['p50']:>8.1f} {lat['p95']:>8.1f} "
                     f"{lat['p99']:>8.1f} {s['mean_accepted_length']:>6.3f}")
    if "first_error" in report["server"]:
        lines.append(f"first error: {report['server']['first_error']}")
    if "token_mismatches" in report:
        lines.append(f"token mismatches vs in-process: {report['token_mismatches']}")
    return "\n".join(lines)
