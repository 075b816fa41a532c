"""Tiny real checkpoints with seeded random weights, saved in their published layouts:
transformers decoders with a BPE tokenizer trained on CPython sources, DFlash drafters in
the z-lab/dflash layout, PARD drafters in PARD's (a transformers causal LM + pard_token),
EAGLE-3 drafters in theirs; and the same models in memory in float64. Built in about a
second. The tests' fixtures (tests/tiny.py) and scripts that need an engine without
downloading one (scripts/compare_outputs.py) build on them."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from runtime.models.dflash import DFlashConfig, DFlashDrafter, save_dflash
from runtime.models.pard import PARDConfig, PARDDrafter, save_pard

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]


def stdlib_text(limit: int = 200_000) -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((lib / name).read_text() for name in ("textwrap.py", "shlex.py", "glob.py"))
    return text[:limit]


def train_tokenizer(out: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([stdlib_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")
    # SmolLM2's ChatML layout, so the OpenAI endpoint's chat route runs a real template.
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                          "+ '<|im_end|>\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    fast.save_pretrained(out)
    return fast


def make_target(out: Path, model_type: str = "llama", vocab_size: int = 320, layers: int = 3,
                hidden: int = 32, context: int = 512, seed: int = 0,
                dtype: torch.dtype = torch.float32, tokenizer: bool = True) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=context, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
        **({"sliding_window": None} if model_type == "mistral" else {}))
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # larger weights: peakier, more decisive random models
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(out)
    if tokenizer:
        train_tokenizer(out, vocab_size)
    return out


def drafter_config(target_dir: Path, block_size: int = 4, layers: int = 1, **extra) -> DFlashConfig:
    t = json.loads((target_dir / "config.json").read_text())
    n = t["num_hidden_layers"]
    return DFlashConfig(
        hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_layers=layers,
        num_heads=t["num_attention_heads"], num_kv_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"], rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=t["vocab_size"], block_size=block_size, mask_token_id=3,
        target_layer_ids=tuple(sorted({0, n // 2, n - 1})), num_target_layers=n, **extra)


def make_drafter(out: Path, target_dir: Path, block_size: int = 4, seed: int = 1,
                 dtype: torch.dtype = torch.float32, draft_vocab: int | None = None) -> Path:
    """draft_vocab: a draft vocabulary of that many (seeded, random) tokens."""
    torch.manual_seed(seed)
    model = DFlashDrafter(drafter_config(target_dir, block_size, draft_vocab_size=draft_vocab)).to(dtype)
    if draft_vocab:
        ids = torch.randperm(model.config.vocab_size)[:draft_vocab].sort().values
        model.d2t.copy_(ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    if draft_vocab:  # the target head's rows, as every shipped draft vocabulary carries them
        from build.draft_head import target_head

        model.attach_draft_head(target_head(target_dir))
    save_dflash(model, out)
    return out


def float64_target(seed: int, vocab: int, layers: int = 2, context: int = 128,
                   sharpness: float = 3.0):
    """A random float64 TargetModel in memory: exact enough that equal tokens mean equal
    logic. Sharper weights make it decisive, so acceptances happen and ties do not."""
    from runtime.models.target import TargetConfig, TargetModel

    torch.manual_seed(seed)
    config = TargetConfig("llama", vocab, 16, 32, layers, 4, 2, 4, 1e-6, 10000.0, context,
                          False, False, False)
    model = TargetModel(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
    return model


def eagle3_config(target_config, aux_layer_ids=None, draft_vocab: int | None = None,
                  eagle31: bool = False):
    """An EAGLE-3 config for a TargetConfig: the target's widths; eagle31 turns on
    EAGLE 3.1's fc_norm and norm_output."""
    from runtime.models.eagle3 import Eagle3Config

    t = target_config
    return Eagle3Config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=t.vocab_size, draft_vocab_size=draft_vocab or t.vocab_size,
        target_hidden_size=t.hidden_size, aux_layer_ids=aux_layer_ids,
        max_position_embeddings=t.max_position_embeddings, fc_norm=eagle31, norm_output=eagle31)


