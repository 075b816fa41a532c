"""GPU section `gpu_kernel`: the SharpDraft attention op and kernel on one GPU.

Parts, each saved to OUT/gpu_kernel.json as it ends (correctness after every case):
- correctness: the kernel variants (auto slices, single pass, single launch; 5 slices
  in both forms on the DFlash-block case; the exact-rows decode tile on the 4-row case)
  and the registered op against the reference, bf16 on every case (each dtype is a
  fresh set of Triton compiles: fp32 and fp16 run on CPU, under the interpreter, in the
  rehearsal); the in-kernel beta against plugins.scaling.
- capture: the op captured once in a CUDA graph, the visible counts changed IN PLACE,
  replayed, compared with the reference at the new counts (beta must follow them).
- host_us_per_call: µs of CPU per eager op call (median of 200, after warm-up).
- compiled_op: torch.compile(mode="reduce-overhead", fullgraph=True) over a step calling
  the op (inductor, replayed as a CUDA graph), counts changed between calls, against eager.
- bench: plugins.bench_kernel on four shapes (its JSON, saved after each shape, and plot
  land beside this file).
- tensorrt_engine: where TensorRT builds, the tiny pair built with the plugin form;
  elsewhere (the GPU machine has no TensorRT) skipped as not installed, with the reason.

    python -m scripts.gpu_kernel --out DIR            # scripts/gpu_check.py runs it
    SHARPDRAFT_CPU=1 python -m scripts.gpu_kernel --out DIR   # CPU: Triton's interpreter on
        # small cases in fp32/fp16, the op under inductor; capture and host timings GPU-only
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_kernel ...")

import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from scripts.gpu_record import Absent, GpuOnly, NotRun, SectionRecord, log, section_main

REPO = Path(__file__).resolve().parent.parent
SECTION = "gpu_kernel"
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # bf16: ~2 ulp at |x| ~ 1
DEVICE = "cuda"  # "cpu" on CPU (run sets it)
# dtype -> the cases it runs on: on the GPU bf16 on every case (fp32 and fp16 compiles cut:
# the interpreter covers both on CPU); on CPU fp32 on every small case, fp16 on one
DTYPE_CASES = {"bfloat16": None}
CPU_DTYPE_CASES = {"float32": None, "float16": ("small_decode",)}
# the 5-slice variants (a slice count the auto choice does not take) on this case alone
SLICES_CASE = "dflash_block16_N16416"
BENCH_SHAPES = [(1, 16, 8192), (1, 16, 32768), (1, 1, 32768), (8, 1, 32768)]


def case(seed, batch, heads, kv_heads, q_len, kv_len, head_dim, dtype):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g, device=DEVICE).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, device=DEVICE).to(dtype)
    return q, k, v


def correctness_cases():
    """(name, batch, heads, kv_heads, q_len, kv_len, head_dim, visibility, scaling)."""
    from plugins.scaling import QueryScaling

    small = QueryScaling(ref_keys=64, top_k=8)
    return [
        ("dflash_block16_N16416", 1, 32, 8, 16, 16416, 128, "block", QueryScaling()),
        ("chain_causal_past_cap", 2, 8, 2, 7, 1500, 64, "causal", small),
        ("decode_gqa4", 3, 16, 4, 1, 4097, 128, "random", small),
        ("decode_gqa5_d80", 2, 10, 2, 1, 9000, 80, "random", small),
        ("prefill_ragged_d80", 1, 4, 4, 300, 300, 80, "causal", small),
        ("plain_attention", 1, 8, 8, 16, 2048, 64, "block", None),
    ]


def cpu_cases():
    """Small cases for the Triton interpreter (CPU), of the same kinds of visibility: the
    interpreter runs a program per tile in Python, so the GPU's shapes take it hours."""
    from plugins.scaling import QueryScaling

    small = QueryScaling(ref_keys=64, top_k=8)
    return [("small_block", 1, 4, 2, 4, 100, 16, "block", small),
            ("small_decode", 2, 4, 2, 1, 70, 16, "random", small)]


