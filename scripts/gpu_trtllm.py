#!/usr/bin/env python3
"""GPU section gpu_trtllm: SharpDraft's TensorRT-LLM wrappers under CUDA graphs.

For each wrapper TensorRT-LLM's drafters go through (plugins/trtllm/kernels.py: flash-attn
`flash_attn_with_kvcache`, flashinfer trtllm-gen decode and context, FlashAttention-4's
`_flash_attn_fwd`; plugins/trtllm/rope.py: `Attention.apply_rope` with the attention
metadata laid out as TensorRT-LLM lays it out: a host `seq_lens` gone stale, device
`seq_lens_cuda` / `kv_lens_cuda`, a padded CUDA-graph batch as `create_cuda_graph_metadata`
builds it): capture the wrapped call in a CUDA graph, change the length tensors IN PLACE,
replay, and check the query the kernel was handed against beta of the visible-key count
derived independently; every kernel case also checks that the wrapper's device counter of
scaled calls (plugins/trtllm/proof.py Tally, the launchers' proof) grows with every replay,
where no Python runs, (from the stand-in kernels' own masks, tests/trtllm_standins.py, or
from the metadata's Python-side layout), row by row.

The GPU machine has no tensorrt_llm, flash-attn or flashinfer, so the kernel under the
wrapper is a recorder with the library kernel's signature (it keeps the query it is
handed); each case also runs the wrapper eagerly over the stand-in's pure-torch kernel
(on CPU copies) against the stand-in's reference. Every case reports which kernel it used;
nothing here claims a run of TensorRT-LLM or of those libraries.

    run(out_dir) -> dict          # what scripts/gpu_check.py calls (section gpu_trtllm)
    python -m scripts.gpu_trtllm --out DIR    # what scripts/gpu_check.py runs
    SHARPDRAFT_CPU=1 python -m scripts.gpu_trtllm --out DIR   # CPU: every case eagerly

OUT/gpu_trtllm.json is saved after every case (scripts/gpu_record.py), so a timeout or a
crash keeps the cases that ran. Refuses in one line without a CUDA device (and not in
CPU mode, where the capture part is skipped as GPU-only). Runs in seconds on one GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import time

SECTION = "gpu_trtllm"
LIBRARIES = {"flash_attn_with_kvcache": "flash_attn", "trtllm_gen_decode": "flashinfer",
             "trtllm_gen_context": "flashinfer", "fa4_fwd": "flash_attn.cute", "apply_rope": "tensorrt_llm"}


class NoCuda(RuntimeError):
    """No CUDA device: the section cannot run (one line)."""


def scaling():
    from plugins.scaling import QueryScaling

    # a small reference count, so short test lengths reach every regime (1, between, the cap)
    return QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def recorder(standin, query: str):
    """A kernel with `standin`'s signature that keeps the query it is handed (out[0])."""
    signature = inspect.signature(standin)
    kept = {}

    def kernel(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        kept["q"] = bound.arguments[query] * 1  # a new tensor, written by the captured graph
        return kept["q"]

    kernel.__signature__ = signature
    return kernel, kept


def expected(q, counts, active):
    """q's rows times beta of each row's count, from QueryScaling.beta (Python floats)."""
    import torch

    beta = torch.tensor([active.beta(int(n)) for n in counts.reshape(-1).tolist()], dtype=torch.float64)
    beta = beta.reshape(*counts.shape, *([1] * (q.dim() - counts.dim())))
    return (q.detach().cpu().double() * beta).to(torch.float32)


def captured(call, graphs: bool):
    """call() captured in a CUDA graph (returns replay), or run eagerly on CPU (returns call)."""
    from plugins.cuda_graph import capture

    if not graphs:
        return call
    graph, _ = capture(call, warmups=1)  # one warm-up outside capture, as CUDA-graph runners do
    return graph.replay


def _compare(name, got, want, kernel, lengths, started):
    import torch

    error = float((got.detach().cpu().to(torch.float32) - want).abs().max())
    return {"case": name, "kernel": kernel, "lengths_replayed": lengths, "max_abs_error": error,
            "passed": error <= 1e-5 * max(1.0, float(want.abs().max())), "seconds": round(time.time() - started, 3)}


def _kernel_note(name):
    library = LIBRARIES[name]
    where = "installed" if _installed(library) else "not installed"
    return (f"recorder with the {library} kernel's signature ({library} {where}); eager check over the "
            "stand-in's pure-torch kernel")


def _replayed(name, wrap, standin, query, active, graphs, started, *, call, lengths, new, counts, cpu,
              first=False):
    """The shape every kernel case shares: `wrap` over a recorder of `standin`'s signature,
    call(wrapped) captured (run eagerly without graphs), the device `lengths` set to `new`
    IN PLACE, replayed; the query the kernel was handed against beta of `counts`. Then the
    wrapper over the stand-in's pure-torch kernel, eagerly on the CPU arguments `cpu` (the
    query under `query`), against the stand-in's own reference (`first`: the first of
    each output tuple)."""
    import torch

    from plugins.trtllm import standins as k

    from plugins.trtllm import proof

    kernel, kept = recorder(standin, query)
    tally = proof.Tally([name])
    wrapped = wrap(kernel, active, lambda like: tally.add(0, like))
    replay = captured(lambda: call(wrapped), graphs)
    before = tally.read()[name]  # after the warm-up and the capture
    lengths.copy_(torch.tensor(new, dtype=torch.int32))  # in place, as the drafting loop does
    replay()
    replay()
    counted = tally.read()[name] - before  # two replays: two scaled calls, counted on the device
    result = _compare(name, kept["q"], expected(cpu[query], counts, active), _kernel_note(name), new, started)
    result |= {"passed": result["passed"] and counted == 2, "replays_counted": counted}
    want = k.reference(standin, active, **cpu)
    got = wrap(standin, active)(**cpu)
    if first:
        want, got = want[0], got[0]
    return result | {"standin_max_abs_error": float((got - want).abs().max())}


def case_flash_attn(device, graphs, active):
    import torch

    from plugins.trtllm.kernels import wrap_flash_attn_with_kvcache
    from plugins.trtllm import standins as k

    started = time.time()
    g = torch.Generator().manual_seed(0)
    batch, q_len, heads, kv_heads, dim, keys = 3, 4, 4, 2, 16, 160
    q = torch.randn(batch, q_len, heads, dim, generator=g).to(device)
    k_cache = torch.randn(batch, keys, kv_heads, dim, generator=g).to(device)
    v_cache = torch.randn(batch, keys, kv_heads, dim, generator=g).to(device)
    lens = torch.tensor([10, 60, 100], dtype=torch.int32, device=device)
    window = (90, 0)  # caps the count at 91: between beta = 1 and the cap
    new = [150, 9, 70]
    row = torch.arange(q_len)[None, :]
    counts = k.window_mask(torch.tensor(new)[:, None], q_len, row, keys, True, *window).sum(-1)
    cpu = dict(q=q.cpu(), k_cache=k_cache.cpu(), v_cache=v_cache.cpu(), cache_seqlens=torch.tensor(new),
               causal=True, window_size=window)
    return _replayed("flash_attn_with_kvcache", wrap_flash_attn_with_kvcache, k.flash_attn_with_kvcache, "q",
                     active, graphs, started, lengths=lens, new=new, counts=counts, cpu=cpu,
                     call=lambda wrapped: wrapped(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                  window_size=window))


def _pages(totals, kv_heads, dim, page, g, layout):
    import torch

    pages_per_seq = -(-max(totals) // page)
    count = len(totals) * pages_per_seq
    shape = (count, kv_heads, page, dim) if layout == "HND" else (count, page, kv_heads, dim)
    tables = torch.arange(count, dtype=torch.int32).reshape(len(totals), pages_per_seq)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g), tables


def case_trtllm_gen_decode(device, graphs, active):
    import torch

    from plugins.trtllm.kernels import wrap_trtllm_gen_decode
    from plugins.trtllm import standins as k

    started = time.time()
    g = torch.Generator().manual_seed(1)
    batch, q_len, heads, dim = 3, 4, 4, 16
    k_pages, v_pages, tables = _pages([200, 200, 200], 2, dim, 16, g, "HND")
    query = torch.randn(batch * q_len, heads, dim, generator=g).to(device)
    kv = (k_pages.to(device), v_pages.to(device))
    seq_lens = torch.tensor([12, 70, 130], dtype=torch.int32, device=device)
    tables_on = tables.to(device)  # every copy to the device happens before capture
    new = [190, 40, 90]  # the cap, beta = 1, in between
    row = torch.arange(q_len)[None, :]
    counts = k.window_mask(torch.tensor(new)[:, None], q_len, row, 208, True, -1, None).sum(-1).reshape(-1)
    cpu = dict(query=query.cpu(), kv_cache=(k_pages, v_pages), workspace_buffer=None, block_tables=tables,
               seq_lens=torch.tensor(new, dtype=torch.int32), max_seq_len=200, bmm1_scale=dim ** -0.5,
               q_len_per_req=q_len)
    return _replayed("trtllm_gen_decode", wrap_trtllm_gen_decode, k.trtllm_batch_decode_with_kv_cache, "query",
                     active, graphs, started, lengths=seq_lens, new=new, counts=counts, cpu=cpu,
                     call=lambda wrapped: wrapped(query, kv, None, tables_on, seq_lens, 200,
                                                  bmm1_scale=dim ** -0.5, q_len_per_req=q_len))


def case_trtllm_gen_context(device, graphs, active):
    import torch

    from plugins.trtllm.kernels import wrap_trtllm_gen_context
    from plugins.trtllm import standins as k

    started = time.time()
    g = torch.Generator().manual_seed(2)
    q_lens, heads, dim = [3, 5, 4], 4, 16
    k_pages, v_pages, tables = _pages([200, 200, 200], 2, dim, 16, g, "HND")
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(device)
    cum_q = torch.tensor([0, 3, 8, 12], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([20, 90, 150], dtype=torch.int32, device=device)
    kv = (k_pages.to(device), v_pages.to(device))
    tables_on = tables.to(device)  # every copy to the device happens before capture
    new = [170, 11, 66]
    counts = torch.cat([k.window_mask(torch.tensor([n]), q, torch.arange(q), 208, False, -1, None).sum(-1)
                        for n, q in zip(new, q_lens)])
    cpu = dict(query=query.cpu(), kv_cache=(k_pages, v_pages), workspace_buffer=None, block_tables=tables,
               seq_lens=torch.tensor(new, dtype=torch.int32), max_q_len=5, max_kv_len=200, bmm1_scale=dim ** -0.5,
               bmm2_scale=1.0, batch_size=3, cum_seq_lens_q=cum_q.cpu(), cum_seq_lens_kv=None, causal=False)
    return _replayed("trtllm_gen_context", wrap_trtllm_gen_context, k.trtllm_batch_context_with_kv_cache, "query",
                     active, graphs, started, lengths=seq_lens, new=new, counts=counts, cpu=cpu,
                     call=lambda wrapped: wrapped(query, kv, None, tables_on, seq_lens, 5, 200, dim ** -0.5, 1.0, 3,
                                                  cum_q, None, causal=False))


def case_fa4(device, graphs, active):
    import torch

    from plugins.trtllm.kernels import wrap_fa4_fwd
    from plugins.trtllm import standins as k

    started = time.time()
    g = torch.Generator().manual_seed(3)
    batch, q_len, heads, dim = 2, 4, 4, 16
    k_pages, v_pages, tables = _pages([160, 160], 2, dim, 16, g, "NHD")
    q = torch.randn(batch, q_len, heads, dim, generator=g).to(device)
    used = torch.tensor([30, 100], dtype=torch.int32, device=device)
    kv = (k_pages.to(device), v_pages.to(device))
    tables_on = tables.to(device)  # every copy to the device happens before capture
    new = [100, 70]  # both between beta = 1 and the cap: an off-by-one count changes beta
    row = torch.arange(q_len)[None, :]
    counts = k.window_mask(torch.tensor(new)[:, None], q_len, row, 160, False, None, None).sum(-1)
    cpu = dict(q=q.cpu(), k=k_pages, v=v_pages, seqused_k=torch.tensor(new, dtype=torch.int32), page_table=tables,
               causal=False)
    return _replayed("fa4_fwd", wrap_fa4_fwd, k._flash_attn_fwd, "q", active, graphs, started, lengths=used,
                     new=new, counts=counts, cpu=cpu, first=True,
                     call=lambda wrapped: wrapped(q, *kv, seqused_k=used, page_table=tables_on, causal=False,
                                                  window_size_left=None, window_size_right=None))


def case_apply_rope(device, graphs, active):
    """EAGLE-3 / PARD: Attention.forward -> apply_rope (RoPE fused into the kernel: the qkv
    comes back unrotated) over create_cuda_graph_metadata's padded batch: 4 slots of 1 + 3
    draft tokens, two real requests then two dummies; the host seq_lens is left stale, the
    drafting loop moves kv_lens_cuda in place between replays."""
    import torch

    from plugins.trtllm.rope import wrap_apply_rope, wrap_forward
    from plugins.trtllm.standins import Metadata

    started = time.time()
    heads, dim, kv_size = 4, 16, 32
    q_size = heads * dim
    slots, drafts = 4, 3
    gen = 1 + drafts

    class Layer:
        def apply_rope(self, q, k, v, position_ids):
            return q, None, None  # rope_fusion: fused qkv, rotated inside the kernel

        def forward(self, position_ids, hidden_states, attn_metadata, **kwargs):
            return self.apply_rope(hidden_states, None, None, position_ids)[0] * 1

    layer = Layer()
    meta = Metadata.cuda_graph(slots, drafts, kv_lens=[40, 120, 5, 5], device=device)
    if device != "cpu":
        meta.seq_lens = meta.seq_lens.pin_memory()
    layer.apply_rope = wrap_apply_rope(Layer.apply_rope.__get__(layer), active, q_size, layer)
    layer.forward = wrap_forward(Layer.forward.__get__(layer), layer)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(slots * gen, q_size + 2 * kv_size, generator=g).to(device)
    positions = torch.zeros(1, slots * gen, dtype=torch.int64, device=device)
    out = {}

    def call():
        out["q"] = layer.forward(positions, qkv, meta)

    replay = captured(call, graphs)
    meta.seq_lens.copy_(torch.tensor([1, 7, 2, 9], dtype=torch.int32))  # stale host values
    meta.kv_lens_cuda += 70  # in place: the EAGLE-3 / PARD workers' kv_lens_cuda +=
    replay()
    kv_now = [110, 190, 75, 75]
    counts = torch.tensor([kv - gen + depth + 1 for kv in kv_now for depth in range(gen)])
    want = expected(qkv[:, :q_size], counts, active)
    result = _compare("apply_rope (EAGLE-3 / PARD, padded CUDA-graph batch)", out["q"][:, :q_size], want,
                      f"stand-in Attention layer ({LIBRARIES['apply_rope']} "
                      f"{'installed' if _installed('tensorrt_llm') else 'not installed'}); metadata laid out as "
                      "interface.py create_cuda_graph_metadata", kv_now, started)
    untouched = bool(torch.equal(out["q"][:, q_size:].cpu(), qkv[:, q_size:].cpu()))
    return result | {"passed": result["passed"] and untouched, "kv_columns_untouched": untouched}


CASES = (case_flash_attn, case_trtllm_gen_decode, case_trtllm_gen_context, case_fa4, case_apply_rope)


def check(device: str = "cuda", graphs: bool = True, cases: list | None = None, saved=None) -> dict:
    """Every case on `device`; graphs=False runs them eagerly (the CPU test of the plumbing).
    Each case's row is appended to `cases` as it ends and `saved()` called (the section
    file, rewritten after every case)."""
    active = scaling()
    cases = [] if cases is None else cases
    for case in CASES:
        try:
            entry = case(device, graphs, active)
        except Exception as exc:  # one failing case is reported, the others still run
            first = str(exc).splitlines()[0] if str(exc) else ""
            entry = {"case": case.__name__, "passed": False, "error": f"{type(exc).__name__}: {first}"}
        if entry.get("standin_max_abs_error", 0.0) > 1e-5:  # the eager stand-in check is part of passing
            entry["passed"] = False
        cases.append(entry)
        if saved:
            saved()
    return {"section": SECTION, "graphs": graphs, "device": device, "cases": cases,
            "passed": all(c["passed"] for c in cases)}


def run(out_dir, on_cpu: bool = False, args=None) -> dict:
    """The section: CUDA-graph capture and in-place replay of every wrapper (on CPU: every
    case eagerly, the capture skipped as GPU-only); OUT_DIR/gpu_trtllm.json saved after
    every case; the record's data returned. NoCuda (one line) without a GPU and not on CPU."""
    import torch

    if not on_cpu and not torch.cuda.is_available():
        raise NoCuda("gpu_trtllm needs a CUDA device (torch.cuda.is_available() is False): run it on the GPU "
                     "machine; tests/test_trtllm_gpu_section.py covers its plumbing on CPU")
    from scripts.gpu_record import GpuOnly, SectionRecord

    device = "cpu" if on_cpu else "cuda"
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu,
                           device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    record.data.update(graphs=not on_cpu, torch=torch.__version__)

    def cases(part):
        rows = part.setdefault("cases", [])
        check(device, graphs=not on_cpu, cases=rows, saved=record.save)
        return all(c["passed"] for c in rows)

    def graphs(part):
        raise GpuOnly("each wrapper captured in a CUDA graph and replayed with its lengths changed in "
                      "place needs CUDA; the cases above ran eagerly")

    record.part("cases", cases)
    if on_cpu:
        record.part("graphs", graphs)
    data = record.finish()
    data["cases"] = data["parts"]["cases"].get("cases", [])
    return data


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):  # --out DIR [--cpu]: as gpu_check runs every section
        from scripts.gpu_record import section_main

        try:
            return section_main(SECTION, run, argv)
        except NoCuda as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    try:  # the older form: OUT_DIR
        report = run(argv[0])
    except NoCuda as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for entry in report["cases"]:
        print(f"{'passed' if entry['passed'] else 'FAILED'}  {entry['case']}: "
              f"{entry.get('error') or entry['kernel']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
