"""Release numbers compared as versions, without importing TensorRT-LLM or `packaging`.

Only to say whether a release is inside the range whose sources we read (pins.READ_RANGE,
both ends inclusive): a release outside it is named untested, never refused (compatibility
is decided by structure, plugins/trtllm/structure.py). A local build tag (`+cu130`,
`+gitabc`) and a post-release (`.post1`) belong to the release they are built from, so they
compare as that release; `.devN` builds precede it. Only what PEP 440 allows in TensorRT-LLM's own version strings is
parsed: N(.N)*, an optional a/b/rc pre-release, .postN, .devN, +local.
"""

from __future__ import annotations

import re

__all__ = ["parse", "in_range", "is_tested", "describe_range"]

_PATTERN = re.compile(r"^v?(?P<release>\d+(?:\.\d+)*)"
                      r"(?:[-_.]?(?P<pre>a|b|rc|alpha|beta|c)[-_.]?(?P<pre_n>\d*))?"
                      r"(?:[-_.]?post[-_.]?(?P<post>\d*))?"
                      r"(?:[-_.]?dev[-_.]?(?P<dev>\d*))?"
                      r"(?:\+(?P<local>[a-z0-9.]+))?$", re.IGNORECASE)
_PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2}


def parse(text: str) -> tuple:
    """A sortable key for a version string; ValueError (one line) when it is not one."""
    match = _PATTERN.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a version number")
    release = [int(x) for x in match["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:  # 1.4 == 1.4.0
        release.pop()
    if match["pre"]:
        pre = (_PRE[match["pre"].lower()], int(match["pre_n"] or 0))
    else:
        pre = (3, 0)  # a final release sorts after its pre-releases
    # A dev build sorts before what it is a dev build of; post and local are that release.
    dev = -1 if match["dev"] is not None else 0
    return tuple(release), pre, dev


def in_range(version: str, low: str, high: str) -> bool:
    """low <= version <= high, each compared as a release (post/local ignored)."""
    key = parse(version)
    return parse(low) <= key <= parse(high)


def is_tested(version: str, low: str, high: str) -> bool:
    """in_range, with a string that is no version number counted as untested."""
    try:
        return in_range(version, low, high)
    except ValueError:
        return False


def describe_range(low: str, high: str) -> str:
    return f"{low} to {high} (local +tags and .postN builds of those included)"
