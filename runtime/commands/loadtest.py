"""`python -m runtime loadtest`: at each concurrency C (default 1, 4, 8, 16), C concurrent
clients send R requests to a served model (HTTP or gRPC) and report throughput, p50/p95
time to first token and per-request latency, errors and mean accepted length. The
streaming model (in-flight batching, gRPC streams) is preferred when the server has one:
its first response is the first token. With --engine-dir the same prompts also run
in-process, one after another, for the serving overhead and a token-by-token comparison
(greedy)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from urllib.parse import urlparse

from runtime.cli import UsageError, progress
from runtime.commands.provenance import provenance
from runtime.commands.serve import API_KEY_ENV
from runtime.modes import Mode

# Short prompts in the register both the tiny test tokenizer (CPython sources) and a chat
# target handle; request i gets PROMPTS[i % len(PROMPTS)].
PROMPTS = [
    "def fib(n):", "import os\n\n\ndef main():", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "with open(path) as f:", "def parse_args(argv):",
    "try:\n    import json\nexcept ImportError:", "return sorted(items, key=",
]


def add_parser(sub):
    from runtime.backends import RUNNABLE_BACKENDS
    from runtime.placement import PREFILL_DTYPES

    p = sub.add_parser("loadtest", help="load a served model: throughput, latency, MAL")
    p.add_argument("--url", required=True,
                   help="http://HOST:PORT (HTTP) or grpc://HOST:PORT (gRPC)")
    p.add_argument("--model", help="default: the server's streaming model (in-flight batching), "
                                   "else its only non-streaming model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="one run per level (default: %(default)s)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mode", choices=[m.value for m in Mode], metavar="NAME",
                   help="the decoding mode every request names (docs/modes.md); default: none "
                        "named, so the server's default (SharpDraft where the engine has it)")
    p.add_argument("--prompts-file",
                   help="one prompt per line, or a .jsonl file of {\"text\": ...} objects (AIPerf's "
                        "single_turn form: prompts with newlines, scripts/aiperf_prompts.py); "
                        "default: built-in code prompts")
    p.add_argument("--engine-dir", help="also run the prompts in-process on this engine")
    p.add_argument("--backend", choices=RUNNABLE_BACKENDS,
                   help="the in-process engine's backend, as the server's (serve --backend); "
                        "default: the one engine.json names")
    p.add_argument("--prefill-dtype", choices=PREFILL_DTYPES,
                   help="the in-process engine's prefill, as the server's (serve --prefill-dtype)")
    p.add_argument("--threads", type=int,
                   help="torch threads for the in-process run (default: torch's, one per core); "
                        "1 matches a server instance on a shared machine")
    p.add_argument("--api-key", metavar="KEY",
                   help="the key a server started with `serve --api-key` wants on Triton's "
                        "inference and repository APIs (default: $SHARPDRAFT_API_KEY, else none)")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true")


def read_prompts(path) -> list[str]:
    """A prompts file's prompts: a .jsonl file's "text" fields, else its non-blank lines;
    a missing or empty file is a UsageError."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompt file {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"prompt file {path} has no prompts")
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UsageError(f'{path}:{number}: expected an object with a "text" string')
        prompts.append(record["text"])
    return prompts


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def speculation_summary(objects: list[dict]) -> dict | None:
    """The responses' own `sharpdraft` objects (Generation.speculation), pooled: the modes
    that ran, verify steps, draft and accepted tokens, MAL (committed tokens over steps),
    the acceptance rate and the mean beta over the drafter's steps."""
    objects = [o for o in objects if o]
    if not objects:
        return None
    steps = sum(o["verify_steps"] for o in objects)
    accepted = sum(sum(o["accepted_per_step"]) for o in objects)
    drafts = sum(o["draft_tokens"] for o in objects)
    drafter_steps = sum(o["drafter_steps"] for o in objects)
    return {"modes": sorted({o["mode"] for o in objects}), "verify_steps": steps,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "mean_accepted_length": round((accepted + steps) / steps, 4) if steps else 0.0,
            "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
            "mean_beta": round(sum(o["mean_beta"] * o["drafter_steps"] for o in objects)
                               / drafter_steps, 4) if drafter_steps else None}


