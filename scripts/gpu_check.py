"""One GPU machine call of the prepared run: its sections, each in a process of its own
under its own timeout, every file under $OUT.

    python -m scripts.gpu_check --call N --out "$OUT"     # what the plan's call N runs
    python -m scripts.gpu_check --sections gpu_kernel --out DIR
    SHARPDRAFT_SMOKE=1 python -m scripts.gpu_check ...    # CPU, tiny shapes (the rehearsal)

The calls, their sections and each section's timeout are scripts/gpu_travel.py's plan
(`python scripts/gpu_travel.py plan` prints it). First the target's parts that this call
carried (.gpu/parts/) are copied to the folder that outlives a call while the machine
is warm; then each section runs as `python -m scripts.<module> --out DIR`, its output
appended to DIR/gpu_check.log (its last lines echoed here). A section saves its
DIR/<section>.json after every sub-part (scripts/gpu_record.py); at its timeout it is
sent SIGTERM (it writes what it has), then SIGKILL; a section that raised, was killed or
crashed its process leaves the other sections' files and its own partial one, and this
records its exit in DIR/gpu_check.json. Exit 1 when a section failed; without CUDA
(and not in smoke mode) one line `error: ...`, exit 1.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_check ...")

import argparse
import json
import os
import shutil
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from scripts import gpu_travel
from scripts.gpu_record import KILLED, RUNNING, smoke_mode

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
    started = time.perf_counter()
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
            "timeout_s": timeout_s}


def stash_parts(repo: Path = REPO, travel: Path | None = None) -> list[str]:
    """The target's parts this call carried (repo/.gpu/parts/*) into the travel folder,
    which outlives the call while the machine stays warm (copied: the rehearsal runs on
    the real checkout)."""
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


def run_sections(sections, out_dir: Path, *, env=None, echo=print) -> dict:
    """sections: (name, argv, timeout_s) in order. name -> what run_one saw; the log and
    the summary DIR/gpu_check.json are rewritten after every section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "sections": results}
    with open(out_dir / "gpu_check.log", "a") as log:
        for name, argv, timeout_s in sections:
            results[name] = run_one(name, argv, timeout_s, out_dir, log, env)
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
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not args.out:
        print("error: no output folder: pass --out DIR or set OUT", file=sys.stderr)
        return 2
    if args.call is not None:
        if not 1 <= args.call <= len(gpu_travel.CALL_SECTIONS):
            print(f"error: the plan has calls 1 to {len(gpu_travel.CALL_SECTIONS)}, not {args.call}",
                  file=sys.stderr)
            return 2
        names = list(gpu_travel.CALL_SECTIONS[args.call - 1])
    else:
        names = [n.strip() for n in args.sections.split(",") if n.strip()]
        unknown = [n for n in names if n not in gpu_travel.SECTIONS]
        if unknown:
            print(f"error: not a section: {', '.join(unknown)} (sections: {', '.join(gpu_travel.SECTIONS)})",
                  file=sys.stderr)
            return 2
    if not smoke_mode() and shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        print("error: no NVIDIA device here; the GPU run needs one (SHARPDRAFT_SMOKE=1 runs the "
              "sections' CPU smoke mode: scripts/gpu_travel.py rehearse)", file=sys.stderr)
        return 1
    out = Path(args.out)
    stashed = stash_parts()
    if stashed:
        print(f"gpu_check: {len(stashed)} carried part(s) kept in {gpu_travel.travel_dir() / 'parts'}",
              flush=True)
    sections = [(n, section_command(n), gpu_travel.SECTIONS[n][1]) for n in names]
    results = run_sections(sections, out, env=section_env(gpu_travel.travel_dir() / "site"))
    bad = [n for n, r in results.items() if r["status"] not in ("passed", "not run")]
    print(f"gpu_check call {args.call or '-'}: " + "; ".join(f"{n} {r['status']}" for n, r in results.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
