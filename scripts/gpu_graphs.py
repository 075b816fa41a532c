"""GPU section `gpu_graphs`, the first thing call 1 runs: does a decode step of a tiny
model, captured as a CUDA graph (`--steps cudagraph`: runtime/backends/pytorch/compiled.py's
`captured`), replay what the same step computes eagerly? Seconds long, so that a capture
failure is known before the long sections run, and stated in the call's output tail.

A tiny Qwen3-shaped target with random weights (scripts/gpu_steps.py's TINY) and its
feature layers, a batch of 2 rows at different lengths over KV buffers filled alike: the
engine's target step (EngineSteps, as a loaded engine makes it) and the eager step are
called side by side for a few decode steps and one verify, the lengths advanced IN PLACE
between replays; their logits, features and written keys are compared.

    python -m scripts.gpu_graphs --out DIR          # scripts/gpu_check.py runs it
    SHARPDRAFT_CPU=1 python -m scripts.gpu_graphs --out DIR   # CPU: the capture is GPU-only

On CPU the capture part is skipped (GPU-only, with the reason); tests run the same
comparison over dynamo's eager backend, the compiled stand-in a CPU has.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_graphs ...")

from scripts.gpu_record import GpuOnly, SectionRecord, log, section_main

SECTION = "gpu_graphs"
BATCH, CAPACITY, LENGTHS, DECODES, VERIFY = 2, 64, (9, 23), 4, 5
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # the same kernels: equal, or nearly (bf16)


def compare_decode(device, dtype, backend: str) -> dict:
    """The target step made by `backend` (EngineSteps) against the eager step on twin KV
    buffers: DECODES one-token steps then one VERIFY-token step, the lengths advanced in
    place between calls (a captured graph must read them, not keep its capture's).
    Returns each call's largest difference and whether every one is within tolerance."""
    import torch

    from runtime.backends.pytorch.compiled import EngineSteps
    from scripts.gpu_steps import TINY, qwen3_8b_shaped

    torch.manual_seed(0)
    target, drafter = qwen3_8b_shaped(device, dtype, TINY)
    steps = EngineSteps(target, drafter.config.target_layer_ids, (1, VERIFY), backend)
    graph_cache, eager_cache = (steps.target_buffers.take(CAPACITY, BATCH) for _ in range(2))
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for buffer in (graph_cache.k, graph_cache.v):
            buffer.copy_(torch.randn(buffer.shape, generator=g, device=device).to(dtype))
        eager_cache.k.copy_(graph_cache.k)
        eager_cache.v.copy_(graph_cache.v)
    for cache in (graph_cache, eager_cache):
        cache.lengths.copy_(torch.tensor(LENGTHS, device=device))
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]
    calls = []
    with torch.inference_mode():
        for width in [1] * DECODES + [VERIFY]:
            ids = torch.randint(0, TINY["vocab"], (BATCH, width), generator=g, device=device)
            got = steps.target_step(ids, *graph_cache.layers, graph_cache.lengths)
            want = steps.target_module(ids, *eager_cache.layers, eager_cache.lengths)
            if device.type == "cuda":
                torch.cuda.synchronize()
            errors = {name: (a.float() - b.float()).abs().max().item()
                      for name, a, b in (("logits", got[0], want[0]), ("features", got[1], want[1]),
                                         ("keys", graph_cache.k, eager_cache.k))}
            calls.append(dict(width=width, lengths=graph_cache.lengths.tolist(), max_abs_error=errors,
                              passed=all(e <= tolerance for e in errors.values())))
            for cache in (graph_cache, eager_cache):  # the next step: in place, as the roles do
                cache.lengths.add_(width)
    return dict(backend=backend, dtype=str(dtype), tolerance=tolerance, calls=calls,
                passed=all(c["passed"] for c in calls))


def run(out_dir, on_cpu: bool = False, args=None) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not on_cpu
    if not on_cpu and not cuda:
        raise SystemExit("error: gpu_graphs needs a CUDA device; SHARPDRAFT_CPU=1 runs it on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu,
                           device=torch.cuda.get_device_name() if cuda else "cpu")
    record.data["versions"] = {"torch": torch.__version__}

    def eager(part):
        """The tiny model's eager step against itself through the same harness: the
        harness's own check (the CPU's share of this section)."""
        part.update(compare_decode(device, torch.float32, "eager"))
        return part["passed"]

    def captured(part):
        if not cuda:
            raise GpuOnly("capturing a decode step as a CUDA graph and replaying it needs CUDA")
        part.update(compare_decode(device, torch.bfloat16, "cudagraph"))
        for c in part["calls"]:
            log(f"{SECTION}: cudagraph width {c['width']} lengths {c['lengths']}: "
                + " ".join(f"{k}={e:.1e}" for k, e in c["max_abs_error"].items())
                + (" ok" if c["passed"] else " DIFFERS FROM EAGER"))
        return part["passed"]

    record.part("dynamo_eager", eager)
    record.part("cudagraph_decode", captured)
    data = record.finish()
    graph = data["parts"]["cudagraph_decode"]
    log(f"{SECTION}: CUDA-graph capture of a decode step: {graph['status']}"
        + (f" ({graph.get('error') or graph.get('reason')})" if graph["status"] != "passed" else
           ", replays equal eager"))
    return data


def main(argv=None) -> int:
    return section_main(SECTION, run, argv)


if __name__ == "__main__":
    sys.exit(main())
