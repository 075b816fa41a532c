"""Proof that SharpDraft was applied where TensorRT-LLM runs the drafter.

The launcher (our generate / trtllm-serve / the Triton llmapi model) cannot see inside
TensorRT-LLM's worker processes, so every process that builds a SharpDraft drafter writes
small JSON records into the launch's *proof directory*:

- `wrapped` when a drafter built from a SharpDraft drafter directory is wrapped: its
  class, one unit per draft layer, the QueryScaling its config carries, the pid and the
  MPI rank (TensorRT-LLM's `mpi_rank()`: COMM_WORLD's rank) -- or `refused` / `disabled`
  where the hook could not apply beta, and why;
- `ran`, per layer and per process, the first time that layer's scaled kernel is traced
  or called (`ran(unit)`; calls are counted per unit, `calls()`).

What `ran` proves, and what it cannot. Eagerly, it is written on the layer's first scaled
call. Under CUDA graphs (on by default) Python runs only while a graph is captured: the
record then says the layer's query went through our wrapper when the graph was
recorded, with beta's constants of that moment -- placement before capture. Replays run
no Python, so nothing here can observe them, count them, or see a graph captured through
another path; the scaled-call counters stop at capture. A captured graph keeps its scale
even after `uninstall()`.

The launcher reads the directory (`require`): it refuses in one line unless every rank
that built a drafter wrapped it with the engine's QueryScaling and nothing was refused
(with pipeline parallelism only the ranks that hold the drafter build one); with `ran`,
also unless every wrapped layer of every process ran scaled. With CUDA graphs the
warm-up captures the drafter and `ran` holds once the LLM is built; without them
(`cuda_graph_config: null`) the warm-up is context-only, so the proof of running comes
with the drafter's first generation step (the first request), not before.

The proof directory reaches workers in TRTLLM_SHARPDRAFT_PROOF, read when a record is
written (a drafter is built long after the worker started, so the variable that
MpiPoolSession forwards to its workers is there by then).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

__all__ = ["ProofError", "PROOF_ENV", "set_directory", "directory", "record", "read", "require",
           "summary", "ran", "calls", "rank"]

PROOF_ENV = "TRTLLM_SHARPDRAFT_PROOF"  # TRTLLM_-prefixed: MpiPoolSession forwards it to workers
_state = {"directory": None, "count": 0}
_calls: dict[str, int] = {}  # unit -> scaled calls in this process


class ProofError(ValueError):
    """SharpDraft was requested but the proof says it is not applied (one line; a ValueError,
    so the command line's one-line handling applies)."""


def set_directory(path) -> None:
    _state["directory"] = None if path is None else str(path)


def directory() -> Path | None:
    value = _state["directory"] or os.environ.get(PROOF_ENV)
    return Path(value) if value else None


def rank() -> int:
    """This process's MPI rank as TensorRT-LLM sees it (`_utils.mpi_rank()`: COMM_WORLD's
    rank) where mpi4py is loaded (it always is in TensorRT-LLM's workers); else a launcher's
    rank variable; else 0 (a single process). Never initialises MPI itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return int(mpi.COMM_WORLD.Get_rank())
        except Exception:
            pass
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def ran(unit: str) -> None:
    """A wrapper scaled a query of `unit`: count it; the first time, record it."""
    first = unit not in _calls
    _calls[unit] = _calls.get(unit, 0) + 1
    if first:
        record("ran", unit=unit)


def calls() -> dict[str, int]:
    """Scaled calls per wrapped unit in this process (Python-level calls: a CUDA graph's
    replays run no Python, so its capture counts once)."""
    return dict(_calls)


def record(kind: str, **fields) -> Path | None:
    """Write one record (kind: wrapped | refused | disabled) for this process; never raises
    (it runs inside TensorRT-LLM's model construction and import)."""
    where = directory()
    if where is None:
        return None
    _state["count"] += 1
    entry = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), "rank": rank(), **fields}
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


def require(where, scaling, world: int = 1, ran: bool = False, pipeline: int = 1) -> list[dict]:
    """The 'wrapped' records for this launch; ProofError (one line) unless each rank that
    holds a drafter wrapped it with `scaling` and nothing was refused or disabled: every
    rank of the world, or with `pipeline` > 1 stages at least one (the drafter runs in the
    last stage's epilogue; ranks of the other stages build none); with `ran`, also unless
    every layer each process wrapped has run scaled at least once."""
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
                         "drafter, or the drafter directory carries no SharpDraft parameters; install "
                         "the autoloader: python -m plugins.trtllm autoload install — docs/trtllm.md)")
    expected = scaling.to_dict()
    other = [e for e in wrapped if e.get("scaling") != expected]
    if other:
        raise ProofError(f"{head} with this engine's QueryScaling: pid {other[0]['pid']} applied "
                         f"{other[0].get('scaling')} (expected {expected})")
    pids_by_rank: dict[int, set] = {}
    for e in wrapped:
        pids_by_rank.setdefault(int(e.get("rank", 0)), set()).add(e["pid"])
    seen = ", ".join(f"rank {r} pid {', '.join(map(str, sorted(p)))}" for r, p in sorted(pids_by_rank.items()))
    missing = [] if int(pipeline) > 1 else [r for r in range(int(world)) if r not in pids_by_rank]
    if missing:
        raise ProofError(f"{head} of rank(s) {', '.join(map(str, missing))} of {world} (wrapped: {seen}); a rank "
                         "without the autoloader runs unscaled")
    owners: dict[int, int] = {}
    for r, pids in pids_by_rank.items():
        for pid in pids:
            if owners.setdefault(pid, r) != r:
                raise ProofError(f"{head} of distinct processes: pid {pid} reported ranks {owners[pid]} and {r} "
                                 f"(world {world}; wrapped: {seen})")
    if ran:
        done = {(e["pid"], e.get("unit")) for e in entries if e["kind"] == "ran"}
        idle = [(e, u) for e in wrapped for u in e.get("units", ()) if (e["pid"], u) not in done]
        if idle:
            e, u = idle[0]
            raise ProofError(f"SharpDraft wrapped {len(idle)} layer(s) that never ran scaled "
                             f"(first: {u} in pid {e['pid']} rank {e.get('rank', 0)}): a path that bypasses "
                             "the wrappers runs that drafter unscaled")
    return wrapped


def summary(wrapped: list[dict]) -> dict:
    """What a health/metadata output reports: the applied scaling and where."""
    return {"sharpdraft": True, "scaling": wrapped[0]["scaling"],
            "drafters": sorted({e["drafter"] for e in wrapped}),
            "processes": sorted({e["pid"] for e in wrapped}),
            "ranks": sorted({int(e.get("rank", 0)) for e in wrapped}),
            "layers": max(e.get("layers", 0) for e in wrapped)}
