"""A served A/B: one Triton instance per arm (`python -m runtime serve`, each arm's own
code directory and engine), rounds interleaved (A, B, A, B, ...), and in each the
default mode at every concurrency level with its tokens checked against in-process
generate, then target-only and n-gram lookup at the first and last level, the peers of
every figure. The Triton model's turn times (runtime/serve/scheduler.py: TURNS) are
scraped around the default's last level, so a change can be read as prefill against
decode steps. One JSON: every run whole, and per arm the medians over its rounds.

    python -m scripts.served_ab --arm before=/work/fresh --arm after=. \\
        --engine-dir engines/dflash-sharpdraft --prompts-file results/loadtest-mixed/prompts.jsonl \\
        --rounds 3 --out results/loadtest-mixed/served-ab.json

Run it on an idle machine: the server, the clients and the in-process check share its
cores. An arm's engine path resolves under its own code directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from runtime.cli import UsageError, code_commit, run

PEERS = ("target", "ngram")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def turn_sums(metrics: str) -> dict[str, float]:
    """Seconds per turn kind of the streaming model (sharpdraft_turn_seconds_sum)."""
    sums = {}
    for line in metrics.splitlines():
        m = re.match(r'sharpdraft_turn_seconds_sum\{[^}]*kind="(\w+)",model="([^"]+)"\} (\S+)', line)
        if m and m.group(2).endswith("-stream"):
            sums[m.group(1)] = float(m.group(3))
    return sums


def start_server(code: Path, engine_dir: str, repo: Path, log: Path, flags=()):
    """The arm's server (runtime/serve/launch.py: ServeProcess, run by the arm's own
    checkout and interpreter, with the arm's serve `flags`), ready."""
    from runtime.serve.launch import NotReady, ServeProcess

    server = ServeProcess(engine_dir, repo, "--streaming", "--instances", "1", "--max-batch", "8",
                          *flags, stderr=open(log, "w"), root=code,
                          python=str(code / ".venv/bin/python"))
    try:
        server.wait_ready(300)
    except NotReady as exc:
        server.kill()
        raise UsageError(f"the {code} server did not start ({exc}); see {log}") from None
    return server


def loadtest(code: Path, server, args, levels, mode: str | None, check: bool, name: str = "") -> dict:
    command = [str(code / ".venv/bin/python"), "-m", "runtime", "loadtest",
               "--url", f"grpc://127.0.0.1:{server.grpc_port}", "--concurrency", *map(str, levels),
               "--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens),
               "--prompts-file", str(Path(args.prompts_file).resolve()), "--json"]
    if mode:
        command += ["--mode", mode]
    if check:  # the in-process reference loads the engine as the arm's server does
        command += ["--engine-dir", args.engine_dir, "--threads", "2", *args.flags.get(name, [])]
    out = subprocess.run(command, cwd=code, capture_output=True, text=True)
    if out.returncode:
        raise UsageError(f"loadtest failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode} ({' '.join(command)})")
    return json.loads(out.stdout)


def one_arm(name: str, code: Path, args, round_: int) -> dict:
    levels = args.concurrency
    repo = Path(f"/tmp/served-ab-{os.getpid()}-{name}-{round_}")
    server = start_server(code, args.engine_dir, repo, Path(f"/tmp/served-ab-{name}-{round_}.log"),
                          args.flags.get(name, []))
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    try:
        loadtest(code, server, argparse.Namespace(**{**vars(args), "requests": 2, "max_new_tokens": 8}),
                 [1], None, check=False)  # warm: sessions, arenas, the first batch
        default = (loadtest(code, server, args, levels[:-1], None, check=False)
                   if len(levels) > 1 else None)
        before = turn_sums(get(metrics))
        last = loadtest(code, server, args, levels[-1:], None, check=True, name=name)
        after = turn_sums(get(metrics))
        runs = {"default": (default["levels"] if default else []) + last["levels"]}
        for peer in PEERS:
            runs[peer] = loadtest(code, server, args, [levels[0], levels[-1]], peer,
                                  check=False)["levels"]
    finally:
        server.stop(grace=60)
    return {"arm": name, "round": round_, "commit": code_commit(code),
            "runs": {mode: {str(level["concurrency"]): level for level in levels_}
                     for mode, levels_ in runs.items()},
            "token_mismatches": last.get("token_mismatches"),
            f"turn_seconds_at_c{levels[-1]}": {k: round(after.get(k, 0) - before.get(k, 0), 3)
                                               for k in after}}


def summary(rounds: list[dict], levels: list[int]) -> dict:
    """Per arm and mode: median tok/s at each level and the median of the rounds' last-
    over-first ratios."""
    out = {}
    lo, hi = str(levels[0]), str(levels[-1])
    for arm in dict.fromkeys(r["arm"] for r in rounds):
        mine = [r for r in rounds if r["arm"] == arm]
        out[arm] = {"commit": mine[0]["commit"]}
        for mode in mine[0]["runs"]:
            tok_s = {level: statistics.median(r["runs"][mode][level]["tokens_per_second"] for r in mine)
                     for level in mine[0]["runs"][mode]}
            ratio = statistics.median(r["runs"][mode][hi]["tokens_per_second"]
                                      / r["runs"][mode][lo]["tokens_per_second"] for r in mine)
            out[arm][mode] = {"tokens_per_second": tok_s, f"c{hi}_over_c{lo}": round(ratio, 3)}
        out[arm]["token_mismatches"] = sum(r["token_mismatches"] or 0 for r in mine)
    return out


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", required=True, metavar="NAME=CODE_DIR",
                   help="an arm: its name and the code directory whose runtime serves it")
    p.add_argument("--engine-dir", required=True, help="relative to each arm's code directory")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arm-flags", action="append", default=[], metavar="NAME=FLAGS",
                   help="flags for that arm's serve and for loadtest's in-process check, e.g. "
                        "bf16='--prefill-dtype bfloat16' (one arm's code, served two ways)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.flags = {}
    for item in args.arm_flags:
        name, _, flags = item.partition("=")
        args.flags[name] = flags.split()
    arms = []
    for arm in args.arm:
        name, _, code = arm.partition("=")
        code = Path(code).resolve()
        if not name or not (code / ".venv/bin/python").exists():
            raise UsageError(f"--arm {arm!r}: want NAME=CODE_DIR, a checkout with its .venv")
        if not (code / args.engine_dir / "engine.json").exists():
            raise UsageError(f"{code / args.engine_dir} holds no engine.json")
        arms.append((name, code))
    rounds = []
    for round_ in range(1, args.rounds + 1):
        for name, code in arms:
            print(f"round {round_}: {name} ({code})", file=sys.stderr, flush=True)
            rounds.append(one_arm(name, code, args, round_))
            Path(args.out).write_text(json.dumps({"partial": True, "rounds": rounds}, indent=1))
    result = {"command": "python -m scripts.served_ab " + " ".join(argv), "arm_flags": args.flags,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpus": os.cpu_count()}, "engine_dir": args.engine_dir,
              "concurrency": args.concurrency, "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "peers": list(PEERS),
              "summary": summary(rounds, args.concurrency), "rounds": rounds}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
