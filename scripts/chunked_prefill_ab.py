"""Chunked prefill, A/B in one run: the same engine served twice, one mode, the same long
prompts at the same concurrency, with `serve --prefill-chunk CHUNK` and with 0 (a joining
prompt prefills whole), one server after the other on free loopback ports. Every
request is a gRPC stream; each response's arrival time is kept, so the script reports,
per arm, what running streams saw while another prompt joined:

- worst_gap_while_joining_ms: the longest wait between two responses of a stream that was
  already decoding, over the gaps that overlap another request's join (its send to its
  first token);
- itl_ms p50/p99 per request (AIPerf's inter-token latency: (last - first response) /
  (tokens - 1); vLLM's and SGLang's serving benchmarks call this TPOT), and gap_ms, the
  gaps between consecutive responses of every stream pooled, p50/p99/max (what vLLM's and
  SGLang's serving benchmarks report as ITL: their percentiles run over every gap between
  a stream's consecutive chunks, all requests together);
- ttft_ms p50/p99 and output tokens/s;
- tokens_identical: every stream's tokens equal between the arms (greedy: they must).

- turns_ms: the server's own scheduler turns over the arm (its metrics endpoint:
  sharpdraft_turn_*, runtime/serve/model.py), per kind (step, chunk, join, prefill):
  count, mean and longest.

served_bound, from the chunked arm's turns: the issue's bound (the worst gap while joining
<= one chunk's prefill + one step) with the longest chunk and the longest step the server
itself timed under this load, and whether the worst gap kept within it. With --bound it
also times, in this process, one chunk's prefill at the prompts' length (one turn of a
chunked join between two steps: the target's chunk and the drafter's read of its
features) and one decode step at the concurrency, and the join's last part on its own
(the rows join, the first token): the same turns on an otherwise idle process, which run
faster than in the loaded server. Run it on an idle machine:

    python -m scripts.chunked_prefill_ab --engine-dir engines/dflash-sharpdraft \
        --mode sharpdraft --tokens 4096 --concurrency 4 --requests 8 --max-new-tokens 64 \
        --chunk 256 --bound --out results/chunked-prefill-ab.json

Prompts: --tokens-token windows of the evaluation split (scripts/aiperf_prompts.py), or
--prompts-file (JSONL of {"text": ...}). Progress goes to stderr, one JSON to --out and
stdout.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from runtime.serve.repository import DEFAULT_PREFILL_CHUNK


def start_server(args, chunk: int, work: Path):
    """The arm's server, ready: (its ServeProcess, serve's JSON line)."""
    from runtime.serve.launch import NotReady, ServeProcess

    server = ServeProcess(args.engine_dir, work / f"repo-{chunk}", "--streaming", "--instances", "1",
                          "--max-batch", str(args.max_batch), "--prefill-chunk", str(chunk))
    try:
        return server, server.wait_ready()
    except NotReady as exc:
        raise SystemExit(f"error: serve --prefill-chunk {chunk} exited with {exc.code} before ready")


def stream(grpc_port: int, model: str, prompt: str, n: int, mode: str | None) -> dict:
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput("prompt", [1], "BYTES"),
              grpcclient.InferInput("max_new_tokens", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([n], dtype=np.int32))
    if mode:
        inputs.append(grpcclient.InferInput("mode", [1], "BYTES"))
        inputs[2].set_data_from_numpy(np.array([mode.encode()], dtype=np.object_))
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    sent = time.perf_counter()
    client.async_stream_infer(model, inputs)
    arrivals, ids = [], []  # (time, tokens in that response)
    try:
        while True:
            at, result, error = responses.get(timeout=1800)
            if error is not None:
                raise RuntimeError(str(error))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return {"sent": sent, "arrivals": arrivals, "ids": ids,
                        "sharpdraft": json.loads(result.as_numpy("speculation")[0])}
            new = result.as_numpy("token_ids").tolist()
            ids += new
            arrivals.append((at, len(new)))
    finally:
        client.stop_stream()
        client.close()


def load(grpc_port: int, model: str, prompts: list[str], args) -> list[dict]:
    """--concurrency closed-loop clients, --requests in all, request i on prompt i."""
    results, lock, order = [None] * args.requests, threading.Lock(), iter(range(args.requests))

    def client():
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = stream(grpc_port, model, prompts[i % len(prompts)], args.max_new_tokens,
                                    args.mode)
            except Exception as exc:  # reported once the load is over, the server stopped
                results[i] = {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pct(values, q):
    return round(float(np.percentile(values, q)) * 1000, 1) if len(values) else None


def summarize(results: list[dict]) -> dict:
    joins = [(r["sent"], r["arrivals"][0][0]) for r in results]
    gaps, gaps_joining, itl = [], [], []
    for i, r in enumerate(results):
        times = [t for t, _ in r["arrivals"]]
        tokens = sum(n for _, n in r["arrivals"])
        if tokens > 1:
            itl.append((times[-1] - times[0]) / (tokens - 1))
        for a, b in zip(times, times[1:]):
            gaps.append(b - a)
            if any(j != i and s < b and e > a for j, (s, e) in enumerate(joins)):
                gaps_joining.append(b - a)
    start = min(r["sent"] for r in results)
    end = max(r["arrivals"][-1][0] for r in results)
    return {"worst_gap_while_joining_ms": round(max(gaps_joining) * 1000, 1) if gaps_joining else None,
            "gaps_while_joining": len(gaps_joining),
            "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
            "gap_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": pct(gaps, 100)},
            "ttft_ms": {"p50": pct([e - s for s, e in joins], 50), "p99": pct([e - s for s, e in joins], 99)},
            "output_tokens_per_s": round(sum(len(r["ids"]) for r in results) / (end - start), 3),
            "mean_accepted_length": round(sum(sum(r["sharpdraft"]["accepted_per_step"]) + r["sharpdraft"]["verify_steps"]
                                              for r in results) / sum(r["sharpdraft"]["verify_steps"] for r in results), 4)}


def served_turns(metrics_port: int, model: str) -> dict:
    """The server's scheduler turns for `model` (runtime.metrics.read_turns), in ms."""
    import urllib.request

    from runtime.metrics import read_turns

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        turns = read_turns(response.read().decode(), model)
    return {kind: {"count": t["count"],
                   "mean": round(t["seconds"] / t["count"] * 1000, 1) if t["count"] else None,
                   "longest": round(t["longest"] * 1000, 1)}
            for kind, t in sorted(turns.items())}


