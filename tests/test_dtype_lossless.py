"""scripts/dtype_lossless.py: every mode's greedy tokens, alone and batched through the
serving scheduler, against target-only alone in the same backend and dtype; a planted
difference is found at its first token; a bad configuration is one error line."""

import json

from script_loader import load_script


def script():
    return load_script("dtype_lossless")


def test_differences_name_each_prompt_and_its_first_differing_token():
    found = script().differences([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [7, 8]])
    assert found == [{"prompt": 1, "first_token": 1}, {"prompt": 2, "first_token": 2}]


def test_float32_is_lossless_alone_and_batched(tiny_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in ("def f(x):\n    return x", "import os\n" * 6)))
    out = tmp_path / "lossless.json"
    code = script().main(["--engine-dir", str(tiny_engine), "--prompts-file", str(prompts),
                          "--config", "torch:float32", "--modes", "sharpdraft", "--requests", "3",
                          "--max-new-tokens", "6", "--concurrency", "2", "--threads", "1",
                          "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["lossless"]
    (row,) = report["configs"]
    assert (row["backend"], row["dtype"]) == ("torch", "float32")
    assert set(row["modes"]) == {"target", "sharpdraft"}
    assert all(m == {"alone": [], "c2": [], "errors": []} for m in row["modes"].values())
    assert "torch float32 (prefill float32): lossless" in capsys.readouterr().out


def test_a_bad_config_is_refused_in_one_line(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        script().main(["--engine-dir", "x", "--prompts-file", "x", "--config", "torch:int8",
                       "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "--config torch:int8: expected BACKEND:DTYPE" in err[-1]
