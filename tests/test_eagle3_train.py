"""build/train_eagle3.py in seconds: a few steps over shards cached from a tiny target
in train_drafter.py's format give a checkpoint in the published layout that loads
against the target and decodes losslessly; a rerun resumes; another recipe is refused."""

import json
from pathlib import Path

import torch

import tiny
from build import train_eagle3
from runtime.backends.pytorch import TorchBatchEagle3, TorchBatchTarget
from runtime.models.eagle3 import load_eagle3
from runtime.models.target import load_target
from runtime.sampling import Sampler
from speculative import generate_target_only, generate_tree
from runtime.tree import TreeShape

CACHED_LAYERS = [0, 1, 2]


def cache_like_train_drafter(target, work: Path, source: str, seq_len=24):
    """Shards in build/train_drafter.py's format: ids, features (fp16, the cached layers'
    outputs concatenated), the target's top-32 ids and probabilities, meta.json."""
    work.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, count in (("shard-0000.pt", 6), ("held-out.pt", 3)):
        ids = torch.randint(0, target.config.vocab_size, (count, seq_len), generator=g)
        with torch.no_grad():
            logits, features = target(ids, target.new_cache(seq_len, batch=count), tuple(CACHED_LAYERS))
        top_logits, top = logits.topk(32, dim=-1)
        probs = torch.exp(top_logits - torch.logsumexp(logits, -1, keepdim=True))
        torch.save({"ids": ids, "features": features.half(), "top": top.int(), "probs": probs.half()},
                   work / name)
    (work / "meta.json").write_text(json.dumps({"target": source, "tokens": 6 * seq_len, "seq_len": seq_len,
                                                "seed": 0, "target_layer_ids": CACHED_LAYERS}))


def test_training_smoke_writes_a_loadable_lossless_checkpoint_and_resumes(tmp_path, capsys):
    target_dir = tiny.make_target(tmp_path / "target", layers=4)
    model, _ = load_target(target_dir)
    cache = tmp_path / "cache"
    cache_like_train_drafter(model, cache, str(target_dir.resolve()))
    args = ["--target", str(target_dir), "--cache", str(cache), "--work", str(tmp_path / "work"),
            "--out", str(tmp_path / "eagle3"), "--aux-layers", *map(str, CACHED_LAYERS),
            "--steps", "3", "--batch", "2", "--ttt-steps", "2", "--draft-vocab", "64"]
    # a run out of time stops before its steps, saves its state and still writes a card
    assert train_eagle3.main(args + ["--max-minutes", "0.000001"]) == 0
    assert "--max-minutes" in capsys.readouterr().err
    assert json.loads((tmp_path / "eagle3" / "training.json").read_text())["steps"] == 0
    assert train_eagle3.main(args) == 0  # the same command continues it
    out = tmp_path / "eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 64 and config["eagle_config"]["training_max_length"] == 24
    card = json.loads((out / "training.json").read_text())
    assert card["steps"] == 3
    assert len(card["held_out"]["held_out_calibration_split"]["top1_agreement_by_step"]) == 2
    assert (out / "README.md").is_file()
    drafter = load_eagle3(out, torch.float32, model)  # embed_tokens left out: the target's
    assert torch.equal(drafter.embed_tokens.weight, model.embed_tokens.weight)
    shape = TreeShape(3, 3, 8)
    t = TorchBatchTarget(model, drafter.config.feature_layers(model.config.num_layers))
    prompt = [5, 9, 14, 3, 7]
    want = generate_target_only(t, prompt, 12, Sampler()).tokens
    assert generate_tree(t, TorchBatchEagle3(drafter, None, shape.depth, shape), prompt, 12, Sampler(), shape).tokens == want
    # a rerun resumes at the last saved step; another recipe in the same --work is refused
    capsys.readouterr()
    assert train_eagle3.main(args) == 0
    assert "resuming at step 3" in capsys.readouterr().err
    assert train_eagle3.run(train_eagle3.main, args[:-2] + ["--draft-vocab", "32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "another recipe" in err[-1]
