#!/usr/bin/env python3
"""One prepared GPU run (a few minutes on one H200): each section is a module in scripts/
with `run(out_dir) -> dict`, run in order, its figures written to
results/gpu/<section>.json with the device, the date and the command.

    python scripts/gpu_check.py                       # every section, into results/gpu/
    python scripts/gpu_check.py --sections gpu_kernel --out DIR
    python scripts/gpu_check.py --dry-run             # CPU too: which sections would run

Sections (SECTIONS): gpu_kernel (the attention op and kernel: correctness, CUDA-graph
capture, host time per call, the kernel bench), gpu_trtllm (SharpDraft inside
TensorRT-LLM), gpu_e2e (engines end to end). A section whose module does not exist is
skipped with a note; a section that fails (returns passed: false or raises) is recorded
and the run goes on. Progress to stderr, one line per section and a summary to stdout;
exit 1 when a section failed or when no CUDA device is visible (one line, `error: ...`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(REPO))

SECTIONS = ["gpu_kernel", "gpu_trtllm", "gpu_e2e"]
PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"


def parse(argv):
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", default=str(REPO / "results" / "gpu"),
                   help="folder for <section>.json (default: results/gpu)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default: {','.join(SECTIONS)})")
    p.add_argument("--dry-run", action="store_true",
                   help="say which sections exist and would run; run nothing, write nothing")
    return p.parse_args(argv)


def load_section(name: str):
    """scripts/<name>.py as a module, or None when it does not exist (yet)."""
    path = SCRIPTS / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise AttributeError(f"scripts/{name}.py has no run(out_dir)")
    return module


def one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def run_sections(names, out_dir: Path, *, device: str, command: str, loader=load_section,
                 dry_run: bool = False) -> dict:
    """name -> {"status": passed | failed | not run, "reason"?}; each section that ran
    leaves out_dir/<name>.json (its figures plus device, date, command, status)."""
    statuses = {}
    for name in names:
        try:
            module = loader(name)
        except Exception as exc:
            statuses[name] = {"status": FAILED, "reason": f"cannot load scripts/{name}.py: {one_line(exc)}"}
        else:
            if module is None:
                statuses[name] = {"status": NOT_RUN, "reason": f"scripts/{name}.py does not exist yet: skipped"}
            elif dry_run:
                statuses[name] = {"status": NOT_RUN, "reason": "dry run: would run"}
            else:
                statuses[name] = run_one(module, name, out_dir, device, command)
        status = statuses[name]
        print(f"{name}: {status['status']}" + (f" ({status['reason']})" if "reason" in status else ""),
              flush=True)
    return statuses


def run_one(module, name: str, out_dir: Path, device: str, command: str) -> dict:
    started = time.perf_counter()
    print(f"gpu_check: section {name} ...", file=sys.stderr, flush=True)
    status = {}
    try:
        figures = dict(module.run(out_dir))
        status["status"] = PASSED if figures.get("passed", True) else FAILED
    except Exception as exc:  # keep going: the next section may still pass
        figures = {"error": one_line(exc)}
        status = {"status": FAILED, "reason": one_line(exc)}
        print(f"error: section {name}: {one_line(exc)}", file=sys.stderr)
    record = dict(section=name, device=device, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  command=command, status=status["status"],
                  section_seconds=round(time.perf_counter() - started, 1))
    record.update({k: v for k, v in figures.items() if k not in record})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return status


def summary(statuses: dict, seconds: float) -> str:
    verdict = "FAILED" if any(s["status"] == FAILED for s in statuses.values()) else "passed"
    ran = [n for n, s in statuses.items() if s["status"] != NOT_RUN]
    return (f"gpu_check {verdict} ({len(ran)} of {len(statuses)} sections ran in {seconds:.0f} s): "
            + "; ".join(f"{name} {s['status']}" for name, s in statuses.items()))


def main(argv) -> int:
    args = parse(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if not n.replace("_", "").isalnum()]
    if unknown:
        print(f"error: not a section name: {', '.join(unknown)} (sections: {', '.join(SECTIONS)})",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("error: no CUDA device visible; gpu_check.py needs an NVIDIA GPU "
              "(--dry-run lists the sections; on CPU run pytest tests/test_triton_kernel.py)", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (dry run)"
    command = "python scripts/gpu_check.py " + " ".join(argv)
    started = time.perf_counter()
    statuses = run_sections(names, Path(args.out), device=device, command=command.strip(), dry_run=args.dry_run)
    print(summary(statuses, time.perf_counter() - started))
    return 1 if any(s["status"] == FAILED for s in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
