"""One GPU machine call of the prepared run: its sections, each in a process of its own
under its own timeout, every file under $OUT.

    python -m scripts.gpu_check --call N --out "$OUT"     # what the plan's call N runs
    python -m scripts.gpu_check --call N --parts-only --out "$OUT"   # carry its parts again
    python -m scripts.gpu_check --sections gpu_kernel --out DIR
    SHARPDRAFT_CPU=1 python -m scripts.gpu_check ...      # on CPU (the rehearsal)

The calls, their sections and each section's timeout are scripts/gpu_travel.py's plan
(`python scripts/gpu_travel.py plan` prints it). First the target's parts that this call
carried (.gpu/parts/) are copied to the folder that outlives a call while the machine
is warm; a call whose sections need every part (gpu_target) and finds one gone (the
machine went cold between calls) refuses at once, in one line, exit 1, before anything
slow. Then each section runs as `python -m scripts.<module> --out DIR`, with an
environment computed as it starts (the target's wheels on PYTHONPATH once a section
before it installed them), its output appended to DIR/gpu_check.log (its last lines
echoed here). A section saves its DIR/<section>.json after every sub-part
(scripts/gpu_record.py); at its timeout it is sent SIGTERM (it writes what it has), then
SIGKILL; a section that raised, was killed or crashed its process leaves the other
sections' files and its own partial one, and this records its exit in
DIR/gpu_check.json. Exit 1 when a section did not pass: failed, crashed, killed, or a
part "not run" that the section does not name as skipped on this machine. Without CUDA
(and not on CPU by SHARPDRAFT_CPU=1) one line `error: ...`, exit 1. On CPU each section's
timeout is gpu_travel.CPU_TIMEOUT_SCALE times its GPU one.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_check ...")

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from scripts import gpu_travel
from scripts.gpu_record import FINE, KILLED, RUNNING, cpu_mode

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 15  # after SIGTERM, the time a section has to write its file before SIGKILL
ECHO_LINES = 12  # of each section's output, echoed to stdout (the device tool returns its tail)


def section_command(name: str) -> list[str]:
    module, _ = gpu_travel.SECTIONS[name]
    return [sys.executable, "-m", module]


def section_env(site: Path | None) -> dict:
    """The repository on the import path (every section runs as `python -m scripts.x`
    from its root), and the target's installed wheels where a call unpacked them."""
    paths = [str(REPO)] + ([str(site)] if site and site.is_dir() else [])
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
            "PYTHONUNBUFFERED": "1"}


def run_one(name: str, argv: list[str], timeout_s: float, out_dir: Path, log, env=None) -> dict:
    """Run one section's process; what it left: its exit, seconds, the status of its file
    (patched to say how it ended where the process could not say so itself)."""
    started, cpu = time.perf_counter(), cpu_time()
    log.write(f"\n===== {name}: {' '.join(argv)} (timeout {timeout_s:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(argv + ["--out", str(out_dir)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)  # the section's handler writes what it has
        try:
            rc = proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    seconds = round(time.perf_counter() - started, 1)
    path = out_dir / f"{name}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = None
    if record is None:  # died before its first save: a file that says so
        record = {"section": name, "parts": {}}
    ended = ("timed out" if timed_out else f"exit {rc}") + (f" (signal {-rc})" if rc < 0 else "")
    if record.get("status") in (None, RUNNING) or (timed_out and record.get("status") != KILLED):
        record["status"] = f"crashed: {ended}" if not timed_out else f"killed: {ended}"
        path.write_text(json.dumps(record, indent=1) + "\n")
    return {"status": record["status"], "exit": rc, "timed_out": timed_out, "seconds": seconds,
            "cpu_time_s": round(cpu_time() - cpu, 1), "timeout_s": timeout_s}


def cpu_time() -> float:
    """User + system seconds of every finished child process (and theirs): a section's
    CPU time, which a shared machine does not stretch as it stretches wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stash_parts(repo: Path = REPO, travel: Path | None = None) -> list[str]:
    """The target's parts this call carried (repo/.gpu/parts/*) into the travel folder,
    which outlives the call while the machine stays warm (copied: the tree stays as it came)."""
    source = repo / gpu_travel.PACK_DIR / "parts"
    if not source.is_dir():
        return []
    dest = (travel or gpu_travel.travel_dir()) / "parts"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for part in sorted(source.iterdir()):
        if part.is_file():
            shutil.copyfile(part, dest / part.name)
            copied.append(part.name)
    return copied


def missing_parts(travel: Path) -> str | None:
    """Why the target's parts in travel/parts are not all there (None: every part is, at
    its size: gpu_target checks each sha256). Reads one small file: a refusal in
    milliseconds, before any section starts."""
    parts = travel / "parts"
    try:
        manifest = json.loads((parts / "manifest.json").read_text())
    except (OSError, ValueError):
        return f"{parts} has no manifest.json"
    gone = [name for entry in manifest["files"] for name, part in entry["parts"].items()
            if not (parts / name).is_file() or (parts / name).stat().st_size != part["bytes"]]
    return f"{parts} lacks {', '.join(gone)}" if gone else None


def run_sections(sections, out_dir: Path, *, env=None, echo=print, summary=None) -> dict:
    """sections: (name, argv, timeout_s) in order. name -> what run_one saw; the log and
    the summary DIR/gpu_check.json are rewritten after every section. `env`: a dict, or
    a function called as each section starts (what an earlier section made, the site
    folder of installed wheels say, is then on the next one's PYTHONPATH)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(summary or {}),
               "sections": results}
    started = time.perf_counter()
    with open(out_dir / "gpu_check.log", "a") as log:
        for name, argv, timeout_s in sections:
            results[name] = run_one(name, argv, timeout_s, out_dir, log, env() if callable(env) else env)
            summary["seconds"] = round(time.perf_counter() - started, 1)
            (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
            log.flush()
            tail = (out_dir / "gpu_check.log").read_text(errors="replace").splitlines()[-ECHO_LINES:]
            echo("\n".join(tail))
            echo(f"{name}: {results[name]['status']} ({results[name]['seconds']} s)")
    return results


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT"),
                   help="folder for every file this call returns (default: $OUT)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--call", type=int, help="the plan's call number (scripts/gpu_travel.py plan)")
    which.add_argument("--sections", help=f"comma-separated, of {', '.join(gpu_travel.SECTIONS)}")
    p.add_argument("--parts-only", action="store_true",
                   help="keep the parts this call carried and run no section (a cold machine's rerun)")
    return p.parse_args(argv)


