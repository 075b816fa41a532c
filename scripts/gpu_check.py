#!/usr/bin/env python3
"""The Triton SharpDraft kernel on a real GPU, in one short run: correctness against the
reference op in fp32/fp16/bf16 (bf16 cannot be checked on CPU: the interpreter's tl.dot is
wrong for it), then timings of a drafter-like step against the reference op and plain
SDPA, then, where TensorRT imports, the TensorRT engine path: the tiny test pair built with
--backend tensorrt (plugin form), generate, tokens compared with the torch backend
(otherwise the section is "not run", with the reason).

    python scripts/gpu_check.py --out DIR        # writes DIR/gpu_check.json

Results go to stdout as one line per check and to the JSON file ($OUT if --out is not
given); progress goes to stderr. Exits 1 with one line when no CUDA device exists. Every
section ends as "passed", "failed" or "not run" with the reason (report["sections"]); a
section that did not run is never counted as passed, and the last line names each one.

Then, where `tensorrt_llm` imports, SharpDraft inside TensorRT-LLM: one prompt through a
DFlash engine built with `build_engine.py --backend trtllm` (--trtllm-engine, default
engines/dflash-sharpdraft-trtllm), target-only, DFlash without the hook and DFlash with
it; greedy tokens must be equal in all three (speculative decoding is lossless whatever
beta does to the drafts), and the hook must have wrapped the drafter. Where it does not
import, the section is "not run" and one line says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # bf16: ~2 ulp at |x| ~ 1
DEVICE = "cuda"
STEP = (1, 32, 8, 16, 128)  # timed step: batch, q heads, kv heads, q_len (DFlash block), head_dim


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse(argv):
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT"),
                   help="folder for gpu_check.json (default: $OUT)")
    p.add_argument("--repeats", type=int, default=50, help="timed launches per measurement")
    p.add_argument("--contexts", default="4096,16384,65536", help="KV lengths to time")
    p.add_argument("--trtllm-engine", metavar="DIR", default=str(Path(__file__).resolve().parent.parent
                                                                  / "engines" / "dflash-sharpdraft-trtllm"),
                   help="a DFlash engine built with --backend trtllm, for the TensorRT-LLM section")
    p.add_argument("--trtllm-tokens", type=int, default=48, help="greedy tokens per TensorRT-LLM run")
    return p.parse_args(argv)


PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"


class NotRun(Exception):
    """A section cannot run here; the message (one line) says why."""


def trtllm_section(report: dict, engine_dir: str, tokens: int) -> bool:
    """SharpDraft's hook inside TensorRT-LLM; NotRun where tensorrt_llm cannot run."""
    from runtime import trtllm

    try:
        trtllm.require_tensorrt_llm()
    except ImportError as exc:
        raise NotRun(str(exc)) from None
    from plugins.trtllm import hook
    from runtime.manifest import read_manifest
    from runtime.modes import Mode

    engine = Path(engine_dir)
    if not (engine / "engine.json").is_file():
        raise NotRun(f"{engine} has no engine.json — build one with: python build_engine.py --drafter "
                     f"dflash --sharpdraft --backend trtllm --output {engine}")
    manifest = read_manifest(engine)
    prompt = "def fibonacci(n):\n    "
    runs = {}
    for mode in (Mode.TARGET, Mode.FROZEN, Mode.SHARPDRAFT):  # TensorRT-LLM's own loop runs these
        started = time.perf_counter()
        result = trtllm.generate(manifest, prompt, tokens, sharpdraft=mode.scaled,
                                 speculative=mode.uses_drafter_model)
        runs[mode] = dict(tokens=result["tokens"], seconds=round(time.perf_counter() - started, 2),
                          applied=result.get("sharpdraft_applied"))
        log(f"trtllm {mode}: {len(result['tokens'])} tokens in {runs[mode]['seconds']} s")
    # the launch's proof check: drafters wrapped where TensorRT-LLM built them
    hooked = len((runs[Mode.SHARPDRAFT]["applied"] or {}).get("drafters", []))
    hook.uninstall()
    equal = runs[Mode.FROZEN]["tokens"] == runs[Mode.TARGET]["tokens"] == runs[Mode.SHARPDRAFT]["tokens"]
    ok = equal and hooked > 0
    report["trtllm"] = dict(runs=runs, greedy_equal=equal, drafters_hooked=hooked, passed=ok)
    print(f"trtllm: greedy tokens {'equal' if equal else 'DIFFER'} across target-only / frozen / "
          f"SharpDraft; hook wrapped {hooked} drafter(s)", flush=True)
    return ok


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
        ("prefill_ragged_d80", 1, 4, 4, 300, 300, 80, "causal", small),
        ("plain_attention", 1, 8, 8, 16, 2048, 64, "block", None),
    ]


