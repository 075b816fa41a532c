"""The compiled fixed-shape steps (runtime/backends/pytorch/compiled.py): the same tokens as the eager
torch roles, one graph with no break, no recompile when only a length changes, device and
dtype refusals in one line. The fast tier compiles with dynamo's eager backend (the graph
capture is what breaks or recompiles; seconds); inductor's code runs in the slow tier
(minutes of compilation on 2 cores). CUDA checks skip without a GPU."""

from __future__ import annotations

import pytest
import torch

import tiny
from plugins.scaling import QueryScaling
from runtime import proposers
from runtime.backends.pytorch import TorchBatchDFlash, TorchBatchTarget
from runtime.backends.pytorch.compiled import (CompiledBatchDFlash, CompiledBatchTarget, EngineSteps,
                                               StaticView, layers, static_capacity, target_forward)
from runtime.backends.pytorch.placement import resolve_device, resolve_dtype
from runtime.decode import Decoder, Request
from runtime.models.dflash import DFlashConfig, DFlashDrafter
from runtime.models.target import ModelError

VOCAB, BLOCK = 48, 4
SCALING = QueryScaling(ref_keys=40, top_k=8)  # beta > 1 from ~40 keys: the prompts reach it
PROMPT = [(7 * i) % VOCAB for i in range(60)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pair(device="cpu", dtype=torch.float64, layers=1):
    """A float64 target (equal tokens mean equal logic) and a DFlash drafter for it."""
    target = tiny.float64_target(seed=3, vocab=VOCAB, layers=layers, context=256)
    c = target.config
    torch.manual_seed(4)
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=1,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB, block_size=BLOCK,
        mask_token_id=1, target_layer_ids=tuple(range(layers)), num_target_layers=layers))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return target.to(device, dtype), drafter.to(device, dtype).eval()


def batch_of(size: int, prompt=PROMPT, tokens=24):
    """A batch of one (`prompt`), or of four at other lengths and budgets, joining a step
    or more apart: (requests, join_at)."""
    if size == 1:
        return [Request(prompt=prompt, max_new_tokens=tokens)], [0]
    prompts = [prompt, prompt[:45], prompt[10:], prompt[:30]]
    return [Request(prompt=p, max_new_tokens=n) for p, n in zip(prompts, (tokens, 16, 20, 12))], [0, 0, 1, 3]


def decode(target, drafter=None, size=1, **request):
    """Each request's tokens, decoded together on the batch roles `target` and `drafter`
    (DFlash blocks; None: target-only)."""
    proposer = proposers.Block(drafter) if drafter is not None else proposers.NoDrafts()
    requests, join_at = batch_of(size, **request)
    seqs = Decoder(target, proposer, slack=BLOCK).run(requests, join_at=join_at)
    assert all(s.error is None for s in seqs)
    return [s.gen.tokens for s in seqs]


def compiled_roles(target, drafter, backend):
    """The compiled batch roles over one EngineSteps (decode and block-verify widths)."""
    steps = EngineSteps(target, drafter.config.target_layer_ids, (1, BLOCK), backend, drafter=drafter)
    return CompiledBatchTarget(steps), CompiledBatchDFlash(steps, SCALING)


def eager_tokens(target, drafter, speculative=True, **request):
    features = drafter.config.target_layer_ids
    return decode(TorchBatchTarget(target, features),
                  TorchBatchDFlash(drafter, target, SCALING) if speculative else None, **request)


@pytest.mark.slow  # the fast tier's check: the engine's roles, below (the same steps, float32)
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_steps_equal_eager_and_compile_once(backend):
    """Token for token the eager batch roles' output, target-only and speculative, a batch
    of one and of four, on float64 roles made without an engine. fullgraph=True raises on
    a graph break; error_on_recompile raises when a step at another length (or another
    request's) needs a new graph."""
    import torch._dynamo

    target, drafter = pair()
    ct, cd = compiled_roles(target, drafter, backend)
    steps = cd.step  # the drafter's compiled step must actually run, not the eager fallback
    ran = []
    cd.step = lambda *a: ran.append(1) or steps(*a)
    for size in (1, 4):
        plain = eager_tokens(target, drafter, False, size=size)
        speculative = eager_tokens(target, drafter, size=size)
        assert plain == speculative  # lossless eagerly, so the comparison below means something
        assert decode(ct, size=size) == plain
        assert decode(ct, cd, size=size) == speculative
    assert len(ran) > 3
    # every graph now exists (1-row and block-row verify, the drafter's block, 1 to 4
    # slots): another request, at lengths the first never reached (a shorter prompt) in
    # the same capacity bucket, compiles nothing
    shorter = dict(tokens=20, prompt=PROMPT[:45])
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert decode(ct, cd, **shorter) == eager_tokens(target, drafter, **shorter)