def refuse(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv=None) -> int:
    args = parse(argv)
    if not args.out:
        return refuse("no output folder: pass --out DIR or set OUT", 2)
    if args.call is not None:
        if not 1 <= args.call <= len(gpu_travel.CALL_SECTIONS):
            return refuse(f"the plan has calls 1 to {len(gpu_travel.CALL_SECTIONS)}, not {args.call}", 2)
        names = list(gpu_travel.CALL_SECTIONS[args.call - 1])
    else:
        names = [n.strip() for n in args.sections.split(",") if n.strip()]
        unknown = [n for n in names if n not in gpu_travel.SECTIONS]
        if unknown:
            return refuse(f"not a section: {', '.join(unknown)} (sections: {', '.join(gpu_travel.SECTIONS)})", 2)
    if not args.parts_only and not cpu_mode() and shutil.which("nvidia-smi") is None \
            and not Path("/dev/nvidia0").exists():
        return refuse("no NVIDIA device here; the GPU run needs one (SHARPDRAFT_CPU=1 runs the sections "
                      "on CPU: scripts/gpu_travel.py rehearse)")
    out = Path(args.out)
    travel = gpu_travel.travel_dir()
    stashed = stash_parts()
    if args.parts_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps({"call": args.call, "parts_only": True,
                                                        "parts_kept": stashed}, indent=1) + "\n")
        return 0
    if set(names) & gpu_travel.NEEDS_PARTS:
        gone = missing_parts(travel)
        if gone:  # the earlier calls' parts did not survive: say so now, not after the GPU work
            earlier = ", ".join(str(c) for c in range(1, args.call or len(gpu_travel.CALL_SECTIONS)))
            return refuse(f"call {args.call or '-'} needs the target's parts that calls {earlier} carried, and "
                          f"{gone} (the machine went cold between calls): rerun calls {earlier} with "
                          "--parts-only, then this call")
    if stashed:
        print(f"gpu_check: {len(stashed)} carried part(s) kept in {travel / 'parts'}", flush=True)
    scale = gpu_travel.CPU_TIMEOUT_SCALE if cpu_mode() else 1
    sections = [(n, section_command(n), gpu_travel.SECTIONS[n][1] * scale) for n in names]
    results = run_sections(sections, out, env=lambda: section_env(travel / "site"),
                           summary={"call": args.call})
    print(f"gpu_check call {args.call or '-'}: " + "; ".join(f"{n} {r['status']}" for n, r in results.items()))
    return 0 if all(r["status"] in FINE for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