def visible_for(kind, b, t, kv):
    import torch

    if kind == "block":
        return torch.full((b, t), kv, device=DEVICE)
    if kind == "causal":
        return (torch.arange(t, device=DEVICE) + kv - t + 1).expand(b, t).contiguous()
    return torch.randint(1, kv + 1, (b, t), device=DEVICE)


KERNEL_VARIANTS = (("auto_splits", dict()), ("single_pass", dict(splits=1)), ("splits_5", dict(splits=5)),
                   ("single_launch", dict(variant="single")), ("single_launch_5", dict(variant="single", splits=5)))
SLICED = ("splits_5", "single_launch_5")


def correctness(report: dict, save, on_cpu: bool = False) -> bool:
    """Every variant and the op against the reference, case by case (saved after each)."""
    import torch

    from plugins import triton_kernel
    from plugins.attention import reference_attention, sharpdraft_attention
    from plugins.scaling import QueryScaling

    ok = True
    rows = report.setdefault("correctness", [])
    cases = cpu_cases() if on_cpu else correctness_cases()
    # the interpreter's tl.dot is wrong for bf16: on CPU fp32 and fp16
    plan = CPU_DTYPE_CASES if on_cpu else DTYPE_CASES
    for dtype_name, only in plan.items():
        dtype, tolerance = getattr(torch, dtype_name), TOLERANCE[dtype_name]
        for seed, (name, b, h, kvh, t, kv, d, kind, scaling) in enumerate(cases):
            if only is not None and name not in only:
                continue
            q, k, v = case(seed, b, h, kvh, t, kv, d, dtype)
            visible = visible_for(kind, b, t, kv)
            want = reference_attention(q, k, v, visible, None, scaling).float()
            errors = {}
            variants = [v for v in KERNEL_VARIANTS if v[0] not in SLICED or on_cpu or name == SLICES_CASE]
            exact = triton_kernel.exact_row_tile(t * h // kvh)
            # the one-row decode tile, both merge variants: bf16 on the 4-row case only (its
            # compiles are slow; fp32/fp16 are covered on CPU by the interpreter)
            if exact is not None and dtype_name == "bfloat16" and name == "decode_gqa4":
                variants += [("exact_rows", dict(block_m=exact)), ("exact_rows_single", dict(block_m=exact, variant="single"))]
            for label, options in variants:
                got = triton_kernel.attention(q, k, v, visible, scaling, **options)
                errors[label] = (got.float() - want).abs().max().item()
            # the registered op must dispatch to the kernel on CUDA
            errors["op"] = (sharpdraft_attention(q, k, v, visible, scaling).float() - want).abs().max().item()
            passed = all(e <= tolerance for e in errors.values()) and all(map(math.isfinite, errors.values()))
            ok &= passed
            rows.append(dict(case=name, dtype=dtype_name, tolerance=tolerance, max_abs_error=errors,
                             passed=passed))
            save()
            print(f"correctness {name:24s} {dtype_name:9s} "
                  + " ".join(f"{k}={e:.1e}" for k, e in errors.items()) + f" {'ok' if passed else 'FAIL'}",
                  flush=True)
    return ok


def beta(report: dict) -> bool:
    """The kernel's in-kernel beta against plugins.scaling's, at counts across the regimes."""
    import torch

    from plugins import triton_kernel
    from plugins.scaling import QueryScaling

    ok = True
    counts = torch.tensor([1, 63, 64, 65, 2048, 2049, 16416, 51694, 10**6], device=DEVICE)
    for scaling in (QueryScaling(), QueryScaling(ref_keys=64, top_k=8)):
        got = triton_kernel.kernel_beta(counts, scaling).double().cpu()
        want = scaling.beta(counts.double().cpu())
        error = ((got - want).abs() / want).max().item()
        ok &= error <= 1e-6
        report.setdefault("rows", []).append(dict(scaling=scaling.to_dict(), max_rel_error=error,
                                                  passed=error <= 1e-6))
        print(f"beta in-kernel vs scaling.beta ref_keys={scaling.ref_keys}: max rel error {error:.2e}", flush=True)
    return ok


def capture(report: dict) -> bool:
    """Capture the op once, change the counts in place, replay: output and beta follow."""
    import torch

    from plugins import triton_kernel
    from plugins.attention import reference_attention, sharpdraft_attention
    from plugins.cuda_graph import capture as capture_graph
    from plugins.scaling import QueryScaling

    scaling = QueryScaling()
    batch, heads, kv_heads, q_len, kv_len, head_dim = 2, 32, 8, 16, 65536, 128
    q, k, v = case(11, batch, heads, kv_heads, q_len, kv_len, head_dim, torch.float16)
    q *= 3  # peaked attention, so beta's effect stands far above fp16 rounding
    visible = torch.full((batch, q_len), 2048, device=DEVICE)  # beta = 1 here
    calls = {"op": lambda: sharpdraft_attention(q, k, v, visible, scaling),
             "single_launch": lambda: triton_kernel.launch(q, k, v, visible, scaling, variant="single")}
    results = {}
    for name, fn in calls.items():
        visible.fill_(2048)
        try:
            graph, out = capture_graph(fn)
        except Exception as exc:  # the old op failed here: a host read invalidates capture
            results[name] = dict(passed=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        checks = []
        for counts in ([2048] * q_len, [40000] * q_len, list(range(60000, 60000 + q_len))):
            visible.copy_(torch.tensor(counts, device=DEVICE).expand(batch, q_len))  # in place
            graph.replay()
            torch.cuda.synchronize()
            want = reference_attention(q, k, v, visible, None, scaling).float()
            unscaled = reference_attention(q, k, v, visible, None, None).float()
            error = (out.float() - want).abs().max().item()
            # beta must follow the new counts: past 2,048 keys beta > 1, and the replay must
            # sit on the scaled reference, far from the unscaled one (beta at capture time)
            moved = (out.float() - unscaled).abs().max().item()
            checks.append(dict(visible=counts[0], max_abs_error=error, distance_from_unscaled=moved,
                               beta=float(scaling.beta(counts[0])),
                               passed=error <= TOLERANCE["float16"] and (counts[0] <= 2048 or moved > 10 * error)))
        results[name] = dict(passed=all(c["passed"] for c in checks), replays=checks)
        print(f"capture {name}: " + " ".join(f"N={c['visible']} err={c['max_abs_error']:.1e}" for c in checks)
              + f" {'ok' if results[name]['passed'] else 'FAIL'}", flush=True)
    report.update(results)
    return all(r["passed"] for r in results.values())


def host_us_per_call(report: dict, calls: int = 200) -> dict:
    """CPU time of one eager call, median of `calls` (the GPU is not waited for)."""
    import torch

    from plugins import triton_kernel
    from plugins.attention import sharpdraft_attention
    from plugins.scaling import QueryScaling

    scaling = QueryScaling()
    q, k, v = case(3, 1, 32, 8, 16, 8192, 128, torch.bfloat16)
    visible = torch.full((1, 16), 8192, device=DEVICE)
    fns = {"op": lambda: sharpdraft_attention(q, k, v, visible, scaling),
           "launch_split": lambda: triton_kernel.launch(q, k, v, visible, scaling),
           "launch_single": lambda: triton_kernel.launch(q, k, v, visible, scaling, variant="single")}
    result = {}
    for name, fn in fns.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
        result[name] = round(statistics.median(times), 1)
    print("host us per eager call (median of 200): " + " ".join(f"{k}={t}" for k, t in result.items()), flush=True)
    report["us"] = result
    return result


def tensorrt_engine(report: dict, workdir: Path) -> bool:
    """Where TensorRT can build here: the tiny test pair built with --backend tensorrt
    (plugin form), `python -m runtime generate` on it, tokens compared with the torch
    backend on the same checkpoints. Elsewhere: NotRun, saying why."""
    import build_engine

    why = build_engine.tensorrt_usable()
    if why is not None:
        raise NotRun(why)
    from scripts import tiny_checkpoints as tiny
    from runtime.cli import run
    from runtime.__main__ import main as runtime_main

    target = tiny.make_target(workdir / "target", context=4096)
    drafter = tiny.make_drafter(workdir / "drafter", target)
    engine = workdir / "engine-trt"
    code = run(build_engine.main, ["--drafter", "dflash", "--sharpdraft", "--target", str(target),
                                   "--drafter-checkpoint", str(drafter), "--ref-keys", "64",
                                   "--top-k", "8", "--backend", "tensorrt", "--attention", "plugin",
                                   "--max-seq-len", "1024", "--output", str(engine)])
    if code != 0:
        report["tensorrt_engine"] = {"passed": False, "error": "build_engine.py --backend tensorrt failed"}
        return False
    from runtime.engine import load_tokenizer

    ids = load_tokenizer(target).encode(tiny.stdlib_text(), add_special_tokens=False)[:600]
    prompt = workdir / "prompt.txt"
    prompt.write_text(load_tokenizer(target).decode(ids))
    tokens = {}
    for backend in ("tensorrt", "torch"):
        out = workdir / f"generate-{backend}.json"
        with open(out, "w") as handle, contextlib.redirect_stdout(handle):
            code = run(runtime_main, ["generate", "--engine-dir", str(engine), "--backend", backend,
                                      "--prompt-file", str(prompt), "--max-new-tokens", "32",
                                      "--json", "--ignore-eos"])
        if code != 0:
            report["tensorrt_engine"] = {"passed": False, "error": f"generate --backend {backend} failed"}
            return False
        tokens[backend] = json.loads(out.read_text())["tokens"]
    from runtime.spec import open_spec

    record = open_spec(engine, verify="skip").manifest.extra["tensorrt"]
    passed = tokens["tensorrt"] == tokens["torch"]
    report["tensorrt_engine"] = dict(passed=passed, version=record["version"], gpu=record["gpu"],
                                     tokens=tokens)
    print(f"tensorrt engine: TensorRT {record['version']} on {record['gpu']}, generate tokens "
          f"{'match' if passed else 'DIFFER FROM'} the torch backend's", flush=True)
    return passed


def tensorrt_plugin(report: dict) -> bool:
    """The plugin's engine path end to end where TensorRT builds here; elsewhere (the GPU
    machine has no TensorRT) "not run" with the reason, which does not fail the section."""
    try:
        with tempfile.TemporaryDirectory() as workdir:
            passed = tensorrt_engine(report, Path(workdir))
    except NotRun as exc:
        report["tensorrt_engine"] = {"status": "not run", "reason": str(exc)}
        print(f"tensorrt engine: not run ({exc})", flush=True)
        return True
    report["tensorrt_engine"]["status"] = "passed" if passed else "failed"
    return passed


def tensorrt_part(part: dict) -> bool:
    """tensorrt_plugin as a part of the record: its figures in the part, "not run" kept."""
    passed = tensorrt_plugin(part)
    inner = part.pop("tensorrt_engine")
    inner["result"] = inner.pop("status")
    part.update(inner)
    if inner["result"] == "not run":
        raise Absent(inner["reason"])
    return passed



def compiled_op(report: dict, on_cpu: bool = False) -> bool:
    """torch.compile(mode="reduce-overhead", fullgraph=True) over a step that calls the op:
    inductor with the op as one extern node, replayed as a CUDA graph (the op must be
    capturable), the visible counts changed between calls; every call against eager. On
    CPU inductor too (C++ code, no CUDA graphs: the default mode), in fp32 on small shapes."""
    import torch

    from plugins.attention import sharpdraft_attention
    from plugins.scaling import QueryScaling

    scaling = QueryScaling()
    dtype = torch.float32 if on_cpu else torch.bfloat16
    heads, kv_heads, q_len, kv_len, dim = (4, 2, 4, 96, 16) if on_cpu else (32, 8, 16, 8192, 128)
    q, k, v = case(5, 1, heads, kv_heads, q_len, kv_len, dim, dtype)
    visible = torch.full((1, q_len), kv_len // 2, device=DEVICE)

    def step(q, k, v, visible):
        return sharpdraft_attention(q * 1.5, k, v, visible, scaling) + 1

    options = dict(backend="inductor") if on_cpu else dict(mode="reduce-overhead")
    compiled = torch.compile(step, fullgraph=True, dynamic=False, **options)
    report.update(mode=options, dtype=str(dtype), calls=[])
    ok = True
    for i, n in enumerate((kv_len // 2, kv_len // 2, kv_len - 3, kv_len)):
        visible.fill_(n)
        started = time.perf_counter()
        got = compiled(q, k, v, visible)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        error = (got.float() - step(q, k, v, visible).float()).abs().max().item()
        passed = error <= TOLERANCE[str(dtype).removeprefix("torch.")]
        ok &= passed
        report["calls"].append(dict(visible=n, seconds=round(seconds, 3), max_abs_error=error, passed=passed))
        print(f"compiled op ({options}) call {i + 1} N={n}: {seconds:.2f} s, err {error:.1e}", flush=True)
    return ok


def bench(report: dict, out_dir, on_cpu: bool, repeats: int = 10) -> bool:
    from plugins import bench_kernel

    # on CPU the bench's small shapes under the interpreter (wall clock, no graphs)
    figures = bench_kernel.run(out_dir, repeats=repeats, smoke=on_cpu, shapes=None if on_cpu else BENCH_SHAPES,
                               command="python -m scripts.gpu_kernel (part bench)")
    report.update(single_launch_vs_split=figures["single_launch_vs_split"],
                  decode_vs_sdpa=figures["decode_vs_sdpa"], scaled_vs_unscaled=figures["scaled_vs_unscaled"],
                  copy_rate_gbps=figures["copy_rate_gbps"], bench_file="bench_kernel.json")
    return True


def cuda_only(fn, on_cpu: bool, why: str):
    def measure(part):
        if on_cpu:
            raise GpuOnly(why)
        return fn(part)
    return measure


def run(out_dir, on_cpu: bool = False, args=None) -> dict:
    """The section: each part in turn, the file saved after each (correctness: each case)."""
    global DEVICE
    if on_cpu:
        DEVICE = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch

    if not on_cpu and not torch.cuda.is_available():
        raise SystemExit("error: gpu_kernel needs a CUDA device; SHARPDRAFT_CPU=1 runs it on CPU")
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (Triton interpreter)"
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu, device=device)
    record.data["versions"] = {"torch": torch.__version__, "triton": _version("triton"),
                               "python": sys.version.split()[0]}
    record.part("correctness", lambda part: correctness(part, record.save, on_cpu))
    if on_cpu:
        record.part("correctness_bf16", cuda_only(None, on_cpu, "the interpreter's tl.dot is wrong in bf16: "
                                                  "bf16 is compiled and checked on the GPU (its correctness part)"))
    record.part("beta", beta)
    record.part("capture", cuda_only(capture, on_cpu, "captures the op in a CUDA graph and replays it"))
    record.part("host_us_per_call", cuda_only(host_us_per_call, on_cpu,
                                              "host time of an eager launch is a GPU figure (the "
                                              "interpreter runs the kernel on the host)"))
    record.part("compiled_op", lambda part: compiled_op(part, on_cpu))
    record.part("bench", lambda part: bench(part, out_dir, on_cpu))
    record.part("tensorrt_engine", tensorrt_part)
    return record.finish()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv=None) -> int:
    return section_main(SECTION, run, argv)


if __name__ == "__main__":
    sys.exit(main())
