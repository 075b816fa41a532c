"""Which QueryScaling an engine is built with: the drafter checkpoint's own calibration
where it has one, else its family's preset (runtime/families.py), with the command line's
--ref-keys / --top-k / --slope / --max-log-scale on top, checked before anything loads."""

from __future__ import annotations

from pathlib import Path

from build import checkpoints
from plugins.scaling import QueryScaling
from runtime.cli import UsageError
from runtime.families import preset


def scaling_overrides(args, drafter: str) -> dict:
    """--ref-keys/--top-k/--slope/--max-log-scale given, checked before anything loads."""
    overrides = {k: v for k, v in (("ref_keys", args.ref_keys), ("top_k", args.top_k),
                                   ("slope", args.slope), ("max_log_scale", args.max_log_scale))
                 if v is not None}
    if not args.sharpdraft and overrides:
        raise UsageError(f"--{next(iter(overrides)).replace('_', '-')} needs --sharpdraft")
    try:
        QueryScaling(**(preset(drafter).to_dict() | overrides))
    except ValueError as exc:
        raise UsageError(f"invalid query scaling: {exc}") from None
    return overrides


def choose_scaling(args, drafter: str, drafter_dir: Path, overrides: dict):
    """(scaling or None, where it came from): the drafter's own calibration when its
    checkpoint has one, else the family preset; command-line values on top."""
    if not args.sharpdraft:
        return None, None
    calibrated = checkpoints.calibrated_scaling(drafter_dir)
    base, source = ((calibrated, f"calibrated ({checkpoints.CALIBRATION_FILE} in the drafter checkpoint)")
                    if calibrated else (preset(drafter), f"preset {drafter!r}"))
    if overrides:
        source += " + command-line values"
    try:
        return QueryScaling(**(base.to_dict() | overrides)), source
    except ValueError as exc:
        raise UsageError(f"invalid query scaling: {exc}") from None
