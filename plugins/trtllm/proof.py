"""Proof that SharpDraft was applied where TensorRT-LLM runs the drafter, and that it runs.

The launcher (our generate / trtllm-serve / the Triton llmapi model) cannot see inside
TensorRT-LLM's worker processes, so every process that builds a SharpDraft drafter writes
small JSON records into the launch's *proof directory*:

- `wrapped` when a drafter built from a SharpDraft drafter directory is wrapped: its
  class, one unit per draft layer, the QueryScaling its config carries, the pid and the
  MPI rank (TensorRT-LLM's `mpi_rank()`: COMM_WORLD's rank); `refused` where the hook could
  not apply beta (the build then stops: plugins/trtllm/hook.py), or `frozen` where the
  drafter's config asked to run frozen in that case (`"if_unscalable": "frozen"`);
- `counts`, on request: how many scaled drafter-attention calls each unit has made.

The counts are kept on the device by the scaling itself (`Tally`): every scaled call adds
one, with an in-place tensor op, to its layer's slot of a per-drafter int64 tensor. That op
is part of whatever runs the call -- an eager kernel launch, a captured CUDA graph (each
replay adds again), a torch.compile'd graph -- so replays are counted, where a Python side
effect would have run once, at capture. The tensors are read outside the graph, only when
the launcher asks: it drops `flush-N.request` in the directory, and a small thread of each
process that wrapped a drafter (started with the first one) answers with
`counts-<pid>.json` (request N, counts per unit). The launcher reads counts once the model
is built (warm-up and capture are over) and again after its first requests, and refuses,
in one line, a launch where any wrapped layer of any rank did not count up: that drafter
ran unscaled, whatever the `wrapped` records say.

The proof directory reaches the process that builds the drafter in the drafter's own
config: our launchers hand TensorRT-LLM a per-launch view of the drafter directory whose
config.json carries it (`"sharpdraft": {..., "proof": DIR}`), so no environment variable
has to survive MPI (older MpiPoolSession copies forward none, and a variable set after MPI
started does not reach spawned workers). TRTLLM_SHARPDRAFT_PROOF / set_directory() remain
the fallback for a drafter whose config names none (tests, hand-made runs).

Which drafters must count: only the one that serves. TensorRT-LLM may build a drafter and
drop it (model_loader builds the model under MetaInitMode and, on any exception, builds it
again), and every pipeline stage builds one while only the last stage runs it
(SpecDecOneEngineForCausalLM.__init__). So a record names its drafter's pipeline stage
(TensorRT-LLM's own mapping), `require` asks for a record from every rank of the last
stage, and `require_growth` asks, per process of the last stage, for one drafter whose
every layer counted up: a drafter none of whose layers ever counted was discarded (or is
garbage), one that counted on some layers only ran a layer unscaled, and is refused.

The counts are read outside any CUDA-graph capture: the reader waits while a capture is in
progress anywhere in the process (`guard_captures` wraps torch's CUDAGraph.capture_begin /
capture_end; TensorRT-LLM's CUDAGraphRunner may capture a new batch size while serving, in
torch's global capture mode, where a device-to-host copy from another thread would
invalidate the capture).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time
import weakref
from pathlib import Path

__all__ = ["ProofError", "PROOF_ENV", "set_directory", "directory", "record", "read", "require",
           "summary", "Tally", "counts", "request_counts", "require_growth", "rank", "runs_drafter",
           "last_stage_ranks", "guard_captures", "unguard_captures", "capturing"]

PROOF_ENV = "TRTLLM_SHARPDRAFT_PROOF"  # TRTLLM_-prefixed: MpiPoolSession forwards it to workers
# The untested release our launcher already named (forwarded to workers like PROOF_ENV): the
# hook in a worker then does not name it again -- one line per launch.
UNTESTED_ENV = "TRTLLM_SHARPDRAFT_UNTESTED_SAID"
FROZEN = "frozen"  # QueryScaling's config key `if_unscalable`: this value runs an unscalable drafter frozen
_state = {"directory": None, "count": 0, "reporter": None}
_tallies = weakref.WeakSet()  # every live Tally of this process (one per wrapped drafter; the drafter holds it)


class ProofError(ValueError):
    """SharpDraft was requested but the proof says it is not applied (one line; a ValueError,
    so the command line's one-line handling applies)."""


def set_directory(path) -> None:
    _state["directory"] = None if path is None else str(path)


def forget_tallies() -> None:
    """Drop this process's counters (tests: a drafter of an earlier stand-in launch can
    outlive its test until the collector runs, and its zero counts then read as the next
    launch's)."""
    _tallies.clear()


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


class Tally:
    """Scaled drafter-attention calls per unit (draft layer), counted on the device by the
    scaling itself: `add(index, like)` is one in-place tensor op on this drafter's counter,
    so it runs wherever the scaled call runs -- inside a captured CUDA graph's replays and a
    compiled graph's calls too. Index len(units) collects calls no layer claimed. `where`:
    the proof directory this drafter reports to.

    The counter is made when the drafter is built, on the host (torch.zeros: TensorRT-LLM's
    MetaInitMode moves only empty/empty_like to the meta device), and moves to the device of
    the first scaled call: TensorRT-LLM's warm-up runs the drafter eagerly before it
    captures, and a compiled graph then updates the tensor in place."""

    def __init__(self, units, where: Path | None = None):
        self.units = list(units)
        self.where = Path(where) if where else directory()
        self.values = None
        self._place(None)
        _tallies.add(self)

    def _place(self, device) -> None:
        import torch

        if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("sharpdraft: a drafter's first scaled call ran inside a CUDA-graph capture; "
                               "its counter cannot move to the device there")
        if self.values is None or self.values.device.type == "meta":
            self.values = torch.zeros(len(self.units) + 1, dtype=torch.int64, device=device)
        else:
            self.values = self.values.to(device)
        self._slots = [self.values[i:i + 1] for i in range(len(self.units) + 1)]  # one add per call

    def add(self, index: int | None, like) -> None:
        if self.values.device != like.device:
            self._place(like.device)
        self._slots[len(self.units) if index is None else index].add_(1)

    def read(self) -> dict[str, int]:
        values = self.values.detach().to("cpu").tolist()
        out = dict(zip(self.units, values))
        if values[-1]:
            out["(no layer)"] = values[-1]
        return out


# --- reads outside any CUDA-graph capture ------------------------------------------------

_capture = {"depth": 0, "lock": threading.Lock(), "originals": None}
CAPTURE_METHODS = ("torch.cuda.graphs", "CUDAGraph", "capture_begin", "capture_end")


def _capture_began() -> None:
    with _capture["lock"]:
        _capture["depth"] += 1


def _capture_ended() -> None:
    with _capture["lock"]:
        _capture["depth"] = max(0, _capture["depth"] - 1)


def guard_captures() -> None:
    """Wrap torch's CUDAGraph.capture_begin / capture_end (every capture torch makes, so
    TensorRT-LLM's CUDAGraphRunner's and a piecewise compile's) to keep a process-wide count
    of captures in progress; `counts()` reads only while it is zero, holding the lock a
    capture_begin takes, so no capture starts during a read (idempotent)."""
    if _capture["originals"] is not None:
        return
    import importlib

    module_name, class_name, begin, end = CAPTURE_METHODS
    cls = getattr(importlib.import_module(module_name), class_name)
    originals = (cls, cls.__dict__.get(begin), cls.__dict__.get(end))
    if originals[1] is None or originals[2] is None:
        return  # a torch without them captures nothing we could collide with

    def capture_begin(self, *args, **kwargs):
        _capture_began()
        try:
            return originals[1](self, *args, **kwargs)
        except BaseException:
            _capture_ended()  # a capture that never began holds no reader back
            raise

    def capture_end(self, *args, **kwargs):
        try:
            return originals[2](self, *args, **kwargs)
        finally:
            _capture_ended()

    setattr(cls, begin, functools.wraps(originals[1])(capture_begin))
    setattr(cls, end, functools.wraps(originals[2])(capture_end))
    _capture["originals"] = originals


def unguard_captures() -> None:
    originals = _capture["originals"]
    if originals is not None:
        cls, begin, end = originals
        setattr(cls, CAPTURE_METHODS[2], begin)
        setattr(cls, CAPTURE_METHODS[3], end)
        _capture["originals"] = None


def capturing() -> bool:
    return _capture["depth"] > 0


def counts(where: Path | None = None) -> dict[str, int] | None:
    """Scaled calls per wrapped unit in this process (of the drafters reporting to `where`,
    or all), read from the device counters; None while a CUDA-graph capture is in progress
    anywhere in the process (the caller asks again later)."""
    with _capture["lock"]:
        if _capture["depth"]:
            return None
        out: dict[str, int] = {}
        for tally in list(_tallies):
            if where is None or tally.where == where:
                for unit, value in tally.read().items():
                    out[unit] = out.get(unit, 0) + value
        return out


def _answered(where: Path) -> int:
    path = where / f"counts-{os.getpid()}.json"
    try:
        return int(json.loads(path.read_text()).get("request", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def answer(where: Path | None = None) -> list[Path]:
    """Write this process's counts for the newest flush request, in every proof directory
    one of its drafters reports to (or `where`); never raises."""
    written = []
    for folder in ([where] if where is not None else sorted({t.where for t in list(_tallies) if t.where}, key=str)):
        try:
            requests = [int(p.stem.split("-")[1]) for p in folder.glob("flush-*.request")]
        except (OSError, ValueError):
            continue
        newest = max(requests, default=0)
        if newest <= _answered(folder):
            continue
        try:
            values = counts(folder)
        except Exception as exc:  # a device error: say it, in the file the launcher reads
            values = {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        if values is None:
            continue  # a capture is in progress: the next round answers
        entry = {"kind": "counts", "pid": os.getpid(), "host": socket.gethostname(), "rank": rank(),
                 "request": newest, "counts": values}
        path = _write(folder, f"counts-{os.getpid()}.json", entry)
        if path is not None:
            written.append(path)
    return written


def _reporter(interval: float) -> None:
    while True:
        time.sleep(interval)
        answer()


def start_reporter(interval: float = 0.05) -> None:
    """The thread that answers flush requests (once per process; daemon). It touches the
    device only when a request is there, and never while a capture is in progress
    (guard_captures)."""
    guard_captures()
    if _state["reporter"] is None:
        thread = threading.Thread(target=_reporter, args=(interval,), name="sharpdraft-proof", daemon=True)
        _state["reporter"] = thread
        thread.start()


def _write(where: Path, name: str, entry: dict) -> Path | None:
    path = where / name
    try:
        where.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(entry, sort_keys=True))
        temporary.replace(path)  # readers never see half a record
        return path
    except OSError as exc:
        sys.stderr.write(f"sharpdraft: cannot write proof to {where}: {exc}\n")
        return None


def record(kind: str, where: Path | None = None, **fields) -> Path | None:
    """Write one record (kind: wrapped | refused | frozen) for this process into `where`
    (the drafter's config's proof directory; default: directory()); never raises (it runs
    inside TensorRT-LLM's model construction and import)."""
    where = where or directory()
    if where is None:
        return None
    _state["count"] += 1
    entry = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), "rank": rank(), **fields}
    return _write(Path(where), f"{kind}-{os.getpid()}-{_state['count']}.json", entry)


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


def runs_drafter(entry: dict) -> bool:
    """Whether a record's process runs its drafter: the last pipeline stage does (the
    drafter is the epilogue of SpecDecOneEngineForCausalLM), a record without a stage is a
    process without pipeline parallelism."""
    stage = entry.get("stage")
    return stage is None or bool(stage.get("last"))


def last_stage_ranks(world: int, pipeline: int) -> range:
    """The ranks of the last pipeline stage: TensorRT-LLM's Mapping puts pp_rank =
    rank // (tp * cp), so the last stage is the last world // pp ranks."""
    return range(int(world) - int(world) // int(pipeline), int(world))


def require(where, scaling, world: int = 1, pipeline: int = 1, frozen_allowed: bool = False) -> list[dict]:
    """The 'wrapped' (and, where the drafter's config allows it, 'frozen') records for this
    launch; ProofError (one line) unless each rank that runs a drafter wrapped it with
    `scaling` and nothing was refused: every rank of the world, or with `pipeline` > 1
    stages every rank of the last stage (the others build a drafter they never run), each
    record saying which stage it is from TensorRT-LLM's own mapping."""
    entries = read(where)
    held = [e for e in entries if e["kind"] in ("wrapped", FROZEN)]
    refused = [e for e in entries if e["kind"] == "refused"]
    head = "SharpDraft was requested but no drafter was wrapped in the worker processes"
    if refused:
        first = refused[0]
        raise ProofError(f"SharpDraft was requested but the hook could not apply it: pid {first['pid']} rank "
                         f"{first.get('rank', 0)} {first.get('drafter') or 'the hook'}: {first.get('reason', '?')}")
    frozen = [e for e in held if e["kind"] == FROZEN]
    if frozen and not frozen_allowed:
        raise ProofError(f"SharpDraft was requested but pid {frozen[0]['pid']} runs its drafter frozen: "
                         f"{frozen[0].get('reason', '?')}")
    if not held:
        raise ProofError(f"{head}: no proof in {where} (the hook never ran where TensorRT-LLM built the "
                         "drafter, or the drafter directory carries no SharpDraft parameters; install "
                         "the autoloader: python -m plugins.trtllm autoload install — docs/trtllm.md)")
    expected = scaling.to_dict()
    other = [e for e in held if e["kind"] == "wrapped" and e.get("scaling") != expected]
    if other:
        raise ProofError(f"{head} with this engine's QueryScaling: pid {other[0]['pid']} applied "
                         f"{other[0].get('scaling')} (expected {expected})")
    if int(pipeline) > 1:
        blind = [e for e in held if e.get("stage") is None]
        if blind:
            raise ProofError(f"SharpDraft with pipeline parallelism (pp={pipeline}) needs each drafter's stage, but pid "
                             f"{blind[0]['pid']} rank {blind[0].get('rank', 0)} could not read TensorRT-LLM's mapping "
                             "from its drafter config — run with pp=1, or --no-sharpdraft")
        required = last_stage_ranks(world, pipeline)
    else:
        required = range(int(world))
    pids_by_rank: dict[int, set] = {}
    for e in held:
        pids_by_rank.setdefault(int(e.get("rank", 0)), set()).add(e["pid"])
    seen = ", ".join(f"rank {r} pid {', '.join(map(str, sorted(p)))}" for r, p in sorted(pids_by_rank.items()))
    missing = [r for r in required if r not in pids_by_rank]
    if missing:
        raise ProofError(f"{head} of rank(s) {', '.join(map(str, missing))} of {world} (wrapped: {seen}); a rank "
                         "without the autoloader runs unscaled")
    owners: dict[int, int] = {}
    for r, pids in pids_by_rank.items():
        for pid in pids:
            if owners.setdefault(pid, r) != r:
                raise ProofError(f"{head} of distinct processes: pid {pid} reported ranks {owners[pid]} and {r} "
                                 f"(world {world}; wrapped: {seen})")
    return held


def request_counts(where, held: list[dict], timeout: float = 60.0, poll: float = 0.02) -> dict[int, dict]:
    """Ask every process that wrapped a drafter for its device counts and wait for the
    answers: {pid: {unit: count}}. ProofError (one line) when a process does not answer
    within `timeout` seconds."""
    where = Path(where)
    pids = sorted({e["pid"] for e in held if e["kind"] == "wrapped"})
    number = 1 + max((int(p.stem.split("-")[1]) for p in where.glob("flush-*.request")), default=0)
    (where / f"flush-{number}.request").write_text("")
    deadline = time.monotonic() + timeout
    answers: dict[int, dict] = {}
    while True:
        for pid in pids:
            try:
                entry = json.loads((where / f"counts-{pid}.json").read_text())
            except (OSError, ValueError):
                continue
            if int(entry.get("request", 0)) >= number:
                answers[pid] = entry["counts"]
        if len(answers) == len(pids):
            return answers
        if time.monotonic() > deadline:
            late = [p for p in pids if p not in answers]
            raise ProofError(f"SharpDraft's scaled-call counts did not come back from pid {late[0]} within "
                             f"{timeout:g} s: cannot prove its drafter runs scaled")
        time.sleep(poll)


def require_growth(held: list[dict], before: dict[int, dict], after: dict[int, dict]) -> dict[int, dict]:
    """ProofError (one line) unless every process that runs a drafter has one wrapped
    drafter whose every layer counted more scaled calls after the requests than before
    them; returns `after`. A drafter none of whose layers counted was built and dropped
    (TensorRT-LLM's MetaInitMode fallback builds the model twice) or never called: it is
    not the one that serves, and cannot refuse the launch. A drafter some of whose layers
    counted and others not ran a layer unscaled: refused."""
    serving: dict[int, list[dict]] = {}
    for e in held:
        if e["kind"] == "wrapped" and runs_drafter(e):
            serving.setdefault(e["pid"], []).append(e)
    for pid, drafters in serving.items():
        got = after.get(pid, {})
        if "error" in got:
            raise ProofError(f"SharpDraft's scaled-call counts of pid {pid} could not be read: {got['error']}")
        grown = []
        for e in drafters:
            stayed = [u for u in e.get("units", ()) if got.get(u, 0) <= before.get(pid, {}).get(u, 0)]
            if stayed and len(stayed) < len(e.get("units", ())):
                raise ProofError(f"SharpDraft's scaled-call count of {stayed[0]} (pid {pid} rank {e.get('rank', 0)}) "
                                 f"stayed at {got.get(stayed[0], 0)} while its other layers counted: that layer ran "
                                 "unscaled")
            if not stayed:
                grown.append(e)
        if not grown:
            e = drafters[-1]
            unit = (e.get("units") or ["(no unit)"])[0]
            raise ProofError(f"SharpDraft's scaled-call count of {unit} (pid {pid} rank {e.get('rank', 0)}) "
                             f"stayed at {got.get(unit, 0)} after the first requests: that drafter ran unscaled")
    return after


def summary(held: list[dict], counted: dict[int, dict] | None = None) -> dict:
    """What a health/metadata output reports: the applied scaling and where, the scaled-call
    counts, and the frozen drafters (metric sharpdraft_frozen_drafters)."""
    wrapped = [e for e in held if e["kind"] == "wrapped"]
    frozen = [e for e in held if e["kind"] == FROZEN]
    out = {"sharpdraft": bool(wrapped), "scaling": (wrapped or held)[0].get("scaling"),
           "drafters": sorted({e["drafter"] for e in held}),
           "processes": sorted({e["pid"] for e in held}),
           "ranks": sorted({int(e.get("rank", 0)) for e in held}),
           "layers": max((e.get("layers", 0) for e in wrapped), default=0),
           "metrics": {"sharpdraft_frozen_drafters": len(frozen),
                       "sharpdraft_scaled_calls": sum(sum(v for v in c.values() if isinstance(v, int))
                                                      for c in (counted or {}).values())}}
    if frozen:
        out["frozen"] = [{"pid": e["pid"], "rank": e.get("rank", 0), "drafter": e.get("drafter"),
                          "reason": e.get("reason")} for e in frozen]
    if counted is not None:
        out["counts"] = {str(pid): c for pid, c in sorted(counted.items())}
    return out
