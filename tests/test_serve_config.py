"""What `python -m runtime serve` writes and decides without a server running: the
model repository's config.pbtxt, the request contract (protocol.py), and the one-line
error when no tritonserver can be found. (TensorRT-LLM's llmapi repository:
tests/test_trtllm_config.py.)"""

import json
import re

import numpy as np
import pytest

from runtime.__main__ import main
from runtime.cli import run
from runtime.serve import protocol, repository, server
from runtime.spec import open_spec
from runtime.streaming import TextStream


def test_repository_holds_a_python_model_per_variant(tiny_engine, tmp_path):
    names = repository.write_repository(open_spec(tiny_engine), tmp_path / "repo", instances=3, streaming=True,
                                        max_new_tokens_limit=77)
    assert names == [tiny_engine.name, tiny_engine.name + "-stream"]
    for name in names:
        model = tmp_path / "repo" / name
        assert (model / "1" / "model.py").read_text() == repository.MODEL_TEMPLATE.read_text()
        config = (model / "config.pbtxt").read_text()
        assert f'name: "{name}"' in config and 'backend: "python"' in config
        assert "count: 3" in config and "kind: KIND_CPU" in config
        # paths relative to the model directory, so a moved or copied checkout serves too
        params = dict(re.findall(r'key: "(\w+)"\n  value: \{ string_value: "([^"]*)" \}', config))
        assert not any(params[k].startswith("/") for k in ("engine_dir", "repo_root"))
        assert (model / params["engine_dir"]).resolve() == tiny_engine.resolve()
        assert (model / params["repo_root"]).resolve() == repository.REPO_ROOT
        assert 'key: "max_new_tokens_limit"\n  value: { string_value: "77" }' in config
        assert ("decoupled: true" in config) == name.endswith("-stream")


def test_both_models_batch_in_flight_with_their_limits(tiny_engine, tmp_path):
    repository.write_repository(open_spec(tiny_engine), tmp_path / "repo", streaming=True, max_batch=5,
                                max_queue=9)
    for name in (tiny_engine.name, tiny_engine.name + "-stream"):
        config = (tmp_path / "repo" / name / "config.pbtxt").read_text()
        assert 'key: "max_batch"\n  value: { string_value: "5" }' in config
        assert 'key: "max_queue"\n  value: { string_value: "9" }' in config
        assert "max_batch_size: 0" in config  # Triton's own batcher stays off: ours batches


def test_config_declares_the_issue_contract(tiny_engine):
    config = repository.config_pbtxt("m", tiny_engine.parent / "repo" / "m", tiny_engine, 1, False, 10)
    declared = {m[0]: (m[1], m[2], bool(m[3])) for m in re.findall(
        r'name: "(\w+)"\n\s+data_type: (TYPE_\w+)\n\s+dims: \[ ([-\d, ]+) \](\n\s+optional: true)?',
        config)}
    assert {k: v[0] for k, v in declared.items()} == {
        "prompt": "TYPE_STRING", "max_new_tokens": "TYPE_INT32", "temperature": "TYPE_FP32",
        "top_p": "TYPE_FP32", "seed": "TYPE_INT64", "sharpdraft": "TYPE_BOOL", "mode": "TYPE_STRING",
        "text": "TYPE_STRING", "token_ids": "TYPE_INT64", "mean_accepted_length": "TYPE_FP32",
        "verify_steps": "TYPE_INT32", "beta": "TYPE_FP32", "finish_reason": "TYPE_STRING",
        "speculation": "TYPE_STRING", "prompt_tokens": "TYPE_INT32",
        # vLLM's extensions (issue 64) and the log-probabilities they ask for
        "top_k": "TYPE_INT32", "min_p": "TYPE_FP64", "repetition_penalty": "TYPE_FP64",
        "presence_penalty": "TYPE_FP64", "frequency_penalty": "TYPE_FP64", "min_tokens": "TYPE_INT32",
        "ignore_eos": "TYPE_BOOL", "logprobs": "TYPE_INT32", "prompt_logprobs": "TYPE_BOOL",
        "logprob_entries": "TYPE_STRING", "prompt_logprob_entries": "TYPE_STRING"}
    optional = {k for k, v in declared.items() if v[2]}
    assert optional == {"temperature", "top_p", "seed", "sharpdraft", "mode", "top_k", "min_p",
                        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                        "ignore_eos", "logprobs", "prompt_logprobs"}
    assert declared["token_ids"][1] == "-1"


