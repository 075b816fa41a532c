"""GPU section `gpu_steps`: what each compiled step costs on a Qwen3-8B-shaped target,
per step family and batch bucket, eager and as a captured CUDA graph.

A Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head dim 128, random bf16
weights, made on the GPU) and each family's drafter for it, as published for Qwen3-8B:
DFlash (5 layers at the target's width), PARD (Qwen3-0.6B's shape: 28 layers, hidden
1024, 16/8 heads, tied head), EAGLE-3 (one layer at the target's width, a 32K draft
vocabulary); for every family, batch bucket and
context (descending: the largest buffers first, while memory is free) the family's steps
are called as the batched roles call them (runtime/backends/pytorch/compiled.py: one call per group, KV
buffers of batch rows, lengths as device tensors), timed: median host ms (the call's own
CPU time) and median GPU ms (CUDA events), and host / GPU, the share the GPU waits on
Python. Rows go to OUT/gpu_steps.json after every family x mode (scripts/gpu_record.py).

Families (STEP_FAMILIES) are entries of one table -- the target's steps, DFlash's block,
PARD's chain step, EAGLE-3's ingest and chain link, as CompiledBatchTarget,
CompiledBatchDFlash, CompiledBatchPARD and CompiledBatchEagle3 call them -- each measured
in its own sub-part: a family that fails (its drafter, a step that cannot be captured)
leaves every other family's rows. A new family adds an entry, its drafter and its rows;
the plan, the section and the rehearsal run it without another edit. The chain families
draft as many tokens as DFlash's block holds (the target's verify bucket - 1), so every
family's rows meet the same verify width.

    python -m scripts.gpu_steps --out DIR                   # scripts/gpu_check.py runs it
    SHARPDRAFT_CPU=1 python -m scripts.gpu_steps --out DIR   # CPU: every family's eager rows
        # at TINY (8B fp32 weights need 32 GB); the captured rows GPU-only
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_steps ...")

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from scripts.gpu_record import GpuOnly, SectionRecord, log, section_main

SECTION = "gpu_steps"
# pard: the PARD drafter's own shape (PARD-Qwen3-0.6B's); draft_vocab: EAGLE-3's (Qwen3-8B
# EAGLE-3 drafters draft over 32,000 ids)
QWEN3_8B = dict(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                head_dim=128, block=16, draft_layers=5, draft_vocab=32000,
                pard=dict(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128))
TINY = dict(vocab=512, hidden=64, intermediate=128, layers=6, heads=4, kv_heads=2, head_dim=16,
            block=4, draft_layers=2, draft_vocab=128,
            pard=dict(hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1, head_dim=16))
# 32K alone: the long context SharpDraft is for (4K and 16K went to keep the whole GPU run
# under 450 s with room for a rerun: scripts/gpu_travel.py's estimate)
CONTEXTS = (32768,)
BATCH_BUCKETS = (1, 4)
CPU = dict(contexts=(64, 32), batches=(1, 2), repeats=2)


def qwen3_8b_shaped(device, dtype, shape=QWEN3_8B, target=None):
    """A Qwen3-8B-shaped TargetModel (or `target`, given) and a DFlash-shaped drafter with
    random weights, made on the device (8B parameters never touch the host)."""
    from runtime.models.dflash import DFlashConfig, DFlashDrafter
    from runtime.models.target import TargetConfig, TargetModel

    s = shape
    config = TargetConfig("qwen3", s["vocab"], s["hidden"], s["intermediate"], s["layers"], s["heads"],
                          s["kv_heads"], s["head_dim"], 1e-6, 1e6, 40960, False, True, False)
    n = s["layers"]
    ids = tuple(sorted({1 + round(i * (n - 4) / (s["draft_layers"] - 1)) for i in range(s["draft_layers"])}))
    dconfig = DFlashConfig(s["hidden"], s["intermediate"], s["draft_layers"], s["heads"], s["kv_heads"],
                           s["head_dim"], 1e-6, 1e6, s["vocab"], s["block"], s["vocab"] - 1, ids, n,
                           max_position_embeddings=40960)
    target = target if target is not None else made_on(device, dtype, lambda: TargetModel(config))
    return target, made_on(device, dtype, lambda: DFlashDrafter(dconfig))


def made_on(device, dtype, make):
    """make() with `device` and `dtype` the defaults: random weights made where they are
    used (8B parameters never touch the host), in eval mode."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make().eval()
    finally:
        torch.set_default_dtype(previous)


