"""`python -m runtime trtllm-serve --engine-dir DIR [-- trtllm-serve options]`: TensorRT-LLM's
OpenAI-compatible server for a trtllm engine, with SharpDraft's hook installed first.

It writes the engine's LLM-API arguments (speculative_config included) to a YAML file,
installs the hook in this process, exports SHARPDRAFT_TRTLLM for TensorRT-LLM's worker
processes, and hands over to trtllm-serve's own entry point (the console script
`trtllm-serve` = tensorrt_llm.commands.serve:main) as `trtllm-serve MODEL --config FILE
[options]`. Where the model runs decides what else is needed (docs/trtllm.md):
- one GPU: TLLM_WORKER_USE_SINGLE_PROCESS=1 (set here unless you set it) keeps the
  executor in this process, where the hook is;
- several GPUs (MPI workers): install the env-gated .pth autoloader once
  (`python -m plugins.trtllm autoload install`); the workers then install the hook from
  SHARPDRAFT_TRTLLM. This command refuses --tp_size > 1 without it.
--dry-run prints the command and environment without TensorRT-LLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from runtime.cli import UsageError, progress


def add_parser(sub):
    p = sub.add_parser("trtllm-serve", help="TensorRT-LLM's trtllm-serve for a trtllm engine, with "
                                            "SharpDraft's hook installed")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--no-sharpdraft", action="store_true", help="run the drafter frozen")
    p.add_argument("--dry-run", action="store_true",
                   help="print the trtllm-serve command, config and environment; run nothing")
    p.add_argument("--debug", action="store_true")
    p.add_argument("serve_args", nargs="*", metavar="-- OPTION",
                   help="passed on to trtllm-serve (after --), e.g. -- --port 8000")


def plan(engine_dir: Path, sharpdraft: bool, serve_args: list[str]) -> dict:
    """What will run: trtllm-serve's argv (config path left to fill), config and environment."""
    from plugins.trtllm import autoload, pins
    from runtime import trtllm
    from runtime.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    if manifest.backend != "trtllm":
        raise UsageError(f"{engine_dir} was built for backend {manifest.backend!r}; trtllm-serve runs "
                         "engines built with build_engine.py --backend trtllm")
    config = trtllm.llm_api_config(manifest)
    model = config.pop("model")
    scaling = manifest.query_scaling if sharpdraft else None
    env = trtllm.scaling_env(scaling)
    autoloaded = autoload_installed()
    parallel = any(a.split("=")[0] in ("--tp_size", "--pp_size") and not a.endswith("=1")
                   for a in serve_args if a.startswith("--"))
    if parallel and scaling and not autoloaded:
        raise UsageError("several GPUs run TensorRT-LLM's model in MPI workers, which this process's hook "
                         "does not reach — run `python -m plugins.trtllm autoload install` first")
    if not autoloaded and pins.SINGLE_PROCESS_ENV not in os.environ:
        env[pins.SINGLE_PROCESS_ENV] = "1"
    return {"argv": ["trtllm-serve", model, "--config", None, *serve_args], "config": config,
            "env": env, "scaling": scaling, "autoload": autoloaded}


def autoload_installed() -> bool:
    import sysconfig

    from plugins.trtllm import autoload

    return any((Path(p) / autoload.PTH_NAME).is_file()
               for p in {sysconfig.get_paths()["purelib"], *[x for x in sys.path if x.endswith("-packages")]})


def run(args) -> int:
    from plugins.trtllm import install, pins
    from runtime import trtllm

    serve_args = [a for a in args.serve_args if a != "--"]
    what = plan(Path(args.engine_dir), not args.no_sharpdraft, serve_args)
    config_file = tempfile.NamedTemporaryFile("w", prefix="sharpdraft-trtllm-", suffix=".yaml", delete=False)
    with config_file:
        config_file.write(trtllm.to_yaml(what["config"]))
    what["argv"][3] = config_file.name
    if args.dry_run:
        print(json.dumps({"command": shlex.join(what["argv"]), "env": what["env"], "config": what["config"],
                          "autoload_installed": what["autoload"]}))
        return 0
    module_name, attribute = pins.SERVE_ENTRY
    trtllm.require_tensorrt_llm()
    import importlib

    entry = getattr(importlib.import_module(module_name), attribute, None)
    if entry is None:
        raise ImportError(f"TensorRT-LLM has no {module_name}.{attribute} (trtllm-serve's entry point)")
    os.environ.update(what["env"])
    if what["scaling"] is not None:
        install(what["scaling"])
    progress(f"trtllm-serve {' '.join(what['argv'][1:])}"
             + (f" (SharpDraft: ref_keys={what['scaling'].ref_keys})" if what["scaling"] else " (frozen)"))
    sys.argv = what["argv"]
    if hasattr(entry, "main"):  # a click command: it parses the rest and exits with its own code
        return entry.main(args=what["argv"][1:], prog_name="trtllm-serve") or 0
    return entry() or 0
