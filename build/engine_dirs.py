"""Writing an engine directory: every build writes into `<out>.partial` and publishes it
with one rename, so that a failed build leaves no half engine behind."""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.manifest import verify_files


def scratch(out: Path) -> Path:
    """An empty scratch directory beside `out` for a build to write into."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, out: Path, manifest) -> None:
    """Replace `out` with the finished scratch directory; every file is hashed once more
    and stamped for fast loads."""
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    verify_files(out, manifest, full=True)
