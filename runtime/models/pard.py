"""The PARD drafter (AMD-AGI/PARD): a small causal LM of its own, target-independent,
with SharpDraft's scale in its attention.

A step feeds the tokens committed since the last step followed by K-1 copies of
`pard_token`; the last K rows' logits are K drafts, all from one pass. Attention is
causal over the drafter's own cache, so row j of a step sees past + j + 1 keys and gets
beta of that count (StepMetadata.causal_visible). Only the real tokens are committed to
the cache; the pard rows' keys lie past the committed length as scratch.

Published layout: a standard transformers causal-LM directory -- config.json (a Llama /
Qwen2 / Qwen3 config plus `pard_token` and `spd_type: "pard"`) and model.safetensors
(`model.embed_tokens.weight`, `model.layers.N...`, `model.norm.weight`, `lm_head.weight`
unless tied). The layers are the target's own DecoderLayer modules; only the forward
differs, since the drafter's attention takes a QueryScaling.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from plugins.attention import sharpdraft_attention
from plugins.scaling import QueryScaling
from runtime.models.layers import KVCache, Linear, RMSNorm, Rotary
from runtime.models.target import (SUPPORTED_TYPES, DecoderLayer, ModelError, TargetConfig,
                                   read_config_json)
from runtime.step_metadata import StepMetadata

SPD_TYPE = "pard"
CHECKPOINT_FILES = ("config.json", "model.safetensors")  # all that load_pard reads


@dataclasses.dataclass(frozen=True)
class PARDConfig:
    layers: TargetConfig  # the causal LM's shape, in the target's own terms
    pard_token: int
    training_max_length: int | None = None  # ours; transformers ignores the extra key

    @classmethod
    def from_json(cls, data: dict) -> "PARDConfig":
        if data.get("spd_type") != SPD_TYPE:
            raise ModelError(f"config.json has spd_type {data.get('spd_type')!r}, not 'pard' "
                             "(not a PARD drafter)")
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ModelError(f"PARD drafter model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelError(f"PARD drafter rope_type {rope.get('rope_type')!r} is not supported "
                             "(only 'default')")
        try:
            heads = int(data["num_attention_heads"])
            layers = TargetConfig(
                model_type=model_type,
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
                max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
                attention_bias=bool(data.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)))
            pard_token = int(data["pard_token"])
        except KeyError as exc:
            raise ModelError(f"PARD config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelError(f"PARD config.json has a malformed value ({exc})") from None
        if not 0 <= pard_token < layers.vocab_size:
            raise ModelError(f"pard_token {pard_token} lies outside the drafter's vocab "
                             f"{layers.vocab_size}")
        return cls(layers, pard_token, data.get("training_max_length"))

    def to_json(self) -> dict:
        c = self.layers
        architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[c.model_type]
        return {
            "architectures": [architecture],
            "model_type": c.model_type,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": c.attention_bias,
            "tie_word_embeddings": c.tie_word_embeddings,
            "hidden_act": "silu",
            "pard_token": self.pard_token,
            "spd_type": SPD_TYPE,
            "training_max_length": self.training_max_length,
        }

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a drafter that cannot draft for this target. PARD shares only the
        tokenizer with its target: the vocabularies must agree (a larger drafter vocab is
        allowed when the extra rows are tokens the target never emits, such as an added
        pard token; drafts are read over the target's ids only). Hidden size, depth and
        heads are the drafter's own, as in the paper."""
        c = self.layers
        problems = []
        if c.vocab_size < target.vocab_size:
            problems.append(f"vocab_size {c.vocab_size} vs target {target.vocab_size} (the "
                            "drafter cannot propose every target token)")
        if c.max_position_embeddings < target.max_position_embeddings:
            problems.append(f"max_position_embeddings {c.max_position_embeddings} vs target "
                            f"{target.max_position_embeddings}")
        if problems:
            raise ModelError("PARD drafter does not fit the target: " + "; ".join(problems))


