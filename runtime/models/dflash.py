"""The DFlash block drafter (z-lab/dflash layout), with SharpDraft's scale in attention.

Qwen3-style layers (q_norm/k_norm, gated MLP). Context: the target's hidden states at
`target_layer_ids`, concatenated, through `fc` and `hidden_norm`; each layer projects
them with its own k_proj/v_proj into keys/values it caches. A step drafts a block
[bonus, mask x (block_size - 1)] that attends bidirectionally to the whole context and
itself, so every query row sees N = context + block_size keys. The drafter has no
embedding: it borrows the target's `embed_tokens`, and the target's `lm_head` when it
drafts over the whole vocabulary. A drafter with a draft vocabulary (`draft_vocab_size` in
config.json, a `d2t` tensor as in EAGLE-3: target id = draft index + d2t[index]) carries
its own `lm_head.weight` [draft_vocab_size, hidden]: the target head's rows for those ids,
kept in the target's precision. That makes each drafted position's logits several times
cheaper (DraftHead; they stay over the draft vocabulary and the sampler maps the drafts it
picks), and it is the tensor the engines users serve with read: vLLM, given no
`lm_head.weight`, shares the target's whole head, keeps its FIRST draft_vocab_size rows and
maps them through d2t, which scores draft index j with target row j instead of row
j + d2t[j] -- silently wrong drafts (docs/vllm.md). So load_dflash refuses a draft
vocabulary without its head, and `python -m build.draft_head DIR` writes it (HEAD_FILE).
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
                                   Rotary, few_rows_linear)
from runtime.models.target import ModelError, TargetConfig, read_config_json
from runtime.sampling import DraftVocab
from runtime.step_metadata import StepMetadata


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    training_max_length: int | None = None
    draft_vocab_size: int | None = None  # None: draft over the target's whole vocabulary

    @classmethod
    def from_json(cls, data: dict) -> "DFlashConfig":
        """Read config.json: DFlash keys in `dflash_config` or at top level (both exist)."""
        draft = data.get("dflash_config") or {}

        def pick(name, default=None):
            return draft.get(name, data.get(name, default))

        layer_types = data.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ModelError("drafter layer_types other than full_attention (sliding windows) "
                             "are not supported")
        try:
            heads = data["num_attention_heads"]
            rope = data.get("rope_parameters") or {}
            return cls(
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=int(heads),
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
                vocab_size=int(data["vocab_size"]),
                block_size=int(pick("block_size", 16)),
                mask_token_id=int(pick("mask_token_id")),
                target_layer_ids=tuple(int(i) for i in pick("target_layer_ids")),
                num_target_layers=data.get("num_target_layers"),
                attention_bias=bool(data.get("attention_bias", False)),
                max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
                training_max_length=pick("training_max_length"),
                draft_vocab_size=data.get("draft_vocab_size"),
            )
        except KeyError as exc:
            raise ModelError(f"drafter config.json lacks {exc.args[0]!r}") from None
        except TypeError:
            raise ModelError("drafter config.json lacks mask_token_id or target_layer_ids "
                             "(in dflash_config or at top level)") from None

    def to_json(self) -> dict:
        extra = {"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}
        return extra | {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "num_target_layers": self.num_target_layers,
            "layer_types": ["full_attention"] * self.num_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "training_max_length": self.training_max_length,
            },
        }

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a drafter built for another target, naming both values."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} vs target {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} vs target {target.vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} vs target "
                            f"{target.num_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's "
                            f"{target.num_layers} layers")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= target.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} outside 1..{target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocab "
                            f"{target.vocab_size}")
        if problems:
            raise ModelError("drafter does not fit the target: " + "; ".join(problems))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = AttentionProjections(c.hidden_size, c.num_heads, c.num_kv_heads,
                                              c.head_dim, c.attention_bias, True, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, rope, attend):
        """h: block states; attend(q, k_blk, v_blk) is the block's attention over the
        context's keys/values and its own."""
        x = self.input_layernorm(h)
        q = self.self_attn.query(x, *rope)
        h = h + self.self_attn.output(attend(q, *self.self_attn.key_value(x, *rope)))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size,
                         bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            # the draft vocabulary's rows of the target's head (attach_draft_head): never trained
            self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    def draft_token_ids(self) -> torch.Tensor | None:
        """The target token ids the drafter can propose, or None (all of them)."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def attach_draft_head(self, target_head: torch.Tensor) -> None:
        """Set lm_head to the target head's rows for the draft vocabulary, in the target
        head's dtype (a bf16 drafter keeps an fp32 head: an engine then scores drafts
        exactly as the target's head would)."""
        ids = self.draft_token_ids()
        self.lm_head.weight = nn.Parameter(target_head.detach()[ids].clone(), requires_grad=False)

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> KVCache:
        c = self.config
        p = self.fc.weight
        # + block_size: the block's own keys sit past `length` as scratch each step.
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity + c.block_size,
                       c.head_dim, p.dtype, p.device, per_sequence)

    def forward(self, block_embeds: torch.Tensor, context: torch.Tensor, cache: KVCache,
                scaling: QueryScaling | None, probe=None, context_lens=None,
                window: int | None = None):
        """Draft one block per sequence.

        block_embeds [b, block, hidden]: target embeddings of [bonus, mask, ...] at
        positions cached + new context ... ; context [b, c, n_ids*hidden]: target
        features of tokens committed since the last step (c >= 0), appended to the
        cache; context_lens [b]: how many of the c are real in each row (a batch of
        sequences at different lengths; None: all). Returns the block's final hidden
        states [b, block, hidden] and the visible-key count N of each sequence's block
        rows (StepMetadata.block_keys). probe(layer, q, k), when given, sees each layer's
        attention inputs (the diagnose command); window: block rows see only the last
        `window` context keys (layers.window_mask; None: all of them).
        """
        b, block = block_embeds.shape[:2]
        meta = StepMetadata.of(cache, context.shape[1] if context_lens is None else context_lens)
        dev, dtype = context.device, block_embeds.dtype
        ctx_rope = self.rotary(meta.positions(context.shape[1], b, dev), dtype)
        blk_rope = self.rotary(meta.positions(block, b, dev, after_new=True), dtype)
        visible = meta.block_visible(block, b, dev)
        ctx = self.hidden_norm(self.fc(context))
        h = block_embeds
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer.self_attn.key_value(ctx, *ctx_rope)
            cache.write(i, meta.cached, k_ctx, v_ctx)
            layer_probe = None if probe is None else (lambda q, k, i=i: probe(i, q, k))

            # The cache attends (KVCache.attend_block), so an export stand-in can attend
            # over buffers it only reads instead of joining them (build/export.py).

            def attend(q, k_blk, v_blk, i=i, layer_probe=layer_probe):
                return cache.attend_block(i, meta.committed(), q, k_blk, v_blk, visible, scaling,
                                          layer_probe, window)

            h = layer(h, blk_rope, attend)
        if meta.per_sequence:
            cache.lengths = meta.committed()
        else:
            cache.length = meta.committed()
        return self.norm(h), meta.block_keys(block)

    def forward_train(self, block_embeds: torch.Tensor, context: torch.Tensor,
                      anchors: torch.Tensor) -> torch.Tensor:
        """Many blocks of one sequence in one pass, as DFlash trains.

        block_embeds [b, blocks * block, hidden]; context [b, t, n_ids*hidden] target
        features of the whole sequence; anchors [b, blocks]: block j sits at positions
        anchors[j] + (0 .. block-1) and sees the context keys before its anchor plus its
        own block -- exactly what it sees when drafting after `anchor` committed tokens.
        """
        b, t = context.shape[:2]
        block = self.config.block_size
        blocks = anchors.shape[1]
        dev = context.device
        offsets = torch.arange(block, device=dev)
        blk_pos = (anchors[:, :, None] + offsets).flatten(1)  # [b, blocks*block]
        ctx_pos = torch.arange(t, device=dev).expand(b, t)
        dtype = block_embeds.dtype
        blk_rope, ctx_rope = self.rotary(blk_pos, dtype), self.rotary(ctx_pos, dtype)
        sees_ctx = torch.arange(t, device=dev)[None, None] < anchors.repeat_interleave(block, 1)[..., None]
        block_id = torch.arange(blocks, device=dev).repeat_interleave(block)
        sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)
        # every block row sees the context's keys (masked to those before its anchor) and
        # all blocks' keys (masked to its own): kv_len = t + blocks * block
        visible = StepMetadata(0, t).block_visible(blocks * block, b, dev)
        ctx = self.hidden_norm(self.fc(context))
        h = block_embeds
        for layer in self.layers:
            k_ctx, v_ctx = layer.self_attn.key_value(ctx, *ctx_rope)

            def attend(q, k_blk, v_blk, k_ctx=k_ctx, v_ctx=v_ctx):
                return sharpdraft_attention(q, torch.cat([k_ctx, k_blk], 2),
                                            torch.cat([v_ctx, v_blk], 2), visible, None, mask)

            h = layer(h, blk_rope, attend)
        return self.norm(h)