def correctness(report: dict) -> bool:
    import torch

    from plugins import triton_kernel
    from plugins.attention import reference_attention, sharpdraft_attention
    from plugins.scaling import QueryScaling

    small = QueryScaling(ref_keys=64, top_k=8)
    ok = True
    for dtype_name, tolerance in TOLERANCE.items():
        dtype = getattr(torch, dtype_name)
        for seed, (name, b, h, kvh, t, kv, d, kind, scaling) in enumerate(correctness_cases()):
            q, k, v = case(seed, b, h, kvh, t, kv, d, dtype)
            if kind == "block":
                visible = torch.full((b, t), kv, device=DEVICE)
            elif kind == "causal":
                visible = (torch.arange(t, device=DEVICE) + kv - t + 1).expand(b, t).contiguous()
            else:
                visible = torch.randint(1, kv + 1, (b, t), device=DEVICE)
            want = reference_attention(q, k, v, visible, None, scaling).float()
            errors = {}
            for label, splits in (("auto_splits", None), ("single_pass", 1), ("splits_5", 5)):
                got = triton_kernel.attention(q, k, v, visible, scaling, splits=splits)
                errors[label] = (got.float() - want).abs().max().item()
            # The registered op must dispatch to the kernel on CUDA.
            errors["op"] = (sharpdraft_attention(q, k, v, visible, scaling).float() - want).abs().max().item()
            passed = all(e <= tolerance for e in errors.values()) and all(map(math.isfinite, errors.values()))
            ok &= passed
            report["correctness"].append(dict(case=name, dtype=dtype_name, tolerance=tolerance,
                                              max_abs_error=errors, passed=passed))
            print(f"correctness {name:24s} {dtype_name:9s} "
                  + " ".join(f"{k}={e:.2e}" for k, e in errors.items()) + f" {'ok' if passed else 'FAIL'}",
                  flush=True)
    counts = torch.tensor([1, 63, 64, 65, 2048, 2049, 16416, 51694, 10**6], device=DEVICE)
    for scaling in (QueryScaling(), small):
        got = triton_kernel.kernel_beta(counts, scaling).double().cpu()
        want = scaling.beta(counts.double().cpu())
        error = ((got - want).abs() / want).max().item()
        ok &= error <= 1e-6
        report["beta"].append(dict(scaling=scaling.to_dict(), max_rel_error=error, passed=error <= 1e-6))
        print(f"beta in-kernel vs scaling.beta ref_keys={scaling.ref_keys}: max rel error {error:.2e}", flush=True)
    return ok


