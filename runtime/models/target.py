"""The target model: any local transformers Llama / Mistral / Qwen2 / Qwen3 causal LM,
run by our own compact decoder so that it can (a) hand the drafter the hidden states of
chosen layers, (b) keep a preallocated KV cache that rolls back by a length change, and
(c) be exported to ONNX with explicit cache inputs. Weights come straight from the
safetensors when config.json states every field we read, else through transformers'
loader (HF directory or GGUF); `tests/test_target.py` pins logits and loaded weights to
transformers'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from runtime.models.layers import (AttentionProjections, GatedMLP, KVCache, Linear, RMSNorm,
                                   Rotary)
from runtime.step_metadata import StepMetadata

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(ValueError):
    """A checkpoint or config we refuse, with a one-line reason."""


def read_config_json(path, kind: str) -> dict:
    """A checkpoint directory's config.json as a dict, or a one-line ModelError naming
    what is wrong (`kind` names the checkpoint expected, e.g. "a DFlash checkpoint")."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{path} has no config.json (not {kind})")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{cfg_file} must hold a JSON object")
    return data


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, config, state_keys) -> "TargetConfig":
        if config.model_type not in SUPPORTED_TYPES:
            raise ModelError(f"target model_type {config.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ModelError(f"target rope_type {rope_type!r} is not supported (only 'default')")
        window = getattr(config, "sliding_window", None)
        uses_window = getattr(config, "use_sliding_window", config.model_type == "mistral")
        if uses_window and window and window < config.max_position_embeddings:
            raise ModelError(f"targets with sliding-window attention (window {window}) are not "
                             "supported")
        heads = config.num_attention_heads
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            max_position_embeddings=config.max_position_embeddings,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in state_keys,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in state_keys,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class DecoderLayer(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.self_attn = AttentionProjections(c.hidden_size, c.num_heads, c.num_kv_heads,
                                              c.head_dim, c.attention_bias, c.qk_norm,
                                              c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, cache: KVCache, layer: int, start: int, visible, mask=None):
        x = self.input_layernorm(h)
        q = self.self_attn.query(x, cos, sin)
        k, v = self.self_attn.key_value(x, cos, sin)
        h = h + self.self_attn.output(cache.attend(layer, start, q, k, v, visible, mask))
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> KVCache:
        c = self.config
        p = self.embed_tokens.weight
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, p.dtype,
                       p.device, per_sequence)

    def forward(self, ids: torch.Tensor, cache: KVCache, feature_layers=(), last_logits_only=False,
                tree=None):
        """Run `ids` [b, t] after the cache's committed tokens; commit them.

        Returns logits [b, t or 1, vocab] and the concatenated hidden states of
        `feature_layers` [b, t, len(ids) * hidden] in transformers' convention
        (output of layer i; the final norm's output for the last layer).

        tree: (mask [b, t, t], depths [b, t]) to verify a draft tree in one pass: row i
        sees the committed tokens and the rows mask[:, i] allows (its ancestors and
        itself) at position committed + depth. Its keys stay scratch past the
        committed length until the cache keeps the accepted path (KVCache.keep).
        """
        h, features = self.final_hidden(ids, cache, feature_layers, tree)
        return self.lm_head(h[:, -1:] if last_logits_only else h), features

    def final_hidden(self, ids: torch.Tensor, cache: KVCache, feature_layers=(), tree=None):
        """forward() without the LM head: final-norm states [b, t, hidden] and features
        (the ONNX export picks the rows that need logits itself)."""
        b, t = ids.shape
        # cached: an int, a 0-d tensor in an exported graph, or [b] lengths in a batch
        meta = StepMetadata.of(cache, t)
        start, mask = meta.cached, None
        if tree is None:
            positions = meta.positions(t, b, ids.device)
            visible = meta.causal_visible(t, b, ids.device)
        else:
            positions, visible, mask, start = meta.tree_rows(*tree)
        cos, sin = self.rotary(positions, self.embed_tokens.weight.dtype)
        h = self.embed_tokens(ids)
        wanted = set(feature_layers)
        states = {}
        last = self.config.num_layers - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, i, start, visible, mask)
            if i in wanted and i != last:
                states[i] = h
        # A tree's keys stay scratch until KVCache.keep commits the accepted path.
        if tree is None and meta.per_sequence:  # a batch: its runner rolls each sequence back
            cache.lengths = meta.committed()
        elif tree is None:
            cache.length = meta.committed()
        h = self.norm(h)
        if last in wanted:
            states[last] = h
        features = torch.cat([states[i] for i in feature_layers], -1) if feature_layers else None
        return h, features


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """The files of a transformers directory that loading it reads: all but prose (*.md)."""
    return sorted(p.name for p in Path(directory).iterdir() if p.is_file() and p.suffix != ".md")


def _weights_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir()
                  if p.suffix in (".safetensors", ".bin", ".gguf") or p.name.endswith(".index.json"))