class DraftHead(nn.Module):
    """The drafter's output head: the target's LM head, or the drafter's own head over its
    draft vocabulary (the target head's rows for those ids). Logits come over the head's rows (`vocab`: which target token each column
    is; None: the whole vocabulary), never scattered back to the target's width: the
    sampler maps the drafts it picks (Sampler.propose), and a token the drafter cannot
    propose has draft probability 0, so verification stays lossless."""

    transposed_rows: frozenset[int] = frozenset()  # layers.transpose_rows

    def __init__(self, lm_head: nn.Linear, draft_ids: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None):
        """rows: the draft vocabulary's head as the drafter carries it (else the target
        head's rows at draft_ids)."""
        super().__init__()
        weight = lm_head.weight
        # the target head's measured kernel choice (layers.transpose_rows): the same rows
        self.transposed_rows = getattr(lm_head, "transposed_rows", frozenset())
        if draft_ids is None:
            self.weight, self.vocab = weight, None
            return
        rows = weight.detach()[draft_ids] if rows is None else rows.detach().to(weight.dtype)
        self.register_buffer("weight", rows.clone(), persistent=False)
        self.vocab = DraftVocab(draft_ids.detach().clone(), weight.shape[0])

    @classmethod
    def for_drafter(cls, drafter: "DFlashDrafter", lm_head: nn.Linear) -> "DraftHead":
        """The drafter's own draft-vocabulary head where it has one (what vLLM reads),
        else the target's `lm_head`."""
        ids = drafter.draft_token_ids()
        return cls(lm_head, ids, None if ids is None else drafter.lm_head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(hidden, self.weight, transposed_rows=self.transposed_rows)


CHECKPOINT_FILES = ("config.json", "model.safetensors")  # what every DFlash checkpoint holds
# A draft vocabulary's head, in a file of its own: it is derived from the target (the
# target head's rows for the d2t ids, kept in the target's precision) rather than trained,
# so build.draft_head can write it beside a checkpoint as it was published, and the
# trained layers' file stays as trained. Engines load every *.safetensors of the directory.
HEAD_FILE = "lm_head.safetensors"


def checkpoint_files(path: str | Path) -> list[str]:
    """The files load_dflash reads from `path` (engine.json hashes them; a drafter
    directory written for an engine links them)."""
    return list(CHECKPOINT_FILES) + ([HEAD_FILE] if (Path(path) / HEAD_FILE).is_file() else [])


def read_dflash_config(path: str | Path) -> DFlashConfig:
    """A drafter checkpoint's config.json, checked: the one parser of it."""
    return DFlashConfig.from_json(read_config_json(path, "a DFlash checkpoint"))


def load_dflash(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Read a drafter in the published layout: config.json + model.safetensors (+ its draft
    vocabulary's head, HEAD_FILE)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_dflash_config(path)
    weights = path / CHECKPOINT_FILES[1]
    if not weights.is_file():
        raise ModelError(f"{path} has no model.safetensors")
    model = DFlashDrafter(config)
    state = {}
    for name in checkpoint_files(path)[1:]:
        try:
            state |= load_file(path / name)
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{path / name} cannot be read: {exc}") from None
    expected = model.state_dict()
    if config.draft_vocab_size and "lm_head.weight" not in state:
        raise ModelError(f"{path} drafts over a {config.draft_vocab_size}-token vocabulary (d2t) "
                         f"but has no lm_head.weight ({HEAD_FILE}), so vLLM would score its drafts "
                         "with the wrong rows of the target's head: add it with "
                         f"`python -m build.draft_head {path}`")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelError(f"{weights} lacks tensor {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ModelError(f"{weights}: tensor {name} has shape {list(state[name].shape)}, "
                             f"config says {list(tensor.shape)}")
    model.load_state_dict({k: state[k] for k in expected})
    ids = model.draft_token_ids()
    if ids is not None and not (0 <= int(ids.min()) and int(ids.max()) < config.vocab_size
                                and len(ids.unique()) == len(ids)):
        raise ModelError(f"{weights}: d2t maps the draft vocabulary outside the target's "
                         f"{config.vocab_size} tokens or onto one token twice")
    return model.to(dtype).eval()


def save_dflash(model: DFlashDrafter, path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    head = {"lm_head.weight": state.pop("lm_head.weight")} if "lm_head.weight" in state else None
    save_file(state, path / CHECKPOINT_FILES[1])
    if head is not None:
        save_file(head, path / HEAD_FILE, metadata={"format": "pt"})
