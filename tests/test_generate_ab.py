"""scripts/generate_ab.py: generate in two checkouts, interleaved, at batch 1 and batch B."""

import json
from pathlib import Path

import pytest

from scripts import generate_ab

REPO = Path(__file__).resolve().parent.parent


def test_a_missing_engine_is_one_line(tmp_path, capsys):
    assert generate_ab.main(["--engine-dir", str(tmp_path), "--before", str(REPO)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "engine.json" in err[0]


@pytest.mark.slow  # two child interpreters per round; the fast tier keeps decode_ab's arms
def test_both_checkouts_decode_every_mode_at_batch_1_and_b_with_the_same_tokens(tiny_engine, tmp_path,
                                                                                capsys):
    out = tmp_path / "ab.json"
    argv = ["--engine-dir", str(tiny_engine), "--before", str(REPO), "--rounds", "1", "--batch", "2",
            "--max-new-tokens", "5", "--context", "64", "--threads", "1", "--modes", "target",
            "ngram", "sharpdraft", "--out", str(out)]
    assert generate_ab.main(argv) == 0
    result = json.loads(out.read_text())
    for arm in ("before", "after"):
        assert set(result[arm]) == {"target", "ngram", "sharpdraft"}
        assert all(m["batch1_tok_s"] > 0 and m["batch2_tok_s"] > 0 for m in result[arm].values())
    assert result["same_tokens"] == {"target": True, "ngram": True, "sharpdraft": True}
    argv[3] = str(tmp_path)  # not a checkout: its child cannot import the runtime
    assert generate_ab.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: the before checkout failed")
