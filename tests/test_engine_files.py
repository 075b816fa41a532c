"""An engine directory as a user handles it: calibrated after it was built, copied and
moved with or without the checkout, loaded many times. engine.json names exactly what the
engine reads, portably, and a load verifies it cheaply without missing a changed file."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import build_engine
from runtime import manifest as manifest_module
from build.calibrate import main as calibrate_main
from runtime.__main__ import main as runtime_main
from runtime.cli import run
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError, read_manifest

REPO = Path(__file__).resolve().parent.parent


def build(target, drafter, out, *extra):
    assert build_engine.main(["--sharpdraft", "--backend", "torch", "--target", str(target),
                              "--drafter-checkpoint", str(drafter), "--ref-keys", "64",
                              "--top-k", "8", "--step-costs", "fixed", "--output", str(out),
                              *extra]) == 0
    return out


def generate(engine_dir, capsys):
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_dir), "--prompt", "import os\n",
                              "--max-new-tokens", "5", "--json"])
    out, err = capsys.readouterr()
    return code, err


def test_calibrating_a_checkpoint_keeps_its_engines_usable(tiny_target, tiny_drafter, tmp_path, capsys):
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafter, drafter)
    # as shipped checkpoints do, this one already carries a calibration
    (drafter / "sharpdraft.json").write_text(json.dumps(
        {"query_scaling": {"ref_keys": 96, "top_k": 8, "slope": 5.0, "max_log_scale": 0.5}}))
    earlier = build(tiny_target, drafter, tmp_path / "earlier")
    engine = build(tiny_target, drafter, tmp_path / "engine")
    doc = tmp_path / "doc.txt"
    doc.write_text((REPO / "runtime" / "engine.py").read_text() * 20)
    code = run(calibrate_main, ["--engine-dir", str(engine), "--ref-keys", "32", "128",
                              "--slopes", "2", "--lengths", "150", "--short", "40",
                              "--new-tokens", "4", "--docs", str(doc), "--write-checkpoint"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((drafter / "sharpdraft.json").read_text())["calibration"]
    for engine_dir in (engine, earlier):
        code, err = generate(engine_dir, capsys)
        assert code == 0, err
    recorded = json.loads((engine / "engine.json").read_text())["drafter_checkpoint"]["files"]
    assert sorted(recorded) == ["config.json", "model.safetensors"]


@pytest.mark.slow  # fresh interpreters over a copied checkout: the fast tier keeps a copied
# engine's loads (test_loads_hash_only_what_the_stamp_cannot_vouch_for, engine_copy)
def test_an_engine_works_after_the_checkout_moves_and_when_copied_elsewhere(tiny_target, tiny_drafter,
                                                                             tmp_path):
    # A checkout holding its own target and drafter, as the default ones live in it.
    first = tmp_path / "checkout"
    for name in ("plugins", "runtime", "build"):
        shutil.copytree(REPO / name, first / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "build_engine.py", first)
    shutil.copytree(tiny_target, first / "models" / "target")
    shutil.copytree(tiny_drafter, first / "models" / "drafter")
    env = dict(os.environ, PYTHONPATH="")

    def python(cwd, *args):
        done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    python(first, "build_engine.py", "--sharpdraft", "--backend", "torch", "--target",
           "models/target", "--drafter-checkpoint", "models/drafter", "--step-costs", "fixed",
           "--output", "engines/e")
    recorded = json.loads((first / "engines" / "e" / "engine.json").read_text())
    assert recorded["target"]["path"] == "models/target"
    assert recorded["drafter_checkpoint"]["path"] == "models/drafter"
    moved = tmp_path / "moved"
    first.rename(moved)
    elsewhere = tmp_path / "elsewhere" / "e"
    shutil.copytree(moved / "engines" / "e", elsewhere)
    outputs = [json.loads(python(moved, "-m", "runtime", "generate", "--engine-dir", str(engine_dir),
                                 "--prompt", "def f(x):", "--max-new-tokens", "6", "--json"))
               for engine_dir in (moved / "engines" / "e", elsewhere)]
    assert outputs[0]["tokens"] == outputs[1]["tokens"] and len(outputs[0]["tokens"]) == 6


@pytest.fixture
def engine_copy(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    return copy


def count_hashes(monkeypatch) -> list:
    hashed = []
    real = manifest_module.sha256_file

    def counting(path):
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(manifest_module, "sha256_file", counting)
    return hashed


def age(path: Path, seconds: float = 60) -> None:
    """Backdate a file, as if written a while ago (a fresh file is never stamped: racy)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_loads_hash_only_what_the_stamp_cannot_vouch_for(engine_copy, monkeypatch):
    manifest = read_manifest(engine_copy, verify="skip")
    for path, _ in manifest_module.dependencies(engine_copy, manifest):
        age(path)
    hashed = count_hashes(monkeypatch)
    read_manifest(engine_copy)  # the copy moved every path: everything is hashed once
    assert "model.safetensors" in hashed
    hashed.clear()
    read_manifest(engine_copy)
    assert hashed == []  # stamped: nothing is read again
    read_manifest(engine_copy, verify="full")
    assert len(hashed) == len(manifest_module.dependencies(engine_copy, manifest))


def test_a_changed_file_is_refused_even_at_the_same_size(engine_copy, tmp_path):
    manifest = read_manifest(engine_copy, verify="skip")
    drafter = tmp_path / "drafter-copy"
    shutil.copytree(manifest.drafter_dir, drafter)
    data = json.loads((engine_copy / "engine.json").read_text())
    data["drafter_checkpoint"]["path"] = str(drafter)
    (engine_copy / "engine.json").write_text(json.dumps(data))
    weights = drafter / "model.safetensors"
    age(weights)
    Engine(open_spec(engine_copy))  # hashes and stamps the copy
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(blob))
    with pytest.raises(EngineError, match="model.safetensors does not match the sha256"):
        Engine(open_spec(engine_copy))


def test_generate_verify_flag_hashes_every_file(engine_copy, monkeypatch, capsys):
    read_manifest(engine_copy)
    hashed = count_hashes(monkeypatch)
    code = run(runtime_main, ["generate", "--engine-dir", str(engine_copy), "--prompt", "x",
                              "--max-new-tokens", "2", "--json", "--verify"])
    assert code == 0, capsys.readouterr().err
    assert "model.safetensors" in hashed and "config.json" in hashed
