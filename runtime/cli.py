"""What every command line shares: one-line errors (`error: ...`, exit 2 for bad usage,
1 for failures), tracebacks only with --debug, progress on stderr, results on stdout."""

from __future__ import annotations

import argparse
import os
import sys

from runtime.manifest import EngineError
from runtime.models.target import ModelError


class UsageError(ValueError):
    """Bad input from the user: exit code 2."""


# ImportError: optional engines (TensorRT, TensorRT-LLM) that this host cannot load say
# so in one line (plugins.tensorrt.TensorRTUnavailable and friends).
EXPECTED = (UsageError, EngineError, ModelError, ValueError, FileNotFoundError,
            IsADirectoryError, PermissionError, UnicodeDecodeError, ImportError)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors, in our one-line form
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(main, argv, debug_flag="--debug") -> int:
    """Call main(argv); turn expected failures into one line on stderr. Every command
    starts here, so this is where the process is made offline by construction: the loaders
    also pass local_files_only, this keeps anything else from reaching for a model hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    debug = debug_flag in argv
    try:
        return main(argv) or 0
    except SystemExit as exc:  # argparse (--help, usage errors) has already printed
        return exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except UsageError as exc:
        if debug:
            raise
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except EXPECTED as exc:
        if debug:
            raise
        sys.stderr.write(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}\n")
        return 1
    except Exception as exc:  # a bug, not bad input: still one line, traceback on request
        if debug:
            raise
        sys.stderr.write(f"error: internal error: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''} (rerun with --debug)\n")
        return 1
