"""PARD: the published layout loads (and is the causal LM transformers reads), chain
speculation is lossless (greedy: token for token; sampling: the target's exact law),
every row's visible-key count is its causal mask's, and bad checkpoints are refused in
one line."""

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples, law_runs
from safetensors.torch import load_file, save_file

import tiny
from exact_law import assert_batched_chains_keep_the_law
from plugins.attention import sharpdraft_attention
from plugins.scaling import QueryScaling
from runtime.backends.pytorch import TorchBatchPARD, TorchBatchTarget
from runtime.decode import Request
from runtime.models.pard import load_pard, read_pard_config
from runtime.models.target import ModelError, load_target
from runtime.sampling import Sampler, Sampling
from speculative import (assert_batched_as_alone, chain_batch_decoder, generate_chain,
                         generate_target_only)
from runtime.step_costs import StepCosts


@pytest.fixture(scope="module")
def tiny_pard(tmp_path_factory, tiny_target):
    return tiny.make_pard(tmp_path_factory.mktemp("pard"), tiny_target)


def runners(target, drafter, max_drafts, scaling):
    return TorchBatchTarget(target), TorchBatchPARD(drafter, target.config.vocab_size, max_drafts, scaling)


def batched(target, drafter, max_drafts, scaling, costs=None):
    """A decoder whose batch drafts every row's chain in one PARD pass per step."""
    return chain_batch_decoder(TorchBatchTarget(target, ()),
                               TorchBatchPARD(drafter, target.config.vocab_size, max_drafts, scaling),
                               costs)


# ---- the published layout -------------------------------------------------------------

def test_loads_the_published_layout(tiny_target, tiny_pard):
    names = set(load_file(tiny_pard / "model.safetensors"))
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"} <= names
    config = json.loads((tiny_pard / "config.json").read_text())
    assert config["spd_type"] == "pard" and config["pard_token"] == tiny.PARD_TOKEN
    assert config["architectures"] == ["LlamaForCausalLM"]
    target, _ = load_target(tiny_target)
    load_pard(tiny_pard).config.check_target(target.config)


def test_the_drafter_is_the_causal_lm_transformers_reads(tiny_pard):
    """Independent implementation: transformers' own LlamaForCausalLM, loaded from the
    same directory, gives the same logits as our drafter run in two steps over its cache
    (frozen: no scaling)."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(tiny_pard, local_files_only=True).eval()
    ours = load_pard(tiny_pard)
    ids = torch.randint(0, ours.config.layers.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        cache = ours.new_cache(20)
        first, _ = ours(ids[:, :12], cache, None)
        second, _ = ours(ids[:, 12:], cache, None)
        got = ours.logits(torch.cat([first, second], 1), ours.config.layers.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---- losslessness ---------------------------------------------------------------------

@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]),
       max_drafts=st.integers(1, 7), prompt_len=st.integers(1, 24), max_new=st.integers(1, 40),
       scaled=st.booleans(), stop=st.booleans(), copy=st.booleans(),
       per_token=st.one_of(st.none(), st.floats(0.0, 2.0)))
def test_greedy_chain_speculation_equals_target_only(seed, vocab, max_drafts, prompt_len, max_new,
                                                     scaled, stop, copy, per_token):
    """copy: the drafter is the target itself (drafts accepted, long chains); else a
    random PARD drafter of its own width (mostly rejected). Alone, and batched beside a
    sequence at another length that joins a step later: the same tokens, N and beta."""
    target = tiny.float64_target(seed, vocab)
    drafter = (tiny.pard_from_target(target, vocab - 1) if copy
               else tiny.float64_pard(seed + 1, vocab))
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if scaled else None
    t, d = runners(target, drafter, max_drafts, scaling)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    stop_ids = frozenset({0}) if stop else frozenset()
    costs = None if per_token is None else StepCosts((1.0, per_token, 0.0, 0.0), (0.2, 0.0))
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_chain(t, d, prompt, max_new, Sampler(), stop_ids, costs=costs)
    assert got.tokens == want.tokens
    if got.stopped_by == "length":
        assert sum(got.committed_per_step) + 1 == len(got.tokens)
    assert all(1 <= c <= max_drafts + 1 for c in got.committed_per_step)
    other = [(seed + i) % vocab for i in range(prompt_len + 5)]
    together = batched(target, drafter, max_drafts, scaling, costs).run(
        [Request(prompt=prompt, max_new_tokens=max_new, stop_ids=stop_ids), Request(prompt=other, max_new_tokens=max_new)], join_at=[0, 1])
    assert_batched_as_alone(together, got, t, other, max_new)  # and so want's tokens


def test_the_lossless_check_exercises_acceptance():
    """Guard for the property test: with the target as drafter, first drafts are always
    accepted (so long chains are verified), and a random drafter's are sometimes."""
    target = tiny.float64_target(5, 6)
    t, d = runners(target, tiny.pard_from_target(target, 5), 4, None)
    assert generate_chain(t, d, [1, 2, 3], 30, Sampler()).mean_accepted_length >= 2.0
    accepted = []
    for seed in range(8):
        target = tiny.float64_target(seed, 4)
        t, d = runners(target, tiny.float64_pard(seed + 1, 4), 4, QueryScaling(ref_keys=12, top_k=4, slope=2.0))
        accepted.append(generate_chain(t, d, [1, 2, 3], 40, Sampler()).mean_accepted_length)
    assert max(accepted) > 1.2