def load_hf_causal_lm(path: Path, dtype: torch.dtype = torch.float32, gguf_file: str | None = None):
    """transformers' model + tokenizer from a local directory (or a GGUF inside one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # stderr carries our own progress and one-line errors
    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {str(exc).splitlines()[0]}") from None
    except RuntimeError as exc:  # transformers' refusal of weights shaped unlike the config
        raise ModelError(f"cannot load a causal LM from {path}: its weights do not match its "
                         f"config.json (transformers: {str(exc).splitlines()[0]})") from None
    return model.eval(), tokenizer


def load_tokenizer(path: str | Path):
    """The target's tokenizer alone (backends that run exported graphs need no weights)."""
    try:
        if _names_the_generic_tokenizer(Path(path)):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None


# The model types whose checkpoints AutoTokenizer gives transformers' generic
# TokenizersBackend when their tokenizer_config.json names it (its TOKENIZER_MAPPING_NAMES
# has no class of their own; tests/test_target.py checks this against the pinned
# transformers' table).
GENERIC_TOKENIZER_TYPES = ("llama", "mistral")


def _names_the_generic_tokenizer(path: Path) -> bool:
    """Whether AutoTokenizer would settle on TokenizersBackend for this checkpoint: it names
    that class and no code of its own, and its model type has no class of its own.
    AutoTokenizer reads config.json through the model's config class and its own tables to
    find that out (importing them takes ~2 s of every engine process's start), so such a
    checkpoint gets TokenizersBackend directly; any other goes through AutoTokenizer.
    tests/test_target.py checks that the two give the same tokenizer."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(tokenizer_config, dict) and isinstance(config, dict)
            and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config and "auto_map" not in config
            and config.get("model_type") in GENERIC_TOKENIZER_TYPES
            and (path / "tokenizer.json").is_file())


def load_target(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Our TargetModel and its tokenizer from a local transformers directory. The weights
    come straight from its safetensors when config.json states every field we read (as
    transformers' save_pretrained writes it); otherwise, or for other weight files,
    through transformers' own model (its config class supplies the defaults). Both give
    the same model (tests/test_target.py); the direct read skips importing and building
    transformers' model class, about 2 s of every process that opens a torch engine."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model directory (no config.json)")
    if not _weights_in(path):
        raise ModelError(f"{path} has no weight files (*.safetensors, *.bin)")
    config, files = stated_config(path), _safetensors_files(path)
    if config is None or files is None:
        hf_model, tokenizer = load_hf_causal_lm(path, dtype)
        return target_from_hf(hf_model), tokenizer
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    try:
        for file in files:
            state.update(load_file(file))
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"cannot read the weights in {path}: {exc}") from None
    state = {k: v.to(dtype) for k, v in state.items()}
    return target_of(TargetConfig.from_hf(config, state.keys()), state), load_tokenizer(path)


# The config.json fields TargetConfig.from_hf reads whose absence transformers' config
# classes would fill with a per-architecture default (Qwen3's head_dim is 128, not
# hidden / heads): a direct load needs each stated.
STATED_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def stated_config(path: Path):
    """config.json as attributes when it states everything from_hf reads, else None."""
    import types

    raw = read_config_json(path, "a causal LM")
    if any(field not in raw for field in STATED_FIELDS):
        return None
    if "rope_parameters" not in raw and "rope_theta" not in raw:
        return None
    if raw.get("rope_scaling"):  # transformers turns the older key into rope_parameters
        return None
    if raw["model_type"] == "mistral" and "sliding_window" not in raw:
        return None  # transformers' Mistral default is a 4,096-token window
    return types.SimpleNamespace(**raw)


def _safetensors_files(path: Path) -> list[Path] | None:
    """The safetensors holding the weights: model.safetensors, or the shards its index
    lists; None when the weights are in another form."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError):
            return None
        return [path / name for name in shards]
    return None


def target_from_hf(hf_model) -> TargetModel:
    state = hf_model.state_dict()
    return target_of(TargetConfig.from_hf(hf_model.config, state.keys()), state)


def target_of(config: TargetConfig, state: dict) -> TargetModel:
    """Our decoder holding a transformers-named state dict's weights, in their dtype."""
    weight = next(iter(state.values()))
    model = TargetModel(config).to(dtype=weight.dtype)
    ours = {k.removeprefix("model."): v for k, v in state.items()}
    if config.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise ModelError(f"target weights do not match a {config.model_type} decoder: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


def convert_gguf(gguf: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantize a GGUF checkpoint once into a transformers directory (fast to reload)."""
    from safetensors.torch import save_file

    model, tokenizer = load_hf_causal_lm(gguf.parent, dtype, gguf_file=gguf.name)
    config = model.config
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # safetensors stores no shared tensors
    # transformers marks GGUF-loaded models as quantized and refuses save_pretrained;
    # the weights are plain de-quantized tensors by now, so write them ourselves.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = str(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
              metadata={"format": "pt", "converted_from": gguf.name})
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
