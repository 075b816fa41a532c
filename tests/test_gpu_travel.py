"""scripts/gpu_travel.py on a throwaway git repository: what a device call would carry,
slim/restore leaving the index as it was, and the target's wheels split into parts that
fit beside the tree and joined back byte for byte (the GPU machine's side, run here)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import gpu_travel


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "checkpoints" / "pard").mkdir(parents=True)
    (root / "checkpoints" / "dflash").mkdir(parents=True)
    (root / "checkpoints" / "pard" / "model.safetensors").write_bytes(b"p" * 300_000)
    (root / "checkpoints" / "dflash" / "model.safetensors").write_bytes(b"d" * 100_000)
    (root / "code.py").write_text("print('hi')\n")
    (root / ".gitignore").write_text("/built/\n")
    git(tmp_path, "init", "-q", str(root))
    git(root, "add", "-A")
    git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    (root / "built").mkdir()
    (root / "built" / "big.bin").write_bytes(b"x" * 500_000)  # ignored: never travels
    (root / "notes.txt").write_text("untracked, not ignored: travels\n")
    return root


def test_what_travels_is_tracked_untracked_unignored_and_carried(repo):
    sizes = gpu_travel.travelling(repo)
    assert sizes["checkpoints/pard/model.safetensors"] == 300_000
    assert "notes.txt" in sizes and "built/big.bin" not in sizes
    assert gpu_travel.travelling(repo, ["built"])["built/big.bin"] == 500_000
    with pytest.raises(gpu_travel.TravelError, match="does not exist"):
        gpu_travel.travelling(repo, ["nothing-here"])


def test_slim_leaves_the_heavy_checkpoint_behind_and_restore_undoes_it_exactly(repo, monkeypatch):
    before = git(repo, "status", "--porcelain")
    exclude_before = (repo / ".git" / "info" / "exclude").read_text()
    assert gpu_travel.slim(repo, ("checkpoints/pard", "checkpoints/absent")) == ["checkpoints/pard"]
    sizes = gpu_travel.travelling(repo)
    assert "checkpoints/pard/model.safetensors" not in sizes
    assert "checkpoints/dflash/model.safetensors" in sizes
    assert (repo / "checkpoints" / "pard" / "model.safetensors").is_file()  # still on disk
    with pytest.raises(gpu_travel.TravelError, match="restore first"):
        gpu_travel.slim(repo, ("checkpoints/pard",))
    assert gpu_travel.restore(repo) == ["checkpoints/pard"]
    assert git(repo, "status", "--porcelain") == before
    assert (repo / ".git" / "info" / "exclude").read_text() == exclude_before
    with pytest.raises(gpu_travel.TravelError, match="nothing to restore"):
        gpu_travel.restore(repo)


def test_size_fails_when_over_the_limit(repo, monkeypatch, capsys):
    assert gpu_travel.size(repo) == 0
    monkeypatch.setattr(gpu_travel, "LIMIT", 200_000)
    assert gpu_travel.size(repo) == 1
    assert "is OVER" in capsys.readouterr().out


def test_wheels_split_to_fit_beside_the_tree_and_join_back_checked(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_travel, "LIMIT", 6 * 2**20)
    monkeypatch.setattr(gpu_travel, "HEADROOM", 0)
    payload = {"big-0.1-py3-none-any.whl": bytes(range(256)) * 40_000,  # 10.2 MB
               "small-0.2-py3-none-any.whl": b"s" * 1000}

    def download(specs, into):
        assert specs == ["big==0.1", "small==0.2"]
        for name, data in payload.items():
            (into / name).write_bytes(data)

    shutil.rmtree(repo / ".git" / "info")  # CI's clone had none: pack must make it
    manifest, room = gpu_travel.pack(repo, ("big==0.1", "small==0.2"), download)
    tree = sum(gpu_travel.travelling(repo).values())
    assert room == gpu_travel.LIMIT - tree  # .gpu/ is ignored: it never counts itself
    assert "/.gpu/" in (repo / ".git" / "info" / "exclude").read_text()
    calls = [{"carry": carry} for carry in gpu_travel.loads(manifest, room)]
    big = len(payload["big-0.1-py3-none-any.whl"])
    assert len(manifest["files"][0]["parts"]) == -(-big // room) == 2  # 9.8 MiB, < 6 MiB a part
    assert len(calls) == 2  # the small wheel and the manifest ride along
    for call in calls:  # each call's tree + carried parts fits
        assert sum(gpu_travel.travelling(repo, call["carry"]).values()) <= gpu_travel.LIMIT
    # the GPU machine's side: every part moved to one folder, joined, each sha256 checked
    device = tmp_path / "device" / "parts"
    device.mkdir(parents=True)
    for call in calls:
        for path in call["carry"]:
            (repo / path).rename(device / Path(path).name)
    joined = gpu_travel.join(device, tmp_path / "device" / "wheels")
    assert {p.name: p.read_bytes() for p in joined} == payload
    part = next(device.glob("big-*.whl.1"))
    part.write_bytes(b"damaged")
    with pytest.raises(gpu_travel.TravelError, match="damaged"):
        gpu_travel.join(device, tmp_path / "again")
    part.unlink()
    with pytest.raises(gpu_travel.TravelError, match="carry every part"):
        gpu_travel.join(device, tmp_path / "again")
    assert json.loads((device / "manifest.json").read_text())["files"][0]["bytes"] == big


def test_pack_refuses_when_the_tree_leaves_no_room(repo, monkeypatch):
    monkeypatch.setattr(gpu_travel, "LIMIT", 500_000)
    with pytest.raises(gpu_travel.TravelError, match="leaves"):
        gpu_travel.pack(repo, ("x==1",), lambda specs, into: None)


def test_unpack_before_the_first_part_arrived_says_so(tmp_path):
    (tmp_path / "parts").mkdir()
    with pytest.raises(gpu_travel.TravelError, match="no manifest.json"):
        gpu_travel.join(tmp_path / "parts", tmp_path / "wheels")


def wheel(name: str, version: str, module: str) -> dict[str, bytes]:
    """A minimal pure-Python wheel, {file name: bytes}, that pip installs."""
    import base64
    import hashlib
    import io
    import zipfile

    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {f"{module}.py": b"VALUE = 7\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def row(path, data):
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}"

    record = "\n".join([row(p, d) for p, d in files.items()] + [f"{info}/RECORD,,"]) + "\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for path, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return {f"{stem}-py3-none-any.whl": buffer.getvalue()}


@pytest.mark.slow  # the fast tier: test_wheels_split_to_fit_beside_the_tree_and_join_back_checked
# and test_the_refusal_drill_takes_the_parts_away_once_and_puts_them_back
def test_carried_parts_wait_in_the_travel_folder_and_gpu_target_installs_them(repo, tmp_path, monkeypatch):
    """Each call copies the parts it carried to the travel folder (which outlives a call on
    a warm machine); the last call's gpu_target joins them, every sha256 checked, installs
    the wheel under the travel folder's site/ and converts with that folder on the path.
    With a part gone (the machine went cold between calls) it is "not run", naming the
    part: a failure of the section."""
    from scripts import gpu_check, gpu_target

    monkeypatch.setattr(gpu_travel, "LIMIT", 6 * 2**20)
    monkeypatch.setattr(gpu_travel, "HEADROOM", 0)
    payload = wheel("probe-wheel", "0.1", "probe_module")

    def download(specs, into):
        for name, data in payload.items():
            (into / name).write_bytes(data)

    gpu_travel.pack(repo, ("probe-wheel==0.1",), download)
    travel = tmp_path / "travel"
    monkeypatch.setenv("SHARPDRAFT_TRAVEL_DIR", str(travel))
    assert sorted(gpu_check.stash_parts(repo)) == sorted(p.name for p in (repo / ".gpu" / "parts").iterdir())
    # the conversion's own process must find the installed wheel on its path
    monkeypatch.setattr(gpu_target, "CONVERT", "import probe_module; print('/converted', probe_module.VALUE)")
    data = gpu_target.run(tmp_path / "out", on_cpu=True)
    assert data["status"] == "passed", data
    assert (travel / "site" / "probe_module.py").is_file()
    assert data["parts"]["convert"]["target_dir"] == "/converted 7"
    next(travel.glob("parts/probe_wheel-*.whl.0")).unlink()
    data = gpu_target.run(tmp_path / "out", on_cpu=True)
    assert data["status"] == "not run" and "carry every part" in data["parts"]["join_and_install"]["reason"]
    assert json.loads((tmp_path / "out" / "gpu_target.json").read_text())["passed"] is False


CALL_1 = """set -e
test "$PWD" != "$REPO"
test -f code.py && test -f notes.txt && test -f built/big.bin && test -f checkpoints/dflash/model.safetensors
test ! -e checkpoints/pard
test -z "$(ls -A "$OUT")"
python3 -c "import numpy" && ! python3 -c "import gguf" 2>/dev/null
mkdir -p "$SHARPDRAFT_TRAVEL_DIR" && echo kept > "$SHARPDRAFT_TRAVEL_DIR/state"
echo '{"sections": {}}' > "$OUT/gpu_check.json"; echo log > "$OUT/gpu_check.log"
"""
CALL_2 = """set -e
test ! -e built/big.bin
test "$(cat "$SHARPDRAFT_TRAVEL_DIR/state")" = kept
test -z "$(ls -A "$OUT")"
echo '{"sections": {}}' > "$OUT/gpu_check.json"; echo log > "$OUT/gpu_check.log"
"""


def test_the_rehearsal_runs_each_calls_command_in_the_tree_it_carries(repo, tmp_path, monkeypatch):
    """Each call's tree is made afresh outside the checkout: the tracked files less the
    slimmed checkpoints, the untracked files git does not ignore, that call's carried
    paths and nothing else; its command runs there under the stand-in python3 (the
    carried wheels' packages hidden, as on the GPU machine), OUT a fresh folder; state
    passes only through the travel folder."""
    monkeypatch.setattr(gpu_travel, "HEAVY", ("checkpoints/pard",))
    monkeypatch.setenv("REPO", str(repo))
    calls = [dict(call=1, command=CALL_1, carry=["built"], sections=[], timeout_s=60),
             dict(call=2, command=CALL_2, carry=[], sections=[], timeout_s=60)]
    lines = []
    assert gpu_travel.rehearse(tmp_path / "r", repo, echo=lines.append, calls=calls) == 0, lines
    assert lines[-1] == ("rehearsal: 2 calls, estimated GPU machine time 155 s, files back 4, limits ok")
    summary = json.loads((tmp_path / "r" / "rehearsal.json").read_text())
    assert summary["verdict"] == lines[-1] and summary["estimate"]["machine"]["seconds"] == 155
    assert not (repo / "state").exists()


def test_the_rehearsal_names_the_first_broken_limit_and_exits_1(repo, tmp_path):
    """A call whose command leaves nine files under $OUT (the tool returns eight) and no
    summary: the rehearsal's last line names it, exit 1."""
    calls = [dict(call=1, command='for i in 1 2 3 4 5 6 7 8 9; do echo {} > "$OUT/f$i.json"; done',
                  carry=[], sections=[], timeout_s=30)]
    lines = []
    assert gpu_travel.rehearse(tmp_path, repo, echo=lines.append, calls=calls) == 1
    assert lines[-1] == ("rehearsal: 1 calls, estimated GPU machine time 130 s, files back 9, "
                         "broken: call 1: 9 files (at most 8 come back)")
    assert "broken: call 1 left no gpu_check.json" in lines


def test_the_refusal_drill_takes_the_parts_away_once_and_puts_them_back(tmp_path):
    travel = tmp_path / "travel"
    (travel / "parts").mkdir(parents=True)
    (travel / "parts" / "p.0").write_bytes(b"x")
    tree = tmp_path / "tree"
    tree.mkdir()
    command = ('test -f "$SHARPDRAFT_TRAVEL_DIR/parts/p.0" || { echo "error: call 3 needs p.0" >&2; exit 1; }; '
               'echo ran')
    env = {"PATH": "/usr/bin:/bin", "SHARPDRAFT_TRAVEL_DIR": str(travel)}
    drill = gpu_travel.refusal_drill(command, tree, tmp_path / "out", env, travel)
    assert drill["ok"] and drill["exit"] == 1 and drill["output"] == ["error: call 3 needs p.0"]
    assert (travel / "parts" / "p.0").read_bytes() == b"x"  # back for the real call
    drill = gpu_travel.refusal_drill("echo one; echo two; exit 1", tree, tmp_path / "out", env, travel)
    assert not drill["ok"]  # two lines, no error: not a refusal