def test_the_stock_cache_would_break_the_graph():
    """Why StaticView exists: KVCache.write reads the longest length on the host, which
    fullgraph refuses -- the check above can fail."""
    import torch._dynamo

    target, _ = pair()
    cache = target.new_cache(64, batch=1, per_sequence=True)
    step = torch.compile(lambda ids, c: target(ids, c), fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="data-dependent"):
        step(torch.tensor([[1, 2]]), cache)


def test_static_view_writes_at_each_sequences_length():
    k = torch.zeros(2, 1, 8, 1)
    view = StaticView([k], [k.clone()], torch.tensor([1, 5]))
    new = torch.tensor([[[[1.0], [2.0]]], [[[3.0], [4.0]]]])
    out, _ = view.write(0, view.lengths, new, new)
    assert out is k  # in place, and the whole buffer: the visible counts bound each row
    assert out[0, 0, :, 0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert out[1, 0, :, 0].tolist() == [0, 0, 0, 0, 0, 3, 4, 0]


def test_static_capacity_is_a_few_shapes_and_never_past_the_context():
    assert static_capacity(100, 4096) == 128
    assert static_capacity(129, 4096) == 256
    assert static_capacity(4100, 4113) == 4113  # a full-context request pays no doubling
    assert static_capacity(5000, 4113) == 5000


def test_device_and_dtype_refusals_are_one_line():
    with pytest.raises(ModelError, match="not one of"):
        resolve_device("tpu")
    with pytest.raises(ModelError, match="not one of"):
        resolve_dtype("int8")
    assert resolve_dtype("bfloat16") is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA device") as err:
            resolve_device("cuda")
        assert "\n" not in str(err.value)


def test_target_step_returns_the_eager_logits():
    """One compiled step against the eager forward at the same cached length."""
    target, _ = pair()
    eager_cache = target.new_cache(64)
    target(torch.tensor([PROMPT[:20]]), eager_cache)
    buffers = target.new_cache(64)
    buffers.k.copy_(eager_cache.k), buffers.v.copy_(eager_cache.v)
    step = torch.compile(target_forward(target), fullgraph=True, dynamic=False, backend="eager")
    ids = torch.tensor([PROMPT[20:24]])
    expected, _ = target(ids, eager_cache)
    got, _ = step(ids, *layers(buffers), torch.tensor([20]))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@needs_cuda
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_decode_equals_eager_on_cuda(dtype, backend):
    """The compiled batch roles, a batch of one and of four. Needs the capturable op (no
    host read of the visible counts inside it)."""
    target, drafter = pair("cuda", dtype, layers=2)
    ct, cd = compiled_roles(target, drafter, backend)
    for size in (1, 4):
        plain = decode(ct, size=size)
        assert decode(ct, cd, size=size) == plain  # lossless on the device
        if backend == "cudagraph" or dtype == torch.float32:  # the same kernels, or fp32's precision
            assert plain == eager_tokens(target, drafter, False, size=size)


# scripts/gpu_e2e.py and gpu_steps.py (the GPU sections): tests/test_gpu_e2e.py


def test_convert_target_refuses_bad_input_in_one_line(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "convert_target.py"
    spec = importlib.util.spec_from_file_location("convert_target", path)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    assert convert.main(["--out", str(tmp_path / "x"), "--shard-mb", "0"]) == 2
    assert convert.main(["--target", str(tmp_path / "absent"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_convert_target_writes_shards_transformers_loads(tiny_target, tmp_path):
    import importlib.util
    from pathlib import Path

    from runtime.models.target import load_target

    path = Path(__file__).resolve().parent.parent / "scripts" / "convert_target.py"
    spec = importlib.util.spec_from_file_location("convert_target", path)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    out = tmp_path / "fp16"
    shards = convert.convert(str(tiny_target), out, "float16", 0.03)  # 30 kB: several shards
    assert len(shards) > 1 and all(s.stat().st_size <= 31_000 for s in shards)
    model, _ = load_target(out, torch.float16)
    original, _ = load_target(tiny_target, torch.float16)
    for (name, a), b in zip(model.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name


# -- one engine's steps, shared by every request and role ---------------------------------

def engine_prompts(engine, lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, engine.model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def recorded_steps(monkeypatch):
    """compile_step counting the steps made and the CUDA-graph keys its steps are called
    with (compiled.captured captures once per key: a key not seen before is a capture)."""
    from runtime.backends.pytorch import compiled

    made, keys, real = [], set(), compiled.compile_step

    def recording(eager, static, device, backend="inductor"):
        step = real(eager, static, device, backend)
        made.append(eager.__name__)

        def call(*args):
            keys.add((id(eager), compiled.capture_key(set(static), args)))
            return step(*args)
        return call

    monkeypatch.setattr(compiled, "compile_step", recording)
    return made, keys


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_an_engines_compiled_steps_decode_alone_and_batched_and_compile_once(tiny_engine, backend,
                                                                             monkeypatch):
    """The compiled steps, their graphs and the KV buffers they read belong to the loaded
    engine, and batch: target-only and SharpDraft (beta > 1 from 64 keys) alone, then
    batched (CompiledBatchTarget / CompiledBatchDFlash: a graph per batch-size, width and
    capacity bucket; a group grows from one slot to two, one request sits in another
    bucket, one leaves early) decode each request's own target-only tokens; a second
    round of other prompts in the same buckets makes no step, no dynamo graph, no CUDA-graph
    key (the same buffer addresses and shapes: no capture) and no KV buffer."""
    from torch._dynamo.utils import counters

    from runtime.backends.pytorch.compiled import CompiledBatchDFlash, CompiledBatchTarget
    from runtime.decode import Request
    from runtime.engine import Engine
    from runtime.spec import open_spec

    made, keys = recorded_steps(monkeypatch)
    eager, engine = Engine(open_spec(tiny_engine)), Engine(open_spec(tiny_engine, steps=backend))
    shared = engine.loaded.shared
    assert isinstance(engine.loaded.batch_target(), CompiledBatchTarget)
    assert isinstance(engine.loaded.batch_drafter(engine.scaling), CompiledBatchDFlash)

    def one_round(seed):
        alone, batched = engine_prompts(engine, [70], seed), engine_prompts(engine, [90, 100, 30], seed)
        want = eager.generate(alone[0], 12, mode="target", stop=False).tokens
        for mode in ("target", "sharpdraft"):
            assert engine.generate(alone[0], 12, mode=mode, stop=False, adaptive=False).tokens == want
        requests = [Request(prompt=p, max_new_tokens=n) for p, n in zip(batched, (6, 16, 10))]
        want = [eager.generate(r.prompt, r.max_new_tokens, "target", stop=False).tokens for r in requests]
        for mode in ("target", "sharpdraft"):
            seqs = engine.decoder(mode, adaptive=False).run(requests, join_at=[0, 1, 2])
            assert [s.gen.tokens for s in seqs] == want, mode

    one_round(seed=1)
    state = (len(made), len(keys), counters["stats"]["unique_graphs"],
             shared.target_buffers.made, shared.draft_buffers.made)
    # both steps ran compiled, one and two sequences wide (the batch a slot each, not row by row)
    assert {(made_by, args[0][0][0]) for made_by, args in keys} == {
        (id(m), b) for m in (shared.target_module, shared.draft_step(engine.scaling, None)[0])
        for b in (1, 2)}
    with torch._dynamo.config.patch(error_on_recompile=True):
        one_round(seed=2)
    assert (len(made), len(keys), counters["stats"]["unique_graphs"],
            shared.target_buffers.made, shared.draft_buffers.made) == state


def test_slot_groups_keep_each_sequences_keys_as_sequences_join_and_leave():
    """FixedSlots (the batched compiled roles' caches) against the single-sequence caches
    that joined: each remaining row's keys and length in its slot, slots a power of two,
    growing and shrinking; an emptied group's buffers back to the pool and reused; more
    keys reserved than its buffers hold moves it to the next capacity bucket."""
    from runtime.backends.slots import FixedSlots
    from runtime.backends.pytorch.compiled import BufferPool
    from runtime.models.layers import KVCache

    def make(capacity, slots):
        return KVCache(2, slots or 1, 1, capacity, 3, torch.float64, per_sequence=slots is not None)

    pool = BufferPool(make)
    groups = FixedSlots(pool)
    singles = []
    for i, n in enumerate([5, 9, 3, 7, 6]):
        single = KVCache(2, 1, 1, 30, 3, torch.float64)
        single.k.normal_(), single.v.normal_()
        single.length = n
        singles.append(single)
        groups.join(single)
    # a capacity of 30 rounds up to 32: one group, five sequences in eight slots
    (group,) = groups.groups
    assert group.cache.capacity == 32 and len(group.lengths) == 8

    def check(alive):
        (group,) = groups.groups
        assert sorted(group.members) == list(range(len(alive))) and groups.rows == len(alive)
        assert group.cache.lengths.tolist() == group.lengths
        for row, single in enumerate(alive):
            slot, n = group.slots[group.members.index(row)], single.length
            assert group.lengths[slot] == n
            assert torch.equal(group.cache.k[:, slot, :, :n], single.k[:, 0, :, :n])
            assert torch.equal(group.cache.v[:, slot, :, :n], single.v[:, 0, :, :n])
        return group

    check(singles)
    for row in (1, 3, 0):  # down to two sequences in eight slots: moved into two
        groups.drop(row)
        singles.pop(row)
    assert len(check(singles).lengths) == 2
    made = pool.made
    groups.drop(0), groups.drop(0)
    assert not groups.groups and groups.rows == 0
    groups.join(singles[0])
    assert pool.made == made  # the emptied group's buffers, reused
    check(singles[:1])
    (group,) = groups.groups
    groups.reserve(group, 32)  # room enough: stays
    assert group.cache.capacity == 32
    groups.reserve(group, 40)  # a packed tree's scratch past it: buffers of the next bucket
    assert group.cache.capacity == 64
    check(singles[:1])


@pytest.fixture(scope="module")
def pard_engine(tmp_path_factory, tiny_target):
    import build_engine

    out = tmp_path_factory.mktemp("engines") / "pard-torch"
    ckpt = tiny.make_pard(tmp_path_factory.mktemp("pard"), tiny_target)
    assert build_engine.main(["--drafter", "pard", "--sharpdraft", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(ckpt), "--ref-keys", "64", "--top-k", "8",
                              "--backend", "torch", "--step-costs", "fixed", "--output", str(out)]) == 0
    return out


@pytest.mark.slow  # an engine of its own to build and graphs of its own: ~30 s on 2 cores
def test_pard_chains_run_the_engines_compiled_step_and_compile_once(pard_engine, monkeypatch):
    """CompiledBatchPARD, a request alone (a batch of one): SharpDraft (beta > 1 from 64
    keys) on the engine's compiled chain step decodes the target-only tokens; a second
    request makes no step, graph or KV buffer."""
    from torch._dynamo.utils import counters

    from runtime.backends.pytorch.compiled import CompiledBatchPARD
    from runtime.engine import Engine
    from runtime.spec import open_spec

    made, keys = recorded_steps(monkeypatch)
    eager, engine = Engine(open_spec(pard_engine)), Engine(open_spec(pard_engine, steps="eager"))
    assert isinstance(engine.loaded.batch_drafter(engine.scaling), CompiledBatchPARD)

    def one_round(seed):
        (prompt,) = engine_prompts(engine, [80], seed)
        want = eager.generate(prompt, 12, mode="target", stop=False).tokens
        assert engine.generate(prompt, 12, mode="sharpdraft", stop=False, adaptive=False).tokens == want

    one_round(seed=1)
    shared = engine.loaded.shared
    state = (len(made), len(keys), counters["stats"]["unique_graphs"], shared.chain_buffers.made)
    # the chain step ran compiled (a key of its own), not the eager fallback
    assert id(shared.chain_step(engine.scaling)[0]) in {made_by for made_by, _ in keys}
    with torch._dynamo.config.patch(error_on_recompile=True):
        one_round(seed=2)
    assert (len(made), len(keys), counters["stats"]["unique_graphs"], shared.chain_buffers.made) == state


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_seeded_sampling_on_the_compiled_batch_roles_is_the_same_batched_as_alone(tiny_engine, backend,
                                                                                 monkeypatch):
    """The issue's Must-hold: seeded SharpDraft requests sample the same tokens, N and beta
    per step through CompiledBatchTarget / CompiledBatchDFlash -- two sampled rows in one
    group's slots beside a greedy row at another length, joining a step apart -- as
    each alone (a batch of one); the greedy row gets the eager engine's target-only
    tokens; and the draws are not greedy's."""
    from runtime.decode import Request
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.sampling import Sampling

    made, keys = recorded_steps(monkeypatch)
    eager, engine = Engine(open_spec(tiny_engine)), Engine(open_spec(tiny_engine, steps=backend))
    # 70 and 90 tokens share a capacity bucket (one group, a pass for both); 30 another
    first, second, other = engine_prompts(engine, [70, 90, 30], seed=5)
    sampled = [Sampling(1.0, 1.0, seed=1), Sampling(1.0, 1.0, seed=2)]
    alone = [engine.generate(p, 24, "sharpdraft", s, stop=False, adaptive=False)
             for p, s in zip((first, second), sampled)]
    decoder = engine.decoder("sharpdraft", adaptive=False)
    requests = [Request(prompt=first, max_new_tokens=24, sampling=sampled[0]), Request(prompt=other, max_new_tokens=24), Request(prompt=second, max_new_tokens=24, sampling=sampled[1])]
    together = decoder.run(requests, join_at=[0, 1, 2])
    for seq, want in ((together[0], alone[0]), (together[2], alone[1])):
        assert (seq.gen.tokens, seq.gen.visible_per_step, seq.gen.beta_per_step) == \
            (want.tokens, want.visible_per_step, want.beta_per_step)
    assert together[1].gen.tokens == eager.generate(other, 24, "target", stop=False).tokens
    greedy = engine.generate(first, 24, "sharpdraft", stop=False, adaptive=False).tokens
    assert alone[0].tokens != greedy
    # the batched steps ran compiled, the sampled pair in one call two slots wide
    shared = engine.loaded.shared
    assert {(id(m), 2) for m in (shared.target_module, shared.draft_step(engine.scaling, None)[0])} <= {
        (made_by, args[0][0][0]) for made_by, args in keys}


def test_a_chunked_join_on_the_compiled_batch_roles_gives_the_whole_joins_tokens(tiny_engine,
                                                                                monkeypatch):
    """Chunked prefill (Decoder.join) through CompiledBatchTarget: a 100-token prompt joins
    a running row a chunk at a time, the row stepping between chunks, and both decode the
    tokens of a whole join and of the eager engine, target-only and SharpDraft. The chunks
    run eagerly on the joining sequence's own cache (a prompt's prefill: no graph), so a
    second round at another chunk length and other prompts in the same buckets makes no
    step, dynamo graph, CUDA-graph key or KV buffer."""
    from torch._dynamo.utils import counters

    from runtime.backends.pytorch import TorchBatchTarget
    from runtime.decode import Request
    from runtime.engine import Engine
    from runtime.spec import open_spec

    made, keys = recorded_steps(monkeypatch)
    eager, engine = Engine(open_spec(tiny_engine)), Engine(open_spec(tiny_engine, steps="eager"))
    chunks = []
    more = TorchBatchTarget.prefill_more  # CompiledBatchTarget's: its joining prefill is eager
    monkeypatch.setattr(TorchBatchTarget, "prefill_more",
                        lambda self, ids: chunks.append(len(ids)) or more(self, ids))

    def run(mode, running, joining, chunk):
        decoder = engine.decoder(mode, adaptive=False)
        first = decoder.add(Request(prompt=running, max_new_tokens=40))
        decoder.step()
        joins, stepped = decoder.join(Request(prompt=joining, max_new_tokens=10), chunk), 0
        while True:
            try:
                next(joins)
            except StopIteration as joined:
                second = joined.value
                break
            assert not first.done
            decoder.step()  # the running row steps between two chunks
            stepped += 1
        while decoder.active:
            decoder.step()
        return [first.gen.tokens, second.gen.tokens], stepped

    def one_round(seed, chunk):
        running, joining = engine_prompts(engine, [40, 100], seed)
        want = [eager.generate(running, 40, "target", stop=False).tokens,
                eager.generate(joining, 10, "target", stop=False).tokens]
        for mode in ("target", "sharpdraft"):
            chunks.clear()
            chunked, stepped = run(mode, running, joining, chunk)
            # the first chunk is prefill's, the rest prefill_more's; a step after each
            assert chunks == [min(chunk, 100 - b) for b in range(chunk, 100, chunk)]
            assert stepped == -(-100 // chunk)
            whole, stepped = run(mode, running, joining, None)
            assert chunked == whole == want and stepped == 0, mode

    one_round(seed=1, chunk=32)
    shared = engine.loaded.shared
    state = (len(made), len(keys), counters["stats"]["unique_graphs"],
             shared.target_buffers.made, shared.draft_buffers.made)
    with torch._dynamo.config.patch(error_on_recompile=True):
        one_round(seed=2, chunk=24)
    assert (len(made), len(keys), counters["stats"]["unique_graphs"],
            shared.target_buffers.made, shared.draft_buffers.made) == state
