"""Smoke versions of the measuring commands (bench, diagnose, calibrate) on the tiny
engine: seconds, not minutes. The real runs are commands; these check their contracts."""

import json

import pytest

import tiny
from build.calibrate import main as calibrate_main
from runtime.__main__ import main
from runtime.cli import run


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "doc.txt"
    path.write_text(tiny.stdlib_text(30_000))
    return path


def test_bench_reports_every_mode_from_one_prefill(tiny_engine, doc, tmp_path, capsys):
    import statistics

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "16", "160",
                      "--new-tokens", "12", "--docs", str(doc), str(doc), "--repeats", "3",
                      "--json", str(out), "--plot", str(png)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["modes"] == ["target", "ngram", "frozen", "sharpdraft", "hybrid", "frozen-hybrid"]
    assert [r["context_tokens"] for r in result["rows"]] == [16, 160]
    for row in result["rows"]:
        for mode in result["modes"]:
            assert len(row[f"tok_s_{mode}_repeats"]) == 3
            assert row[f"tok_s_{mode}"] == pytest.approx(
                statistics.median(row[f"tok_s_{mode}_repeats"]), rel=1e-3)
            assert row[f"prefill_ms_{mode}"] >= 0
        assert 0 <= row["ngram_share_hybrid"] <= 1 and 0 <= row["ngram_share_frozen-hybrid"] <= 1
        for mode in result["modes"][1:]:
            assert row[f"tok_s_{mode}"] > 0 and row["tok_s_target"] > 0
            assert row[f"speedup_{mode}"] == pytest.approx(
                row[f"tok_s_{mode}"] / row["tok_s_target"], rel=1e-3)
            assert 1 <= row[f"mal_{mode}"] <= 5
            # a verify pass commits at most one token more than it checked drafts
            assert 0 <= row[f"mal_{mode}"] - 1 <= row[f"drafts_per_step_{mode}"]
            # greedy: every repeat of every mode reproduces the target's tokens
            assert row["identical_to_target"][mode] == [True] * 6
    # tiny engine: ref_keys 64, so beta stays 1 at 16 + 4 keys and exceeds 1 at 160 + 4
    assert result["rows"][0]["beta_above_1_fraction"] == 0.0
    assert result["rows"][1]["beta_above_1_fraction"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "MAL ngram" in out and "MAL hybrid" in out and "hybrid n-gram share" in out
    assert "+prefill ms sharpdraft" in out  # the drafter's own prefill, beside the speeds


def test_bench_modes_adds_the_family_preset_beside_the_calibrated_scaling(tiny_engine, doc,
                                                                          tmp_path, capsys):
    out = tmp_path / "preset.json"
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "160",
                      "--new-tokens", "12", "--docs", str(doc), str(doc), "--repeats", "1",
                      "--modes", "sharpdraft", "preset", "frozen", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["modes"] == ["target", "frozen", "preset", "sharpdraft"]  # no n-gram asked
    assert result["preset_scaling"]["ref_keys"] == 2048  # DFlash's preset, recorded at build
    row = result["rows"][0]
    # 164 keys < the preset's 2048: beta 1, so the preset drafter IS the frozen one, while
    # the engine's own ref_keys 64 sharpens it
    assert row["mal_per_document"]["preset"] == row["mal_per_document"]["frozen"]
    assert row["mal_ratio_preset_frozen"]["mean"] == 1.0
    assert row["mal_ratio_sharpdraft_frozen"]["items"] == 2
    assert all(row["identical_to_target"]["preset"])
    assert "MAL preset/frozen" in capsys.readouterr().out
    # the three-family report reads such files: one table row per context, and the plot
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import plot_families

    png = tmp_path / "families.png"
    assert plot_families.main([str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "| dflash | 160 |" in table and "1.000 [1.000, 1.000]" in table  # preset = frozen here
    assert "every run identical to target-only: True" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "160",
                      "--docs", str(doc), "--modes", "bogus"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run mode(s) ['bogus']" in err and "Traceback" not in err


def test_bench_runs_a_kept_preset_once(tiny_target, tiny_drafter, doc, tmp_path, capsys):
    import build_engine

    engine = tmp_path / "preset-engine"  # no calibration, no --ref-keys: the preset itself
    assert build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(tiny_drafter), "--backend", "torch",
                              "--step-costs", "fixed", "--output", str(engine)]) == 0
    out = tmp_path / "kept.json"
    code = run(main, ["bench", "--engine-dir", str(engine), "--lengths", "100", "--new-tokens",
                      "8", "--docs", str(doc), "--repeats", "1", "--modes", "preset", "sharpdraft",
                      "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["preset_is_calibrated"] and result["modes"] == ["target", "preset", "sharpdraft"]
    row = result["rows"][0]
    assert row["mal_preset"] == row["mal_sharpdraft"]
    assert row["tok_s_preset_repeats"] == row["tok_s_sharpdraft_repeats"]  # the same runs


def test_bench_under_sampling_reports_mal_without_identity(tiny_engine, doc, tmp_path, capsys):
    out = tmp_path / "sampled.json"
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "100",
                      "--new-tokens", "10", "--docs", str(doc), "--temperature", "0.8",
                      "--top-p", "0.9", "--seed", "3", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.9, "seed": 3}
    row = result["rows"][0]
    assert "identical_to_target" not in row and 1 <= row["mal_sharpdraft"] <= 4
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "100",
                      "--docs", str(doc), "--temperature", "-1"])
    assert code == 2 and "temperature" in capsys.readouterr().err