def served_bound(arm: dict) -> dict:
    """The issue's bound with the chunked arm's own turns: the longest chunk + the longest
    step the server timed, and whether the worst gap while joining kept within it (a
    join's last part longer than every chunk would break it: it takes a turn alone)."""
    turns = arm["turns_ms"]
    chunk, step = (turns.get(kind, {}).get("longest") or 0.0 for kind in ("chunk", "step"))
    bound = round(chunk + step, 1)
    worst = arm["worst_gap_while_joining_ms"]
    return {"longest_chunk_ms": chunk, "longest_step_ms": step,
            "longest_join_ms": turns.get("join", {}).get("longest"), "bound_ms": bound,
            "worst_gap_while_joining_ms": worst,
            "holds": None if worst is None else worst <= bound}  # None: no stream waited


def timed_join(decoder, request, chunk: int) -> list[float]:
    """Seconds of each turn of a chunked join (Decoder.join, as the scheduler runs it
    between steps): one per chunk (the target's prefill of it, then the drafter's read of
    its features), then the last part."""
    turns, joining = [], decoder.join(request, chunk)
    while True:
        start = time.perf_counter()
        try:
            next(joining)
        except StopIteration:
            turns.append(time.perf_counter() - start)
            return turns
        turns.append(time.perf_counter() - start)