def summarize(latencies: list[float], wall: float, tokens: int, mals: list[float],
              errors: int, first_token: list[float] | None = None,
              speculation: list[dict] | None = None) -> dict:
    done = len(latencies)
    first_token = latencies if first_token is None else first_token
    return {
        "requests": done + errors, "ok": done, "errors": errors,
        "wall_seconds": round(wall, 3),
        "requests_per_second": round(done / wall, 3) if wall > 0 else 0.0,
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": {f"p{q}": round(percentile(first_token, q) * 1000, 1) for q in (50, 95)},
        "latency_ms": {f"p{q}": round(percentile(latencies, q) * 1000, 1) for q in (50, 95, 99)},
        "mean_accepted_length": round(sum(mals) / len(mals), 4) if mals else 0.0,
    } | ({"speculation": speculation_summary(speculation)} if speculation is not None else {})


def _speculation(result) -> dict | None:
    """The response's `sharpdraft` object (None from a server that sends none)."""
    value = result.as_numpy("speculation")
    return None if value is None else json.loads(bytes(value.reshape(-1)[0]))


class Client:
    """One connection, HTTP or gRPC, to one model; call() returns (token_ids, MAL). With an
    `api_key`, every call carries it as Triton's restricted APIs want it (runtime/serve/
    server.py: restricted_api_flags; a gRPC header KEY is sent as triton-grpc-protocol-KEY)."""

    def __init__(self, url: str, model: str, timeout: float, mode: str | None = None,
                 api_key: str | None = None):
        import numpy as np

        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme not in ("http", "grpc") or not parsed.hostname or not parsed.port:
            raise UsageError(f"--url must be http://HOST:PORT or grpc://HOST:PORT, got {url!r}")
        self.np, self.model, self.timeout, self.mode = np, model, timeout, mode
        target = f"{parsed.hostname}:{parsed.port}"
        if parsed.scheme == "grpc":
            import tritonclient.grpc as triton
        else:
            import tritonclient.http as triton
        self.triton, self.grpc = triton, parsed.scheme == "grpc"
        header = "triton-grpc-protocol-authorization" if self.grpc else "authorization"
        self.headers = {header: f"Bearer {api_key}"} if api_key else None
        self.client = (triton.InferenceServerClient(target) if self.grpc else
                       triton.InferenceServerClient(target, connection_timeout=timeout,
                                                    network_timeout=timeout))

    def models(self) -> list[str]:
        index = self.client.get_model_repository_index(
            headers=self.headers, **({"as_json": True} if self.grpc else {}))
        entries = index.get("models", []) if self.grpc else index
        return [m["name"] for m in entries if m.get("state") == "READY"]

    def decoupled(self, name: str) -> bool:
        config = self.client.get_model_config(name, headers=self.headers,
                                              **({"as_json": True} if self.grpc else {}))
        config = config.get("config", config)
        return bool(config.get("model_transaction_policy", config.get("modelTransactionPolicy", {}))
                    .get("decoupled"))

    def _inputs(self, prompt: str, max_new_tokens: int, temperature: float):
        np, t = self.np, self.triton
        inputs = [t.InferInput("prompt", [1], "BYTES"), t.InferInput("max_new_tokens", [1], "INT32"),
                  t.InferInput("temperature", [1], "FP32")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([max_new_tokens], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([temperature], dtype=np.float32))
        if self.mode is not None:
            inputs.append(t.InferInput("mode", [1], "BYTES"))
            inputs[3].set_data_from_numpy(np.array([self.mode.encode()], dtype=np.object_))
        return inputs

    def call(self, prompt: str, max_new_tokens: int, temperature: float):
        """(token_ids, the sharpdraft object, seconds to the first token): one response
        carries them all."""
        start = time.perf_counter()
        kwargs = {"client_timeout": self.timeout} if self.grpc else {}
        result = self.client.infer(self.model, self._inputs(prompt, max_new_tokens, temperature),
                                   headers=self.headers, **kwargs)
        return (result.as_numpy("token_ids").tolist(), _speculation(result),
                time.perf_counter() - start)

    def call_stream(self, prompt: str, max_new_tokens: int, temperature: float):
        """The same over a gRPC stream: tokens arrive step by step, the stats at the end."""
        import queue

        if not self.grpc:
            raise UsageError("a streaming model is loaded over gRPC: pass --url grpc://HOST:PORT")
        responses = queue.Queue()
        if not getattr(self, "streaming", False):
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                     headers=self.headers)
            self.streaming, self.responses = True, responses
        start = time.perf_counter()
        self.client.async_stream_infer(self.model, self._inputs(prompt, max_new_tokens, temperature))
        ids, first = [], None
        while True:
            result, error = self.responses.get(timeout=self.timeout)
            if error is not None:
                raise RuntimeError(str(error))
            if first is None:
                first = time.perf_counter() - start
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ids, _speculation(result), first
            ids += result.as_numpy("token_ids").tolist()

    def close(self):
        if getattr(self, "streaming", False):
            self.client.stop_stream()
        self.client.close()


