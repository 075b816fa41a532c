"""The command lines: real engines over tiny checkpoints, one-line errors on bad input."""

import json
import subprocess
import sys

import pytest
import torch

import build_engine
from runtime.__main__ import main as runtime_main
from runtime.cli import run
from runtime.manifest import FORMAT_VERSION


def call(main, argv, capsys):
    code = run(main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def generate(engine, *extra, capsys):
    return call(runtime_main, ["generate", "--engine-dir", str(engine), *extra], capsys)


def test_generate_json_reports_the_run(tiny_engine, capsys):
    code, out, err = generate(tiny_engine, "--prompt", "def main():\n    ", "--max-new-tokens",
                              "24", "--ignore-eos", "--json", capsys=capsys)
    assert code == 0, err
    result = json.loads(out)
    for key in ("tokens", "text", "new_tokens", "mean_accepted_length", "verify_steps",
                "tokens_per_second", "sharpdraft", "acceptance_histogram"):
        assert key in result
    assert result["new_tokens"] == len(result["tokens"]) == 24
    assert result["sharpdraft"] == {"ref_keys": 64, "top_k": 8, "slope": 5.0, "max_log_scale": 0.5}
    assert 1 <= result["mean_accepted_length"] <= 4
    # this very process holds torch and the models: its peak RSS is at least its current one
    import resource
    assert result["backend"] == "torch"
    assert 0 < result["peak_rss_mib"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 0.1


def test_all_three_modes_produce_the_same_greedy_tokens(tiny_engine, capsys):
    outputs = {}
    for mode in ([], ["--no-sharpdraft"], ["--target-only"]):
        code, out, err = generate(tiny_engine, "--prompt", "import os\n", "--max-new-tokens", "30",
                                  "--ignore-eos", "--json", *mode, capsys=capsys)
        assert code == 0, err
        result = json.loads(out)
        outputs[result["mode"]] = result["tokens"]
    assert outputs["sharpdraft"] == outputs["frozen"] == outputs["target"]


def test_generate_streams_text(tiny_engine, capsys):
    code, out, err = generate(tiny_engine, "--prompt", "class A:\n", "--max-new-tokens", "10",
                              capsys=capsys)
    assert code == 0
    assert out.strip()
    assert "MAL" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
    (["--prompt", "x", "--max-new-tokens", "ten"], "invalid int value"),
])
def test_bad_generate_input_is_one_line(tiny_engine, capsys, args, message):
    code, out, err = generate(tiny_engine, *args, capsys=capsys)
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_prompt_longer_than_the_context_is_refused(tiny_engine, capsys):
    code, _, err = generate(tiny_engine, "--prompt", "def f(x): return x\n" * 400, capsys=capsys)
    assert code == 2 and "the target's context holds 512" in err and err.count("\n") == 1


def test_missing_engine_dir_is_one_line(tmp_path, capsys):
    code, _, err = generate(tmp_path / "nope", "--prompt", "x", capsys=capsys)
    assert code == 1 and "does not exist — run build_engine.py first" in err and err.count("\n") == 1
    code, _, err = generate(tmp_path, "--prompt", "x", capsys=capsys)
    assert code == 1 and "has no engine.json" in err