def capacity(needed: int) -> int:
    """A step's KV buffer size, as the batched roles lease it (a power of two)."""
    from runtime.step_metadata import capacity_bucket

    return 1 << capacity_bucket(needed)


# -- the families: what each one's steps are, called as its batched role calls them ----------

@dataclass(frozen=True)
class StepFamily:
    """drafter: None (the target's steps alone) or make(target, shape, device, dtype) -> the
    drafter model the family's EngineSteps holds (made once, on the device); rows(steps,
    batch, context, compiled) -> [(row name, call)], every buffer the calls need made."""
    drafter: Callable | None
    rows: Callable


def dflash_drafter(target, shape, device, dtype):
    return qwen3_8b_shaped(device, dtype, shape, target=target)[1]


def pard_drafter(target, shape, device, dtype):
    """A PARD drafter of shape["pard"] over the target's vocabulary (a Qwen3 decoder, tied
    head), its pard token the vocabulary's last id."""
    from runtime.models.pard import PARDConfig, PARDDrafter
    from runtime.models.target import TargetConfig

    p, t = shape["pard"], target.config
    config = TargetConfig("qwen3", t.vocab_size, p["hidden"], p["intermediate"], p["layers"], p["heads"],
                          p["kv_heads"], p["head_dim"], 1e-6, 1e6, t.max_position_embeddings, False, True,
                          True)
    return made_on(device, dtype, lambda: PARDDrafter(PARDConfig(config, t.vocab_size - 1)))


def eagle3_drafter(target, shape, device, dtype):
    """An EAGLE-3 drafter at the target's width, reading its default three layers, over a
    draft vocabulary of shape["draft_vocab"] ids."""
    from runtime.models.eagle3 import Eagle3Config, Eagle3Drafter

    t = target.config
    config = Eagle3Config(t.hidden_size, t.intermediate_size, t.num_heads, t.num_kv_heads, t.head_dim,
                          1e-6, 1e6, t.vocab_size, shape["draft_vocab"], t.hidden_size,
                          max_position_embeddings=t.max_position_embeddings)
    return made_on(device, dtype, lambda: Eagle3Drafter(config))


def target_rows(steps, batch, context, compiled):
    """The target's step at every compiled row width (1: decode; the rest: verifies)."""
    import torch

    # the engine's own buffers (bound: per-layer views, static addresses), as a group leases them
    cache = steps.target_buffers.take(capacity(context + steps.widths[-1]), batch)
    cache.lengths.fill_(context)
    step = steps.target_step if compiled else steps.target_module
    out = []
    for width in steps.widths:
        ids = torch.zeros((batch, width), dtype=torch.long, device=steps.device)
        out.append((f"target {'decode' if width == 1 else 'verify'} ({width} token{'s' * (width > 1)})",
                    lambda ids=ids: step(ids, *cache.layers, cache.lengths)))
    return out


def dflash_rows(steps, batch, context, compiled):
    """The DFlash drafter's block after `context` keys, one block of context features."""
    import torch

    from runtime.families import preset

    drafter, block = steps.drafter, steps.block_size
    cache = steps.draft_buffers.take(capacity(context + steps.context_span + block), batch)
    cache.lengths.fill_(context)
    module, step = steps.draft_step(preset("dflash"), None)
    call = step if compiled else module
    ids = torch.full((batch, block), drafter.config.mask_token_id, dtype=torch.long, device=steps.device)
    features = torch.zeros((batch, steps.context_span, drafter.fc.in_features),
                           dtype=drafter.fc.weight.dtype, device=steps.device)
    lens = torch.full((batch,), block, dtype=torch.long, device=steps.device)
    return [(f"dflash block ({block})", lambda: call(ids, features, *cache.layers, cache.lengths, lens))]


def chain_drafts(steps) -> int:
    """A chain family's draft length: the target's verify bucket - 1 (DFlash's block)."""
    return steps.widths[-1] - 1


