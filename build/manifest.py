"""engine.json: what an engine directory holds, how it was built, and the sha256 of
every file it depends on. The runtime refuses an engine whose files no longer match."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

from plugins.scaling import QueryScaling
from runtime.models.target import sha256_file

FORMAT_VERSION = 1
MANIFEST = "engine.json"


class EngineError(ValueError):
    """An engine directory we cannot use, with a one-line reason."""


def file_record(path: Path) -> dict:
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def engine_files(engine_dir: Path) -> dict:
    """Manifest.artifacts: sha256 of every file in an engine directory but engine.json."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(Path(engine_dir).iterdir()) if p.is_file() and p.name != MANIFEST}


def checkpoint_record(directory: Path) -> dict:
    """sha256 of each file of a checkpoint directory (weights, config, tokenizer, the
    calibration); its prose (cards, *.md) is no dependency and may be edited freely."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix != ".md")
    return {"path": str(directory.resolve()),
            "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}}


@dataclasses.dataclass
class Manifest:
    drafter: str
    backend: str
    target: dict
    drafter_checkpoint: dict
    query_scaling: QueryScaling | None
    block_size: int
    dtype: str = "float32"
    artifacts: dict = dataclasses.field(default_factory=dict)  # files inside the engine dir
    extra: dict = dataclasses.field(default_factory=dict)  # calibration, export details ...
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["query_scaling"] = self.query_scaling.to_dict() if self.query_scaling else None
        data["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return data

    def write(self, engine_dir: Path) -> Path:
        engine_dir.mkdir(parents=True, exist_ok=True)
        path = engine_dir / MANIFEST
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def read_manifest(engine_dir: Path, verify: bool = True) -> Manifest:
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
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
            artifacts=data.get("artifacts", {}), extra=data.get("extra", {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path} is malformed ({exc}) — rebuild the engine") from None
    if verify:
        verify_files(engine_dir, manifest)
    return manifest


def verify_files(engine_dir: Path, manifest: Manifest) -> None:
    checks = [(Path(manifest.target["path"]) / name, rec)
              for name, rec in manifest.target["files"].items()]
    checks += [(Path(manifest.drafter_checkpoint["path"]) / name, rec)
               for name, rec in manifest.drafter_checkpoint["files"].items()]
    checks += [(engine_dir / name, rec) for name, rec in manifest.artifacts.items()]
    for path, rec in checks:
        if not path.is_file():
            raise EngineError(f"{path} named in {engine_dir / MANIFEST} is missing — rebuild the engine")
        if path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
            raise EngineError(f"{path} does not match the sha256 in {engine_dir / MANIFEST} — "
                              "rebuild the engine")
