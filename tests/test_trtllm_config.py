"""`--backend trtllm` engines: what build_engine.py writes (engine.json + the LLM-API
config), the Triton llmapi repository `serve --backend trtllm` writes, the trtllm-serve
wrapper's plan, and one-line refusals where TensorRT-LLM (absent here) would be needed.
Every emitted field name must be in the pinned lists (plugins/trtllm/pins.py)."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import build_engine
from plugins.trtllm import installed, pins, uninstall
from runtime.__main__ import main as runtime_main
from runtime.cli import run

SHARP = ["--sharpdraft", "--ref-keys", "64", "--top-k", "8"]


def build(*argv) -> int:
    return run(build_engine.main, list(argv))


def assert_pinned_fields(config: dict, triton: bool = False):
    allowed = set(pins.LLM_API_FIELDS) | ({"triton_config"} if triton else set())
    assert set(config) <= allowed
    spec = config["speculative_config"]
    family = {t: f for f, t in pins.DECODING_TYPES.items()}[spec["decoding_type"]]
    assert set(spec) <= set(pins.SPECULATIVE_FIELDS[family])
    if triton:
        assert set(config["triton_config"]) <= set(pins.TRITON_CONFIG_FIELDS)


@pytest.fixture(scope="module")
def dflash_engine(tmp_path_factory, tiny_target, tiny_drafter):
    out = tmp_path_factory.mktemp("trtllm") / "dflash-trtllm"
    assert build("--drafter", "dflash", *SHARP, "--backend", "trtllm", "--target", str(tiny_target),
                 "--drafter-checkpoint", str(tiny_drafter), "--output", str(out)) == 0
    return out


def test_dflash_trtllm_engine_holds_manifest_and_an_llm_api_config_of_pinned_fields(dflash_engine, tiny_drafter):
    manifest = json.loads((dflash_engine / "engine.json").read_text())
    assert manifest["backend"] == "trtllm" and manifest["drafter"] == "dflash"
    assert manifest["query_scaling"]["ref_keys"] == 64 and manifest["drafter_checkpoint"]["files"]
    config = yaml.safe_load((dflash_engine / "llm_api.yaml").read_text())
    assert_pinned_fields(config)
    drafter = json.loads((tiny_drafter / "config.json").read_text())
    assert config["backend"] == "pytorch"
    assert config["speculative_config"] == {
        "decoding_type": "DFlash", "max_draft_len": drafter["block_size"] - 1,
        "speculative_model": str((dflash_engine / "drafter").resolve()),  # the SharpDraft drafter directory
        "mask_token_id": drafter["dflash_config"]["mask_token_id"],
        "target_layer_ids": drafter["dflash_config"]["target_layer_ids"], "attention_backend": "VANILLA"}
    assert "llm_api.yaml" in manifest["artifacts"]
    carried = json.loads((dflash_engine / "drafter" / "config.json").read_text())
    assert carried == drafter | {"sharpdraft": manifest["query_scaling"]}  # the checkpoint's config + ours
    assert Path(manifest["extra"]["trtllm"]["stock_drafter"]).resolve() == tiny_drafter.resolve()


def fake_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


@pytest.mark.parametrize("family,decoding_type", [("eagle3", "Eagle3"), ("pard", "PARD")])
def test_eagle3_and_pard_trtllm_engines_point_at_the_given_checkpoint(tmp_path, tiny_target, family, decoding_type):
    ckpt = fake_checkpoint(tmp_path / f"{family}-ckpt")
    out = tmp_path / family
    assert build("--drafter", family, "--sharpdraft", "--backend", "trtllm", "--target", str(tiny_target),
                 "--drafter-checkpoint", str(ckpt), "--num-draft-tokens", "5", "--output", str(out)) == 0
    config = yaml.safe_load((out / "llm_api.yaml").read_text())
    assert_pinned_fields(config)
    assert config["speculative_config"] == {"decoding_type": decoding_type, "max_draft_len": 5,
                                            "speculative_model": str((out / "drafter").resolve())}
    weights = out / "drafter" / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (ckpt / "model.safetensors").resolve()
    assert "sharpdraft" not in json.loads((ckpt / "config.json").read_text())  # the checkpoint is untouched
    manifest = json.loads((out / "engine.json").read_text())
    preset = {"eagle3": 2048, "pard": 8192}[family]
    assert manifest["query_scaling"]["ref_keys"] == preset
    assert set(manifest["drafter_checkpoint"]["files"]) == {"config.json", "model.safetensors"}


def test_eagle3_without_a_checkpoint_is_refused_in_one_line(tmp_path, tiny_target, capsys, monkeypatch):
    """Without the default EAGLE-3 checkpoint both backends name the recipe that trains it."""
    from build import checkpoints

    monkeypatch.setitem(checkpoints.DEFAULT_DRAFTERS, "eagle3", tmp_path / "no-eagle3")
    assert build("--drafter", "eagle3", "--backend", "torch", "--target", str(tiny_target),
                 "--output", str(tmp_path / "t")) == 1
    assert build("--drafter", "eagle3", "--backend", "trtllm", "--target", str(tiny_target),
                 "--output", str(tmp_path / "x")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in lines if line.startswith("error: ")]
    assert len(lines) == 2 and all("python -m build.train_eagle3" in line for line in lines)


def test_generate_on_a_trtllm_engine_says_in_one_line_what_is_missing(dflash_engine, capsys):
    code = run(runtime_main, ["generate", "--engine-dir", str(dflash_engine), "--prompt", "def f():"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("error: TensorRT-LLM is not installed here") and pins.PINNED in err[0]
    uninstall()


@pytest.mark.parametrize("flag", ["--window", "--hybrid", "--ngram"])
def test_generate_on_a_trtllm_engine_refuses_our_own_loops_flags(dflash_engine, capsys, flag):
    # TensorRT-LLM runs its own loop: a flag only ours honours must not be silently dropped
    code = run(runtime_main, ["generate", "--engine-dir", str(dflash_engine), "--prompt", "def f():",
                              flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "runs in TensorRT-LLM: drop" in err[0]


def test_trtllm_serve_wrapper_plans_config_and_environment(dflash_engine, capsys, monkeypatch, tmp_path):
    from plugins.trtllm import autoload

    monkeypatch.delenv(pins.SINGLE_PROCESS_ENV, raising=False)
    monkeypatch.setattr(autoload, "find_site", lambda: None)
    code = run(runtime_main, ["trtllm-serve", "--engine-dir", str(dflash_engine), "--dry-run", "--", "--port", "9"])
    assert code == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    # one GPU, no autoloader: the executor is kept in this process, and the line says why
    assert err.count("\n") == 1 and pins.SINGLE_PROCESS_ENV in err and "no autoloader" in err
    assert plan["command"].startswith("trtllm-serve ") and "--config" in plan["command"]
    assert plan["command"].endswith("--port 9")
    config = plan["config"] | {"model": "x"}
    assert_pinned_fields(config)
    assert plan["sharpdraft"]["ref_keys"] == 64 and plan["world"] == 1
    assert plan["env"] == {pins.SINGLE_PROCESS_ENV: "1"}  # no variable of ours: workers need none
    monkeypatch.setattr(autoload, "find_site", lambda: tmp_path)  # with the autoloader: not forced, nothing said
    assert run(runtime_main, ["trtllm-serve", "--engine-dir", str(dflash_engine), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["env"] == {} and err == ""
    assert run(runtime_main, ["trtllm-serve", "--engine-dir", str(dflash_engine)]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0


def serve_plan(engine, capsys, *serve_args):
    code = run(runtime_main, ["trtllm-serve", "--engine-dir", str(engine), "--dry-run", "--", *serve_args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err.strip().splitlines()


PARALLEL = [(["--tp_size", "2"], "tensor_parallel_size"), (["--tp_size=2"], "tensor_parallel_size"),
            (["--tensor_parallel_size", "2"], "tensor_parallel_size"),
            (["--tensor_parallel_size=2"], "tensor_parallel_size"), (["--pp_size", "2"], "pipeline_parallel_size"),
            (["--pipeline_parallel_size=2"], "pipeline_parallel_size")]


@pytest.mark.parametrize("flags,field", PARALLEL)
def test_trtllm_serve_every_parallel_alias_needs_the_autoloader_and_lands_in_the_config(
        dflash_engine, capsys, monkeypatch, tmp_path, flags, field):
    from plugins.trtllm import autoload

    monkeypatch.setattr(autoload, "find_site", lambda: None)
    code, _, err = serve_plan(dflash_engine, capsys, *flags)
    assert code == 2 and len(err) == 1 and "autoload install" in err[0]
    monkeypatch.setattr(autoload, "find_site", lambda: tmp_path)  # the autoloader is installed
    code, plan, _ = serve_plan(dflash_engine, capsys, *flags, "--port", "9")
    # trtllm-serve lets the config file win over its command line: the size must be in the file
    assert code == 0 and plan["config"][field] == 2 and plan["world"] == 2
    assert pins.SINGLE_PROCESS_ENV not in plan["env"]


def test_trtllm_serve_one_gpu_written_either_way_is_served(dflash_engine, capsys, monkeypatch):
    from plugins.trtllm import autoload

    monkeypatch.setattr(autoload, "find_site", lambda: None)
    for flags in (["--tp_size", "1"], ["--tp_size=1"], ["--pp_size", "1", "--tp_size", "1"]):
        code, plan, err = serve_plan(dflash_engine, capsys, *flags)
        assert code == 0 and plan["world"] == 1, err


@pytest.mark.parametrize("flags", [["--cp_size", "2"], ["--context_parallel_size=2"]])
def test_trtllm_serve_context_parallelism_is_refused_in_one_line(dflash_engine, capsys, monkeypatch, tmp_path,
                                                                  flags):
    from plugins.trtllm import autoload

    monkeypatch.setattr(autoload, "find_site", lambda: tmp_path)
    code, _, err = serve_plan(dflash_engine, capsys, *flags)
    assert code == 2 and len(err) == 1 and "context parallelism" in err[0]


def test_trtllm_serve_reads_the_engines_own_sizes(dflash_engine, capsys, monkeypatch, tmp_path):
    import shutil

    from plugins.trtllm import autoload

    engine = tmp_path / "tp2"
    shutil.copytree(dflash_engine, engine)
    manifest = json.loads((engine / "engine.json").read_text())
    manifest["extra"]["trtllm"]["tensor_parallel_size"] = 2
    (engine / "engine.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(autoload, "find_site", lambda: None)
    code, _, err = serve_plan(engine, capsys)
    assert code == 2 and len(err) == 1 and "tp=2" in err[0]


@pytest.mark.parametrize("flags,words", [(["--config", "x.yaml"], "written by this command"),
                                         (["--extra_llm_api_options=x.yaml"], "written by this command"),
                                         (["--tp_size"], "needs a value"), (["--tp_size=two"], "positive integer"),
                                         (["--pp_size", "0"], "positive integer")])
def test_trtllm_serve_bad_options_are_refused_in_one_line(dflash_engine, capsys, flags, words):
    code, _, err = serve_plan(dflash_engine, capsys, *flags)
    assert code == 2 and len(err) == 1 and words in err[0]


def test_generate_refuses_inexact_configurations_before_tensorrt_llm(tmp_path, dflash_engine):
    from plugins.trtllm import launch as trtllm
    from plugins.trtllm.launch import LaunchError as UsageError

    for config in ({"sparse_attention_config": {"algorithm": "rocket"}},
                   {"kv_cache_config": {"max_attention_window": [4096]}}, {"context_parallel_size": 2}):
        with pytest.raises(UsageError) as exc:
            trtllm.refuse_inexact(config, "dflash")
        assert "\n" not in str(exc.value)
    drafter = tmp_path / "eagle"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"sliding_window": 4096}))  # Mistral-style: used
    with pytest.raises(UsageError):
        trtllm.refuse_inexact({}, "eagle3", drafter)
    (drafter / "config.json").write_text(json.dumps({"sliding_window": 4096, "use_sliding_window": False}))
    trtllm.refuse_inexact({}, "eagle3", drafter)  # Qwen2-style: present but unused
    trtllm.refuse_inexact({}, "dflash", drafter)


def test_use_dynamic_tree_without_its_top_k_is_refused():
    from plugins.trtllm import config as trtllm

    spec = {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "x"}
    with pytest.raises(trtllm.ConfigFieldError):
        trtllm.check_fields({"model": "m", "speculative_config": spec | {"use_dynamic_tree": True}})
    trtllm.check_fields({"model": "m", "speculative_config": spec | {"use_dynamic_tree": True,
                                                                       "dynamic_tree_max_topK": 4}})


def stock_llmapi(root: Path) -> Path:
    """A stand-in for TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm."""
    (root / "1").mkdir(parents=True)
    (root / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    (root / "1" / "helpers.py").write_text("ANSWER = 42\n")
    (root / "1" / "model.py").write_text(textwrap.dedent("""
        from helpers import ANSWER  # the stock model imports helpers from beside itself

        CALLS = []

        class TritonPythonModel:
            def initialize(self, args):
                CALLS.append(args)
                return ANSWER
        """))
    return root


def test_serve_backend_trtllm_writes_the_llmapi_layout_whose_model_installs_the_hook_first(
        dflash_engine, tmp_path, capsys):
    repo = tmp_path / "repo"
    stock = stock_llmapi(tmp_path / "stock")
    code = run(runtime_main, ["serve", "--engine-dir", str(dflash_engine), "--model-repository", str(repo),
                              "--llmapi-model", str(stock), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["models"] == ["tensorrt_llm"]
    model = repo / "tensorrt_llm"
    assert sorted(p.name for p in model.iterdir()) == ["1", "config.pbtxt"]
    assert {"model.py", "model.yaml", "sharpdraft.json", "llmapi"} <= {p.name for p in (model / "1").iterdir()}
    model_yaml = yaml.safe_load((model / "1" / "model.yaml").read_text())
    assert_pinned_fields(model_yaml, triton=True)
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert model_yaml["speculative_config"]["decoding_type"] == "DFlash"

    path_before = list(sys.path)
    spec = importlib.util.spec_from_file_location("generated_trtllm_model", model / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        stock_module = sys.modules["sharpdraft_llmapi_stock"]
        assert module.TritonPythonModel.__mro__[1] is stock_module.TritonPythonModel
        assert not installed()  # importing the model changes nothing; initialize() launches
        assert sys.path == path_before  # nothing of ours on anyone's sys.path
        # No TensorRT-LLM here: SharpDraft's launch refuses in one line before the stock
        # initialize() would import it (tests/test_trtllm_workers.py drives both outcomes
        # against a stand-in TensorRT-LLM whose worker builds the drafter).
        with pytest.raises(ValueError) as exc:  # the private package's LaunchError
            module.TritonPythonModel().initialize({})
        assert type(exc.value).__name__ == "LaunchError"
        assert "version" in str(exc.value) and "\n" not in str(exc.value)
        assert stock_module.CALLS == []
        # the drafter family comes from serve's spec in sharpdraft.json (the model process
        # reads no engine.json); a repository without it is refused in one line
        assert json.loads((model / "1" / "sharpdraft.json").read_text())["drafter"] == "dflash"
        module.SETTINGS.pop("drafter")
        with pytest.raises(ValueError, match="names no drafter family — regenerate") as exc:
            module.TritonPythonModel().initialize({})
        assert "\n" not in str(exc.value) and stock_module.CALLS == []
    finally:
        uninstall()
        for name in [n for n in sys.modules if n in ("sharpdraft_llmapi_stock", "helpers")
                     or n.startswith("_sharpdraft_plugins")]:
            sys.modules.pop(name)
        sys.path[:] = path_before
    assert not installed()


def test_serve_backend_trtllm_without_the_stock_model_writes_core_tensors_and_refuses_start(
        dflash_engine, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert run(runtime_main, ["serve", "--engine-dir", str(dflash_engine), "--model-repository",
                              str(repo)]) == 0
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'name: "tensorrt_llm"' in config and '"text_input"' in config and '"text_output"' in config
    capsys.readouterr()
    assert run(runtime_main, ["serve", "--engine-dir", str(dflash_engine), "--model-repository",
                              str(repo), "--start"]) == 2
    assert run(runtime_main, ["serve", "--engine-dir", str(dflash_engine), "--model-repository",
                              str(repo), "--backend", "torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