def test_model_is_named_after_the_engine_unless_told(tiny_engine, tmp_path):
    assert repository.model_name(tiny_engine, None) == tiny_engine.name
    assert repository.write_repository(open_spec(tiny_engine), tmp_path, name="sd") == ["sd"]
    with pytest.raises(ValueError, match="--model-name"):
        repository.model_name(tiny_engine, "has space")


def test_a_directory_that_is_not_an_engine_is_refused(tmp_path, capsys):
    code = run(main, ["serve", "--engine-dir", str(tmp_path), "--model-repository",
                      str(tmp_path / "repo")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "engine.json" in err
    assert len(err.strip().splitlines()) == 1


def _arrays(**values):
    base = {"prompt": np.array([b"def f():"], dtype=object),
            "max_new_tokens": np.array([4], dtype=np.int32)}
    return base | {k: None if v is None else np.asarray(v) for k, v in values.items()}


@pytest.mark.parametrize("values, message", [
    ({"prompt": np.array([b"   "], dtype=object)}, "prompt is empty"),
    ({"prompt": np.array([b"\xff\xfe"], dtype=object)}, "not valid UTF-8"),
    ({"max_new_tokens": np.array([0], dtype=np.int32)}, "max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": np.array([10**9], dtype=np.int32)}, "exceeds this server's limit of 100"),
    ({"temperature": np.array([-1.0], dtype=np.float32)}, "temperature"),
    ({"top_p": np.array([0.0], dtype=np.float32)}, "top_p"),
    ({"temperature": np.array([np.nan], dtype=np.float32)}, "finite"),
    ({"top_p": np.array([0.5, 0.5], dtype=np.float32)}, "exactly one value"),
    ({"max_new_tokens": None}, "'max_new_tokens' is required"),
])
def test_bad_requests_are_refused_with_the_reason(values, message):
    with pytest.raises(protocol.RequestError, match=re.escape(message)):
        protocol.parse(_arrays(**values), max_new_tokens_limit=100)


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(protocol.RequestError, match="'colour'"):
        protocol.parse(_arrays(), parameters={"colour": "red"})


def test_defaults_match_the_generate_command(tiny_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(tiny_engine))
    req = protocol.parse(_arrays(temperature=None, seed=None))
    assert (req.temperature, req.top_p, req.seed, req.sharpdraft) == (0.0, 1.0, None, None)
    # the test engines record no measured default (fixed step costs): the table's rule
    assert req.mode(engine) == engine.spec.rule_default() == "sharpdraft"
    off = protocol.parse(_arrays(sharpdraft=np.array([False])))
    assert off.mode(engine) == "frozen"


def test_a_request_runs_the_mode_it_names_among_the_engines(tiny_engine):
    from runtime.engine import Engine
    from runtime.spec import open_spec

    engine = Engine(open_spec(tiny_engine))
    for name in ("target", "ngram", "frozen", "sharpdraft", "hybrid", "frozen-hybrid"):
        assert protocol.parse(_arrays(mode=np.array([name.encode()], dtype=object))).mode(engine) == name
    # named in the table, but not a mode this engine serves: refused, naming the ones it does
    for name, why in (("window", "no draft window"), ("preset", "a study")):
        req = protocol.parse(_arrays(mode=np.array([name.encode()], dtype=object)))
        with pytest.raises(protocol.RequestError) as refused:
            req.mode(engine)
        message = str(refused.value)
        assert why in message and "it runs target, ngram, frozen, sharpdraft, hybrid, frozen-hybrid" in message


@pytest.mark.parametrize("values, message", [
    ({"mode": np.array([b"fast"], dtype=object)}, "no decoding mode 'fast' (modes: target, ngram"),
    ({"mode": np.array([b"hybrid"], dtype=object), "sharpdraft": np.array([True])},
     "send mode or sharpdraft, not both"),
    ({"mode": np.array([b"\xff"], dtype=object)}, "mode is not valid UTF-8"),
])
def test_a_bad_mode_is_refused_before_any_engine_work(values, message):
    with pytest.raises(protocol.RequestError, match=re.escape(message)):
        protocol.parse(_arrays(**values))


def test_streamed_text_concatenates_to_the_whole_decode():
    # A byte-level tokenizer can split one character over two tokens: "é" is 2 bytes.
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" ok"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    deltas = [stream.push([1]), stream.push([2]), stream.push([3, 4])]
    assert deltas == ["caf", "", "é ok"]  # the half character is held back, not sent as U+FFFD
    assert "".join(deltas) + stream.flush() == decode([1, 2, 3, 4])


def test_missing_tritonserver_is_a_one_line_error(tiny_engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no tritonserver on PATH
    monkeypatch.setattr(server, "WHEEL", tmp_path / "no-wheel")
    code = run(main, ["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                      str(tmp_path / "repo"), "--start"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: no tritonserver found") and "make setup" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "repo").exists()  # refused before writing anything


def test_explicit_tritonserver_must_exist(tiny_engine, tmp_path, capsys):
    code = run(main, ["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                      str(tmp_path / "repo"), "--start", "--tritonserver", str(tmp_path / "nope")])
    assert code == 1 and "--tritonserver" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--http-port", "8000", "--grpc-port", "8000"], "must differ"),
    (["--http-port", "70000"], "1..65535"),
    (["--instances", "0"], "--instances"),
    (["--max-new-tokens-limit", "0"], "--max-new-tokens-limit"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--openai-port", "9000"], "add --start"),
    (["--openai-port", "8001", "--start"], "differ from the Triton ports"),
])
def test_bad_serve_flags_are_usage_errors(tiny_engine, tmp_path, capsys, flags, message):
    code = run(main, ["serve", "--engine-dir", str(tiny_engine), "--model-repository",
                      str(tmp_path / "repo")] + flags)
    assert code == 2 and message in capsys.readouterr().err


def test_the_stub_environment_puts_numpy1_and_this_checkout_first(tmp_path):
    install = server.Installation(binary=tmp_path / "tritonserver", backends=tmp_path / "be",
                                  kind="system", stub_site=tmp_path / "stub-site")
    backends, env = server.prepare_workspace(install, tmp_path / "ws")
    assert backends == tmp_path / "be"
    prefix = tmp_path / "ws" / "stub-env"
    assert env["PATH"].split(":")[0] == str(prefix / "bin")
    assert (prefix / "bin" / "python3").is_symlink() and (prefix / "pyvenv.cfg").is_file()
    pth = next(prefix.glob("lib/python3.*/site-packages/sharpdraft.pth")).read_text().splitlines()
    assert pth[:2] == [str(tmp_path / "stub-site"), str(repository.REPO_ROOT)]


def test_internal_errors_reach_the_client_as_an_id_not_internals():
    try:
        open("/nonexistent/secret/path/model.bin")
    except OSError as exc:
        reply, log = protocol.internal_error(exc)
    incident = re.search(r"id ([0-9a-f]{12})", reply).group(1)
    assert "secret" not in reply and "FileNotFoundError" not in reply and "\n" not in reply
    assert f"id {incident}" in log and "/nonexistent/secret/path/model.bin" in log
    assert "Traceback" in log
