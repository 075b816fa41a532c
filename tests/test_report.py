"""`python -m runtime report`: docs/results.md is written from results/*.json alone, bad
files are refused in one line, and the README's published figures are the files' figures."""

import json
import re
from pathlib import Path

import pytest

from runtime.__main__ import main as runtime_main
from runtime.cli import run
from runtime.commands import report
from runtime.commands.provenance import provenance

REPO = Path(__file__).resolve().parent.parent
MACHINE = {"cpus": 2, "torch_threads": 2, "processor": "x86_64", "python": "3.11.7", "torch": "2.13.0+cpu"}


def bench_row(context, mal, speedup):
    row = {"context_tokens": context, "tok_s_target": 10.0,
           "identical_to_target": {m: [True] for m in mal}}
    for m in mal:
        row[f"mal_{m}"], row[f"speedup_{m}"] = mal[m], speedup[m]
    row["mal_ratio_sharpdraft_frozen"] = {"mean": mal["sharpdraft"] / mal["frozen"],
                                          "ci": [1.1111, 1.2222], "level": 0.95, "items": 3}
    return row


def fixtures() -> dict:
    """One small file per table, shaped as the commands write them."""
    bench = {"command": "python -m runtime bench --lengths 512 4096", "machine": MACHINE,
             "date": "2026-12-01T10:00:00Z", "engine_dir": "engines/x", "backend": "onnxruntime",
             "documents": ["a.py"], "new_tokens": 64, "repeats": 3, "draft_length": "adaptive",
             "query_scaling": {"ref_keys": 512, "top_k": 32, "slope": 2.5, "max_log_scale": 0.75},
             "rows": [bench_row(512, {"ngram": 2.3456, "frozen": 1.5, "sharpdraft": 1.6789},
                                {"ngram": 2.01, "frozen": 1.3, "sharpdraft": 1.4321}),
                      bench_row(4096, {"ngram": 1.9, "frozen": 1.1, "sharpdraft": 1.7654},
                                {"ngram": 1.5, "frozen": 0.9, "sharpdraft": 1.2345})]}
    mal = dict(bench, command="python -m runtime bench --draft-length full", draft_length="full")
    families = dict(bench, drafter="pard", preset_scaling=bench["query_scaling"],
                    rows=[bench_row(512, {"frozen": 1.2, "preset": 1.2, "sharpdraft": 1.3},
                                    {"frozen": 1, "preset": 1, "sharpdraft": 1})])
    s = {"ref_keys": 512, "top_k": 32, "slope": 2.5, "max_log_scale": 0.75}
    return {
        "bench.json": bench, "bench-mal.json": mal, "families-pard.json": families,
        "bench-batch8.json": {"command": "python -m runtime bench --batch 8", "contexts": [512, 4096],
                              "rows": [{"mode": "sharpdraft", "batch": 8, "mal": 1.4913,
                                        "tok_s_batched": 5.5, "tok_s_one_at_a_time": 7.1,
                                        "batching_speedup": 0.7746,
                                        "identical_to_one_at_a_time": [True, True]}]},
        "diagnose-calibrated.json": {"engine_dir": "engines/x", "top_k": 32, "query_scaling": s,
                                     "documents": ["a.py"],
                                     "rows": [{"context_tokens": 4096, "visible_keys": 4104,
                                               "beta": 1.8552, "frozen": [0.519, 0.4857],
                                               "sharpdraft": [0.8803, 0.8752]}]},
        "calibrate.json": {"chosen": s, "long_contexts": [2048], "short_context": 496,
                           "split": "calibration", "documents": ["z.py"], "criterion": "max mean MAL",
                           "frozen": {"query_scaling": None, "mal_short": 2.0187, "mal_long": 1.2604,
                                      "mal_by_length": {"2048": 1.2604}, "keeps_short": True},
                           "grid": [{"query_scaling": s, "mal_short": 2.07, "mal_long": 1.9113,
                                     "mal_by_length": {"2048": 1.9113}, "keeps_short": True}]},
        "draft-window-sweep.json": {"engine": "engines/x", "documents": ["z.py"], "new_tokens": 64,
                                    "mean_mal": {"frozen": {"2048": 1.44},
                                                 "window 512": {"2048": 2.0708}}},
        "loadtest-b8.json": {"url": "grpc://127.0.0.1:8001", "model": "m", "requests": 16,
                             "max_new_tokens": 32, "token_mismatches": 0,
                             "levels": [{"concurrency": 8, "requests_per_second": 2.776,
                                         "tokens_per_second": 88.84, "ttft_ms": {"p50": 179.9},
                                         "latency_ms": {"p50": 2550.1, "p95": 3358.5},
                                         "mean_accepted_length": 1.5119}]},
        "rss-torch.json": {"backend": "torch", "prompt_tokens": 7680, "new_tokens": 32,
                           "peak_rss_mib": 1893.4, "seconds": {"prefill": 33.2, "verify": 4.2}},
        "backends.json": {"args": {"engine": ["torch=e@torch"], "contexts": [512], "modes": ["target"],
                                   "new_tokens": 48, "repeats": 3},
                          "rows": [{"context": 512, "mode": "target", "engine": "torch",
                                    "tok_s_median": 15.56, "same_tokens_as_first": True}]},
    }


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    for name, data in fixtures().items():
        (folder / name).write_text(json.dumps(data))
    return folder


