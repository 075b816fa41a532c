"""Proof that SharpDraft was applied where TensorRT-LLM runs the drafter.

The launcher (our generate / trtllm-serve / the Triton llmapi model) cannot see inside
TensorRT-LLM's worker processes, so every process that builds a drafter with the hook
installed writes one small JSON record into the launch's *proof directory*: which drafter
class, how many attention layers (or kernels) were wrapped, the QueryScaling, the pid —
or, where the hook could not apply beta (a version outside the tested range, a missing
name, an MLA drafter), why not. Once TensorRT-LLM has built the model, the launcher reads
the directory (`require`) and refuses to serve in one line unless at least one drafter was
wrapped with the requested scaling and none was refused.

The proof directory reaches workers through the *activation file* (activation.py), or
SHARPDRAFT_TRTLLM_PROOF in the environment where it is inherited; the process that
installed the hook itself (single-process executor) reports the same way.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

__all__ = ["ProofError", "PROOF_ENV", "set_directory", "directory", "record", "read", "require",
           "summary"]

PROOF_ENV = "SHARPDRAFT_TRTLLM_PROOF"
_state = {"directory": None, "count": 0}


class ProofError(ValueError):
    """SharpDraft was requested but the proof says it is not applied (one line; a ValueError,
    so the command line's one-line handling applies)."""


def set_directory(path) -> None:
    _state["directory"] = None if path is None else str(path)


def directory() -> Path | None:
    value = _state["directory"] or os.environ.get(PROOF_ENV)
    return Path(value) if value else None


def record(kind: str, **fields) -> Path | None:
    """Write one record (kind: wrapped | refused | disabled) for this process; never raises
    (it runs inside TensorRT-LLM's model construction and import)."""
    where = directory()
    if where is None:
        return None
    _state["count"] += 1
    entry = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), **fields}
    path = where / f"{kind}-{os.getpid()}-{_state['count']}.json"
    try:
        where.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entry, sort_keys=True))
        temporary.replace(path)  # readers never see half a record
        return path
    except OSError as exc:
        sys.stderr.write(f"sharpdraft: cannot write proof to {where}: {exc}\n")
        return None


def read(where) -> list[dict]:
    where = Path(where)
    if not where.is_dir():
        return []
    entries = []
    for path in sorted(where.glob("*.json")):
        try:
            entries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return entries


def require(where, scaling) -> list[dict]:
    """The 'wrapped' records for this launch; ProofError (one line) unless at least one
    drafter was wrapped with `scaling` and nothing was refused or disabled."""
    entries = read(where)
    wrapped = [e for e in entries if e["kind"] == "wrapped"]
    bad = [e for e in entries if e["kind"] in ("refused", "disabled")]
    head = "SharpDraft was requested but no drafter was wrapped in the worker processes"
    if bad:
        first = bad[0]
        raise ProofError(f"{head.replace('no drafter was wrapped', 'the hook could not apply it')}: "
                         f"pid {first['pid']} {first['kind']} {first.get('drafter') or 'the hook'}: "
                         f"{first.get('reason', '?')}")
    if not wrapped:
        raise ProofError(f"{head}: no proof in {where} (the hook never ran where TensorRT-LLM built the "
                         "drafter; install the autoloader: python -m plugins.trtllm autoload install — "
                         "docs/trtllm.md)")
    expected = scaling.to_dict()
    other = [e for e in wrapped if e.get("scaling") != expected]
    if other:
        raise ProofError(f"{head} with this engine's QueryScaling: pid {other[0]['pid']} applied "
                         f"{other[0].get('scaling')} (expected {expected})")
    return wrapped


def summary(wrapped: list[dict]) -> dict:
    """What a health/metadata output reports: the applied scaling and where."""
    return {"sharpdraft": True, "scaling": wrapped[0]["scaling"],
            "drafters": sorted({e["drafter"] for e in wrapped}),
            "processes": sorted({e["pid"] for e in wrapped}),
            "layers": max(e.get("layers", 0) for e in wrapped)}
