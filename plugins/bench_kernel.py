"""Kernel benchmark: the SharpDraft attention kernel against what a drafter would run
without it, on one GPU, eager and under CUDA-graph replay, with the K/V read rate against
the device's measured copy rate.

    python -m plugins.bench_kernel --out DIR      # DIR/bench_kernel.json and .png
    python -m plugins.bench_kernel --smoke --out DIR   # seconds-long plumbing run (CPU too)

Variants per shape: `split` (our kernel, key slices merged by a second launch: what the op
runs), `single` (key slices merged inside one launch: what the TensorRT plugin runs),
`exact_rows` (split with a row tile of exactly the step's
rows, under 16: one-row decode with a small GQA group), `unscaled` (split, beta = 1: what beta costs), `sdpa_gqa` (PyTorch SDPA with enable_gqa,
beta folded into q) and `flash_expanded` (SDPA's flash backend on K/V expanded to every
query head beforehand, the expansion not timed). Results to stdout as one line per shape;
the JSON holds every time and the ratios `single_launch_vs_split` and `decode_vs_sdpa`
(graph replay, one per shape). Without a CUDA device (and without --smoke) it refuses in
one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B-shaped drafter attention
FULL_SHAPES = [(batch, q_len, kv_len) for batch in (1, 8) for q_len in (1, 16)
               for kv_len in (8192, 32768, 65536)]
SMOKE_SHAPES = [(1, 1, 256), (1, 4, 256)]  # 2 and 8 packed rows (group 2)
VARIANTS = ("split", "single", "exact_rows", "unscaled", "sdpa_gqa", "flash_expanded")


def shape_name(batch: int, q_len: int, kv_len: int) -> str:
    return f"b{batch}_q{q_len}_kv{kv_len // 1024}k" if kv_len >= 1024 else f"b{batch}_q{q_len}_kv{kv_len}"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m plugins.bench_kernel", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", required=True, help="folder for bench_kernel.json / .png")
    p.add_argument("--repeats", type=int, default=50, help="timed calls (or replays) per measurement")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, few repeats; runs on CPU too (Triton interpreter), no graphs")
    return p.parse_args(argv)


def _variant_calls(q, k, v, visible, scaling, beta, names):
    """name -> zero-argument call for one shape's tensors."""
    import torch
    import torch.nn.functional as F

    from plugins import triton_kernel

    exact = triton_kernel.exact_row_tile(q.shape[2] * q.shape[1] // k.shape[1])
    calls = {
        "split": lambda: triton_kernel.launch(q, k, v, visible, scaling, variant="split"),
        "single": lambda: triton_kernel.launch(q, k, v, visible, scaling, variant="single"),
        "unscaled": lambda: triton_kernel.launch(q, k, v, visible, None, variant="split"),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q * beta, k, v, enable_gqa=True),
    }
    if exact is not None:  # steps under 16 packed rows: the exact-rows tile (opt-in so far)
        calls["exact_rows"] = lambda: triton_kernel.launch(q, k, v, visible, scaling, block_m=exact)
    if q.is_cuda:
        group = q.shape[1] // k.shape[1]
        k_full, v_full = (t.repeat_interleave(group, dim=1) for t in (k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q * beta, k_full, v_full)

        calls["flash_expanded"] = flash
    return {name: calls[name] for name in names if name in calls}


def time_eager_us(fn, repeats: int, cuda: bool) -> float:
    """Median device time of one call (CUDA events), or wall time off CUDA."""
    import torch

    for _ in range(3):
        fn()
    if not cuda:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph_us(fn, repeats: int) -> float:
    """Device time per replay of a CUDA graph of `fn` (captured once after a warm-up on a
    side stream, as torch.cuda.graph requires), averaged over `repeats` replays, median of 5."""
    import torch

    from plugins.cuda_graph import capture

    graph, _ = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(samples)


def copy_rate_gbps(device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median of 10)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_eager_us(lambda: dst.copy_(src), 10, True) / 1e3
    del src, dst
    return 2 * (1 << 30) / ms / 1e6


def measure(shapes, repeats: int, device, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            variants=VARIANTS, done=None) -> list[dict]:
    """One row per shape: eager and (on CUDA) graph-replay µs per variant, K/V GB/s.
    done(rows) is called after every shape (the caller saves what it has)."""
    import torch

    from plugins.scaling import QueryScaling

    cuda = torch.device(device).type == "cuda"
    scaling = QueryScaling()
    rows = []
    for batch, q_len, kv_len in shapes:
        g = torch.Generator(device=device).manual_seed(kv_len + q_len)
        q = torch.randn(batch, heads, q_len, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, device=device).to(dtype)
        visible = torch.full((batch, q_len), kv_len, device=device)  # every row sees every key
        beta = scaling.beta(visible.float())[:, None, :, None].to(dtype)
        calls = _variant_calls(q, k, v, visible, scaling, beta, variants)
        eager = {name: round(time_eager_us(fn, repeats, cuda), 2) for name, fn in calls.items()}
        graph = {name: round(time_graph_us(fn, repeats), 2) for name, fn in calls.items()} if cuda else {}
        kv_bytes = 2 * k.numel() * k.element_size()
        best = graph or eager
        rows.append(dict(shape=shape_name(batch, q_len, kv_len), batch=batch, q_len=q_len, kv_len=kv_len,
                         heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype).split(".")[-1],
                         eager_us=eager, graph_us=graph,
                         kv_gbps={name: round(kv_bytes / us / 1e3, 1) for name, us in best.items()}))
        del q, k, v
        if done:
            done(rows)
    return rows


