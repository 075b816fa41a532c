"""scripts/gpu_travel.py on a throwaway git repository: what a device call would carry,
slim/restore leaving the index as it was, and the target's wheels split into parts that
fit beside the tree and joined back byte for byte (the GPU machine's side, run here)."""

import json
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
    with pytest.raises(gpu_travel.TravelError, match="run slim first"):
        gpu_travel.pack(repo, ("x==1",), lambda specs, into: None)


def test_unpack_before_the_first_part_arrived_says_so(tmp_path):
    (tmp_path / "parts").mkdir()
    with pytest.raises(gpu_travel.TravelError, match="no manifest.json"):
        gpu_travel.join(tmp_path / "parts", tmp_path / "wheels")


def test_carried_parts_wait_in_the_travel_folder_and_gpu_target_joins_them(repo, tmp_path, monkeypatch):
    """Each call copies the parts it carried to the travel folder (which outlives a call on
    a warm machine); the last call's gpu_target joins them, every sha256 checked. With a
    part gone (the machine went cold between calls) it is "not run", naming the part."""
    from scripts import gpu_check, gpu_target

    monkeypatch.setattr(gpu_travel, "LIMIT", 6 * 2**20)
    monkeypatch.setattr(gpu_travel, "HEADROOM", 0)
    payload = bytes(range(256)) * 40_000

    def download(specs, into):
        (into / "big-0.1-py3-none-any.whl").write_bytes(payload)

    gpu_travel.pack(repo, ("big==0.1",), download)
    travel = tmp_path / "travel"
    monkeypatch.setenv("SHARPDRAFT_TRAVEL_DIR", str(travel))
    assert sorted(gpu_check.stash_parts(repo)) == sorted(p.name for p in (repo / ".gpu" / "parts").iterdir())
    data = gpu_target.run(tmp_path / "out", smoke=True)
    assert data["parts"]["join_and_install"]["status"] == "passed"
    assert (travel / "wheels" / "big-0.1-py3-none-any.whl").read_bytes() == payload
    assert data["parts"]["convert"]["status"] == "not run"  # smoke: nothing installed or converted
    next(travel.glob("parts/big-*.whl.1")).unlink()
    data = gpu_target.run(tmp_path / "out", smoke=True)
    assert data["status"] == "not run" and "carry every part" in data["parts"]["join_and_install"]["reason"]
    assert json.loads((tmp_path / "out" / "gpu_target.json").read_text())["status"] == "not run"