def pick_model(client: Client) -> str:
    ready = client.models()
    streaming = [m for m in ready if client.decoupled(m)]
    if len(streaming) == 1:
        return streaming[0]
    plain = [m for m in ready if m not in streaming]
    if len(plain) != 1:
        raise UsageError(f"the server has {len(streaming)} ready streaming and {len(plain)} "
                         f"non-streaming models ({', '.join(ready) or 'none'}) — pass --model")
    return plain[0]


def run_server(args, prompts: list[str], model: str, concurrency: int,
               streaming: bool = False) -> tuple[dict, dict]:
    """Returns (summary, {request index: token_ids})."""
    lock = threading.Lock()
    next_index = iter(range(args.requests))
    latencies, first_token, objects, outputs, failures = [], [], [], {}, []

    def worker():
        try:
            client = Client(args.url, model, args.timeout, args.mode, args.api_key)
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
                call = client.call_stream if streaming else client.call
                try:
                    ids, spec, first = call(prompts[i % len(prompts)], args.max_new_tokens,
                                           args.temperature)
                except Exception as exc:
                    with lock:
                        failures.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    continue
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    first_token.append(first)
                    objects.append(spec)
                    outputs[i] = ids
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    errors = args.requests - len(latencies)
    mals = [o["mean_accepted_length"] for o in objects if o]
    summary = summarize(latencies, wall, sum(len(v) for v in outputs.values()), mals, errors,
                        first_token, objects)
    if failures:
        summary["first_error"] = failures[0]
    return summary, outputs


def reference_engine(args):
    """The in-process engine, loaded as the server's (--backend, --prefill-dtype) before
    any request is sent, so an engine or mode it cannot be stops the run in one line."""
    import torch

    from runtime.engine import Engine
    from runtime.spec import open_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(open_spec(args.engine_dir, backend=args.backend, prefill_dtype=args.prefill_dtype))
    if args.mode:
        engine.spec.check_mode(args.mode)
    return engine


def run_in_process(args, engine, prompts: list[str]) -> tuple[dict, dict]:
    from runtime.sampling import Sampling

    # the mode the requests name, else what the server runs for a request that names none
    mode = engine.spec.check_mode(args.mode) if args.mode else engine.spec.default_mode
    latencies, mals, objects, outputs = [], [], [], {}
    start = time.perf_counter()
    for i in range(args.requests):
        t0 = time.perf_counter()
        gen = engine.generate(engine.encode(prompts[i % len(prompts)]), args.max_new_tokens, mode,
                              Sampling(args.temperature))
        latencies.append(time.perf_counter() - t0)
        mals.append(gen.mean_accepted_length)
        objects.append(gen.speculation(mode))
        outputs[i] = gen.tokens
    wall = time.perf_counter() - start
    return summarize(latencies, wall, sum(len(v) for v in outputs.values()), mals, 0,
                     speculation=objects), outputs