def figures(rows: list[dict]) -> dict:
    """The named ratios, one per shape, from graph-replay times (eager where no graphs)."""
    out = {"single_launch_vs_split": {}, "decode_vs_sdpa": {}, "scaled_vs_unscaled": {}}
    for row in rows:
        times = row["graph_us"] or row["eager_us"]
        if "single" in times and "split" in times:
            out["single_launch_vs_split"][row["shape"]] = round(times["single"] / times["split"], 3)
        if "unscaled" in times and "split" in times:
            out["scaled_vs_unscaled"][row["shape"]] = round(times["split"] / times["unscaled"], 3)
        if row["q_len"] == 1 and "sdpa_gqa" in times and "split" in times:
            # what the op runs today; the opt-in exact-rows tile beside it
            out["decode_vs_sdpa"][row["shape"]] = round(times["split"] / times["sdpa_gqa"], 3)
            if "exact_rows" in times:
                out.setdefault("decode_exact_rows_vs_sdpa", {})[row["shape"]] = round(
                    times["exact_rows"] / times["sdpa_gqa"], 3)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["shape"] for r in rows]
    variants = [v for v in VARIANTS if any(v in (r["graph_us"] or r["eager_us"]) for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        ys = [(r["graph_us"] or r["eager_us"]).get(variant, 0) for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=variant)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("µs per call")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir, *, repeats: int = 50, smoke: bool = False, command: str | None = None,
        shapes=None) -> dict:
    """Measure, write out_dir/bench_kernel.json after every shape (a timeout keeps the
    shapes measured: `complete` says whether every one was) and the .png at the end;
    return the report. `shapes`: (batch, q_len, kv_len) to measure instead of the full
    set (the GPU run's budget)."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if smoke:
        shapes, dtype, dims = shapes or SMOKE_SHAPES, (torch.float16 if cuda else torch.float32), (4, 2, 32)
        repeats = min(repeats, 3)
    else:
        shapes, dtype, dims = shapes or FULL_SHAPES, torch.bfloat16, (HEADS, KV_HEADS, HEAD_DIM)
    name = torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the copy rate first: every shape's row can then say its fraction as it is saved
    copy = round(copy_rate_gbps(device), 1) if cuda and not smoke else None
    report = dict(device=name, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  command=command or "python -m plugins.bench_kernel", smoke=smoke,
                  timing="graph replay" if cuda else "wall clock, eager (no CUDA graphs off CUDA)",
                  copy_rate_gbps=copy, planned_shapes=[shape_name(*s) for s in shapes], complete=False)

    def save(rows):
        for row in rows:
            row["kv_fraction_of_copy_rate"] = ({k: round(g / copy, 3) for k, g in row["kv_gbps"].items()}
                                               if copy else None)
        report.update(shapes=rows, complete=len(rows) == len(shapes), **figures(rows))
        tmp = out / ".bench_kernel.json.tmp"  # renamed: never half a file
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out / "bench_kernel.json")

    rows = measure(shapes, repeats, device, dtype, *dims, done=save)
    save(rows)
    plot(rows, out / "bench_kernel.png", f"{name}: µs per call ({report['timing']})")
    return report


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("error: plugins.bench_kernel needs a CUDA device (none visible); "
              "--smoke runs the plumbing on CPU", file=sys.stderr)
        return 1
    command = "python -m plugins.bench_kernel " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run(args.out, repeats=args.repeats, smoke=args.smoke, command=command.strip())
    for row in report["shapes"]:
        times = row["graph_us"] or row["eager_us"]
        print(f"{row['shape']:16s} " + " ".join(f"{k}={t:.1f}us" for k, t in times.items()), flush=True)
    print(f"wrote {Path(args.out) / 'bench_kernel.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