def test_speculative_sampling_through_batched_chains_preserves_the_target_distribution():
    """Runs (temperature 0.8, top-p 0.9) against the target's exact law of the first three
    tokens: the prefill's token, then a step of up to 2 PARD drafts, each outcome (reject
    draft 1, reject draft 2, accept both) exercised. Through the batched chain drafter:
    eight sequences under test share every drafter pass with one at another length."""
    vocab, draws = 4, law_runs(20_000)
    target = tiny.float64_target(11, vocab, sharpness=1.5)
    drafter = tiny.pard_from_target(target, 3)
    with torch.no_grad():  # near the target, not equal: every outcome of the step happens
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()),
                                     dtype=p.dtype))
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    assert_batched_chains_keep_the_law(target, lambda: batched(target, drafter, 2, scaling), draws, vocab)


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch():
    target = tiny.float64_target(7, 12, sharpness=1.5)
    drafter = tiny.pard_from_target(target, 11)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()),
                                     dtype=p.dtype))
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    requests = [Request(prompt=p, max_new_tokens=30, sampling=Sampling(0.8, 0.9, seed=s))
                for s, p in enumerate([[1, 2], [3] * 9, [4, 5, 6, 7]], start=1)]
    got = batched(target, drafter, 3, scaling).run(requests, join_at=[0, 2, 1])
    for request, seq in zip(requests, got):
        t, d = runners(target, drafter, 3, scaling)
        alone = generate_chain(t, d, request.prompt, 30, Sampler(request.sampling))
        assert seq.gen.tokens == alone.tokens
        assert seq.gen.committed_per_step == alone.committed_per_step
    assert len({tuple(s.gen.tokens) for s in got}) == 3
    assert max(max(s.gen.committed_per_step) for s in got) > 1  # drafts were accepted


# ---- visible keys ---------------------------------------------------------------------

def test_each_row_sees_the_keys_its_causal_mask_leaves(monkeypatch):
    """Every attention call of a chain run: the count handed to the op for each row equals
    the keys a causal mask leaves that row, the mask built here from where the row and
    each key sit (the step's rows are the last q_len of the kv_len positions)."""
    import runtime.models.pard as pard

    handed = []

    def recording(q, k, v, visible, scaling=None, mask=None):
        handed.append((visible.clone(), q.shape[2], k.shape[2], scaling))
        return sharpdraft_attention(q, k, v, visible, scaling, mask)

    monkeypatch.setattr(pard, "sharpdraft_attention", recording)
    target = tiny.float64_target(3, 8)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0)
    t, d = runners(target, tiny.pard_from_target(target, 7), 3, scaling)
    gen = generate_chain(t, d, list(range(1, 8)), 30, Sampler())
    layers = len(d.drafter.layers)
    # the prompt's read during prefill, then one pass per step
    assert handed and len(handed) == layers * (1 + len(gen.visible_per_step))
    assert [h[1] for h in handed[:layers]] == [7] * layers
    for visible, q_len, kv_len, applied in handed:
        row_position = torch.arange(kv_len - q_len, kv_len)[:, None]
        mask = torch.arange(kv_len)[None, :] <= row_position  # causal: keys up to the row
        assert visible[0].tolist() == mask.sum(-1).tolist()
        assert applied is scaling
    # the stats report the first draft row's N: the drafter has read the prompt and every
    # committed token, and the first draft row is the newest of them
    read = [7 + 1 + sum(gen.committed_per_step[:s]) for s in range(len(gen.visible_per_step))]
    assert gen.visible_per_step == read
    assert gen.beta_per_step == [scaling.beta(n) for n in gen.visible_per_step]
    assert max(gen.beta_per_step) > 1.0


