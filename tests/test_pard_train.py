"""build/train_pard.py end to end on a tiny target: a cache in the DFlash recipe's shard
format, a few steps, a resumed run, and a drafter in the published layout with its card
that loads and drafts for the target."""

import json

import torch

import tiny
from runtime.cli import run
from runtime.models.pard import load_pard
from runtime.models.target import load_target


def fake_cache(path, target_dir, windows: int = 4, seq_len: int = 64):
    """shard-*.pt and held-out.pt as build/train_drafter.py writes them: ids, the target's
    top-32 next-token distribution (probs, fp16), and hidden states PARD never reads."""
    target, _ = load_target(target_dir)
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    for name in ("shard-0000.pt", "held-out.pt"):
        ids = torch.randint(0, target.config.vocab_size, (windows, seq_len), generator=g)
        with torch.no_grad():
            logits, _ = target(ids, target.new_cache(seq_len, batch=windows))
        top_logits, top = logits.topk(32, -1)
        probs = torch.exp(top_logits - torch.logsumexp(logits, -1, keepdim=True))
        torch.save({"ids": ids, "features": torch.zeros(windows, seq_len, 1).half(),
                    "top": top.int(), "probs": probs.half()}, path / name)
    return path


def test_the_recipe_trains_resumes_and_writes_the_published_layout(tmp_path, tiny_target, capsys):
    from build import train_pard

    cache = fake_cache(tmp_path / "cache", tiny_target)
    args = ["--target", str(tiny_target), "--cache", str(cache), "--work", str(tmp_path / "work"),
            "--out", str(tmp_path / "pard"), "--layers", "2", "--draft-tokens", "4", "--anchors", "4",
            "--pard-token", str(tiny.PARD_TOKEN), "--batch", "2", "--save-every", "2",
            "--eval-every", "2"]
    assert run(train_pard.main, args + ["--steps", "2"]) == 0, capsys.readouterr().err
    assert run(train_pard.main, args + ["--steps", "2"]) == 0  # resumes at its end: no steps
    assert "resuming at step 2" in capsys.readouterr().err
    # another recipe in the same work dir is refused, not mixed in
    assert run(train_pard.main, args + ["--steps", "3", "--lr", "1"]) == 2
    assert "another recipe" in capsys.readouterr().err

    drafter = load_pard(tmp_path / "pard")
    target, _ = load_target(tiny_target)
    drafter.config.check_target(target.config)
    assert drafter.config.pard_token == tiny.PARD_TOKEN and drafter.config.training_max_length == 64
    # the tied head stays the target's, but for the pard token's row
    embed = target.embed_tokens.weight.to(torch.bfloat16).float()
    same = (drafter.embed_tokens.weight == embed).all(-1)
    assert same.sum() == len(same) - 1 and not same[tiny.PARD_TOKEN]
    card = json.loads((tmp_path / "pard" / "training.json").read_text())
    for key in ("data", "steps", "wall_seconds_this_run", "final_loss_last100", "held_out", "command"):
        assert key in card
    assert len(card["held_out"]["held_out_calibration_split"]["top1_agreement_by_position"]) == 4
    assert "PARD" in (tmp_path / "pard" / "README.md").read_text()


def test_the_recipe_stops_at_its_time_limit_and_continues_on_rerun(tmp_path, tiny_target, capsys):
    from build import train_pard

    cache = fake_cache(tmp_path / "cache", tiny_target)
    args = ["--target", str(tiny_target), "--cache", str(cache), "--work", str(tmp_path / "work"),
            "--out", str(tmp_path / "pard"), "--layers", "1", "--draft-tokens", "3", "--anchors", "4",
            "--pard-token", str(tiny.PARD_TOKEN), "--batch", "1", "--steps", "2"]
    assert run(train_pard.main, args + ["--max-minutes", "1e-9"]) == 0
    assert "stopping at step 0" in capsys.readouterr().err
    card = json.loads((tmp_path / "pard" / "training.json").read_text())
    assert (card["steps"], card["steps_planned"]) == (0, 2)
    assert run(train_pard.main, args) == 0  # same recipe: continues from the saved state
    assert json.loads((tmp_path / "pard" / "training.json").read_text())["steps"] == 2
