"""A GPU section's record: the JSON file a section keeps under $OUT, saved after every
sub-part, so that whatever stops the section (its own exception, the timeout's SIGTERM,
a crash of its process) leaves what it had measured.

Each section (scripts/gpu_kernel.py, gpu_trtllm.py, gpu_steps.py, gpu_e2e.py) is run by
scripts/gpu_check.py in a process of its own and writes OUT/<section>.json through this:

    record = SectionRecord(out_dir, "gpu_kernel", smoke=smoke)
    record.part("correctness", lambda part: ...)   # part: the dict the sub-part fills
    return record.finish()

`status` reads "running" until finish(); a SIGTERM writes "killed: SIGTERM (timeout)"
and exits 124 (what coreutils' `timeout` returns), so a file still saying "running"
after its process ended means the process died without a word (gpu_check.py marks it).
The environment variable SHARPDRAFT_SMOKE=1 puts every section in its smoke mode (CPU,
tiny shapes): what scripts/gpu_travel.py's rehearsal sets.
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

RUNNING, PASSED, FAILED, NOT_RUN = "running", "passed", "failed", "not run"
# set by section_main: only a section's own process exits on SIGTERM (not a test calling run())
HANDLE_SIGTERM = False
KILLED = "killed: SIGTERM (timeout)"


def smoke_mode() -> bool:
    """The rehearsal's switch (SHARPDRAFT_SMOKE=1): CPU, the Triton interpreter, tiny shapes."""
    return os.environ.get("SHARPDRAFT_SMOKE") == "1"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NotRun(Exception):
    """A sub-part cannot run here (no CUDA, no TensorRT, no target); the message says why.
    Recorded as "not run", which fails nothing."""


class SectionRecord:
    def __init__(self, out_dir, section: str, *, smoke: bool = False, command: str | None = None,
                 device: str | None = None):
        self.path = Path(out_dir) / f"{section}.json" if out_dir else None
        self.started = time.perf_counter()
        self.data = {"section": section, "status": RUNNING, "smoke": smoke,
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
        returned False or raised; "not run" when it raised NotRun. Saved either way."""
        part = self.data["parts"].setdefault(name, {})
        part["status"] = RUNNING
        started = time.perf_counter()
        log(f"{self.data['section']}: {name} ...")
        try:
            ok = measure(part)
            part["status"] = FAILED if ok is False or part.get("passed") is False else PASSED
        except NotRun as exc:
            part.update(status=NOT_RUN, reason=str(exc))
        except Exception as exc:  # this part fails; the section's next part still runs
            part.update(status=FAILED, error=one_line(exc),
                        where=traceback.format_exc().strip().splitlines()[-3:])
            log(f"{self.data['section']}: {name} failed: {one_line(exc)}")
        part["seconds"] = round(time.perf_counter() - started, 1)
        self.save()
        return part

    def finish(self) -> dict:
        parts = self.data["parts"].values()
        failed = [p for p in parts if p["status"] == FAILED]
        ran = [p for p in parts if p["status"] == PASSED]
        # nothing failed and nothing ran (every part "not run": no CUDA, no target) is not
        # a pass, and not a failure either
        self.data["status"] = FAILED if failed else PASSED if ran else NOT_RUN
        self.data["passed"] = self.data["status"] != FAILED
        self.save()
        return self.data


def section_main(section: str, run, argv=None, extra=None) -> int:
    """The command line every section shares: --out DIR (default $OUT); --smoke (or
    SHARPDRAFT_SMOKE=1). `extra(parser)` adds a section's own options; run(out_dir, smoke,
    args) returns the record's data. Exit 0 when the section passed."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m scripts.{section}")
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT"),
                   help="folder for the section's JSON (default: $OUT)")
    p.add_argument("--smoke", action="store_true", default=smoke_mode(),
                   help="CPU, tiny shapes (default from SHARPDRAFT_SMOKE=1)")
    if extra:
        extra(p)
    args = p.parse_args(argv)
    global HANDLE_SIGTERM
    HANDLE_SIGTERM = True
    if not args.out:
        print("error: no output folder: pass --out DIR or set OUT", file=sys.stderr)
        return 2
    data = run(args.out, args.smoke, args)
    print(f"{section}: {data['status']} in {data['seconds']} s: "
          + ", ".join(f"{n} {p['status']}" for n, p in data["parts"].items()), flush=True)
    return 1 if data["status"] == FAILED else 0