# ---- refusals -------------------------------------------------------------------------

def copy_checkpoint(src, dst):
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes, message", [
    ({"spd_type": None}, "spd_type None, not 'pard'"),
    ({"spd_type": "eagle3"}, "spd_type 'eagle3', not 'pard'"),
    ({"pard_token": None}, "lacks 'pard_token'"),
    ({"pard_token": 10**6}, "pard_token 1000000 lies outside"),
    ({"hidden_size": 32}, "tensor embed_tokens.weight has shape"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
])
def test_bad_configs_are_refused_in_one_line(tiny_pard, tmp_path, changes, message):
    path = copy_checkpoint(tiny_pard, tmp_path / "ck")
    edit_config(path, **changes)
    with pytest.raises(ModelError, match=message) as info:
        load_pard(path)
    assert "\n" not in str(info.value)


def test_a_drafter_for_another_vocabulary_is_refused(tiny_pard, tiny_target, tmp_path):
    from runtime.models.pard import PARDDrafter, save_pard

    config = read_pard_config(tiny_pard)
    small = tiny.pard_config(config.layers.vocab_size - 20, config.layers.max_position_embeddings)
    save_pard(PARDDrafter(small), tmp_path / "small")
    target, _ = load_target(tiny_target)
    with pytest.raises(ModelError, match=r"vocab_size 300 vs target 320"):
        load_pard(tmp_path / "small").config.check_target(target.config)


def test_missing_and_corrupt_tensors_are_refused(tiny_pard, tmp_path):
    path = copy_checkpoint(tiny_pard, tmp_path / "missing")
    state = load_file(path / "model.safetensors")
    del state["model.layers.0.self_attn.k_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="lacks tensor layers.0.self_attn.k_proj.weight"):
        load_pard(path)

    path = copy_checkpoint(tiny_pard, tmp_path / "nan")
    state = load_file(path / "model.safetensors")
    state["model.norm.weight"][0] = float("nan")
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="norm.weight holds NaN"):
        load_pard(path)

    path = copy_checkpoint(tiny_pard, tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cannot be read") as info:
        load_pard(path)
    assert "\n" not in str(info.value)

    (path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="has no model.safetensors"):
        load_pard(path)


# ---- training matches drafting --------------------------------------------------------

def test_a_training_chain_sees_exactly_what_a_drafting_step_sees():
    """build/train_pard.py's masked rows against the drafter's own inference step: a
    chain anchored at p in a training pass gives the logits of drafting after p tokens
    (the real token's row, then the pard rows)."""
    from build.train_pard import pard_batch

    drafter = tiny.float64_pard(7, 12, layers=2)
    ids = torch.randint(0, 11, (1, 30), generator=torch.Generator().manual_seed(0))
    anchors, k = torch.tensor([[4, 17, 25]]), 4
    x, positions, mask, predicting, _ = pard_batch(ids, anchors, k, 11)
    with torch.no_grad():
        trained = drafter.forward_train(x, mask, positions)[0, predicting[0]]
        for a, p in enumerate(anchors[0].tolist()):
            cache = drafter.new_cache(p + k)
            row = ids[0, :p + 1].tolist() + [11] * (k - 1)
            hidden, _ = drafter(torch.tensor([row]), cache, None, keep=p + 1)
            torch.testing.assert_close(trained[a], hidden[0, -k:], atol=1e-10, rtol=0)