def bound(args, prompt_ids: list[int]) -> dict:
    """One decode step of --concurrency rows, then three chunked joins of the prompt into
    that batch, timed in this process (medians of three): a full chunk's turn at the
    prompt's length (target + drafter), the join's last part, and their bound, one
    chunk's prefill + one step. Each joining request asks for one token, so it leaves
    at its first, in its last part, as a finished request does: the three join into the
    same buffer row, as joins at a steady concurrency do (a row never written before
    costs this VM's first touch of its pages: 0.3-0.7 s at 4,096 tokens)."""
    from runtime.decode import Request
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(args.engine_dir))
    decoder = engine.decoder(args.mode or engine.spec.default_mode)
    chunk, chunks = args.chunk, -(-len(prompt_ids) // args.chunk)
    for _ in range(args.concurrency):
        decoder.add(Request(prompt=prompt_ids, max_new_tokens=args.max_new_tokens))
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        decoder.step()
        steps.append(time.perf_counter() - start)
    turns, last_parts = [], []
    for _ in range(3):
        timed = timed_join(decoder, Request(prompt=prompt_ids, max_new_tokens=1), chunk)
        if len(timed) != chunks + 1 or chunks < 2:  # a join in one piece: nothing to time
            return {"error": f"a {len(prompt_ids)}-token prompt does not join in chunks of "
                             f"{chunk} on this engine's batch ({type(decoder.target).__name__})"}
        turns.append(timed[len(prompt_ids) // chunk - 1])  # the last full chunk
        last_parts.append(timed[-1])
    chunk_ms, step_ms = (round(float(np.median(t)) * 1000, 1) for t in (turns, steps))
    return {"chunk_prefill_ms": chunk_ms, "step_ms": step_ms,
            "bound_ms": round(chunk_ms + step_ms, 1),
            "join_last_part_ms": round(float(np.median(last_parts)) * 1000, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--mode", help="the mode every request names (default: the engine's default)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length (evaluation-split windows)")
    p.add_argument("--prompts-file", help="JSONL of {\"text\": ...} instead")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="the chunked arm's --prefill-chunk (default: serve's, %(default)s)")
    p.add_argument("--bound", action="store_true", help="also time one chunk's prefill (target + drafter), one step and a join's last part")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.chunk < 1 or args.concurrency < 1 or args.requests < 1:
        print("error: --chunk, --concurrency and --requests must be >= 1", file=sys.stderr)
        return 2
    from runtime.cli import code_commit

    with tempfile.TemporaryDirectory(prefix="chunked-ab-") as tmp:
        work = Path(tmp)
        if args.prompts_file:
            path = Path(args.prompts_file)
        else:
            from scripts import aiperf_prompts

            path = work / "prompts.jsonl"
            if aiperf_prompts.main(["--engine-dir", args.engine_dir, "--tokens", str(args.tokens),
                                    "--count", str(args.requests), "--out", str(path)]):
                return 1
        prompts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        report = {"command": "python -m scripts.chunked_prefill_ab " + " ".join(
                      argv if argv is not None else sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "commit": code_commit(),
                  "engine_dir": args.engine_dir, "mode": args.mode, "tokens": args.tokens,
                  "concurrency": args.concurrency, "requests": args.requests,
                  "max_new_tokens": args.max_new_tokens, "chunk": args.chunk, "arms": {}}
        tokens = {}
        for chunk in (args.chunk, 0):
            arm = f"chunk-{chunk}" if chunk else "whole"
            print(f"serving with --prefill-chunk {chunk} ...", file=sys.stderr)
            server, info = start_server(args, chunk, work)
            try:
                model = next(m for m in info["models"] if m.endswith("-stream"))
                results = load(server.grpc_port, model, prompts, args)
                turns = served_turns(server.metrics_port, model)
            finally:
                server.stop(120)
            failed = [r["error"] for r in results if "error" in r]
            if failed:
                print(f"error: {len(failed)} of {len(results)} requests failed with --prefill-chunk "
                      f"{chunk}, e.g. {failed[0]}", file=sys.stderr)
                return 1
            report["arms"][arm] = summarize(results) | {"turns_ms": turns}
            tokens[arm] = [r["ids"] for r in results]
            print(f"{arm}: {json.dumps(report['arms'][arm])}", file=sys.stderr)
        report["tokens_identical"] = len(set(json.dumps(t) for t in tokens.values())) == 1
        report["served_bound"] = served_bound(report["arms"][f"chunk-{args.chunk}"])
        if args.bound:
            from runtime.engine import Engine

            ids = Engine(open_spec(args.engine_dir)).encode(prompts[0])
            report["bound"] = bound(args, ids)
            if "error" in report["bound"]:
                print(f"error: --bound: {report['bound']['error']}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if report["tokens_identical"] and "error" not in report.get("bound", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
