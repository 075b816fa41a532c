"""`python -m runtime bench --batch B`: B sequences of different context lengths decoded
together by the in-flight batching executor (runtime/decode.py), frozen drafter versus
SharpDraft (and target-only), against the same B requests decoded one at a time.

Sequence i takes the first lengths[i % len(lengths)] tokens of document i % documents,
so every row of a step sits at its own length and gets its own beta. Rows report MAL
(tokens per verify pass, pooled over the B sequences), aggregate tokens/s batched and one
at a time (medians over --repeats, interleaved), and for greedy runs whether each
sequence's batched tokens equal its own single-sequence run.
"""

from __future__ import annotations

import statistics
import time

from runtime.decode import Request
from runtime.metrics import pooled_mean_accepted_length
from runtime.modes import Mode


def batch_requests(docs, lengths: list[int], batch: int, new_tokens: int, sampling) -> list[Request]:
    requests = []
    for i in range(batch):
        _, ids = docs[i % len(docs)]
        requests.append(Request(prompt=ids[:lengths[i % len(lengths)]], max_new_tokens=new_tokens,
                                sampling=sampling))
    return requests


def measure(engine, requests: list[Request], modes, repeats: int, adaptive: bool) -> list[dict]:
    """{mode: row} from `repeats` interleaved rounds of (batched, one at a time) per mode."""
    seconds = {(m, how): [] for m in modes for how in ("batched", "alone")}
    last = {}
    for r in range(repeats):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            start = time.perf_counter()
            batched = engine.decoder(mode, adaptive).run(requests)
            seconds[mode, "batched"].append(time.perf_counter() - start)
            start = time.perf_counter()
            alone = [engine.generate(q.prompt, q.max_new_tokens, mode, q.sampling, stop=False,
                                     adaptive=adaptive) for q in requests]
            seconds[mode, "alone"].append(time.perf_counter() - start)
            last[mode] = (batched, alone)
    rows = []
    for mode in modes:
        batched, alone = last[mode]
        tokens = sum(len(s.gen.tokens) for s in batched)
        tok_s = {how: tokens / statistics.median(seconds[mode, how]) for how in ("batched", "alone")}
        gens = [s.gen for s in batched]
        row = {"mode": mode, "batch": len(requests), "tokens": tokens,
               "mal": round(pooled_mean_accepted_length(gens), 4) if mode != Mode.TARGET else 1.0,
               "tok_s_batched": round(tok_s["batched"], 3), "tok_s_one_at_a_time": round(tok_s["alone"], 3),
               "batching_speedup": round(tok_s["batched"] / tok_s["alone"], 4),
               "seconds_batched": [round(x, 4) for x in seconds[mode, "batched"]],
               "seconds_one_at_a_time": [round(x, 4) for x in seconds[mode, "alone"]],
               "identical_to_one_at_a_time": [s.gen.tokens == a.tokens for s, a in zip(batched, alone)]}
        if mode != Mode.TARGET:
            row["mal_per_sequence"] = [round(g.mean_accepted_length, 3) for g in gens]
            row["beta_mean_per_sequence"] = [round(statistics.fmean(g.beta_per_step), 4)
                                             if g.beta_per_step else 1.0 for g in gens]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<12}{'batch':>6}{'MAL':>8}{'tok/s batched':>15}{'tok/s 1-at-a-time':>19}"
          f"{'x':>7}  same")
    for r in rows:
        same = "-" if r["identical_to_one_at_a_time"] is None else (
            "yes" if all(r["identical_to_one_at_a_time"]) else "NO")
        print(f"{r['mode']:<12}{r['batch']:>6}{r['mal']:>8.3f}{r['tok_s_batched']:>15.1f}"
              f"{r['tok_s_one_at_a_time']:>19.1f}{r['batching_speedup']:>7.2f}  {same}")
