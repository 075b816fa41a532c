"""A GPU section's record: the JSON file a section keeps under $OUT, saved after every
sub-part, so that whatever stops the section (its own exception, the timeout's SIGTERM,
a crash of its process) leaves what it had measured.

Each section (scripts/gpu_kernel.py, gpu_trtllm.py, gpu_steps.py, gpu_e2e.py) is run by
scripts/gpu_check.py in a process of its own and writes OUT/<section>.json through this:

    record = SectionRecord(out_dir, "gpu_kernel", on_cpu=on_cpu)
    record.part("correctness", lambda part: ...)   # part: the dict the sub-part fills
    return record.finish()

`status` reads "running" until finish(); a SIGTERM writes "killed: SIGTERM (timeout)"
and exits 124 (what coreutils' `timeout` returns), so a file still saying "running"
after its process ended means the process died without a word (gpu_check.py marks it).

A part ends passed, failed, "not run" (NotRun: something it needed was missing: a
failure of the section, never a quiet pass) or skipped (Skip: the section names the part
as one that cannot run on this machine, with the reason: GpuOnly for what needs CUDA,
Absent for a library neither machine has). The environment variable SHARPDRAFT_CPU=1
runs every section on CPU, on the GPU run's own paths wherever a CPU can take them: what
scripts/gpu_travel.py's rehearsal sets.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

RUNNING, PASSED, FAILED, NOT_RUN, SKIPPED = "running", "passed", "failed", "not run", "skipped"
# a section's status that fails nothing (gpu_check.py, the rehearsal): every other one fails
FINE = (PASSED, SKIPPED)
# set by section_main: only a section's own process exits on SIGTERM (not a test calling run())
HANDLE_SIGTERM = False
KILLED = "killed: SIGTERM (timeout)"


CPU_ENV = "SHARPDRAFT_CPU"


def cpu_mode() -> bool:
    """The rehearsal's switch (SHARPDRAFT_CPU=1): the sections on CPU, GPU-only parts skipped."""
    return os.environ.get(CPU_ENV) == "1"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NotRun(Exception):
    """A sub-part that should have run could not (no target, no parts carried); the
    message says why. Recorded as "not run", which fails the section."""


class Skip(Exception):
    """A sub-part the section names as one this machine cannot run; recorded as skipped
    with `kind` and the reason, which fails nothing."""
    kind = "skipped"


class GpuOnly(Skip):
    """Needs CUDA itself (graph capture, bf16 Triton kernels, device timings): skipped on CPU."""
    kind = "GPU-only"


class Absent(Skip):
    """Needs a library neither the GPU machine nor this one has (TensorRT: FACTS.md)."""
    kind = "not installed"


class SectionRecord:
    def __init__(self, out_dir, section: str, *, on_cpu: bool = False, command: str | None = None,
                 device: str | None = None):
        self.path = Path(out_dir) / f"{section}.json" if out_dir else None
        self.started = time.perf_counter()
        self.data = {"section": section, "status": RUNNING, "on_cpu": on_cpu,
                     "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "command": command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                     "device": device, "parts": {}}
        if HANDLE_SIGTERM:
            signal.signal(signal.SIGTERM, self._terminated)
        self.save()

    def _terminated(self, signum, frame):
        self.data["status"] = KILLED
        self.save()
        log(f"{self.data['section']}: {KILLED}; what was measured is in {self.path}")
        os._exit(124)

    def save(self) -> None:
        """Write the record whole (a temporary file renamed: never half a file)."""
        self.data["seconds"] = round(time.perf_counter() - self.started, 1)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def part(self, name: str, measure) -> dict:
        """Run measure(part) -- part is the sub-part's dict, which measure fills as it goes
        (and may save() between its own rows) -- and record its status: passed unless it
        returned False or raised; "not run" when it raised NotRun; skipped (with its kind
        and reason) when it raised Skip. Saved either way."""
        part = self.data["parts"].setdefault(name, {})
        part["status"] = RUNNING
        started = time.perf_counter()
        log(f"{self.data['section']}: {name} ...")
        try:
            ok = measure(part)
            part["status"] = FAILED if ok is False or part.get("passed") is False else PASSED
        except NotRun as exc:
            part.update(status=NOT_RUN, reason=str(exc))
            log(f"{self.data['section']}: {name} not run: {exc}")
        except Skip as exc:
            part.update(status=SKIPPED, skipped=exc.kind, reason=str(exc))
            log(f"{self.data['section']}: {name} skipped ({exc.kind}): {exc}")
        except Exception as exc:  # this part fails; the section's next part still runs
            part.update(status=FAILED, error=one_line(exc),
                        where=traceback.format_exc().strip().splitlines()[-3:])
            log(f"{self.data['section']}: {name} failed: {one_line(exc)}")
        part["seconds"] = round(time.perf_counter() - started, 1)
        self.save()
        return part

    def finish(self) -> dict:
        """failed if a part failed; "not run" if a part did not run without being named
        as skipped here (both fail the call); passed if a part ran; skipped if every part
        was. The skipped parts and their reasons are listed under `skipped`."""
        parts = self.data["parts"]
        statuses = {p["status"] for p in parts.values()}
        self.data["status"] = (FAILED if FAILED in statuses else NOT_RUN if NOT_RUN in statuses
                               else PASSED if PASSED in statuses else SKIPPED)
        self.data["passed"] = self.data["status"] in FINE
        self.data["skipped"] = {n: f"{p['skipped']}: {p['reason']}" for n, p in parts.items()
                                if p["status"] == SKIPPED}
        self.save()
        return self.data


def section_main(section: str, run, argv=None, extra=None) -> int:
    """The command line every section shares: --out DIR (default $OUT); --cpu (or
    SHARPDRAFT_CPU=1). `extra(parser)` adds a section's own options; run(out_dir, on_cpu,
    args) returns the record's data. Exit 0 when the section passed (or was skipped)."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m scripts.{section}")
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT"),
                   help="folder for the section's JSON (default: $OUT)")
    p.add_argument("--cpu", action="store_true", default=cpu_mode(),
                   help="on CPU, GPU-only parts skipped (default from SHARPDRAFT_CPU=1)")
    if extra:
        extra(p)
    args = p.parse_args(argv)
    global HANDLE_SIGTERM
    HANDLE_SIGTERM = True
    if not args.out:
        print("error: no output folder: pass --out DIR or set OUT", file=sys.stderr)
        return 2
    data = run(args.out, args.cpu, args)
    print(f"{section}: {data['status']} in {data['seconds']} s: "
          + ", ".join(f"{n} {p['status']}" for n, p in data["parts"].items()), flush=True)
    return 0 if data["status"] in FINE else 1
