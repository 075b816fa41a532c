"""engine.json: what an engine directory holds, how it was built, and the sha256 of
every file it depends on. The runtime refuses an engine whose files no longer match.

Dependencies outside the engine directory (target and drafter checkpoints) are named
relative to the checkout when they lie inside it, so a moved or copied checkout, or an
engine directory copied anywhere, still finds them; elsewhere they are absolute.

Verification: the build hashes every file; a load compares each file's size and
modification time with a stamp (`.verified.json` in the engine directory) written by
the last load that hashed it, and hashes only what the stamp does not vouch for. So a
load takes milliseconds at any model size, a changed file is still refused, and
`verify="full"` (the commands' --verify) hashes everything again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path

from plugins.scaling import QueryScaling
from runtime.models.target import sha256_file
from runtime.modes import FAMILIES

FORMAT_VERSION = 2  # 2: checkout-relative dependency paths, exact dependency lists
MANIFEST = "engine.json"
STAMP = ".verified.json"
VERIFY_MODES = ("quick", "full", "skip")
DRAFTERS = tuple(sorted(FAMILIES))  # the drafters this runtime runs
# Drafters whose models this runtime does not have yet: only --backend trtllm builds an
# engine for them, i.e. configuration for TensorRT-LLM pointing at their checkpoint.
TRTLLM_ONLY_DRAFTERS = ()
CHECKOUT = Path(__file__).resolve().parents[1]
# A file modified within this many seconds of being stamped could change again within the
# same timestamp tick, unseen; such files are hashed again next time instead of stamped.
RACY_SECONDS = 2.0


class EngineError(ValueError):
    """An engine directory we cannot use, with a one-line reason."""


def portable_path(path: str | Path) -> str:
    """How engine.json names a dependency: checkout-relative inside the checkout."""
    path = Path(path).resolve()
    try:
        return path.relative_to(CHECKOUT).as_posix()
    except ValueError:
        return str(path)


def resolve_path(stored: str) -> Path:
    """The inverse of portable_path, against the checkout this code runs from."""
    path = Path(stored)
    return path if path.is_absolute() else CHECKOUT / path


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def engine_files(engine_dir: Path) -> dict:
    """Manifest.artifacts: sha256 of every file in an engine directory but engine.json
    and the verification stamp."""
    return {p.name: _file_entry(p) for p in sorted(Path(engine_dir).iterdir())
            if p.is_file() and p.name not in (MANIFEST, STAMP)}


def dependency_record(directory: Path, names: list[str]) -> dict:
    """engine.json's record of a checkpoint: where it is and the sha256 of the files the
    engine reads from it (`names`), nothing else: cards and a drafter's calibration file
    (read once, at build time, into engine.json) may change freely."""
    directory = Path(directory)
    return {"path": portable_path(directory),
            "files": {name: _file_entry(directory / name) for name in sorted(names)}}


# What a measured record must share with an engine as loaded to apply to it.
PLACEMENT = ("backend", "device", "dtype", "steps")


@dataclasses.dataclass
class Manifest:
    drafter: str
    backend: str
    target: dict
    drafter_checkpoint: dict | None  # None: a drafter without weights (n-gram lookup)
    query_scaling: QueryScaling | None
    block_size: int
    dtype: str = "float32"
    artifacts: dict = dataclasses.field(default_factory=dict)  # files inside the engine dir
    extra: dict = dataclasses.field(default_factory=dict)  # calibration, export details ...
    format_version: int = FORMAT_VERSION
    # the directory it was read from (read_manifest), so the spec opened over it can be
    # handed down in its place; not written to engine.json
    dir: Path | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def target_dir(self) -> Path:
        return resolve_path(self.target["path"])

    @property
    def drafter_dir(self) -> Path | None:
        return resolve_path(self.drafter_checkpoint["path"]) if self.drafter_checkpoint else None

    def build_placement(self, backend: str) -> dict:
        """Where build_engine.py times an engine's steps and modes: `backend` on the CPU,
        in engine.json's dtype, steps not compiled (steps None)."""
        return {"backend": backend, "device": "cpu", "dtype": self.dtype, "steps": None}

    def measured_on(self, record: dict | None, placement: dict) -> dict | None:
        """`record` (step costs or the default mode, from engine.json) if it was measured
        where `placement` runs (PLACEMENT: backend, device, dtype, steps; a field the record
        lacks, as in engines built before it was kept, is the build's), else None: costs
        timed on a CPU say nothing of a GPU, nor uncompiled steps of CUDA graphs."""
        if not record:
            return None
        where = self.placement_of(record, placement["backend"])
        return record if all(where[k] == placement[k] for k in PLACEMENT) else None

    def placement_of(self, record: dict, backend: str) -> dict:
        """Where `record` was measured: its own PLACEMENT fields, the build's for those it
        lacks (`backend` where it names none: step costs are kept per backend)."""
        return self.build_placement(record.get("backend", backend)) | {
            k: record[k] for k in PLACEMENT if k in record}

    def default_record(self, placement: dict) -> dict | None:
        """The default-mode record measured where `placement` runs: extra.default_mode
        (the build's, or the last measured) or one of extra.default_modes (others kept by
        `default-mode`); None: the table's rule."""
        records = [self.extra.get("default_mode")] + self.extra.get("default_modes", [])
        return next((r for r in records if self.measured_on(r, placement)), None)

    def keep_default_record(self, record: dict) -> None:
        """Record a measured default: as extra.default_mode, and the one it replaces, if
        measured elsewhere, into extra.default_modes (one record per placement)."""
        where = self.placement_of(record, self.backend)
        old = self.extra.get("default_mode")
        kept = [r for r in [old] + self.extra.get("default_modes", [])
                if r and self.placement_of(r, self.backend) != where]
        self.extra["default_mode"] = record
        if kept:
            self.extra["default_modes"] = kept
        else:
            self.extra.pop("default_modes", None)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        del data["dir"]
        data["query_scaling"] = self.query_scaling.to_dict() if self.query_scaling else None
        data["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return data

    def write(self, engine_dir: Path) -> Path:
        engine_dir.mkdir(parents=True, exist_ok=True)
        path = engine_dir / MANIFEST
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def read_manifest(engine_dir: Path, verify: str = "quick") -> Manifest:
    """engine.json parsed and checked (runtime/spec.py: open_spec is the way in, its one
    caller)."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if not engine_dir.is_dir():
        raise EngineError(f"{engine_dir} does not exist — run build_engine.py first")
    if not path.is_file():
        raise EngineError(f"{engine_dir} has no {MANIFEST} — run build_engine.py first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON ({exc}) — rebuild the engine") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise EngineError(f"{path} has format_version {version!r}; this runtime reads "
                          f"{FORMAT_VERSION} — rebuild the engine")
    try:
        scaling = data["query_scaling"]
        manifest = Manifest(
            drafter=data["drafter"], backend=data["backend"], target=data["target"],
            drafter_checkpoint=data["drafter_checkpoint"],
            query_scaling=QueryScaling.from_dict(scaling) if scaling else None,
            block_size=int(data["block_size"]), dtype=data.get("dtype", "float32"),
            artifacts=data.get("artifacts", {}), extra=data.get("extra", {}), dir=engine_dir)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path} is malformed ({exc}) — rebuild the engine") from None
    if verify != "skip":
        verify_files(engine_dir, manifest, full=verify == "full")
    return manifest


def dependencies(engine_dir: Path, manifest: Manifest) -> list[tuple[Path, dict]]:
    """(file, its record) for everything the engine depends on."""
    checks = [(manifest.target_dir / name, rec) for name, rec in manifest.target["files"].items()]
    if manifest.drafter_checkpoint:
        checks += [(manifest.drafter_dir / name, rec)
                   for name, rec in manifest.drafter_checkpoint["files"].items()]
    return checks + [(engine_dir / name, rec) for name, rec in manifest.artifacts.items()]


def verify_files(engine_dir: Path, manifest: Manifest, full: bool = False) -> None:
    """Refuse the engine if a dependency is missing or its content changed; hash only the
    files the stamp does not vouch for (all of them when `full`), then refresh the stamp."""
    stamp = {} if full else _read_stamp(engine_dir)
    fresh = {}
    now = time.time()
    for path, rec in dependencies(engine_dir, manifest):
        if not path.is_file():
            raise EngineError(f"{path} named in {engine_dir / MANIFEST} is missing — rebuild the engine")
        st = path.stat()
        key, seen = str(path.resolve()), [st.st_size, st.st_mtime_ns, rec["sha256"]]
        if stamp.get(key) == seen:
            fresh[key] = seen
            continue
        if st.st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
            raise EngineError(f"{path} does not match the sha256 in {engine_dir / MANIFEST} — "
                              "rebuild the engine")
        if now - st.st_mtime > RACY_SECONDS:
            fresh[key] = seen
    if fresh != stamp:
        _write_stamp(engine_dir, fresh)


def _read_stamp(engine_dir: Path) -> dict:
    try:
        data = json.loads((engine_dir / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_stamp(engine_dir: Path, stamp: dict) -> None:
    # Atomic (server instances load at once); a read-only engine simply hashes every time.
    tmp = engine_dir / f"{STAMP}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(stamp, indent=1) + "\n")
        os.replace(tmp, engine_dir / STAMP)
    except OSError:
        tmp.unlink(missing_ok=True)


DRAFT_VOCAB_FILE = "draft-vocab.npy"  # a DFlash drafter's draft vocabulary (target ids)


def read_draft_vocab(engine_dir: Path, record: dict):
    """The DraftVocab of an engine's DFlash drafter graphs (their logits' columns), from
    the file export's record names; None where the graphs return logits over the whole
    vocabulary (no draft vocabulary, or an engine exported before they were compact)."""
    import numpy as np
    import torch

    from runtime.sampling import DraftVocab

    entry = record.get("draft_vocab")
    if not entry:
        return None
    path = Path(engine_dir) / entry["file"]
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path} cannot be read ({exc}) — rebuild the engine") from None
    size = int(entry["target_vocab_size"])
    if (ids.ndim != 1 or ids.dtype != np.int64 or not len(ids) or ids.min() < 0
            or ids.max() >= size or len(np.unique(ids)) != len(ids)):
        raise EngineError(f"{path} is not a draft vocabulary of distinct target ids below "
                          f"{size} — rebuild the engine")
    return DraftVocab(torch.from_numpy(ids), size)
