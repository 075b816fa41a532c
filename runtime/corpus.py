"""Real text for training and evaluation: CPython's standard-library sources (and the
python3.11-doc reST sources where that Debian package is installed), split by file with
a fixed hash rule so evaluation documents never reach training or calibration."""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "calibration", "eval")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOCS = Path("/usr/share/doc/python3.11/html/_sources")
# Tests repeat themselves, pydoc_data is one generated 750 kB string, encodings are tables.
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "encodings"}


def split_of(name: str) -> str:
    """train 85% / calibration 5% / eval 10%, by a hash of the file's relative name."""
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 20
    return "eval" if bucket < 2 else "calibration" if bucket == 2 else "train"


def documents(split: str) -> list[Path]:
    """Files of one split, in a fixed order (sorted by relative name)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [path for name, path in _listing(STDLIB, DOCS) if split_of(name) == split]


@functools.cache
def _listing(stdlib: Path, docs: Path) -> tuple[tuple[str, Path], ...]:
    """Every corpus file under the two roots as (relative name, path), sorted by name:
    walked once per process (about a third of a second on these machines, and the
    commands and training read several splits); keyed on the roots, which tests point
    elsewhere."""
    found = []
    for root, pattern in ((stdlib, "*.py"), (docs, "*.rst.txt")):
        if not root.is_dir():
            continue
        for path in root.rglob(pattern):
            rel = path.relative_to(root)
            if SKIP_PARTS.isdisjoint(rel.parts):
                found.append((f"{root.name}/{rel}", path))
    return tuple(sorted(found))


def long_documents(split: str, min_chars: int) -> list[Path]:
    """Source files (.py) of a split with at least `min_chars` characters, longest first:
    what bench, calibrate and diagnose read by default, so that installing the reST
    sources (training text) does not change the documents every result was measured on."""
    docs = [p for p in documents(split) if p.suffix == ".py" and p.stat().st_size >= min_chars]
    return sorted(docs, key=lambda p: (-p.stat().st_size, str(p)))