def pard_rows(steps, batch, context, compiled):
    """PARD's chain step at both compiled row widths (CompiledBatchPARD's chain_widths: a step
    that accepted little, and every draft and the bonus read with k drafted) after
    `context` keys."""
    import torch

    from runtime.families import preset
    from runtime.backends.pytorch.compiled import chain_widths

    widths = chain_widths(chain_drafts(steps))
    cache = steps.chain_buffers.take(capacity(context + widths[-1]), batch)
    cache.lengths.fill_(context)
    module, step = steps.chain_step(preset("pard"))
    call = step if compiled else module
    out = []
    for width in widths:
        ids = torch.full((batch, width), steps.drafter.config.pard_token, dtype=torch.long, device=steps.device)
        out.append((f"pard chain ({width} tokens)", lambda ids=ids: call(ids, *cache.layers, cache.lengths)))
    return out


def eagle3_rows(steps, batch, context, compiled):
    """EAGLE-3's two steps after `context` entries, as CompiledBatchEagle3 calls them: the
    ingest of a step's committed entries (every draft and the bonus: k + 1 rows of target
    features, projected) and one chain link (a token and the state it reads)."""
    import torch

    from runtime.families import preset

    drafter, k = steps.drafter, chain_drafts(steps)
    c, dtype = drafter.config, drafter.fc.weight.dtype
    # room as CompiledBatchEagle3's slots: the widest ingest, then the chain's links
    cache = steps.chain_buffers.take(capacity(context + (k + 1) + k), batch)
    cache.lengths.fill_(context)
    ingest_module, ingest = steps.eagle3_step(preset("eagle3"), ingest=True)
    link_module, link = steps.eagle3_step(preset("eagle3"), ingest=False)
    ingest, link = (ingest, link) if compiled else (ingest_module, link_module)
    ids = torch.zeros((batch, k + 1), dtype=torch.long, device=steps.device)
    features = torch.zeros((batch, k + 1, c.num_aux * c.target_hidden_size), dtype=dtype, device=steps.device)
    token = torch.zeros((batch, 1), dtype=torch.long, device=steps.device)
    state = torch.zeros((batch, 1, c.hidden_size), dtype=dtype, device=steps.device)
    return [(f"eagle3 ingest ({k + 1} entries)", lambda: ingest(ids, features, *cache.layers, cache.lengths)),
            ("eagle3 chain link (1 token)", lambda: link(token, state, *cache.layers, cache.lengths))]


# in the order they run: a family new to the GPU after those the plan has run before
STEP_FAMILIES: dict[str, StepFamily] = {
    "target": StepFamily(None, target_rows),
    "dflash": StepFamily(dflash_drafter, dflash_rows),
    "pard": StepFamily(pard_drafter, pard_rows),
    "eagle3": StepFamily(eagle3_drafter, eagle3_rows),
}


def time_call(fn, cuda: bool, repeats: int) -> tuple[float, float | None]:
    """Median host ms (the call's own time, the GPU idle before it) and median GPU ms
    (events around it; None off CUDA) of `fn()`."""
    import torch

    host, gpu = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(gpu) if gpu else None


def family_rows(name, family, make_steps, compiled, contexts, batches, cuda, repeats, rows, save):
    """Every (context, batch bucket) of one family in one mode, a row each, saved as it goes.
    The engine's steps are made afresh for each (context, batch): a captured graph keeps
    its KV buffers alive, and the 32K, batch-4 buffers alone take ~39 GB."""
    import torch

    graph = "cudagraph" if compiled and cuda else "eager"
    for context in contexts:
        for batch in batches:
            steps = make_steps()
            try:
                calls = family.rows(steps, batch, context, compiled)
            except Exception as exc:  # out of memory at this size, say: the row says why
                rows.append({"family": name, "mode": f"{name} steps, {graph}, batch {batch}", "steps": graph,
                             "context": context, "batch": batch,
                             "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"})
                del steps
                save()
                continue
            for label, fn in calls:
                # mode: the row's label in `python -m runtime report`'s table
                row = {"family": name, "step": label, "mode": f"{label}, {graph}, batch {batch}",
                       "steps": graph, "context": context, "batch": batch}
                try:
                    with torch.inference_mode():
                        fn()  # the graph made (and kernels warmed) before timing
                        host, gpu = time_call(fn, cuda, repeats)
                    row.update(host_ms=round(host, 3), gpu_ms=None if gpu is None else round(gpu, 3),
                               host_share=None if not gpu else round(host / gpu, 3))
                except Exception as exc:  # a step that cannot be captured yet: the row says why
                    row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                rows.append(row)
                log(f"{SECTION}: {row['mode']} at {context}: "
                    + (row.get("error") or f"host {row['host_ms']} ms, GPU {row['gpu_ms']} ms"))
            del calls, steps
            save()
            if cuda:
                torch.cuda.empty_cache()


