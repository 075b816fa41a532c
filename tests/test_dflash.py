import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from runtime.models.dflash import DFlashConfig, load_dflash
from runtime.models.target import ModelError, load_target


def test_loads_the_published_layout(tiny_target, tiny_drafter):
    names = set(load_file(tiny_drafter / "model.safetensors"))
    # z-lab/dflash tensor names: fc, hidden_norm, norm, layers.i.{self_attn,mlp,...}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.input_layernorm.weight"} <= names
    config = json.loads((tiny_drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 3
    drafter = load_dflash(tiny_drafter)
    target, _ = load_target(tiny_target)
    drafter.config.check_target(target.config)


def test_top_level_dflash_keys_are_accepted(tiny_drafter, tmp_path):
    data = json.loads((tiny_drafter / "config.json").read_text())
    inner = data.pop("dflash_config")
    data.update(mask_token_id=inner["mask_token_id"], target_layer_ids=inner["target_layer_ids"])
    (tmp_path / "config.json").write_text(json.dumps(data))
    (tmp_path / "model.safetensors").write_bytes((tiny_drafter / "model.safetensors").read_bytes())
    assert load_dflash(tmp_path).config.target_layer_ids == tuple(inner["target_layer_ids"])


def copy_checkpoint(src, dst):
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_missing_tensor_is_refused(tiny_drafter, tmp_path):
    path = copy_checkpoint(tiny_drafter, tmp_path / "ck")
    state = load_file(path / "model.safetensors")
    del state["layers.0.self_attn.k_norm.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="lacks tensor layers.0.self_attn.k_norm.weight"):
        load_dflash(path)


def test_wrong_shape_is_refused(tiny_drafter, tmp_path):
    path = copy_checkpoint(tiny_drafter, tmp_path / "ck")
    state = load_file(path / "model.safetensors")
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="fc.weight has shape"):
        load_dflash(path)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": 32}', "lacks"),
])
def test_bad_config_is_refused(tiny_drafter, tmp_path, text, message):
    path = copy_checkpoint(tiny_drafter, tmp_path / "ck")
    (path / "config.json").write_text(text)
    with pytest.raises(ModelError, match=message):
        load_dflash(path)


def test_truncated_weights_are_refused(tiny_drafter, tmp_path):
    path = copy_checkpoint(tiny_drafter, tmp_path / "ck")
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ModelError, match="cannot be read"):
        load_dflash(path)


def test_drafter_for_another_target_is_refused_naming_both_values(tiny_target):
    target, _ = load_target(tiny_target)
    base = tiny.drafter_config(tiny_target)
    for change, message in (({"hidden_size": 64}, "hidden_size 64 vs target 32"),
                            ({"vocab_size": 999}, "vocab_size 999 vs target 320"),
                            ({"target_layer_ids": (0, 7)}, r"target_layer_ids \[7\] outside the target's 3 layers"),
                            ({"num_target_layers": 36}, "num_target_layers 36 vs target 3")):
        with pytest.raises(ModelError, match=message):
            DFlashConfig(**(base.__dict__ | change)).check_target(target.config)


def test_sliding_window_drafters_are_refused(tiny_drafter):
    data = json.loads((tiny_drafter / "config.json").read_text())
    data["layer_types"] = ["sliding_attention"]
    with pytest.raises(ModelError, match="sliding"):
        DFlashConfig.from_json(data)


def test_training_forward_equals_drafting_forward(tiny_target):
    """Each anchored training block sees exactly what a drafting step sees."""
    from runtime.models.dflash import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny.drafter_config(tiny_target, block_size=4, layers=2)).double().eval()
    width = drafter.fc.in_features
    context = torch.randn(1, 20, width, dtype=torch.float64)
    embeds = torch.randn(1, 12, 32, dtype=torch.float64)
    anchors = [3, 9, 15]
    trained = drafter.forward_train(embeds, context, torch.tensor([anchors]))
    for j, a in enumerate(anchors):
        cache = drafter.new_cache(64)
        drafter(embeds[:, :4], context[:, :a - 1], cache, None)  # context arrives over two steps
        drafted, visible = drafter(embeds[:, 4 * j:4 * j + 4], context[:, a - 1:a], cache, None)
        assert visible == a + 4
        assert (drafted - trained[:, 4 * j:4 * j + 4]).abs().max() < 1e-12


