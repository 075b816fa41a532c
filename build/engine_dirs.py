"""Writing an engine directory: every build writes into `<out>.partial` and publishes it
with one rename, so that a failed build leaves no half engine behind."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

from runtime.manifest import engine_files, verify_files


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


@contextmanager
def engine_dir(out: Path):
    """The scratch directory a build writes `out` into (scratch), removed if the build
    fails; the build ends inside it with seal()."""
    partial = scratch(out)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def seal(partial: Path, out: Path, manifest) -> None:
    """The build's last step: engine.json records every file of the scratch directory, is
    written there, and the directory is published as `out`."""
    manifest.artifacts = engine_files(partial)
    manifest.write(partial)
    publish(partial, out, manifest)
