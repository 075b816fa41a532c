"""The EAGLE-3 drafter (SafeAILab/EAGLE `cnets.py`, SpecForge's Llama draft: the published
`midlayer.*` layout), with SharpDraft's scale in its attention, and EAGLE 3.1's `fc_norm`
and `norm_output` when config.json asks for them.

One Llama decoder layer whose q/k/v read cat(input_layernorm(embedding of a token),
hidden_norm(h)) -- twice the hidden size -- where h is `fc` over three target layers'
hidden states for a committed token, or the drafter's own output state while it drafts
ahead. Its own embedding, and an LM head over a draft vocabulary (target id = draft
index + d2t[index]; t2d marks the target ids it covers). Causal: the cache holds one
entry per committed token p, built from (the target's features of p, the token after
p); drafted rows (a chain, or a tree's levels) are scratch past them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from plugins.attention import sharpdraft_attention
from plugins.scaling import QueryScaling
from runtime.models.layers import (AttentionProjections, GatedMLP, KVCache, Linear, RMSNorm,
                                   Rotary)
from runtime.models.target import ModelError, TargetConfig, read_config_json
from runtime.step_metadata import StepMetadata

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # SpecForge writes the first, EAGLE the second


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None  # None: EAGLE-3's default (2, L // 2, L - 3)
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per target layer before fc
    norm_output: bool = False  # EAGLE 3.1: the next drafting step reads the final-norm state
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h
    training_max_length: int | None = None

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    @classmethod
    def from_json(cls, data: dict) -> "Eagle3Config":
        eagle = data.get("eagle_config") or {}
        if data.get("num_hidden_layers", 1) != 1:
            raise ModelError(f"EAGLE-3 drafter has num_hidden_layers {data['num_hidden_layers']}; "
                             "this runtime runs the published one-layer form")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ModelError("EAGLE-3 drafter sets use_aux_hidden_state false (an EAGLE-1/2 form); "
                             "this runtime reads three target layers through fc")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelError(f"EAGLE-3 drafter rope_type {rope_type!r} is not supported (only 'default')")
        if data.get("hidden_act", "silu") != "silu":
            raise ModelError(f"EAGLE-3 drafter hidden_act {data['hidden_act']!r} is not supported (only silu)")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        try:
            heads = int(data["num_attention_heads"])
            hidden = int(data["hidden_size"])
            config = cls(
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
                vocab_size=int(data["vocab_size"]),
                draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
                target_hidden_size=int(data.get("target_hidden_size") or hidden),
                aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
                attention_bias=bool(data.get("attention_bias", False)),
                max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                fc_norm=bool(data.get("fc_norm", False)),
                norm_output=bool(data.get("norm_output", False)),
                norm_before_residual=bool(data.get("norm_before_residual", False)),
                training_max_length=eagle.get("training_max_length"),
            )
        except KeyError as exc:
            raise ModelError(f"EAGLE-3 drafter config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelError(f"EAGLE-3 drafter config.json has a malformed value ({exc})") from None
        aux = data.get("num_aux_hidden_states")
        if aux is not None and int(aux) != config.num_aux:
            raise ModelError(f"EAGLE-3 drafter num_aux_hidden_states {aux} disagrees with "
                             f"eagle_aux_hidden_state_layer_ids {list(config.aux_layer_ids or ())}")
        return config

    def to_json(self) -> dict:
        eagle = {"use_aux_hidden_state": True}
        if self.aux_layer_ids:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if self.training_max_length:
            eagle["training_max_length"] = self.training_max_length
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": eagle,
        }

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layer ids fc reads (EAGLE's convention: id i = the input of target
        layer i, i.e. the output of layer i - 1)."""
        n = num_target_layers
        return self.aux_layer_ids or (2, n // 2, n - 3)

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The same layers in TargetModel's convention (the output of layer i)."""
        return tuple(i - 1 for i in self.aux_layers(num_target_layers))

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a drafter built for another target, naming both values."""
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} vs target {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} vs target {target.vocab_size}")
        ids = self.aux_layers(target.num_layers)
        if any(not 1 <= i < target.num_layers for i in ids):
            problems.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} outside 1..{target.num_layers - 1} "
                            f"(id i reads the input of target layer i)")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} outside 1..{self.vocab_size}")
        if problems:
            raise ModelError("EAGLE-3 drafter does not fit the target: " + "; ".join(problems))


class Eagle3Layer(nn.Module):
    """The published `midlayer`: attention over [embedding, hidden], then a gated MLP."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = AttentionProjections(2 * c.hidden_size, c.num_heads, c.num_kv_heads,
                                              c.head_dim, c.attention_bias, False, c.rms_norm_eps,
                                              output_size=c.hidden_size)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def forward(self, embeds, hidden, rope, attend):
        """attend(q, k, v) stores the rows' keys/values and attends over the cache."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        q = self.self_attn.query(x, *rope)
        h = residual + self.self_attn.output(attend(q, *self.self_attn.key_value(x, *rope)))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps)
                                     for _ in range(c.num_aux)) if c.fc_norm else None
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[:c.draft_vocab_size] = True  # d2t all zero: the first draft_vocab_size ids
        self.register_buffer("t2d", t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary index."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> KVCache:
        c, p = self.config, self.fc.weight
        return KVCache(1, batch, c.num_kv_heads, capacity, c.head_dim, p.dtype, p.device,
                       per_sequence)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., num_aux * target_hidden] -> the layer's hidden input."""
        if self.fc_norm is not None:
            chunks = features.chunk(self.config.num_aux, dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], -1)
        return self.fc(features)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                scaling: QueryScaling | None, tree=None, keep=None):
        """Rows of (token ids [b, t], hidden [b, t, H]) after the cache's entries (each
        sequence's own, in a per-sequence cache).

        Without `tree`: causal rows at the next positions, the first `keep` of each
        sequence committed (an int, or [b]; None: all t) -- context entries, or chain
        drafts that a runner rolls back. With tree = (scratch_mask [b, t, s],
        offsets [b, t]): one level of a draft tree, its keys scratch (StepMetadata.tree_rows).
        Returns draft-vocabulary logits [b, t, V_draft], the state each row hands the next
        drafting step [b, t, H], and each row's visible-key count N [b, t].
        """
        b, t = ids.shape
        meta = StepMetadata.of(cache, t)
        dev = hidden.device
        if tree is None:
            positions, mask, start = meta.positions(t, b, dev), None, meta.cached
            visible = meta.causal_visible(t, b, dev)
            counts = visible
        else:
            positions, visible, mask, start = meta.tree_rows(*tree)
            counts = meta.tree_visible(mask)

        def attend(q, k, v):
            k, v = cache.write(0, start, k, v)
            return sharpdraft_attention(q, k, v, visible, scaling, mask)

        h = self.midlayer(self.embed_tokens(ids), hidden, self.rotary(positions, hidden.dtype), attend)
        if tree is None:
            committed = StepMetadata(meta.cached, t if keep is None else keep).committed()
            if meta.per_sequence:
                cache.lengths = committed
            else:
                cache.length = committed
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.config.norm_output else h), counts


