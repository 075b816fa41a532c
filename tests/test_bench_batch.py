"""`python -m runtime bench --batch B` on the tiny engine: B sequences at different
context lengths decoded together, frozen vs SharpDraft, against one at a time."""

import json

import tiny

from runtime.__main__ import main
from runtime.cli import run


def test_bench_batch_reports_mal_and_throughput_batched_and_one_at_a_time(tiny_engine, tmp_path,
                                                                         capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(tiny.stdlib_text(30_000))
    out = tmp_path / "batch.json"
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--batch", "3", "--lengths", "16",
                      "160", "--new-tokens", "10", "--docs", str(doc), "--repeats", "2",
                      "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["batch"] == 3 and result["contexts"] == [16, 160, 16]
    rows = {r["mode"]: r for r in result["rows"]}
    # every mode the engine lists batches, in the table's order
    assert list(rows) == ["target", "ngram", "frozen", "sharpdraft", "hybrid", "frozen-hybrid"]
    for mode, row in rows.items():
        assert row["tok_s_batched"] > 0 and row["tok_s_one_at_a_time"] > 0
        assert row["identical_to_one_at_a_time"] == [True] * 3  # greedy: batching changes nothing
        assert len(row["seconds_batched"]) == 2
    assert all(1 <= rows[m]["mal"] <= 4 for m in ("frozen", "sharpdraft"))
    # ref_keys 64: the 16-token sequences keep beta 1 while the 160-token one is sharpened
    betas = rows["sharpdraft"]["beta_mean_per_sequence"]
    assert betas[0] == betas[2] == 1.0 < betas[1]
    assert rows["frozen"]["beta_mean_per_sequence"] == [1.0] * 3
    assert "tok/s batched" in capsys.readouterr().out


def test_bench_batch_refuses_a_batch_below_one(tiny_engine, capsys):
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--batch", "0", "--lengths", "16"])
    assert code == 2 and capsys.readouterr().err.startswith("error: --batch")
