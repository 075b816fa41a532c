"""EAGLE-3: the drafter against an independent implementation of the published
architecture, tree speculation lossless against target-only decoding (with and without
SharpDraft), the visible-key counts its attention is handed, the caches after tree
steps against caches built from scratch, and the checkpoint layout and its refusals."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from tiers import examples

from runtime.backends.roles import TokenRows
import runtime.models.eagle3 as eagle3
from plugins.attention import sharpdraft_attention, visible_counts
from plugins.scaling import QueryScaling
from runtime.backends.pytorch import TorchBatchEagle3, TorchBatchTarget
from runtime.models.eagle3 import DraftVocabulary, load_eagle3, save_eagle3
from runtime.models.target import ModelError
from runtime.sampling import Sampler, Sampling
from speculative import generate_target_only, generate_tree
from runtime.tree import TreeShape

from tiny import float64_eagle3, float64_target

AUX = (1, 2, 3)  # EAGLE ids over a 4-layer target: the inputs of layers 1, 2 and 3


def eagle_pair(seed, vocab, draft_vocab=None, eagle31=False, sharpness=3.0):
    target = float64_target(seed, vocab, layers=4, sharpness=sharpness)
    drafter = float64_eagle3(target, seed + 1, AUX, draft_vocab, eagle31, sharpness)
    return target, drafter


def runners(target, drafter, scaling=None, shape=TreeShape(4, 4, 12)):
    layers = drafter.config.feature_layers(target.config.num_layers)
    return TorchBatchTarget(target, layers), TorchBatchEagle3(drafter, scaling, shape.depth, shape)


# --- the architecture, against an independent plain-torch reading of cnets.py -----

def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_rows(state, c, ids, hidden_in, scaling=None):
    """EAGLE-3's layer over rows 0..t-1 (causal, positions 0..t-1), from the weights:
    returns logits over the draft vocabulary and the state handed to the next step."""
    t, H, hd = len(ids), c.hidden_size, c.head_dim
    emb = state["embed_tokens.weight"][ids]
    normed_h = rms(hidden_in, state["midlayer.hidden_norm.weight"])
    residual = normed_h if c.norm_before_residual else hidden_in
    x = torch.cat([rms(emb, state["midlayer.input_layernorm.weight"]), normed_h], -1)
    q = (x @ state["midlayer.self_attn.q_proj.weight"].T).view(t, c.num_heads, hd)
    k = (x @ state["midlayer.self_attn.k_proj.weight"].T).view(t, c.num_kv_heads, hd)
    v = (x @ state["midlayer.self_attn.v_proj.weight"].T).view(t, c.num_kv_heads, hd)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(z):
        return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    if scaling is not None:  # SharpDraft: row i sees i + 1 keys
        q = q * torch.tensor([scaling.beta(i + 1) for i in range(t)], dtype=q.dtype)[:, None, None]
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    h = residual + attn @ state["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, state["midlayer.post_attention_layernorm.weight"])
    h = h + (F.silu(m @ state["midlayer.mlp.gate_proj.weight"].T) * (m @ state["midlayer.mlp.up_proj.weight"].T)
             ) @ state["midlayer.mlp.down_proj.weight"].T
    normed = rms(h, state["norm.weight"])
    return normed @ state["lm_head.weight"].T, (normed if c.norm_output else h)


def reference_project(state, c, features):
    if c.fc_norm:
        chunks = features.chunk(c.num_aux, -1)
        features = torch.cat([rms(x, state[f"fc_norm.{i}.weight"]) for i, x in enumerate(chunks)], -1)
    return features @ state["fc.weight"].T


@pytest.mark.parametrize("eagle31", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_drafter_matches_an_independent_reading_of_the_published_layer(eagle31, scaled):
    """Context rows from target features, then two chain rows fed the drafter's own
    state: one incremental run against one plain causal pass over all rows."""
    target, drafter = eagle_pair(5, vocab=11, draft_vocab=7, eagle31=eagle31)
    state, c = drafter.state_dict(), drafter.config
    scaling = QueryScaling(ref_keys=6, top_k=2, slope=2.0) if scaled else None
    g = torch.Generator().manual_seed(0)
    features = torch.randn(5, 3 * c.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (7,), generator=g)
    cache = drafter.new_cache(16)
    with torch.no_grad():
        logits, out, _ = drafter(ids[None, :5], drafter.project(features[None]), cache, scaling)
        rows = [out[0, -1]]
        for i in (5, 6):
            step_logits, step_out, _ = drafter(ids[None, i:i + 1], rows[-1][None, None], cache, scaling)
            rows.append(step_out[0, 0])
            logits = torch.cat([logits, step_logits], 1)
    hidden_in = torch.cat([reference_project(state, c, features), torch.stack(rows[:2])])
    want_logits, want_out = reference_rows(state, c, ids, hidden_in, scaling)
    # RoPE angles are float32 in the model (as transformers computes them), float64 here
    torch.testing.assert_close(logits[0], want_logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rows[-1], want_out[-1], atol=1e-6, rtol=1e-6)
    assert cache.length == 7


def test_draft_vocabulary_maps_through_d2t():
    _, drafter = eagle_pair(2, vocab=13, draft_vocab=5)
    vocab = DraftVocabulary(drafter)
    logits = torch.randn(3, 5, dtype=torch.float64)
    full = vocab.target_logits(logits)
    ids = (torch.arange(5) + drafter.d2t).tolist()
    assert torch.equal(full[:, ids], logits)
    assert torch.isinf(full[:, [i for i in range(13) if i not in ids]]).all()
    assert vocab.to_target(torch.tensor([0, 4])).tolist() == [ids[0], ids[4]]
    assert drafter.t2d.nonzero().flatten().tolist() == sorted(ids)


# --- tree speculation: lossless -----------------------------------------------------

@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([4, 6, 12, 40]), top_k=st.integers(1, 4),
       depth=st.integers(1, 5), total=st.integers(2, 16), prompt_len=st.integers(1, 24),
       max_new=st.integers(1, 40), scaled=st.booleans(), stop=st.booleans(),
       reduced_vocab=st.booleans(), eagle31=st.booleans())
def test_greedy_tree_speculation_equals_target_only(seed, vocab, top_k, depth, total, prompt_len,
                                                    max_new, scaled, stop, reduced_vocab, eagle31):
    target, drafter = eagle_pair(seed % 5000, vocab, vocab // 2 if reduced_vocab else None, eagle31)
    scaling = QueryScaling(ref_keys=12, top_k=4, slope=2.0) if scaled else None
    shape = TreeShape(top_k, depth, total)
    t, d = runners(target, drafter, scaling, shape)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    stop_ids = frozenset({0}) if stop else frozenset()
    want = generate_target_only(t, prompt, max_new, Sampler(), stop_ids)
    got = generate_tree(t, d, prompt, max_new, Sampler(), shape, stop_ids)
    assert got.tokens == want.tokens
    if got.stopped_by == "length":  # a stop token may cut the last step's path short
        assert sum(got.committed_per_step) + 1 == len(got.tokens)
    assert all(1 <= n <= depth + 1 for n in got.committed_per_step)


def test_the_tree_check_exercises_acceptance():
    """Guard for the property test: on these pairs whole paths of drafts get accepted."""
    accepted = []
    for seed in range(6):
        target, drafter = eagle_pair(seed, vocab=6)
        t, d = runners(target, drafter, QueryScaling(ref_keys=12, top_k=4, slope=2.0), TreeShape(3, 4, 16))
        accepted.append(generate_tree(t, d, [1, 2, 3], 40, Sampler(), TreeShape(3, 4, 16)).mean_accepted_length)
    assert max(accepted) > 1.5, accepted


def test_tree_speculation_refuses_sampling_in_one_line():
    target, drafter = eagle_pair(0, vocab=6)
    t, d = runners(target, drafter)
    with pytest.raises(ValueError) as err:
        generate_tree(t, d, [1, 2], 5, Sampler(Sampling(temperature=0.7, seed=1)))
    assert "\n" not in str(err.value) and "greed" in str(err.value)


@pytest.mark.parametrize("seed", range(4))
def test_caches_after_tree_steps_equal_caches_built_from_scratch(seed):
    """After a generation: the target's cache (compacted to each accepted path) equals a
    causal prefill over the committed tokens, and the drafter's entries equal ingesting
    the committed tokens' features in one go."""
    target, drafter = eagle_pair(seed, vocab=8, draft_vocab=6)
    shape = TreeShape(3, 4, 14)
    t, d = runners(target, drafter, QueryScaling(ref_keys=10, top_k=2, slope=2.0), shape)
    left = []  # the row's caches (target's, drafter's) as the finished sequence leaves the batch
    for role in (t, d):
        def remove(row, role=role, leave=role.remove):
            cache = role.caches.groups[0].cache
            left.append((int(cache.lengths[0]), cache.k.clone(), cache.v.clone()))
            leave(row)

        role.remove = remove
    prompt = [1, 5, 2, 7, 3]
    gen = generate_tree(t, d, prompt, 30, Sampler(), shape)
    assert gen.mean_accepted_length > 1.0
    committed = prompt + gen.tokens[:-1]  # the last token is not in any cache yet
    (n, k, v), (m, dk, dv) = sorted(left, key=lambda c: -c[0])  # the drafter is a token behind
    assert n == len(committed)
    scratch = TorchBatchTarget(target, t.feature_layers)
    _, features = scratch.add(committed, n + 4)
    ref = scratch.caches.groups[0].cache
    torch.testing.assert_close(k[..., :n, :], ref.k[..., :n, :], atol=1e-9, rtol=0)
    torch.testing.assert_close(v[..., :n, :], ref.v[..., :n, :], atol=1e-9, rtol=0)
    # the drafter last ingested what was committed before its last tree
    assert len(prompt) <= m < n
    fresh = TorchBatchEagle3(drafter, d.scaling, shape.depth, shape)
    fresh.add(n + 4, committed[:m + 1], features[:m])
    ref = fresh.caches.groups[0].cache
    torch.testing.assert_close(dk[..., :m, :], ref.k[..., :m, :], atol=1e-9, rtol=0)
    torch.testing.assert_close(dv[..., :m, :], ref.v[..., :m, :], atol=1e-9, rtol=0)