def test_bench_refuses_a_document_too_short(tiny_engine, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("def f():\n    return 1\n")
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "64",
                      "--docs", str(short)])
    err = capsys.readouterr().err
    assert code == 2 and "short.txt has" in err and "needs 64" in err
    assert err.strip().splitlines()[-1].startswith("error:") and "Traceback" not in err


def test_bench_refuses_lengths_beyond_the_context(tiny_engine, doc, capsys):
    code = run(main, ["bench", "--engine-dir", str(tiny_engine), "--lengths", "500",
                      "--new-tokens", "64", "--docs", str(doc)])
    assert code == 2 and "must be within the target's 512" in capsys.readouterr().err


def test_diagnose_shows_dilution_and_sharpening(tiny_engine, doc, tmp_path, capsys):
    out = tmp_path / "diag.json"
    code = run(main, ["diagnose", "--engine-dir", str(tiny_engine), "--lengths", "8", "60", "400",
                      "--top-k", "8", "--docs", str(doc), "--json", str(out), "--plot",
                      str(tmp_path / "diag.png")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    # beta = 1 below ref_keys: identical mass; above it SharpDraft concentrates attention
    assert rows[0]["frozen"] == rows[0]["sharpdraft"]
    assert all(s > f for f, s in zip(rows[-1]["frozen"], rows[-1]["sharpdraft"]))
    assert rows[-1]["frozen"][0] < rows[0]["frozen"][0]  # more keys, thinner attention


@pytest.mark.slow  # an auto build (exports and times both backends) and a 16-setting sweep
def test_calibrate_writes_the_choice_and_keeps_the_preset(tiny_target, tiny_drafter, doc,
                                                          tmp_path, capsys):
    import shutil

    import build_engine

    drafter = tmp_path / "drafter"  # a copy: --write-checkpoint adds a file to it
    shutil.copytree(tiny_drafter, drafter)
    engine = tmp_path / "engine"
    assert build_engine.main(["--sharpdraft", "--target", str(tiny_target), "--drafter-checkpoint",
                              str(drafter), "--ref-keys", "64", "--top-k", "8",
                              "--attention", "plugin",  # the plugin fields must follow the choice
                              "--output", str(engine)]) == 0
    code = run(calibrate_main, ["--engine-dir", str(engine), "--ref-keys", "32", "128",
                      "--slopes", "2", "5", "--max-log-scales", "0.5", "1.0", "--lengths", "150",
                      "300", "--short", "40", "--new-tokens", "8", "--docs", str(doc),
                      "--write-checkpoint"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((engine / "engine.json").read_text())
    calibration = manifest["extra"]["calibration"]
    assert calibration["previous_scaling"]["ref_keys"] == 64
    assert manifest["query_scaling"] == calibration["chosen"]
    assert len(calibration["grid"]) == 8
    # teacher-forced: every setting scored at each of the 8 anchors of each context
    assert calibration["anchors"] == {"40": 8, "150": 8, "300": 8}
    assert {row["query_scaling"]["max_log_scale"] for row in calibration["grid"]} == {0.5, 1.0}
    assert manifest["extra"]["onnx"]["plugin"]["fields"]["ref_keys"] == calibration["chosen"]["ref_keys"]
    # the re-exported graph is what the manifest hashes: the engine still loads and runs
    code = run(main, ["generate", "--engine-dir", str(engine), "--prompt", "import re\n",
                      "--max-new-tokens", "6", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["sharpdraft"] == calibration["chosen"]
    # the checkpoint now carries the choice: a new engine defaults to it, preset recorded
    saved = json.loads((drafter / "sharpdraft.json").read_text())
    assert saved["query_scaling"] == calibration["chosen"]
    again = tmp_path / "again"
    assert build_engine.main(["--sharpdraft", "--backend", "torch", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(drafter), "--output", str(again)]) == 0
    rebuilt = json.loads((again / "engine.json").read_text())
    assert rebuilt["query_scaling"] == calibration["chosen"]
    assert rebuilt["extra"]["query_scaling_source"].startswith("calibrated")
    assert rebuilt["extra"]["family_preset"]["ref_keys"] == 2048


def test_ab_step_costs_decodes_under_both_tables(tiny_engine, doc, tmp_path, capsys):
    """scripts/ab_step_costs.py swaps the engine's step costs for another build's: under a
    table where every verified token costs a whole step, no draft is worth verifying (MAL
    1), under the engine's own (verifying free) the lookups' drafts land on this
    repetitive text (the tiny drafter's rarely do); both lossless."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "ab_step_costs", Path(__file__).resolve().parent.parent / "scripts" / "ab_step_costs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    manifest = json.loads((tiny_engine / "engine.json").read_text())
    for backend in manifest["extra"]["step_costs"]:
        manifest["extra"]["step_costs"][backend] = {"verify": [0.0, 1.0, 0.0, 0.0], "draft": [0.0, 0.0]}
    other = tmp_path / "engine.json"
    other.write_text(json.dumps(manifest))
    argv = ["--engine-dir", str(tiny_engine), "--costs-from", str(other), "--lengths", "40",
            "--new-tokens", "24", "--docs", str(doc), "--modes", "hybrid"]
    assert script.main(argv) == 0
    mal = {line.split()[2]: float(line.split()[4]) for line in capsys.readouterr().out.splitlines()
           if line.split()[:2] == ["40", "hybrid"]}
    assert mal["other"] == 1.0 and mal["own"] > 1.0
    assert script.main(argv[:2] + ["--costs-from", str(tmp_path / "none.json")] + argv[4:]) == 2
    assert "error:" in capsys.readouterr().err


def test_calibrate_refuses_what_it_cannot_score_in_one_line(tiny_engine, doc, capsys):
    # 500 + 10 anchors + 3 drafts after the last one overrun the tiny target's 512 (with
    # 9 anchors they fit: the limit counts the last anchor's drafts, not more)
    for new_tokens, length, message in (("0", "150", "--new-tokens must be >= 1"),
                                        ("10", "500", "must fit the target's 512")):
        code = run(calibrate_main, ["--engine-dir", str(tiny_engine), "--ref-keys", "32",
                          "--short", "40", "--docs", str(doc), "--dry-run",
                          "--new-tokens", new_tokens, "--lengths", length])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_calibrate_counts_near_equal_long_mals_as_tied_and_keeps_the_gentlest():
    """Long-context MALs within --tolerance of the best are one measurement: the choice
    among them is the largest ref_keys (beta stays exactly 1 over more short contexts),
    then the larger slope; a clear winner still wins, and a setting that loses the short
    context is never chosen however well it does long."""
    from plugins.scaling import QueryScaling
    from build.calibrate import choose

    def gen(mal):  # 100 anchors committing `mal` tokens each on average
        return [round(mal * 100) - 99] + [1] * 99

    def results(long_mals, short_mals):
        out = {None: {40: gen(1.5), 300: gen(1.2)}}
        for setting, mal in long_mals.items():
            out[setting] = {40: gen(short_mals.get(setting, 1.5)), 300: gen(mal)}
        return out

    r512, r1024, r256 = QueryScaling(512, 32, 2.5), QueryScaling(1024, 32, 2.5), QueryScaling(256, 32, 5.0)
    chosen, _ = choose(results({r512: 1.813, r1024: 1.80, r256: 1.90}, {r256: 1.40}), [300], 40, 0.01)
    assert chosen == r1024  # 1.80 is within 1% of 1.813; 256 lost the short context
    chosen, _ = choose(results({r512: 1.90, r1024: 1.80}, {}), [300], 40, 0.01)
    assert chosen == r512  # 5% apart is not a tie
    chosen, _ = choose(results({r512: 1.80, QueryScaling(512, 32, 5.0): 1.80}, {}), [300], 40, 0.01)
    assert chosen.slope == 5.0
    higher_cap = QueryScaling(1024, 32, 2.5, max_log_scale=0.75)
    chosen, _ = choose(results({r1024: 1.80, higher_cap: 1.805}, {}), [300], 40, 0.01)
    assert chosen == r1024  # a tie keeps the paper's lower cap
    chosen, _ = choose(results({r1024: 1.80, higher_cap: 1.90}, {}), [300], 40, 0.01)
    assert chosen == higher_cap  # a cap that wins clearly is taken


def test_draft_window_sweep_scores_each_window_at_every_anchor(tiny_engine, doc, tmp_path, capsys):
    """scripts/draft_window_sweep.py: every way scored at the same anchors; a window wider
    than the context is no window (the frozen drafter's counts exactly); bad input gets
    one line and exit 2."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "draft_window_sweep",
        Path(__file__).resolve().parent.parent / "scripts" / "draft_window_sweep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "sweep.json"
    argv = ["--engine-dir", str(tiny_engine), "--windows", "4", "100000", "--lengths", "150",
            "--new-tokens", "12", "--docs", str(doc), "--json", str(out)]
    assert script.main(argv) == 0, capsys.readouterr().err
    counts = {way: per["150"] for way, per in json.loads(out.read_text())["committed_per_anchor"].items()}
    assert set(counts) == {"frozen", "sharpdraft", "window 4", "window 100000"}
    block = json.loads((tiny_engine / "engine.json").read_text())["block_size"]
    assert all(len(c) == 12 and all(1 <= n <= block for n in c) for c in counts.values())
    assert counts["window 100000"] == counts["frozen"]
    assert script.main(argv[:2] + ["--windows", "0"] + argv[4:]) == 2
    assert script.main(argv[:-4] + ["--docs", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.count("error:") == 2


@pytest.mark.slow  # two checkouts' processes: the fast tier keeps an A/B in process
# (test_ab_step_costs_decodes_under_both_tables)
def test_decode_ab_runs_both_checkouts_interleaved(tiny_engine, tmp_path, capsys):
    """scripts/decode_ab.py runs the decode path as the scheduler drives it in each
    checkout's own process (here the same checkout twice) and records both arms and their
    ratio; a checkout that cannot run is one error line and exit 1."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("decode_ab", repo / "scripts" / "decode_ab.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": tiny.stdlib_text(400 + 100 * i)}) + "\n" for i in range(2)))
    out = tmp_path / "ab.json"
    argv = ["--engine-dir", str(tiny_engine), "--before", str(repo), "--prompts-file", str(prompts),
            "--rounds", "1", "--requests", "2", "--max-new-tokens", "6", "--prefill-chunk", "32",
            "--threads", "1", "--out", str(out)]
    assert script.main(argv) == 0
    result = json.loads(out.read_text())
    assert [len(result["runs"][arm]) for arm in ("before", "after")] == [1, 1]
    modes = ["sharpdraft", "target", "ngram"]  # SharpDraft beside its peers, by default
    assert all(list(run) == modes and all(m["tokens"] == 12 and m["seconds"] > 0 for m in run.values())
               for arm in result["runs"].values() for run in arm)
    assert set(result["ratio"]) == set(modes) and all(v > 0 for v in result["ratio"].values())
    assert result["command"].startswith("python scripts/decode_ab.py")
    argv[3] = str(tmp_path)  # not a checkout: its child cannot import the runtime
    assert script.main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: the before checkout failed")