def call(argv, capsys):
    code = run(runtime_main, ["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_writes_every_table_with_its_provenance(results, tmp_path, capsys):
    page = tmp_path / "results.md"
    code, _, err = call(["--results", str(results), "--output", str(page)], capsys)
    assert code == 0, err
    text = page.read_text()
    # each file's figures, at the precision the tables print them
    for figure in ("1.679, 1.43x", "1.765, 1.23x", "1.119 [1.111, 1.222]", "0.77", "1.491",
                   "0.8803", "1.911", "2.071", "88.8", "2550.1", "1893.4", "15.56"):
        assert figure in text, figure
    # what a file records is printed; what it does not is "not recorded", never guessed
    assert "- command: `python -m runtime bench --lengths 512 4096`" in text
    assert "- date: 2026-12-01T10:00:00Z" in text
    assert "2 CPUs (x86_64), 2 torch thread(s), torch 2.13.0+cpu" in text
    diagnose = text[text.index("diagnose-calibrated.json"):text.index("## Calibration")]
    assert "- command: not recorded" in diagnose and "- date: not recorded" in diagnose
    # backends.json records its arguments, not its command line: rebuilt and said so
    assert "python -m scripts.bench_backends --engine torch=e@torch --contexts 512" in text
    assert "does not record the command line" in text


def test_check_fails_when_the_page_is_stale(results, tmp_path, capsys):
    page = tmp_path / "results.md"
    assert call(["--results", str(results), "--output", str(page)], capsys)[0] == 0
    assert call(["--results", str(results), "--output", str(page), "--check"], capsys)[0] == 0
    data = json.loads((results / "bench.json").read_text())
    data["rows"][0]["mal_frozen"] = 1.25  # a rerun changed a figure
    (results / "bench.json").write_text(json.dumps(data))
    code, _, err = call(["--results", str(results), "--output", str(page), "--check"], capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "out of date" in err


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "bench.json").unlink(), "bench.json is missing"),
    (lambda f: (f / "calibrate.json").write_text("{not json"), "calibrate.json is not valid JSON"),
    (lambda f: (f / "bench-mal.json").write_text("[1, 2]"), "not a JSON object"),
    (lambda f: (f / "draft-window-sweep.json").write_text('{"engine": "x"}'), "has no ['mean_mal']"),
    (lambda f: (f / "loadtest-b8.json").write_text('{"levels": [{"concurrency": 1}]}'),
     "lacks a field"),
    (lambda f: [p.unlink() for p in f.glob("families-*.json")], "no families-*.json"),
])
def test_a_missing_or_invalid_file_is_one_line(results, tmp_path, capsys, damage, message):
    damage(results)
    page = tmp_path / "results.md"
    code, out, err = call(["--results", str(results), "--output", str(page)], capsys)
    assert code == 1 and not out and not page.exists()
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_missing_results_folder_is_one_line(tmp_path, capsys):
    code, _, err = call(["--results", str(tmp_path / "nowhere"), "--output", str(tmp_path / "r.md")], capsys)
    assert code == 1 and err.count("\n") == 1 and "is not a folder of results" in err


def test_provenance_records_command_machine_and_date(monkeypatch):
    monkeypatch.setattr("sys.argv", ["runtime/__main__.py", "bench", "--lengths", "512", "--json", "a b.json"])
    record = provenance("bench")
    assert record["command"] == "python -m runtime bench --lengths 512 --json 'a b.json'"
    assert record["machine"]["cpus"] >= 1 and record["machine"]["torch"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])


# -- the published page and README against the real results/ --------------------------

def test_docs_results_is_what_the_report_writes_from_results(capsys):
    code, _, err = call(["--check"], capsys)
    assert code == 0, f"{err.strip()}: docs/results.md was edited by hand or results/ changed"