class PARDDrafter(nn.Module):
    def __init__(self, config: PARDConfig):
        super().__init__()
        self.config = config
        c = config.layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> KVCache:
        c = self.config.layers
        p = self.embed_tokens.weight
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, p.dtype,
                       p.device, per_sequence)

    def forward(self, ids: torch.Tensor, cache: KVCache, scaling: QueryScaling | None,
                keep=None, probe=None):
        """Run ids [b, t] (real tokens, then pard tokens) after the cache's committed
        tokens, causally; commit the first `keep` rows of each sequence (an int, or [b];
        None: all t). Returns final-norm states [b, t, hidden] and the visible-key count
        of every row [b, t] (StepMetadata.causal_visible). probe(layer, q, k), when given,
        sees each layer's attention inputs (the diagnose command)."""
        b, t = ids.shape
        meta = StepMetadata.of(cache, t)
        dev = ids.device
        rope = self.rotary(meta.positions(t, b, dev), self.embed_tokens.weight.dtype)
        visible = meta.causal_visible(t, b, dev)
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q = layer.self_attn.query(x, *rope)
            k, v = cache.write(i, meta.cached, *layer.self_attn.key_value(x, *rope))
            if probe is not None:
                probe(i, q, k)
            h = h + layer.self_attn.output(sharpdraft_attention(q, k, v, visible, scaling))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        committed = StepMetadata(meta.cached, t if keep is None else keep).committed()
        if meta.per_sequence:
            cache.lengths = committed
        else:
            cache.length = committed
        return self.norm(h), visible

    def logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Logits over the target's vocabulary (ids >= vocab_size are the drafter's own,
        e.g. an added pard token, and never drafts)."""
        return self.lm_head(hidden)[..., :vocab_size]

    def forward_train(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """Many PARD chains of one sequence in one pass, as PARD trains: ids [b, rows]
        (the real tokens, then pard rows), positions [b, rows], mask [b, rows, rows]
        (True where a row may attend). Returns final-norm states [b, rows, hidden]."""
        b, rows = ids.shape
        rope = self.rotary(positions, self.embed_tokens.weight.dtype)
        # The mask does the selecting; every row's prefix bound is the whole sequence.
        everything = StepMetadata(0, 0).block_visible(rows, b, ids.device)
        h = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer.input_layernorm(h)
            q = layer.self_attn.query(x, *rope)
            k, v = layer.self_attn.key_value(x, *rope)
            h = h + layer.self_attn.output(sharpdraft_attention(q, k, v, everything, None, mask))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def read_pard_config(path: str | Path) -> PARDConfig:
    """A PARD checkpoint's config.json, checked: the one parser of it."""
    return PARDConfig.from_json(read_config_json(path, "a PARD checkpoint"))


def load_pard(path: str | Path, dtype: torch.dtype = torch.float32) -> PARDDrafter:
    """Read a PARD drafter in the published layout: config.json + model.safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_pard_config(path)
    weights = path / CHECKPOINT_FILES[1]
    if not weights.is_file():
        raise ModelError(f"{path} has no model.safetensors")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"{weights} cannot be read: {str(exc).splitlines()[0]}") from None
    model = PARDDrafter(config)
    ours = {k.removeprefix("model."): v for k, v in state.items()}
    expected = {k: v for k, v in model.state_dict().items()
                if not (config.layers.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise ModelError(f"{weights} lacks tensor {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in expected.items():
        if ours[name].shape != tensor.shape:
            raise ModelError(f"{weights}: tensor {name} has shape {list(ours[name].shape)}, "
                             f"config says {list(tensor.shape)}")
        if ours[name].is_floating_point() and not bool(torch.isfinite(ours[name]).all()):
            raise ModelError(f"{weights}: tensor {name} holds NaN or infinite values")
    model.load_state_dict({k: ours[k] for k in expected}, strict=False)
    return model.to(dtype).eval()


def save_pard(model: PARDDrafter, path: str | Path) -> None:
    """Write the published layout (tied heads stored once, as transformers does)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous()
             for k, v in model.state_dict().items()}
    if model.config.layers.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