# --- what the attention op is handed -----------------------------------------------

def test_drafter_rows_get_the_visible_keys_of_their_own_path(monkeypatch):
    """Recorded at the op: the context rows are causal (row i sees i + 1 keys); a tree
    level's rows at offset o each see the c committed entries and one key per level of
    their own path: c + o + 1 -- not the cache's length, which counts every frontier."""
    handed = []

    def recording(q, k, v, visible, scaling=None, mask=None):
        handed.append((visible.clone(), None if mask is None else mask.clone(), k.shape[2], scaling))
        return sharpdraft_attention(q, k, v, visible, scaling, mask)

    monkeypatch.setattr(eagle3, "sharpdraft_attention", recording)
    target, drafter = eagle_pair(1, vocab=12)
    scaling = QueryScaling(ref_keys=8, top_k=2, slope=2.0)
    shape = TreeShape(3, 5, 20)
    d = TorchBatchEagle3(drafter, scaling, shape.depth, shape)
    d.add(40, [], None)
    c = 9
    features = torch.randn(c, 3 * 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (tree, visible), = d.draft_trees(TokenRows.of([list(range(1, c + 1))]), [features], [shape])
    assert len(handed) == shape.depth  # the context, then one call per level below the first
    bound, mask, kv, applied = handed[0]
    assert mask is None and bound[0].tolist() == list(range(1, c + 1))
    for offset, (bound, mask, kv, applied) in enumerate(handed[1:]):
        n, _ = visible_counts(bound, kv, mask)  # what the op scales by
        by_hand = [sum(1 for key in range(kv) if key < int(bound[0, r]) and bool(mask[0, r, key]))
                   for r in range(mask.shape[1])]
        assert n[0].tolist() == by_hand == [c + offset + 1] * mask.shape[1]
        assert kv == c + (offset + 1) * 3 and applied is scaling
    assert visible == c + shape.depth - 1
    assert max(tree.depths) <= shape.depth


# --- the checkpoint: published layout, refusals ---------------------------------------

@pytest.fixture()
def saved(tmp_path):
    target, drafter = eagle_pair(4, vocab=12, draft_vocab=8, eagle31=True)
    save_eagle3(drafter, tmp_path / "eagle3")
    return target, drafter, tmp_path / "eagle3"


def test_checkpoint_has_the_published_names_and_loads_back(saved):
    from safetensors.torch import load_file

    target, drafter, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["draft_vocab_size"] == 8 and config["fc_norm"] and config["norm_output"]
    state = load_file(path / "model.safetensors")
    for name in ("fc.weight", "fc_norm.0.weight", "fc_norm.2.weight", "midlayer.hidden_norm.weight",
                 "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                 "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
                 "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"):
        assert name in state, name
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 16  # q reads [embedding, hidden]
    assert state["fc.weight"].shape == (16, 3 * 16) and state["lm_head.weight"].shape == (8, 16)
    loaded = load_eagle3(path, torch.float64, target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_checkpoint_without_embed_tokens_shares_the_targets(saved):
    from safetensors.torch import load_file, save_file

    target, _, path = saved
    state = load_file(path / "model.safetensors")
    del state["embed_tokens.weight"]
    save_file(state, path / "model.safetensors")
    loaded = load_eagle3(path, torch.float64, target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    with pytest.raises(ModelError, match="embed_tokens"):
        load_eagle3(path, torch.float64)


def edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key == "layer_ids":
            data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))


def edit_weights(path, change):
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors")


REFUSALS = [
    ("hidden size", lambda p: edit_config(p, target_hidden_size=24), "target_hidden_size 24 vs target 16"),
    ("layer ids", lambda p: edit_config(p, layer_ids=[1, 2, 4]), "eagle_aux_hidden_state_layer_ids [1, 2, 4]"),
    ("layer id 0", lambda p: edit_config(p, layer_ids=[0, 2, 3]), "outside 1..3"),
    ("vocab", lambda p: edit_config(p, vocab_size=13), "vocab_size 13 vs target 12"),
    ("vocab without d2t", lambda p: edit_weights(p, lambda s: (s.pop("d2t"), s.pop("t2d"))), "needs a d2t map"),
    ("d2t off the vocabulary", lambda p: edit_weights(p, lambda s: s["d2t"].add_(100)), "d2t maps"),
    ("t2d against d2t", lambda p: edit_weights(p, lambda s: s["t2d"].logical_not_()), "t2d disagrees"),
    ("missing tensor", lambda p: edit_weights(p, lambda s: s.pop("midlayer.self_attn.k_proj.weight")),
     "lacks tensor midlayer.self_attn.k_proj.weight"),
    ("wrong shape", lambda p: edit_weights(p, lambda s: s.update({"fc.weight": torch.zeros(16, 32)})),
     "tensor fc.weight has shape [16, 32]"),
    ("NaN tensor", lambda p: edit_weights(p, lambda s: s["norm.weight"].fill_(float("nan"))), "NaN"),
    ("truncated file", lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:300]),
     "cannot be read"),
    ("no weights", lambda p: (p / "model.safetensors").unlink(), "has no model.safetensors"),
    ("two layers", lambda p: edit_config(p, num_hidden_layers=2), "one-layer form"),
    ("not JSON", lambda p: (p / "config.json").write_text("{"), "not valid JSON"),
]


@pytest.mark.parametrize("what,break_it,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_loader_refuses_in_one_line(saved, what, break_it, message):
    target, _, path = saved
    break_it(path)
    with pytest.raises(ModelError) as err:
        load_eagle3(path, torch.float64, target)
    assert message in str(err.value) and "\n" not in str(err.value)
