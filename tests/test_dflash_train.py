"""build/train_drafter.py on a tiny target, in seconds: a warm start from a DFlash
checkpoint begins from that checkpoint's weights and draft vocabulary (0 steps give it
back), the card names it by hash, and a checkpoint that does not fit is refused in one line."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

import tiny
from build import train_drafter
from runtime.cli import run


def recipe_args(target, tmp_path, *more):
    """A DFlash recipe the size of tiny.drafter_config: 1 layer, block 4, target layers 0..2,
    16 windows of 32 tokens from the stdlib train split."""
    return ["--target", str(target), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--tokens", "512", "--seq-len", "32", "--layers", "1", "--block-size", "4",
            "--target-layer-ids", "0", "1", "2", "--mask-token-id", "3", "--blocks", "4",
            "--batch", "2", *more]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_target):
    # bfloat16, as the recipe publishes: the round trip through float32 training is exact
    return tiny.make_drafter(tmp_path_factory.mktemp("warm"), tiny_target, dtype=torch.bfloat16,
                             draft_vocab=64)


def test_a_warm_start_begins_from_the_checkpoints_weights_and_draft_vocabulary(
        tmp_path, tiny_target, checkpoint, capsys):
    args = recipe_args(tiny_target, tmp_path, "--init", "checkpoint", "--init-checkpoint",
                       str(checkpoint), "--draft-vocab", "64", "--steps", "0")
    assert run(train_drafter.main, args) == 0, capsys.readouterr().err
    theirs = load_file(checkpoint / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in theirs:  # d2t included: the checkpoint's, not recomputed from these windows
        assert torch.equal(ours[name], theirs[name]), name
    card = json.loads((tmp_path / "out" / "training.json").read_text())
    digest = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    assert card["init"] == "checkpoint"
    assert card["init_checkpoint"] == {"path": str(checkpoint), "sha256": digest}
    assert digest[:16] in (tmp_path / "out" / "README.md").read_text()


def test_a_warm_started_run_trains_away_from_the_checkpoint(tmp_path, tiny_target, checkpoint, capsys):
    args = recipe_args(tiny_target, tmp_path, "--init", "checkpoint", "--init-checkpoint",
                       str(checkpoint), "--draft-vocab", "64", "--steps", "2", "--lr", "1e-2")
    assert run(train_drafter.main, args) == 0, capsys.readouterr().err
    theirs = load_file(checkpoint / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(ours["d2t"], theirs["d2t"])
    assert not torch.equal(ours["fc.weight"], theirs["fc.weight"])
    assert json.loads((tmp_path / "out" / "training.json").read_text())["steps"] == 2


@pytest.mark.parametrize("change, named", [
    (["--layers", "2"], "num_layers 1 there, 2 here (--layers)"),
    (["--block-size", "8"], "block_size 4 there, 8 here (--block-size)"),
    (["--target-layer-ids", "0", "2"], "--target-layer-ids"),
    (["--draft-vocab", "128"], "--draft-vocab 64"),
])
def test_a_checkpoint_that_does_not_fit_the_recipe_is_refused_in_one_line(
        tmp_path, tiny_target, checkpoint, capsys, change, named):
    args = recipe_args(tiny_target, tmp_path, "--init", "checkpoint", "--init-checkpoint",
                       str(checkpoint), "--draft-vocab", "64", "--steps", "0") + change
    assert run(train_drafter.main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and str(checkpoint) in err[-1] and named in err[-1]
    assert not (tmp_path / "work" / "shard-0000.pt").exists()  # refused before caching


def test_init_checkpoint_needs_its_directory(tmp_path, tiny_target, capsys):
    assert run(train_drafter.main, recipe_args(tiny_target, tmp_path, "--init", "checkpoint")) == 2
    assert "--init-checkpoint" in capsys.readouterr().err


def test_the_recipe_stops_at_its_time_limit_and_continues_on_rerun(tmp_path, tiny_target, capsys):
    args = recipe_args(tiny_target, tmp_path, "--steps", "2", "--draft-vocab", "64")
    assert run(train_drafter.main, args + ["--max-minutes", "1e-9"]) == 0, capsys.readouterr().err
    assert "stopping at step 0" in capsys.readouterr().err
    card = json.loads((tmp_path / "out" / "training.json").read_text())
    assert (card["steps"], card["steps_planned"], card["final_loss_last100"]) == (0, 2, None)
    assert run(train_drafter.main, args) == 0  # same recipe: continues from the saved state
    assert "resuming at step 0" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "training.json").read_text())["steps"] == 2
    # another recipe in the same work dir is refused, naming what differs
    assert run(train_drafter.main, args + ["--lr", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "another recipe (it differs in lr)" in err[-1]


@pytest.mark.slow  # two recipe runs with caching; the fast tier trains in the tests above
def test_extend_caches_only_new_windows_and_trains_on_both(tmp_path, tiny_target, capsys):
    first = recipe_args(tiny_target, tmp_path, "--steps", "0", "--draft-vocab", "64")
    assert run(train_drafter.main, first) == 0, capsys.readouterr().err
    more = tmp_path / "more"
    second = recipe_args(tiny_target, tmp_path, "--steps", "0", "--draft-vocab", "64",
                         "--work", str(more), "--extend", str(tmp_path / "work"))
    assert run(train_drafter.main, second) == 0, capsys.readouterr().err
    old = torch.load(tmp_path / "work" / "shard-0000.pt")["ids"].tolist()
    new = torch.load(more / "shard-0000.pt")["ids"].tolist()
    assert len(new) == 16 and not {tuple(r) for r in old} & {tuple(r) for r in new}
    assert json.loads((tmp_path / "out" / "training.json").read_text())["windows"] == 32
    assert json.loads((more / "meta.json").read_text())["extends"][0]["tokens"] == 512
    assert not (more / "held-out.pt").exists()  # the extended dir's: comparable agreement
    # a third dir extends both (the second has no held-out shard of its own)
    third = second + ["--work", str(tmp_path / "third"), "--extend", str(more)]
    assert run(train_drafter.main, third) == 0, capsys.readouterr().err
    newest = torch.load(tmp_path / "third" / "shard-0000.pt")["ids"].tolist()
    assert not {tuple(r) for r in old + new} & {tuple(r) for r in newest}
    assert json.loads((tmp_path / "out" / "training.json").read_text())["windows"] == 48
    # an extension dir alone has no held-out shard to score on: refused in one line
    alone = recipe_args(tiny_target, tmp_path, "--steps", "0", "--draft-vocab", "64",
                        "--work", str(tmp_path / "alone"), "--extend", str(more))
    assert run(train_drafter.main, alone) == 2
    assert "holds a held-out shard" in capsys.readouterr().err.strip().splitlines()[-1]
    # more new windows than the train split holds: refused in one line
    too_many = second + ["--work", str(tmp_path / "huge"), "--tokens", str(10 ** 9)]
    assert run(train_drafter.main, too_many) == 2
    assert "ask for fewer --tokens" in capsys.readouterr().err.strip().splitlines()[-1]
    # a work dir cached for another length cannot be extended
    assert run(train_drafter.main, second + ["--seq-len", "16", "--work", str(tmp_path / "x")]) == 2
    assert "--extend" in capsys.readouterr().err.strip().splitlines()[-1]


def test_windows_read_across_shards_as_from_one_tensor():
    parts = [torch.randn(n, 5, 3).half() for n in (4, 1, 7)]
    rows = train_drafter.Rows(parts)
    rows_wanted = torch.tensor([0, 3, 4, 5, 11, 2, 4])
    assert len(rows) == 12
    assert torch.equal(rows[rows_wanted], torch.cat(parts)[rows_wanted])


def test_heldout_mal_scores_every_anchor_as_one_block_at_a_time(tiny_target, checkpoint):
    """scripts/heldout_mal.py drafts 64 anchors per pass over every window; each block's MAL
    must equal the same block drafted alone, its drafts mapped through the draft
    vocabulary and checked against the target's top-1 at positions a .. a+block-2. The
    labels make every block's first draft right, so MAL >= 2 tests the alignment."""
    import importlib.util
    from pathlib import Path

    from runtime.models.dflash import DraftHead, load_dflash
    from runtime.models.target import load_target
    from runtime.sampling import target_ids

    spec = importlib.util.spec_from_file_location(
        "heldout_mal", Path(__file__).resolve().parent.parent / "scripts" / "heldout_mal.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    drafter = load_dflash(checkpoint).float().eval()
    target, _ = load_target(tiny_target)
    embed = target.embed_tokens.weight.detach().float()
    c, seq, windows = drafter.config, 80, 2
    g = torch.Generator().manual_seed(0)
    data = {"ids": torch.randint(0, c.vocab_size, (windows, seq), generator=g),
            "features": torch.randn(windows, seq, drafter.fc.in_features, generator=g),
            "top": torch.randint(0, c.vocab_size, (windows, seq, 32), generator=g)}
    head = DraftHead(train_drafter._Head(embed), drafter.draft_token_ids())
    alone = {}
    with torch.no_grad():
        for w in range(windows):
            for a in range(1, seq - c.block_size + 1):
                ids = torch.tensor([[data["ids"][w, a]] + [c.mask_token_id] * (c.block_size - 1)])
                hidden = drafter.forward_train(torch.nn.functional.embedding(ids, embed),
                                               data["features"][w:w + 1], torch.tensor([[a]]))
                alone[w, a] = target_ids(head(hidden[0, 1:]).argmax(-1), head.vocab)
                data["top"][w, a, 0] = alone[w, a][0]  # the first draft is the target's choice
    expected = []
    for (w, a), drafts in alone.items():
        want = data["top"][w, a:a + c.block_size - 1, 0]
        expected.append(1 + float((drafts == want).float().cumprod(0).sum()))
    got = script.heldout_mal(drafter, embed, data)
    assert got.tolist() == expected and min(expected) >= 2 and max(expected) <= c.block_size
    # --anchors-from A: the same blocks' MALs, those anchored at A or later
    later = [mal for (w, a), mal in zip(alone, expected) if a >= 30]
    assert script.heldout_mal(drafter, embed, data, first_anchor=30).tolist() == later


def test_heldout_mal_refuses_bad_input_in_one_line(tmp_path, tiny_target, checkpoint, capsys):
    """A missing held-out file, a directory that is no checkpoint, and an --anchors-from
    past the last whole block each exit 2 with one line naming the problem."""
    import importlib.util
    from pathlib import Path

    from runtime.models.dflash import load_dflash

    spec = importlib.util.spec_from_file_location(
        "heldout_mal", Path(__file__).resolve().parent.parent / "scripts" / "heldout_mal.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    drafter = load_dflash(checkpoint)
    g = torch.Generator().manual_seed(0)
    held_out = tmp_path / "held-out.pt"
    torch.save({"ids": torch.randint(0, drafter.config.vocab_size, (2, 40), generator=g),
                "features": torch.randn(2, 40, drafter.fc.in_features, generator=g).half(),
                "top": torch.randint(0, drafter.config.vocab_size, (2, 40, 32), generator=g)},
               held_out)
    base = [str(checkpoint), "--target", str(tiny_target)]
    cases = [(base + ["--held-out", str(tmp_path / "none.pt")], "none.pt: no such file"),
             ([str(tmp_path), "--target", str(tiny_target), "--held-out", str(held_out)],
              "not a DFlash checkpoint"),
             (base + ["--held-out", str(held_out), "--anchors-from", "40"],
              f"--anchors-from must lie in 1..{40 - drafter.config.block_size}")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            script.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err and "Traceback" not in err
    assert script.main(base + ["--held-out", str(held_out), "--anchors-from", "20"]) == 0
    assert "teacher-forced MAL" in capsys.readouterr().out


def test_continuation_windows_are_the_targets_greedy_path_after_a_text_prompt(
        tmp_path, tiny_target, capsys):
    """--data continuations: each window is a text window's first --prompt-len tokens and
    then the target's own greedy tokens, and the states kept while generating (one decode
    step a token) are the ones a whole-window forward pass computes. The held-out shard is
    continued too. So every block position past the prompt lies on the greedy path."""
    from runtime.models.target import load_target

    prompt = 12
    args = recipe_args(tiny_target, tmp_path, "--steps", "0", "--draft-vocab", "64",
                       "--data", "continuations", "--prompt-len", str(prompt))
    assert run(train_drafter.main, args) == 0, capsys.readouterr().err
    target, tokenizer = load_target(tiny_target)
    text = train_drafter.windows(tokenizer, 32, 16, 0)
    for name in ("shard-0000.pt", "held-out.pt"):
        shard = torch.load(tmp_path / "work" / name)
        ids, top = shard["ids"], shard["top"].long()
        if name == "shard-0000.pt":
            assert ids[:, :prompt].tolist() == [w[:prompt] for w in text]
        assert torch.equal(ids[:, prompt:], top[:, prompt - 1:-1, 0])  # the target's argmax
        assert not torch.equal(ids, torch.tensor(text))  # the target's own text, not the file's
        with torch.inference_mode():
            whole = train_drafter.target_states(target, ids, target.new_cache(32, batch=len(ids)),
                                                (0, 1, 2))
        assert torch.allclose(shard["features"].float(), whole["features"].float(), atol=2e-3)
        assert torch.equal(shard["top"][..., :4], whole["top"][..., :4])
        anchors = torch.arange(prompt - 1, 29)  # blocks whose drafts all lie past the prompt
        source = anchors[None, :, None] + torch.arange(3)
        greedy = train_drafter.on_greedy_path(shard, torch.arange(len(ids)), source)
        assert bool((greedy == 1).all())
    assert json.loads((tmp_path / "work" / "meta.json").read_text())["continuations_after"] == prompt
    card = json.loads((tmp_path / "out" / "training.json").read_text())
    assert (card["data"], card["prompt_len"]) == ("continuations", prompt)
    assert "the target's own greedy continuation" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("prompt_len", ["0", "32"])
def test_a_prompt_that_leaves_no_continuation_is_refused_in_one_line(
        tmp_path, tiny_target, capsys, prompt_len):
    args = recipe_args(tiny_target, tmp_path, "--data", "continuations", "--prompt-len", prompt_len)
    assert run(train_drafter.main, args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --prompt-len must lie in 1..31")
