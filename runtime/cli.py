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


def add_device_options(p) -> None:
    """--device, --dtype, --steps: where and how the torch backend runs an engine;
    --prefill-dtype: the onnxruntime backend's prefill. The choices are names
    (runtime/placement.py), so a command's parser loads no backend; Engine passes the
    values to the backend's loader."""
    from runtime.placement import DEVICES, DTYPES, PREFILL_DTYPES, STEPS

    p.add_argument("--device", choices=DEVICES,
                   help="torch backend: run target and drafter on this device (default cpu)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="torch backend: weights and KV caches in this dtype (default: engine.json's)")
    p.add_argument("--steps", choices=STEPS,
                   help="torch backend: compiled fixed-shape decode, verify and DFlash steps "
                        "(eager: dynamo alone; inductor: torch.compile, CUDA graphs on cuda; "
                        "cudagraph: eager steps captured as CUDA graphs, cuda only); "
                        "default: every step eager")
    p.add_argument("--prefill-dtype", choices=PREFILL_DTYPES,
                   help="onnxruntime backend: bfloat16 runs the target's prefill in bfloat16 "
                        "multiplies (AMX), decode steps stay float32; tokens can differ from "
                        "the float32 target's, every mode stays lossless against it "
                        "(default float32: the graphs)")


def device_options(args) -> dict:
    """The Engine keywords of add_device_options' flags; a cuda the host lacks, or CUDA
    graphs off cuda, refused as bad usage."""
    options = {k: getattr(args, k, None) for k in ("device", "dtype", "steps", "prefill_dtype")}
    if options["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here — pass --device cpu")
    if options["steps"] == "cudagraph" and options["device"] != "cuda":
        raise UsageError("--steps cudagraph captures CUDA graphs: it needs --device cuda "
                         "(on the cpu: --steps inductor or eager)")
    return {k: v for k, v in options.items() if v is not None}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def code_commit(root: str | os.PathLike | None = None) -> str | None:
    """The commit of the code measuring (`git rev-parse --short HEAD`, "-dirty" when
    tracked files differ from it), for a result to say which code made it; None outside
    a git checkout. `root`: another checkout's (an A/B's arm), else this code's."""
    import subprocess

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


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