def median_ms(fn, repeats: int) -> float:
    import torch

    for _ in range(3):  # compile + warm caches
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timings(report: dict, contexts, repeats: int, sm_count: int) -> None:
    import torch
    import torch.nn.functional as F

    from plugins import triton_kernel
    from plugins.attention import reference_attention
    from plugins.scaling import QueryScaling

    scaling = QueryScaling()
    batch, heads, kv_heads, q_len, head_dim = STEP  # a DFlash step, Qwen3-8B-like
    for dtype_name in ("bfloat16", "float16"):
        dtype = getattr(torch, dtype_name)
        for kv in contexts:
            q, k, v = case(kv, batch, heads, kv_heads, q_len, kv, head_dim, dtype)
            visible = torch.full((batch, q_len), kv, device=DEVICE)
            beta = scaling.beta(visible.float())[:, None, :, None].to(dtype)
            run = {
                "kernel": lambda: triton_kernel.launch(q, k, v, visible, scaling),
                "kernel_single_pass": lambda: triton_kernel.launch(q, k, v, visible, scaling, splits=1),
                "reference_op": lambda: reference_attention(q, k, v, visible, None, scaling),
                # What a frozen drafter pays: SDPA over all keys (a DFlash block sees them all),
                # with beta folded into q beforehand.
                "sdpa": lambda: F.scaled_dot_product_attention(q * beta, k, v, enable_gqa=True),
            }
            ms = {name: median_ms(fn, repeats) for name, fn in run.items()}
            blocks = triton_kernel.launch_blocks(q_len * heads // kv_heads, head_dim)
            tiles, batch_kv_heads = triton_kernel.launch_grid(batch, q_len, kv_heads, heads // kv_heads,
                                                              blocks["BLOCK_M"])
            splits, _ = triton_kernel.key_splits(tiles * batch_kv_heads, kv, blocks["BLOCK_N"], sm_count)
            row = dict(dtype=dtype_name, kv_len=kv, batch=batch, heads=heads, kv_heads=kv_heads,
                       q_len=q_len, head_dim=head_dim, median_ms=ms, key_splits=splits,
                       # K and V are read once per step: the bandwidth a memory-bound step reaches.
                       kernel_kv_gbps=2 * k.numel() * k.element_size() / ms["kernel"] / 1e6,
                       speedup_vs_reference=ms["reference_op"] / ms["kernel"],
                       speedup_vs_sdpa=ms["sdpa"] / ms["kernel"])
            report["timings"].append(row)
            print(f"time {dtype_name:9s} kv={kv:6d} " + " ".join(f"{n}={t:.3f}ms" for n, t in ms.items())
                  + f" | kernel reads K/V at {row['kernel_kv_gbps']:.0f} GB/s, x{row['speedup_vs_reference']:.2f}"
                  f" vs reference, x{row['speedup_vs_sdpa']:.2f} vs sdpa", flush=True)


def tensorrt_engine(report: dict, workdir: Path) -> bool:
    """Where TensorRT can build here: the tiny test pair built with --backend tensorrt
    (plugin form), `python -m runtime generate` on it, tokens compared with the torch
    backend on the same checkpoints. Elsewhere: NotRun, saying why."""
    import build_engine

    why = build_engine.tensorrt_usable()
    if why is not None:
        raise NotRun(why)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny
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
        report["tensorrt"] = {"passed": False, "error": "build_engine.py --backend tensorrt failed"}
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
            report["tensorrt"] = {"passed": False, "error": f"generate --backend {backend} failed"}
            return False
        tokens[backend] = json.loads(out.read_text())["tokens"]
    record = json.loads((engine / "engine.json").read_text())["extra"]["tensorrt"]
    passed = tokens["tensorrt"] == tokens["torch"]
    report["tensorrt"] = dict(passed=passed, version=record["version"], gpu=record["gpu"],
                              tokens=tokens)
    print(f"tensorrt engine: TensorRT {record['version']} on {record['gpu']}, generate tokens "
          f"{'match' if passed else 'DIFFER FROM'} the torch backend's", flush=True)
    return passed


def run_sections(report: dict, sections) -> bool:
    """Run (name, function) sections in order; report["sections"][name] is {"status":
    passed | failed | not run, "reason"?}. A section raising NotRun did not run; one raising
    anything else failed, and the sections after it did not run. True when none failed."""
    statuses = report.setdefault("sections", {})
    broken = None
    for name, section in sections:
        try:
            if broken is not None:
                raise NotRun(f"stopped after {broken}")
            statuses[name] = {"status": PASSED if section() else FAILED}
        except NotRun as exc:
            statuses[name] = {"status": NOT_RUN, "reason": str(exc)}
        except Exception as exc:  # keep what was measured; say what broke in one line
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            statuses[name] = {"status": FAILED, "reason": reason}
            report["error"] = reason
            print(f"error: {name}: {reason}", file=sys.stderr)
            broken = f"{name} raised {type(exc).__name__}"
        status = statuses[name]
        print(f"{name}: {status['status']}" + (f" ({status['reason']})" if "reason" in status else ""),
              flush=True)
    return all(s["status"] != FAILED for s in statuses.values())


def summary(report: dict) -> str:
    """The last line: the verdict over the sections that ran, and each section's status."""
    statuses = report["sections"]
    verdict = "FAILED" if any(s["status"] == FAILED for s in statuses.values()) else "passed"
    ran = [n for n, s in statuses.items() if s["status"] != NOT_RUN]
    return (f"gpu_check {verdict} ({len(ran)} of {len(statuses)} sections ran): "
            + "; ".join(f"{name} {s['status']}" for name, s in statuses.items()))


def main(argv) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device visible; gpu_check.py needs an NVIDIA GPU "
              "(on CPU run pytest tests/test_triton_kernel.py, which uses Triton's interpreter)",
              file=sys.stderr)
        return 1
    import triton

    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    report = dict(device=props.name, sm_count=props.multi_processor_count,
                  capability=list(torch.cuda.get_device_capability()), torch=torch.__version__,
                  triton=triton.__version__, correctness=[], beta=[], timings=[])
    log(f"gpu_check on {props.name} ({props.multi_processor_count} SMs)")
    contexts = [int(c) for c in args.contexts.split(",") if c]

    def timed():
        timings(report, contexts, args.repeats, props.multi_processor_count)
        return True

    def tensorrt():
        with tempfile.TemporaryDirectory() as workdir:
            return tensorrt_engine(report, Path(workdir))

    ok = run_sections(report, [("correctness", lambda: correctness(report)), ("timings", timed),
                               ("tensorrt", tensorrt),
                               ("trtllm", lambda: trtllm_section(report, args.trtllm_engine,
                                                                 args.trtllm_tokens))])
    report["passed"], report["seconds"] = ok, round(time.perf_counter() - started, 1)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {out / 'gpu_check.json'}")
    print(f"{summary(report)} in {report['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
