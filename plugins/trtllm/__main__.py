"""`python -m plugins.trtllm check [--family F] [--backend B] [--proof DIR] | autoload {install,uninstall,status}
| bench-wrapper [--json PATH]`

check: what the hook would patch on this installation, and what its source lacks for a
launch of one drafter family (the same structure check our launchers refuse on:
plugins/trtllm/structure.py; the other families' state is reported beside it, never
refusing this launch), or, where
tensorrt_llm is not installed, the pinned plan; with --proof, a launch's proof directory:
the drafters wrapped on each rank and their device counts of scaled calls. autoload: the
.pth that adds the lazy import hook (autoload.py) to every Python process of an environment.
bench-wrapper: the DFlash kernel wrappers' host cost per attention backend (bench.py).
Results on stdout, one-line errors on stderr (exit 1; 2 for bad usage).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import sysconfig
from pathlib import Path

from plugins.trtllm import autoload, pins, proof, structure, versions


def importable() -> tuple[object | None, str]:
    """(tensorrt_llm module or None, one line on why not)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None, "not installed"
    try:
        return importlib.import_module("tensorrt_llm"), ""
    except Exception as exc:  # its __init__ needs libcuda, MPI, ...: any failure is the answer
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def check(backend: str = "VANILLA", proof_dir: Path | None = None, family: str = "dflash") -> dict:
    from plugins.trtllm.hook import resolve
    from plugins.trtllm.launch import installed_version

    module, why = importable()
    report = {"pinned": pins.PINNED, "read": list(pins.READ_RANGE), "importable": module is not None,
              "reason": why, "patch_points": [], "kernels": pins.DFLASH_KERNELS,
              "attention": [f"{m}.{pins.ATTENTION_CLASS}.{pins.ATTENTION_METHOD}" for m in pins.ATTENTION_MODULES]}
    root = structure.package_root()
    if root is not None:
        version = installed_version()
        report["version"] = version
        report["version_read"] = version is not None and versions.is_tested(str(version), *pins.READ_RANGE)
        report["family"] = family
        report["backend"] = backend if family == "dflash" else None
        report["missing"] = structure.missing_names(root, dflash_backend=report["backend"], family=family)
        report["families"] = structure.families(root)
    if proof_dir is not None:
        report["proof"] = proof_report(Path(proof_dir))
    for point in pins.PATCH_POINTS:
        entry = {"name": f"{point.module}.{point.attribute}", "role": point.role, "required": point.required,
                 "source": f"{pins.SOURCES[point.source].path} @ {pins.SOURCES[point.source].commit}"}
        if module is not None:
            try:
                entry["found"] = resolve(importlib.import_module(point.module), point.attribute) is not None
            except Exception as exc:
                entry["found"] = False
                entry["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        report["patch_points"].append(entry)
    return report


def proof_report(where: Path) -> dict:
    """A proof directory as check shows it: what each process recorded and the device counts
    it last reported (counts-<pid>.json, written when a launcher asked)."""
    entries = proof.read(where)
    return {"records": [{k: e.get(k) for k in ("kind", "pid", "rank", "drafter", "layers", "reason") if k in e}
                        for e in entries if e["kind"] != "counts"],
            "counts": {str(e["pid"]): {"rank": e.get("rank", 0), "request": e.get("request"), "counts": e["counts"]}
                       for e in entries if e["kind"] == "counts"}}


def describe(report: dict) -> str:
    lines = [f"SharpDraft TensorRT-LLM hook, configuration for {report['pinned']}, sources read "
             f"{report['read'][0]} to {report['read'][1]}"]
    if "missing" in report:
        read = "in the range read" if report["version_read"] else "UNTESTED: outside the range read"
        state = ("every name SharpDraft reads is present: accepted" if not report["missing"] else
                 "refused: " + "; ".join(report["missing"]) + " not found")
        launch = f"{report['family']} launch" + (f", DFlash backend {report['backend']}" if report["backend"] else "")
        lines.append(f"tensorrt_llm {report['version']} ({read}); {launch}: {state}")
        for family, why in report["families"].items():
            if family != report["family"]:
                lines.append(f"  other family {family}: " + (f"refused for {family} launches: {why} not found" if why
                                                            else "present"))
    if not report["importable"]:
        lines.append(f"tensorrt_llm is not importable here ({report['reason']}): names read from its files only")
    for entry in report["patch_points"]:
        state = "" if "found" not in entry else ("  [found]" if entry["found"] else
                                                 "  [MISSING]" if entry["required"] else "  [absent: other layout]")
        lines.append(f"  would wrap {entry['name']}{state}")
        lines.append(f"      {entry['role']}; read from {entry['source']}")
    lines.append("  DFlash kernels by attention_backend: "
                 + ", ".join(f"{b} -> instance.{a}" for b, a in report["kernels"].items()))
    lines.append("  EAGLE-3 / PARD: per drafter instance, " + " or ".join(report["attention"]))
    for record in (report.get("proof") or {}).get("records", ()):
        lines.append(f"  proof: pid {record['pid']} rank {record.get('rank', 0)} {record['kind']} "
                     f"{record.get('drafter') or ''} {record.get('reason') or ''}".rstrip())
    for pid, entry in (report.get("proof") or {}).get("counts", {}).items():
        lines.append(f"  scaled calls, pid {pid} rank {entry['rank']} (request {entry['request']}): "
                     + ", ".join(f"{u} {c}" for u, c in entry["counts"].items()))
    return "\n".join(lines)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def autoload_command(action: str, site: Path) -> str:
    path = site / autoload.PTH_NAME
    if action == "install":
        path.write_text(autoload.pth_line(site))
        return (f"wrote {path}: every Python process of this environment gets a lazy import hook that "
                "loads SharpDraft's TensorRT-LLM hook when a drafter module is imported (it scales only "
                "drafters whose config.json carries SharpDraft's parameters)")
    if action == "uninstall":
        existed = path.exists()
        path.unlink(missing_ok=True)
        return (f"removed {path} (engines already running keep their hook and captured CUDA graphs "
                "until restarted)" if existed else f"nothing to remove ({path} does not exist)")
    return f"installed: {path}" if path.exists() else f"not installed ({path} does not exist)"


def main(argv) -> int:
    if argv[:1] == ["bench-wrapper"]:  # its own options (argparse.REMAINDER would not take --json)
        from plugins.trtllm import bench

        return bench.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m plugins.trtllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="what the hook would patch on this installation")
    c.add_argument("--json", action="store_true")
    c.add_argument("--backend", default="VANILLA", type=str.upper, choices=sorted(pins.DFLASH_KERNELS),
                   help="the DFlash attention backend whose kernel must be present (default VANILLA)")
    c.add_argument("--proof", metavar="DIR", help="a launch's proof directory: records and scaled-call counts")
    c.add_argument("--family", default="dflash", choices=sorted(pins.FAMILIES),
                   help="the drafter family of the launch to check (default dflash)")
    sub.add_parser("bench-wrapper", help="the DFlash kernel wrappers' host cost, per attention backend "
                   "(--calls N --rounds N --json PATH)")
    a = sub.add_parser("autoload", help="the .pth lazy import hook that reaches worker processes")
    a.add_argument("action", choices=("install", "uninstall", "status"))
    a.add_argument("--site-packages", metavar="DIR", help="default: this interpreter's purelib")
    args = p.parse_args(argv)
    try:
        if args.command == "check":
            report = check(args.backend, args.proof, args.family)
            print(json.dumps(report) if args.json else describe(report))
            if report.get("missing"):
                return 1
        else:
            site = Path(args.site_packages) if args.site_packages else site_packages()
            if not site.is_dir():
                raise FileNotFoundError(f"{site} is not a directory")
            print(autoload_command(args.action, site))
    except (OSError, ImportError, ValueError) as exc:
        sys.stderr.write(f"error: {str(exc).splitlines()[0]}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
