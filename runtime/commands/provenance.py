"""Where a result came from: the command line that produced it, the machine it ran on and
when (UTC). Every command that writes a results JSON records these three, so that
`python -m runtime report` can print them beside each table without guessing."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def machine() -> dict:
    """The host, and torch's thread count where this process runs torch (a load test's
    client does not: it is not imported for this)."""
    from importlib import metadata

    torch = sys.modules.get("torch")
    try:
        version = torch.__version__ if torch else metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads() if torch else None,
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": version}


def command_line(command: str) -> str:
    """`python -m runtime <command> <its arguments>` as this process was started."""
    args = sys.argv[2:] if sys.argv[1:2] == [command] else []
    return shlex.join(["python", "-m", "runtime", command, *args])


def provenance(command: str, line: str | None = None) -> dict:
    """command: a `python -m runtime` command's name; or pass the whole command `line`
    (scripts: `shlex.join(["python", "-m", "scripts.x", *argv])`)."""
    return {"command": line or command_line(command), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
