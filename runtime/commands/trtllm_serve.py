"""`python -m runtime trtllm-serve --engine-dir DIR [-- trtllm-serve options]`: registered
here, run by plugins/trtllm/serve.py (everything TensorRT-LLM lives in plugins/trtllm/);
its refusals are usage errors of this command (one line, exit 2)."""

from __future__ import annotations


def add_parser(sub):
    from plugins.trtllm.serve import add_arguments

    p = sub.add_parser("trtllm-serve", help="TensorRT-LLM's trtllm-serve for a trtllm engine, with "
                                            "SharpDraft's hook installed")
    add_arguments(p)


def run(args) -> int:
    from pathlib import Path

    from plugins.trtllm import serve
    from plugins.trtllm.launch import LaunchError
    from runtime.cli import UsageError, progress
    from runtime.spec import open_spec

    try:  # the spec opened once, here, and its engine.json handed to the launcher
        return serve.run(args, open_spec(Path(args.engine_dir)).manifest, progress)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