@pytest.mark.parametrize("window", [1, 5, 12])
def test_a_draft_window_sees_only_the_last_window_context_keys(tiny_target, window):
    """Under a draft window the block rows read the block and the last `window` context
    keys: older cache entries can hold anything, the newest one cannot."""
    from runtime.models.dflash import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny.drafter_config(tiny_target, block_size=4, layers=2)).double().eval()
    context = torch.randn(1, 20, drafter.fc.in_features, dtype=torch.float64)
    embeds = torch.randn(1, 4, 32, dtype=torch.float64)

    def draft(corrupt=None):
        cache = drafter.new_cache(64)
        drafter(embeds, context[:, :19], cache, None)
        if corrupt is not None:  # overwrite one committed context entry in every layer
            cache.k[:, :, :, corrupt] = 7.0
            cache.v[:, :, :, corrupt] = -7.0
        return drafter(embeds, context[:, 19:], cache, None, window=window)[0]

    clean = draft()
    for old in range(20 - window):  # outside the window
        assert torch.equal(draft(old), clean), old
    if window > 1:  # the oldest key inside (the last context key is written after corrupt)
        assert not torch.allclose(draft(20 - window), clean)
    unwindowed = drafter(embeds, context, drafter.new_cache(64), None)[0]
    assert not torch.allclose(unwindowed, clean)


def test_a_draft_vocabulary_round_trips_and_drafts_only_its_tokens(tiny_target, tmp_path):
    """EAGLE-3's d2t convention (target id = index + d2t[index]); the head's logits are
    the full head's on the draft tokens, one column each, and the sampler's picks map
    back to those target ids -- greedy and sampled, whose q over the target's vocabulary
    is 0 off the draft vocabulary."""
    from runtime.models.dflash import DraftHead
    from runtime.sampling import Sampler, Sampling

    path = tiny.make_drafter(tmp_path / "ck", tiny_target, draft_vocab=100)
    assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == 100
    assert load_file(path / "model.safetensors")["d2t"].shape == (100,)
    drafter = load_dflash(path)
    ids = drafter.draft_token_ids()
    assert len(ids.unique()) == 100 and int(ids.max()) < 320
    target, _ = load_target(tiny_target)
    hidden = torch.randn(3, target.config.hidden_size)
    full = target.lm_head(hidden)
    head = DraftHead.for_drafter(drafter, target.lm_head)
    logits = head(hidden)
    assert logits.shape == (3, 100) and torch.equal(head.vocab.ids, ids) and head.vocab.size == 320
    assert torch.allclose(logits, full[:, ids], atol=1e-6)
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    tokens, q = Sampler().propose(logits, head.vocab)
    assert tokens == masked.argmax(-1).tolist() and q is None
    tokens, q = Sampler(Sampling(temperature=1.0, seed=0)).propose(logits, head.vocab)
    assert q.shape == (3, 320) and torch.allclose(q, torch.softmax(masked.double(), -1))
    assert all(q[i, t] > 0 for i, t in enumerate(tokens)) and torch.isin(torch.tensor(tokens), ids).all()


def test_a_draft_vocabulary_without_its_head_is_refused_and_draft_head_writes_it(
        tiny_target, tmp_path):
    """vLLM reads a draft vocabulary's head from lm_head.weight and, without it, silently
    scores draft token j with target row j: our loader refuses such a checkpoint in one
    line naming the fix, and the fix writes exactly the target head's rows."""
    from build import draft_head

    from runtime.models.dflash import HEAD_FILE

    path = tiny.make_drafter(tmp_path / "ck", tiny_target, draft_vocab=50)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # the trained layers' file
    rows = load_file(path / HEAD_FILE)["lm_head.weight"]
    (path / HEAD_FILE).unlink()
    with pytest.raises(ModelError, match=r"no lm_head\.weight.*python -m build\.draft_head") as err:
        load_dflash(path)
    assert "\n" not in str(err.value)
    head = draft_head.target_head(tiny_target)
    assert "written" in draft_head.add_head(path, head)
    drafter = load_dflash(path)
    assert torch.equal(drafter.lm_head.weight, rows)
    assert torch.equal(rows, head[drafter.draft_token_ids()])
    assert "already holds" in draft_head.add_head(path, head)


def test_a_draft_vocabulary_outside_the_target_is_refused(tiny_target, tmp_path):
    path = tiny.make_drafter(tmp_path / "ck", tiny_target, draft_vocab=10)
    state = load_file(path / "model.safetensors")
    state["d2t"] = state["d2t"] + 400
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="d2t maps the draft vocabulary outside"):
        load_dflash(path)
