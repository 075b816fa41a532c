"""Capturing a call in a CUDA graph the way torch.cuda.graph requires: warm-up calls on a
side stream (lazy initialisation, Triton's first compile and autotune stay out of the
capture), then one call captured. Shared by the kernel benchmark (plugins/bench_kernel.py)
and the GPU checks (scripts/gpu_kernel.py, scripts/gpu_trtllm.py)."""

from __future__ import annotations


def capture(fn, warmups: int = 3):
    """(graph, what fn returned while captured): fn() called `warmups` times on a side
    stream, then captured once. graph.replay() reruns it on the tensors it captured,
    writing that same output."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