def test_tampered_or_unknown_engines_are_refused(tiny_engine, tmp_path, capsys):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest["format_version"] = 99
    (copy / "engine.json").write_text(json.dumps(manifest))
    code, _, err = generate(copy, "--prompt", "x", capsys=capsys)
    assert code == 1 and "format_version 99" in err
    manifest["format_version"] = FORMAT_VERSION
    name = next(iter(manifest["drafter_checkpoint"]["files"]))
    manifest["drafter_checkpoint"]["files"][name]["sha256"] = "0" * 64
    (copy / "engine.json").write_text(json.dumps(manifest))
    code, _, err = generate(copy, "--prompt", "x", capsys=capsys)
    assert code == 1 and "does not match the sha256" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--ref-keys", "16", "--top-k", "32"], "ref_keys must be greater than top_k"),
    (["--slope", "0"], "slope must be > 0"),
    (["--max-log-scale", "-1"], "max_log_scale must be >= 0"),
])
def test_invalid_scaling_values_are_refused(tiny_target, tiny_drafter, tmp_path, capsys, args, message):
    code, _, err = call(build_engine.main, ["--sharpdraft", "--target", str(tiny_target),
                                            "--drafter-checkpoint", str(tiny_drafter),
                                            "--output", str(tmp_path / "e"), *args], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_scaling_flags_need_sharpdraft(tiny_target, tiny_drafter, tmp_path, capsys):
    code, _, err = call(build_engine.main, ["--target", str(tiny_target), "--ref-keys", "4096",
                                            "--drafter-checkpoint", str(tiny_drafter),
                                            "--output", str(tmp_path / "e")], capsys)
    assert code == 2 and "--ref-keys needs --sharpdraft" in err


def test_build_refuses_a_drafter_for_another_target(tmp_path, tiny_drafter, capsys):
    import tiny

    other = tiny.make_target(tmp_path / "other", hidden=48)
    capsys.readouterr()
    code, _, err = call(build_engine.main, ["--target", str(other), "--drafter-checkpoint",
                                            str(tiny_drafter), "--output", str(tmp_path / "e")], capsys)
    # progress lines may come first; the failure itself is one line, last, no traceback
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("error: ") and "hidden_size 32 vs target 48" in last
    assert "Traceback" not in err


def test_a_real_process_exits_nonzero_without_traceback(tmp_path):
    """The same contract seen from outside: exit code and one stderr line."""
    proc = subprocess.run([sys.executable, "-m", "runtime", "generate", "--engine-dir",
                           str(tmp_path), "--prompt", "hi"], capture_output=True, text=True,
                          cwd=build_engine.__file__.rsplit("/", 1)[0])
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_streamed_terminal_text_never_shows_half_a_character(tiny_engine, monkeypatch, capsys):
    # Byte-level tokens can split one character: "é" is the bytes C3 A9, two tokens here.
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.metrics import Generation

    tokenizer = Engine(open_spec(tiny_engine)).tokenizer
    split = tokenizer.convert_tokens_to_ids(["Ã", "©"])  # byte-level symbols of C3 and A9
    ids = tokenizer("caf", add_special_tokens=False).input_ids + split
    assert "\ufffd" in tokenizer.decode(ids[:-1])  # the split really is mid-character

    def fake_generate(self, prompt, max_new_tokens, mode, sampling, stop=True, on_tokens=None,
                      adaptive=True):
        gen = Generation(len(prompt))
        for token in ids:
            gen.tokens.append(token)
            on_tokens([token])
        return gen

    monkeypatch.setattr(Engine, "generate", fake_generate)
    code, out, err = generate(tiny_engine, "--prompt", "x", capsys=capsys)
    assert code == 0, err
    assert out == "café\n"


def test_generate_with_compiled_steps_gives_the_eager_tokens(tiny_engine, capsys):
    """--steps eager (dynamo alone, cheap): the compiled target and drafter steps decode
    the default engine's greedy tokens, speculative and target-only."""
    tokens = {}
    for extra in ([], ["--steps", "eager"], ["--steps", "eager", "--target-only"],
                  ["--steps", "eager", "--device", "cpu", "--dtype", "float32"]):
        code, out, err = generate(tiny_engine, "--prompt", "import os\n", "--max-new-tokens", "20",
                                  "--ignore-eos", "--json", *extra, capsys=capsys)
        assert code == 0, err
        tokens[" ".join(extra)] = json.loads(out)["tokens"]
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--steps", "fast"], "argument --steps: invalid choice: 'fast'"),
    (["--steps", "cudagraph", "--device", "cpu"], "--steps cudagraph captures CUDA graphs"),
])
def test_bad_device_flags_are_one_line(tiny_engine, tmp_path, capsys, command, args, message):
    extra = {"generate": ["--prompt", "x"], "bench": [],
             "serve": ["--model-repository", str(tmp_path / "repo")]}[command]
    code, out, err = call(runtime_main, [command, "--engine-dir", str(tiny_engine), *extra, *args],
                          capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_device_cuda_without_cuda_is_refused_in_one_line(tiny_engine, tmp_path, capsys, command):
    extra = {"generate": ["--prompt", "x"], "bench": [],
             "serve": ["--model-repository", str(tmp_path / "repo")]}[command]
    code, out, err = call(runtime_main, [command, "--engine-dir", str(tiny_engine), *extra,
                                         "--device", "cuda", "--dtype", "bfloat16"], capsys)
    assert code == 2 and err == "error: --device cuda: torch sees no CUDA device here — pass --device cpu\n"
    assert not (tmp_path / "repo").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_speculative_equals_target_only_on_cuda_in_bfloat16(tiny_engine, capsys):
    tokens = {}
    for mode in ([], ["--target-only"]):
        code, out, err = generate(tiny_engine, "--prompt", "import os\n", "--max-new-tokens", "30",
                                  "--ignore-eos", "--json", "--device", "cuda", "--dtype", "bfloat16",
                                  *mode, capsys=capsys)
        assert code == 0, err
        result = json.loads(out)
        tokens[result["mode"]] = result["tokens"]
    assert tokens["sharpdraft"] == tokens["target"]


def test_serve_writes_the_placement_into_the_repository(tiny_engine, tmp_path, capsys):
    code, out, err = call(runtime_main, ["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                                         str(tmp_path / "repo"), "--device", "cpu", "--steps", "eager",
                                         "--json"], capsys)
    assert code == 0, err
    (name,) = json.loads(out)["models"]
    config = (tmp_path / "repo" / name / "config.pbtxt").read_text()
    assert 'key: "device"\n  value: { string_value: "cpu" }' in config
    assert 'key: "steps"\n  value: { string_value: "eager" }' in config
    assert 'key: "dtype"' not in config


def test_steps_on_an_onnxruntime_run_is_refused_in_one_line(tiny_engine, capsys):
    code, out, err = generate(tiny_engine, "--prompt", "x", "--backend", "onnxruntime", "--steps", "eager",
                              capsys=capsys)
    assert code != 0 and err.count("\n") == 1 and err.startswith("error: ")
    assert "runs exported graphs, not compiled torch steps" in err


def test_loadtest_reads_jsonl_prompts_with_newlines_and_names_a_bad_line(tmp_path):
    """A .jsonl prompts file (AIPerf's form, scripts/aiperf_prompts.py) keeps each prompt's
    newlines; a line that is not an object with a "text" string is named, in one line."""
    from pathlib import Path

    from runtime.cli import UsageError
    from runtime.commands.loadtest import read_prompts

    good = tmp_path / "p.jsonl"
    good.write_text('{"text": "def f(x):\\n    return x"}\n\n{"text": "import os"}\n')
    assert read_prompts(good) == ["def f(x):\n    return x", "import os"]
    plain = tmp_path / "p.txt"
    plain.write_text('{"text": "kept as a line"}\nsecond\n')
    assert read_prompts(plain) == ['{"text": "kept as a line"}', "second"]
    for bad, says in (('{"text": 3}', 'expected an object with a "text" string'),
                      ("not json", "not a JSON object")):
        path = tmp_path / "bad.jsonl"
        path.write_text('{"text": "ok"}\n' + bad + "\n")
        with pytest.raises(UsageError, match=f"{Path(path).name}:2: {says}"):
            read_prompts(path)
