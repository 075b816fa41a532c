"""`python -m plugins.trtllm bench-wrapper`: the host cost of SharpDraft's DFlash kernel
wrappers, one wrapped call against the unwrapped one, per attention backend, on the
plain-torch stand-ins (plugins/trtllm/standins.py), on CPU.

Why it matters: TensorRT-LLM replays decode steps from CUDA graphs, where a wrapper's
Python does not run, but mixed context + generation batches run eagerly (and without
CUDA graphs everything does): there every draft layer pays the wrapper's Python and its
extra small kernels on the host. Two figures per backend, medians over rounds:

- `kernel`: the stand-in kernel unwrapped vs wrapped (a decode-sized call: 4 requests,
  a block of 8 queries, 8 query heads over 2 KV heads, head_dim 64, 40-64 keys);
- `host`: the same wrapper around a kernel that does nothing (same signature, returns its
  query): the wrapper's own cost, counter add included, which is what a real GPU kernel
  call gains in launch time (the stand-ins' attention itself is CPU work a GPU does not do).

It imports the wrappers by their public names only (kernels.wrap_*), so the same file can
time an older checkout: `PYTHONPATH=OLD python plugins/trtllm/bench.py`.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

BATCH, BLOCK, HEADS, KV_HEADS, DIM, PAGE = 4, 8, 8, 2, 64, 32
TOTALS = (40, 48, 56, 64)  # keys per request (context + block): small, so the host cost shows


def _calls():
    """{backend: (kernel, wrap, args, kwargs)}: one decode-sized call of each DFlash kernel."""
    from plugins.trtllm import kernels, standins

    g = torch.Generator().manual_seed(0)
    seq = torch.tensor(TOTALS, dtype=torch.int32)
    per_seq = -(-max(TOTALS) // PAGE)
    pages = BATCH * per_seq
    table = torch.arange(pages, dtype=torch.int32).reshape(BATCH, per_seq)
    cache = torch.randn(BATCH, per_seq * PAGE, KV_HEADS, DIM, generator=g)
    q = torch.randn(BATCH, BLOCK, HEADS, DIM, generator=g)
    hnd = tuple(torch.randn(pages, KV_HEADS, PAGE, DIM, generator=g) for _ in range(2))
    nhd = tuple(torch.randn(pages, PAGE, KV_HEADS, DIM, generator=g) for _ in range(2))
    cum_q = torch.arange(0, (BATCH + 1) * BLOCK, BLOCK, dtype=torch.int32)
    cum_kv = torch.cat((torch.zeros(1, dtype=torch.int32), seq.cumsum(0, dtype=torch.int32)))
    return {
        "VANILLA": (standins.flash_attn_with_kvcache, kernels.wrap_flash_attn_with_kvcache, (),
                    dict(q=q, k_cache=cache, v_cache=cache.clone(), cache_seqlens=seq,
                         cache_batch_idx=torch.arange(BATCH, dtype=torch.int32), causal=False,
                         window_size=(-1, -1))),
        "TRTLLM decode": (standins.trtllm_batch_decode_with_kv_cache, kernels.wrap_trtllm_gen_decode, (),
                          dict(query=q.reshape(-1, HEADS, DIM), kv_cache=hnd, workspace_buffer=None,
                               block_tables=table, seq_lens=seq, max_seq_len=per_seq * PAGE,
                               bmm1_scale=DIM ** -0.5, q_len_per_req=BLOCK)),
        "TRTLLM context": (standins.trtllm_batch_context_with_kv_cache, kernels.wrap_trtllm_gen_context, (),
                           dict(query=q.reshape(-1, HEADS, DIM), kv_cache=hnd, workspace_buffer=None,
                                block_tables=table, seq_lens=seq, max_q_len=BLOCK, max_kv_len=per_seq * PAGE,
                                bmm1_scale=DIM ** -0.5, bmm2_scale=1.0, batch_size=BATCH, cum_seq_lens_q=cum_q,
                                cum_seq_lens_kv=cum_kv, causal=False)),
        "FA4": (standins._flash_attn_fwd, kernels.wrap_fa4_fwd, (q, *nhd),
                dict(seqused_k=seq, page_table=table, softmax_scale=DIM ** -0.5, causal=False)),
    }


def _null(kernel):
    """A kernel with `kernel`'s signature (inspect follows __wrapped__) that does nothing."""
    return functools.wraps(kernel)(lambda *args, **kwargs: None)


def _per_call_us(fn, args, kwargs, calls: int, rounds: int) -> float:
    """Median over rounds of the mean time of one call, in microseconds."""
    fn(*args, **kwargs)  # first call: lazy work (the counter's device move) stays out
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def measure(calls: int = 200, rounds: int = 15) -> dict:
    from plugins.scaling import QueryScaling

    scaling = QueryScaling()  # the shipped rule; every request here is past its reference count
    counter = torch.zeros(2, dtype=torch.int64)

    def count(like):  # the proof's device counter: one in-place add per call, as the hook adds
        counter[0:1].add_(1)

    torch.set_num_threads(1)
    out = {}
    for backend, (kernel, wrap, args, kwargs) in _calls().items():
        null = _null(kernel)
        plain = _per_call_us(kernel, args, kwargs, calls, rounds)
        wrapped = _per_call_us(wrap(kernel, scaling, count), args, kwargs, calls, rounds)
        bare = _per_call_us(null, args, kwargs, calls * 5, rounds)
        host = _per_call_us(wrap(null, scaling, count), args, kwargs, calls * 5, rounds)
        out[backend] = {"kernel_unwrapped_us": round(plain, 1), "kernel_wrapped_us": round(wrapped, 1),
                        "kernel_ratio": round(wrapped / plain, 3),
                        "wrapper_host_us": round(host - bare, 1)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugins.trtllm bench-wrapper", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    p.add_argument("--rounds", type=int, default=15, help="rounds; the median is reported (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        sys.stderr.write("error: --calls and --rounds take positive integers\n")
        return 2
    figures = measure(args.calls, args.rounds)
    report = {"command": "python -m plugins.trtllm bench-wrapper " + " ".join(argv or sys.argv[1:]),
              "torch": torch.__version__, "python": platform.python_version(), "threads": 1,
              "shape": {"batch": BATCH, "block": BLOCK, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                        "keys": list(TOTALS)},
              "backends": figures}
    for backend, f in figures.items():
        print(f"{backend:15s} unwrapped {f['kernel_unwrapped_us']:8.1f} us  wrapped {f['kernel_wrapped_us']:8.1f} us"
              f"  ({f['kernel_ratio']:.3f}x)  wrapper host cost {f['wrapper_host_us']:6.1f} us/call")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