def run(args) -> int:
    if min(args.concurrency) < 1:
        raise UsageError(f"--concurrency levels must be >= 1, got {args.concurrency}")
    for name in ("requests", "max_new_tokens", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else PROMPTS
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    probe = Client(args.url, args.model or "", args.timeout, api_key=args.api_key)
    try:
        ready = probe.models()  # the repository API: a server started with --api-key keys it
        if args.model and args.model not in ready:
            raise UsageError(f"the server at {args.url} has no ready model {args.model!r} "
                             f"(ready: {', '.join(ready) or 'none'})")
        model = args.model or pick_model(probe)
        streaming = probe.decoupled(model)
    except UsageError:
        raise
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "restricted" in why:  # tritonserver's answer to a missing or wrong key
            sys.stderr.write(f"error: the server at {args.url} wants an API key: pass --api-key "
                             f"(or ${API_KEY_ENV}) as `serve --api-key` was given ({why})\n")
        else:
            sys.stderr.write(f"error: cannot reach a Triton server at {args.url} ({why})\n")
        return 1
    finally:
        probe.close()

    engine = reference_engine(args) if args.engine_dir else None
    report = {**provenance("loadtest"), "url": args.url, "model": model, "streaming": streaming,
              "mode": args.mode,
              "max_new_tokens": args.max_new_tokens, "requests": args.requests, "levels": []}
    outputs = []
    for concurrency in args.concurrency:
        progress(f"{args.requests} requests, {concurrency} concurrent, to {model} at {args.url}")
        served, served_outputs = run_server(args, prompts, model, concurrency, streaming)
        report["levels"].append({"concurrency": concurrency} | served)
        outputs.append(served_outputs)
    if engine is not None:
        progress(f"the same {args.requests} prompts in-process, one at a time")
        local, local_outputs = run_in_process(args, engine, prompts)
        report["in_process"] = local
        if args.temperature == 0:  # greedy: the server must give the same tokens at every level
            report["token_mismatches"] = sum(o[i] != local_outputs[i] for o in outputs for i in o)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    errors = sum(level["errors"] for level in report["levels"])
    return 0 if errors == 0 and not report.get("token_mismatches") else 1


def format_report(report: dict) -> str:
    rows = [(f"c={level['concurrency']}", level) for level in report["levels"]]
    rows += [("in-process", report["in_process"])] if "in_process" in report else []
    lines = [f"{report['model']} at {report['url']} ({'streaming, in-flight batching' if report['streaming'] else 'one response per request'}): "
             f"{report['requests']} requests, max_new_tokens {report['max_new_tokens']}",
             f"{'':11} {'ok':>5} {'errors':>6} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} "
             f"{'TTFT p95':>9} {'p50 ms':>8} {'p95 ms':>8} {'MAL':>6}"]
    for label, s in rows:
        lat, first = s["latency_ms"], s["ttft_ms"]
        lines.append(f"{label:11} {s['ok']:>5} {s['errors']:>6} {s['requests_per_second']:>7.2f} "
                     f"{s['tokens_per_second']:>8.1f} {first['p50']:>9.1f} {first['p95']:>9.1f} "
                     f"{lat['p50']:>8.1f} {lat['p95']:>8.1f} {s['mean_accepted_length']:>6.3f}")
    for label, s in rows:
        spec = s.get("speculation")
        if spec:
            rate = "-" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.3f}"
            beta = "-" if spec["mean_beta"] is None else f"{spec['mean_beta']:.3f}"
            lines.append(f"speculation {label}: {'/'.join(spec['modes'])}, {spec['verify_steps']} "
                         f"steps, {spec['accepted_tokens']}/{spec['draft_tokens']} drafts accepted "
                         f"({rate}), MAL {spec['mean_accepted_length']:.3f}, mean beta {beta}")
    for level in report["levels"]:
        if "first_error" in level:
            lines.append(f"first error at concurrency {level['concurrency']}: {level['first_error']}")
    if "token_mismatches" in report:
        lines.append(f"token mismatches vs in-process: {report['token_mismatches']}")
    return "\n".join(lines)