class DraftVocabulary:
    """Draft-vocabulary indices and logits in target terms: ids through d2t, logits
    scattered onto the target's vocabulary (-inf elsewhere, so a token the drafter
    cannot propose has draft probability 0 and verification stays lossless)."""

    def __init__(self, drafter: Eagle3Drafter):
        c = drafter.config
        self.ids = drafter.draft_token_ids()
        self.identity = c.draft_vocab_size == c.vocab_size and bool((drafter.d2t == 0).all())
        index = torch.full((c.vocab_size,), c.draft_vocab_size, dtype=torch.long, device=self.ids.device)
        index[self.ids] = torch.arange(c.draft_vocab_size, device=self.ids.device)
        self.index = index

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.identity else self.ids[indices]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return logits
        floor = logits.new_full(logits.shape[:-1] + (1,), float("-inf"))
        return torch.cat([logits, floor], -1).index_select(-1, self.index)


def read_eagle3_config(path: str | Path) -> Eagle3Config:
    """A drafter checkpoint's config.json, checked: the one parser of it."""
    return Eagle3Config.from_json(read_config_json(path, "an EAGLE-3 checkpoint"))


def checkpoint_files(path: str | Path) -> list[str]:
    """The files load_eagle3 reads from a checkpoint directory."""
    path = Path(path)
    weights = next((name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if weights is None:
        raise ModelError(f"{path} has no {' or '.join(WEIGHT_FILES)}")
    return ["config.json", weights]


def _read_weights(file: Path) -> dict:
    try:
        if file.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                return load_file(file)
            except SafetensorError as exc:
                raise ModelError(f"{file} cannot be read: {exc}") from None
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise ModelError(f"{file} cannot be read: {str(exc).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise ModelError(f"{file} does not hold a tensor dictionary")
    return state


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.float32, target=None) -> Eagle3Drafter:
    """Read a drafter in the published layout: config.json + model.safetensors (or
    pytorch_model.bin). Checkpoints without embed_tokens share the target's (as EAGLE's
    own loader does); `target` (a TargetModel) is then required, and always checked."""
    path = Path(path)
    config = read_eagle3_config(path)
    if target is not None:
        config.check_target(target.config)
    file = path / checkpoint_files(path)[1]
    state = _read_weights(file)
    model = Eagle3Drafter(config).to(dtype)  # then weights convert once, to the dtype asked for
    expected = model.state_dict()
    if "embed_tokens.weight" not in state and target is not None:
        if target.config.hidden_size != config.hidden_size:
            raise ModelError(f"{file} has no embed_tokens and the target's embedding is "
                             f"{target.config.hidden_size} wide, not {config.hidden_size}")
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    if "d2t" not in state and config.draft_vocab_size < config.vocab_size:
        raise ModelError(f"{file}: draft_vocab_size {config.draft_vocab_size} < vocab_size "
                         f"{config.vocab_size} needs a d2t map, and there is none")
    optional = {"d2t", "t2d"}  # absent: the identity map (draft vocabulary = target's)
    missing = sorted(set(expected) - set(state) - optional)
    if missing:
        hint = " (shared from the target: pass the target)" if missing == ["embed_tokens.weight"] else ""
        raise ModelError(f"{file} lacks tensor {missing[0]}{hint}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in expected.items():
        if name not in state:
            continue
        got = state[name]
        if not torch.is_tensor(got) or got.shape != tensor.shape:
            shape = list(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise ModelError(f"{file}: tensor {name} has shape {shape}, config says {list(tensor.shape)}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ModelError(f"{file}: tensor {name} holds NaN or infinite values (corrupt checkpoint)")
    model.load_state_dict({k: state[k].to(v.dtype) for k, v in expected.items() if k in state},
                          strict=False)
    _check_vocab_maps(model, file, has_t2d="t2d" in state)
    return model.eval()


def _check_vocab_maps(model: Eagle3Drafter, file: Path, has_t2d: bool) -> None:
    vocab = model.config.vocab_size
    ids = model.draft_token_ids()
    if not (int(ids.min()) >= 0 and int(ids.max()) < vocab and len(ids.unique()) == len(ids)):
        raise ModelError(f"{file}: d2t maps the draft vocabulary outside the target's {vocab} "
                         "tokens or onto one token twice")
    covered = torch.zeros(vocab, dtype=torch.bool)
    covered[ids] = True
    if has_t2d and not torch.equal(model.t2d.cpu(), covered):
        raise ModelError(f"{file}: t2d disagrees with d2t (they must mark the same target tokens)")
    model.t2d.copy_(covered)


def save_eagle3(model: Eagle3Drafter, path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / WEIGHT_FILES[0])