def random_eagle3(config, seed: int, sharpness: float = 3.0, dtype: torch.dtype = torch.float64):
    """An Eagle3Drafter with seeded random weights, a random draft vocabulary when the
    config has one, and RMSNorm weights away from 1 (so a misplaced norm shows)."""
    from runtime.models.eagle3 import Eagle3Drafter

    torch.manual_seed(seed)
    model = Eagle3Drafter(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
            else:  # the norms (there are no biases)
                p.uniform_(0.5, 1.5)
        if config.draft_vocab_size < config.vocab_size:
            ids = torch.randperm(config.vocab_size)[:config.draft_vocab_size].sort().values
            model.d2t.copy_(ids - torch.arange(config.draft_vocab_size))
            model.t2d.zero_()
            model.t2d[ids] = True
    return model


def float64_eagle3(target, seed: int, aux_layer_ids=None, draft_vocab: int | None = None,
                   eagle31: bool = False, sharpness: float = 3.0):
    """An EAGLE-3 drafter in memory for a float64 TargetModel (tests of token equality)."""
    return random_eagle3(eagle3_config(target.config, aux_layer_ids, draft_vocab, eagle31), seed,
                         sharpness)


def make_eagle3(out: Path, target_dir: Path, seed: int = 2, draft_vocab: int | None = None,
                eagle31: bool = False, aux_layer_ids=None) -> Path:
    """An EAGLE-3 drafter for a tiny saved target, written in the published layout."""
    from runtime.models.eagle3 import save_eagle3
    from runtime.models.target import TargetConfig

    t = json.loads((target_dir / "config.json").read_text())
    config = TargetConfig("llama", t["vocab_size"], t["hidden_size"], t["intermediate_size"],
                          t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
                          t["head_dim"], 1e-6, 10000.0, t["max_position_embeddings"], False, False, False)
    n = config.num_layers
    ids = aux_layer_ids or (1, max(1, n // 2), n - 1)
    model = random_eagle3(eagle3_config(config, ids, draft_vocab, eagle31), seed, sharpness=4.0,
                          dtype=torch.float32)
    save_eagle3(model, out)
    return out


PARD_TOKEN = 3  # "<mask>" in SPECIALS


def pard_config(vocab: int, context: int, layers: int = 1, hidden: int = 24,
                pard_token: int = PARD_TOKEN, tied: bool = False) -> PARDConfig:
    """A PARD drafter's config: its own width (hidden 24 against the tiny targets' 32 or
    16: PARD is target-independent), the target's vocabulary and context."""
    from runtime.models.target import TargetConfig

    return PARDConfig(TargetConfig("llama", vocab, hidden, 2 * hidden, layers, 4, 2, hidden // 4,
                                   1e-6, 10000.0, context, False, False, tied),
                      pard_token, training_max_length=64)


def make_pard(out: Path, target_dir: Path, seed: int = 2, layers: int = 1,
              dtype: torch.dtype = torch.float32) -> Path:
    t = json.loads((target_dir / "config.json").read_text())
    torch.manual_seed(seed)
    model = PARDDrafter(pard_config(t["vocab_size"], t["max_position_embeddings"], layers)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    save_pard(model, out)
    return out


def float64_pard(seed: int, vocab: int, layers: int = 1, context: int = 128,
                 sharpness: float = 3.0, pard_token: int | None = None) -> PARDDrafter:
    """A random float64 PARD drafter in memory (pard_token default: the last id)."""
    torch.manual_seed(seed)
    token = vocab - 1 if pard_token is None else pard_token
    model = PARDDrafter(pard_config(vocab, context, layers, pard_token=token)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
    return model


def pard_from_target(target, pard_token: int) -> PARDDrafter:
    """A PARD drafter that IS the target (same layers and head): its first draft of a step
    is the target's own next-token choice, so the tests' drafts do get accepted."""
    import dataclasses

    drafter = PARDDrafter(PARDConfig(dataclasses.replace(target.config), pard_token))
    drafter.load_state_dict(target.state_dict(), strict=False)
    return drafter.to(target.embed_tokens.weight.dtype).eval()
