import pytest
import torch

import tiny
from runtime.models.target import ModelError, load_target, target_from_hf


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_target_logits_and_features_match_transformers(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    path = tiny.make_target(tmp_path, model_type, dtype=torch.float32, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ours = target_from_hf(hf)
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        cache = ours.new_cache(64, batch=2)
        # prefill, then a block, then one token: the cache path must not change results
        parts = [ours(ids[:, a:b], cache, (0, 2)) for a, b in ((0, 25), (25, 39), (39, 40))]
    logits = torch.cat([p[0] for p in parts], 1)
    features = torch.cat([p[1] for p in parts], 1)
    assert (logits - ref.logits).abs().max() < 1e-4
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1)  # hf: [emb, l0, l1, norm(l2)]
    assert (features - want).abs().max() < 1e-4


def test_rollback_then_recompute_gives_identical_logits(tiny_target):
    model, _ = load_target(tiny_target, torch.float64)
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache(64)
        model(ids[:, :20], cache)
        first, _ = model(ids[:, 20:30], cache)
        cache.rollback(23)
        again, _ = model(ids[:, 23:30], cache)
    assert torch.equal(first[:, 3:], again) or (first[:, 3:] - again).abs().max() < 1e-12


def test_rollback_refuses_growing(tiny_target):
    model, _ = load_target(tiny_target)
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(3)


def test_cache_capacity_is_enforced(tiny_target):
    model, _ = load_target(tiny_target)
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        model(torch.zeros(1, 5, dtype=torch.long), cache)


def test_not_a_model_directory_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no weight files"):
        load_target(tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="model_type 'gpt2' is not supported"):
        load_target(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_reading_the_safetensors_directly_gives_transformers_model(tmp_path, model_type,
                                                                   tiny_target):
    """load_target reads config.json and the safetensors itself when config.json states
    every field it reads; the model equals the one built from transformers' own (bfloat16
    weights loaded as float32, as transformers casts them)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from runtime.models.target import stated_config

    path = tiny.make_target(tmp_path / "t", model_type, dtype=torch.bfloat16, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the session's tokenizer
        shutil.copy(tiny_target / name, path / name)
    assert stated_config(path) is not None
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    want = target_from_hf(hf.eval())
    got, tokenizer = load_target(path, torch.float32)
    assert got.config == want.config and tokenizer.vocab_size > 0
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in got.state_dict().items())
    # a config.json that leaves a field to transformers' config class (whose defaults
    # differ by architecture: Qwen3's head_dim is 128, not hidden / heads) loads through
    # transformers instead
    config = json.loads((path / "config.json").read_text())
    del config["rms_norm_eps"]
    (path / "config.json").write_text(json.dumps(config))
    assert stated_config(path) is None
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    assert load_target(path)[0].config == target_from_hf(hf).config



def test_weights_that_do_not_fit_the_config_are_refused_in_one_line(tmp_path, tiny_target):
    """A Qwen3 config.json without head_dim: transformers' default (128) does not fit the
    weights (hidden / heads = 8), so the load is refused with the mismatch named, not a
    traceback."""
    import json
    import shutil

    path = tiny.make_target(tmp_path / "t", "qwen3", tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / name, path / name)
    config = json.loads((path / "config.json").read_text())
    del config["head_dim"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="weights do not match its config.json") as info:
        load_target(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_the_tokenizer_is_the_one_autotokenizer_gives(tmp_path, tiny_target, model_type):
    """load_tokenizer skips AutoTokenizer where it would settle on TokenizersBackend anyway
    (llama, mistral); a Qwen2 checkpoint (a class of its own in transformers' table) and one
    naming code of its own still go through AutoTokenizer. Either way: AutoTokenizer's
    tokenizer, the same class, vocabulary, special tokens, encodings and chat prompt."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from runtime.models import target as target_module

    path = tmp_path / model_type
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target / name, path / name)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert target_module._names_the_generic_tokenizer(path) == (model_type != "qwen2")
    ours, theirs = target_module.load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.special_tokens_map == theirs.special_tokens_map
    text = tiny.stdlib_text()[:2000] + "<|im_start|>user\nhi<|im_end|>"
    for special in (True, False):
        assert (ours.encode(text, add_special_tokens=special)
                == theirs.encode(text, add_special_tokens=special))
    chat = [{"role": "user", "content": "def f(x):"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tok.Custom"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert not target_module._names_the_generic_tokenizer(path)


def test_the_generic_tokenizer_types_are_transformers_own():
    """GENERIC_TOKENIZER_TYPES restates transformers' table for the pinned version: each
    type has no tokenizer class of its own and no known-wrong hub class."""
    from transformers.models.auto import tokenization_auto

    from runtime.models.target import GENERIC_TOKENIZER_TYPES

    for model_type in GENERIC_TOKENIZER_TYPES:
        own_class = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type)
        assert own_class in (None, "TokenizersBackend")
        assert model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