def readme_results_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Results")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_results_table_is_the_reports_headline_from_bench_json():
    table = "\n".join(report.headline(report.load(REPO / "results", "bench.json")))
    assert table in readme_results_section()


def test_every_figure_in_the_readme_results_section_is_in_a_results_file():
    """Each decimal figure the README's results section quotes equals, at the precision
    quoted, some number in a results JSON the report reads."""
    values = [v for path in sorted((REPO / "results").glob("*.json"))
              for v in report.numbers(json.loads(path.read_text()))]
    section = readme_results_section()
    # decimals, not version strings such as 2.13.0
    figures = re.findall(r"(?<![\d.])(\d+\.\d+)(?![\d.])", section)
    assert len(figures) > 40  # the table and the verdict
    missing = [f for f in set(figures)
               if not any(f"{v:.{len(f.split('.')[1])}f}" == f for v in values)]
    assert not missing, f"README figures not found in results/*.json: {sorted(missing)}"


def test_heldout_mal_json_records_its_provenance_and_the_report_prints_it(
        tmp_path, results, tiny_target, capsys):
    """scripts/heldout_mal.py --json writes the scores it prints, with its command line,
    machine and date; the report shows them as a held-out table."""
    import importlib.util

    import torch

    import tiny
    from runtime.models.dflash import load_dflash

    spec = importlib.util.spec_from_file_location("heldout_mal", REPO / "scripts" / "heldout_mal.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    checkpoint = tiny.make_drafter(tmp_path / "drafter", tiny_target)
    drafter = load_dflash(checkpoint)
    g = torch.Generator().manual_seed(0)
    held_out = tmp_path / "held-out.pt"
    torch.save({"ids": torch.randint(0, drafter.config.vocab_size, (2, 40), generator=g),
                "features": torch.randn(2, 40, drafter.fc.in_features, generator=g).half(),
                "top": torch.randint(0, drafter.config.vocab_size, (2, 40, 32), generator=g)},
               held_out)
    out = results / "heldout-tiny.json"
    argv = [str(checkpoint), str(checkpoint), "--target", str(tiny_target), "--held-out",
            str(held_out), "--json", str(out)]
    assert script.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    record = json.loads(out.read_text())
    assert record["command"] == "python -m scripts.heldout_mal " + " ".join(argv)
    assert record["machine"]["cpus"] >= 1 and record["date"].endswith("Z")
    first, second = record["drafters"]
    assert f"teacher-forced MAL {first['mal']:.4f} over {first['blocks']} blocks" in printed[0]
    assert second["minus_first"] == 0 and second["mal"] == first["mal"]  # the same drafter twice
    page = tmp_path / "results.md"
    code, _, err = call(["--results", str(results), "--output", str(page)], capsys)
    assert code == 0, err
    text = page.read_text()
    assert "## Held-out MAL of drafters" in text and f"| {first['mal']:.4f} | {first['blocks']} |" in text


def test_lossless_files_show_the_prefill_dtype_and_the_drift_from_the_first_config(tmp_path):
    run_ = {"alone": [], "c8": [], "errors": []}
    data = {"command": "python scripts/dtype_lossless.py", "machine": MACHINE,
            "date": "2026-12-06T01:00:00Z", "commit": "abc1234", "requests": 16,
            "max_new_tokens": 32, "concurrency": 8, "configs": [
                {"backend": "onnxruntime", "dtype": "float32", "target_alone_prefill_s": 5.1,
                 "target_alone_decode_s": 12.5, "modes": {"target": run_}},
                {"backend": "onnxruntime", "dtype": "float32", "prefill_dtype": "bfloat16",
                 "target_alone_prefill_s": 2.3, "target_alone_decode_s": 12.4,
                 "target_vs_first": {"config": "onnxruntime:float32",
                                     "differ": [{"prompt": 3, "first_token": 9}]},
                 "modes": {"target": run_, "sharpdraft": dict(run_, c8=[{"prompt": 1, "first_token": 2}])}}]}
    (tmp_path / "lossless-dtype-x.json").write_text(json.dumps(data))
    text = "\n".join(report.lossless_section(tmp_path))
    assert "| onnxruntime, float32 | target | 0 | 0 | 5.10 / 12.50 | not recorded |" in text
    assert ("| onnxruntime, float32, prefill bfloat16 | sharpdraft | 0 | 1 | 2.30 / 12.40 | "
            "1 (vs onnxruntime:float32) |") in text