def run(out_dir, on_cpu: bool = False, args=None, families=None) -> dict:
    import torch

    from runtime.backends.pytorch.compiled import EngineSteps

    cuda = torch.cuda.is_available() and not on_cpu
    if not on_cpu and not cuda:
        raise SystemExit("error: gpu_steps needs a CUDA device; SHARPDRAFT_CPU=1 runs it on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    shape = TINY if on_cpu else QWEN3_8B
    contexts, batches = (CPU["contexts"], CPU["batches"]) if on_cpu else (CONTEXTS, BATCH_BUCKETS)
    repeats = CPU["repeats"] if on_cpu else 10
    # the captured rows (EngineSteps' "cudagraph" backend) need CUDA: on CPU the eager ones
    modes = (False, True) if cuda else (False,)
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu,
                           device=torch.cuda.get_device_name() if cuda else "cpu")
    record.data.update(shape=shape, contexts=contexts, batch_buckets=batches, repeats=repeats, rows=[])
    if on_cpu:
        record.data["shape_why"] = ("TINY on CPU: Qwen3-8B's shape is 32 GB of fp32 weights; the rows "
                                    "call the same steps with the same arguments")
    made = {}

    dtype = torch.bfloat16 if cuda else torch.float32

    def models(part):
        started = time.perf_counter()
        made["target"], made["dflash_shape"] = qwen3_8b_shaped(device, dtype, shape)
        part["seconds_to_make"] = round(time.perf_counter() - started, 1)

    record.part("target", models)
    for name, family in (families or STEP_FAMILIES).items():
        def measure(part, name=name, family=family):
            if "target" not in made:
                raise RuntimeError("the target was not made")
            target = made["target"]
            drafter = family.drafter(target, shape, device, dtype) if family.drafter else None
            # the feature layers a DFlash drafter of this shape reads (what the target step returns)
            layer_ids = made["dflash_shape"].config.target_layer_ids
            block = shape["block"]
            rows = record.data["rows"]  # every family's, one table
            before = len(rows)
            for compiled in modes:
                def make_steps(backend="cudagraph" if compiled else "eager"):
                    return EngineSteps(target, layer_ids, (1, block + 1), backend, drafter=drafter,
                                       context_span=block)

                family_rows(name, family, make_steps, compiled, contexts, batches, cuda, repeats, rows,
                            record.save)
            del drafter
            part["rows"] = len(rows) - before
            return not any("error" in r for r in rows[before:])

        record.part(f"family_{name}", measure)
    if on_cpu:
        def captured(part):
            raise GpuOnly("each family's steps captured as CUDA graphs (EngineSteps' cudagraph backend) "
                          "and replayed: the rows marked cudagraph")
        record.part("cudagraph_rows", captured)
    record.data["goals"] = goals(record.data["rows"])
    return record.finish()


def goals(rows: list[dict]) -> dict:
    """The host-share goal (<= 0.1): host / GPU time of a batch-1 decode step replayed as a
    CUDA graph, per context."""
    return {f"host_share_decode_cudagraph_{r['context']}": r["host_share"] for r in rows
            if r.get("step") == "target decode (1 token)" and r.get("steps") == "cudagraph"
            and r.get("batch") == 1 and r.get("host_share") is not None}


def main(argv=None) -> int:
    return section_main(SECTION, run, argv)


if __name__ == "__main__":
    sys.exit(main())
