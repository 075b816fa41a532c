"""Where a served request's time to first token goes, one request at a time: the same
prompts through the OpenAI endpoint (the `openai` client, streaming), through the Triton
model's gRPC stream (loadtest's client), and in process (`Engine.generate` of one token:
the prefill and the first token), each in the mode a request naming none runs alone.
Start the server first (`python -m runtime serve --streaming --start --openai-port PORT`)
and run this on an idle machine: a served TTFT well above the in-process one is the
serving path's cost, or the client's.

    python -m scripts.ttft_paths --openai-url http://127.0.0.1:9000/v1 \\
        --grpc-url grpc://127.0.0.1:8001 --engine-dir engines/dflash-sharpdraft \\
        --prompts-file results/aiperf-default-vs-target/prompts-512.jsonl --requests 8 \\
        --out results/ttft-paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


from runtime.cli import UsageError, code_commit, progress, run


def openai_ttft(url: str, prompts: list[str], new_tokens: int) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="none")
    model = client.models.list().data[0].id
    seconds = []
    for prompt in prompts:
        start, first = time.perf_counter(), None
        for event in client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens,
                                               temperature=0, stream=True):
            if first is None and event.choices:  # the first text (or the end, if none)
                first = time.perf_counter() - start
        seconds.append(first)
    return seconds


def grpc_ttft(url: str, prompts: list[str], new_tokens: int) -> list[float]:
    from runtime.commands.loadtest import Client, pick_model

    client = Client(url, "", 600.0)
    try:
        client.model = pick_model(client)
        return [client.call_stream(prompt, new_tokens, 0.0)[2] for prompt in prompts]
    finally:
        client.close()


def in_process_ttft(engine_dir: str, prompts: list[str]) -> tuple[str, list[float]]:
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(engine_dir))
    mode = engine.spec.default_mode_at(1)
    seconds = []
    for prompt in prompts:
        ids = engine.encode(prompt)
        start = time.perf_counter()
        engine.generate(ids, 1, mode)
        seconds.append(time.perf_counter() - start)
    return mode, seconds


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--openai-url", required=True, help="the server's OpenAI base URL, .../v1")
    p.add_argument("--grpc-url", required=True, help="grpc://HOST:PORT of the same server")
    p.add_argument("--engine-dir", required=True, help="the engine the server runs")
    p.add_argument("--prompts-file", required=True, help="as loadtest reads it")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from runtime.commands.loadtest import read_prompts

    if args.requests < 1 or args.new_tokens < 1:
        raise UsageError("--requests and --new-tokens must be >= 1")
    prompts = read_prompts(args.prompts_file)
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    # each path's first request is untimed: its channel or sessions, the first run of
    # these shapes
    paths, warm = {}, prompts[:1] + prompts
    for name, measure in (("openai", lambda: openai_ttft(args.openai_url, warm, args.new_tokens)),
                          ("grpc", lambda: grpc_ttft(args.grpc_url, warm, args.new_tokens))):
        progress(f"ttft: {name}, {len(prompts)} requests after one untimed")
        paths[name] = measure()[1:]
    progress(f"ttft: in process, {len(prompts)} prompts after one untimed")
    mode, seconds = in_process_ttft(args.engine_dir, warm)
    paths["in_process"] = seconds[1:]
    result = {"command": "python -m scripts.ttft_paths " + " ".join(argv),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": code_commit(),
              "machine": {"cpus": os.cpu_count()}, "in_process_mode": mode,
              "requests": args.requests, "new_tokens": args.new_tokens,
              "ttft_s": {name: [round(s, 4) for s in seconds] for name, seconds in paths.items()},
              "median_s": {name: round(statistics.median(seconds), 4) for name, seconds in paths.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
