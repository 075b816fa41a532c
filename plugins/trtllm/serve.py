"""`python -m runtime trtllm-serve --engine-dir DIR [-- trtllm-serve options]`: TensorRT-LLM's
OpenAI-compatible server for a trtllm engine, with SharpDraft applied where the drafter runs.
(The command is registered by runtime/commands/trtllm_serve.py, which reads the engine's
manifest and calls `run` here.)

It writes the engine's LLM-API arguments (speculative_config included, and the parallel
sizes you pass) to a YAML file, and hands over to trtllm-serve's own entry point (console
script `trtllm-serve` = tensorrt_llm.commands.serve:main) as `trtllm-serve MODEL --config
FILE [options]`. With SharpDraft (plugins/trtllm/launch.py, docs/trtllm.md):
- before TensorRT-LLM builds anything: the structure check, the refusals of
  configurations whose key count is not exact, the drafter directory's own SharpDraft
  parameters, and the hook's reach: one GPU without the autoloader keeps the executor in
  this process (TLLM_WORKER_USE_SINGLE_PROCESS=1 unless you set it, said with the reason);
  tp/pp > 1 need the .pth lazy hook (`python -m plugins.trtllm autoload install`);
- the proof gate on TensorRT-LLM's LLM class itself (pins.LLM_CLASS; launch.Launch.gate):
  every name bound to it is the same object, so whichever serving entry point builds the
  LLM, whenever it imported the name, goes through it; trtllm-serve subcommands that serve
  otherwise (pins.SERVE_SUBCOMMANDS) are refused;
- once the LLM is built, before it serves: the proof that a drafter was wrapped on every
  rank, then one short request of ours and the device counts of scaled calls, which must
  have grown on every wrapped layer (with or without CUDA graphs), else one line and exit 1.
  The applied scaling and counts are printed (one JSON line on stderr, "sharpdraft_applied").
  Frozen runs (--no-sharpdraft) load the stock checkpoint.
--dry-run prints the command, config and environment without TensorRT-LLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from . import config as trtllm_config
from . import pins
from . import autoload
from .launch import LaunchError


def add_arguments(p) -> None:
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--no-sharpdraft", action="store_true", help="run the drafter frozen")
    p.add_argument("--dry-run", action="store_true",
                   help="print the trtllm-serve command, config and environment; run nothing")
    p.add_argument("--debug", action="store_true")
    p.add_argument("serve_args", nargs="*", metavar="-- OPTION",
                   help="passed on to trtllm-serve (after --), e.g. -- --port 8000 --tp_size 2")


def _positive_int(flag: str, value: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{flag} takes a positive integer, got {value!r}") from None
    if number < 1:
        raise LaunchError(f"{flag} takes a positive integer, got {value!r}")
    return number


def parallel_sizes(serve_args: list[str]) -> dict:
    """{tp|pp|cp: size} given on trtllm-serve's command line, every alias, `--flag N` or
    `--flag=N`; a config file of the user's is refused (the engine's config is the one)."""
    aliases = {flag: key for key, flags in pins.PARALLEL_FLAGS.items() for flag in flags}
    sizes, i = {}, 0
    while i < len(serve_args):
        arg = serve_args[i]
        flag, eq, value = arg.partition("=")
        if i == 0 and arg in pins.SERVE_SUBCOMMANDS:
            raise LaunchError(f"trtllm-serve {arg} builds its server outside the path SharpDraft's proof gate "
                              "checks — run it with --no-sharpdraft, or plain serving")
        if flag in pins.SERVE_CONFIG_FLAGS:
            raise LaunchError(f"{flag} is written by this command from the engine directory; pass "
                             "trtllm-serve options, or use trtllm-serve directly (docs/trtllm.md)")
        if flag in aliases:
            if not eq:
                if i + 1 >= len(serve_args):
                    raise LaunchError(f"{flag} needs a value")
                value = serve_args[i + 1]
                i += 1
            sizes[aliases[flag]] = _positive_int(flag, value)
        i += 1
    return sizes


def plan(manifest, engine_dir: Path, sharpdraft: bool, serve_args: list[str]) -> dict:
    """What will run: trtllm-serve's argv (config path left to fill), config and environment."""
    from .launch import refuse_inexact

    if manifest.backend != "trtllm":
        raise LaunchError(f"{engine_dir} was built for backend {manifest.backend!r}; trtllm-serve runs "
                         "engines built with build_engine.py --backend trtllm")
    scaling = manifest.query_scaling if sharpdraft else None
    config = trtllm_config.llm_api_config(manifest, sharpdraft=scaling is not None)
    # trtllm-serve lets the config file override its command line: the sizes asked for on
    # the command line go into the file, or the file's tensor_parallel_size: 1 would win.
    for key, size in parallel_sizes(serve_args).items():
        config[pins.PARALLEL_FIELDS[key]] = size
    model = config.pop("model")
    site = autoload.find_site()
    sizes = trtllm_config.world_sizes(config)
    world = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if scaling is not None:
        refuse_inexact(config, manifest.drafter, manifest.drafter_dir)
        if world > 1 and site is None:
            raise LaunchError(f"tp={sizes['tp']} pp={sizes['pp']} run TensorRT-LLM's model in MPI worker "
                             "processes, which this process's hook does not reach — run `python -m "
                             "plugins.trtllm autoload install` first (docs/trtllm.md)")
    from .launch import single_process_env

    env = single_process_env(world, site is not None, lambda line: sys.stderr.write(line + "\n")) \
        if scaling is not None else {}
    return {"argv": ["trtllm-serve", model, "--config", None, *serve_args], "config": config | {"model": model},
            "env": env, "scaling": scaling, "autoload": site is not None, "world": world, "manifest": manifest}


def run(args, manifest, progress=lambda line: sys.stderr.write(line + "\n")) -> int:
    import importlib

    from . import launch as trtllm

    serve_args = [a for a in args.serve_args if a != "--"]
    what = plan(manifest, Path(args.engine_dir), not args.no_sharpdraft, serve_args)
    config = dict(what["config"])
    config.pop("model")
    if args.dry_run:
        print(json.dumps({"command": shlex.join(a or "<config>" for a in what["argv"]), "env": what["env"],
                          "config": config, "autoload_installed": what["autoload"], "world": what["world"],
                          "sharpdraft": what["scaling"].to_dict() if what["scaling"] else None}))
        return 0
    trtllm.require_tensorrt_llm()
    module_name, attribute = pins.SERVE_ENTRY
    serve_module = importlib.import_module(module_name)
    entry = getattr(serve_module, attribute, None)
    if entry is None:
        raise ImportError(f"TensorRT-LLM has no {module_name}.{attribute} (trtllm-serve's entry point)")
    for key, value in what["env"].items():
        os.environ.setdefault(key, value)
    launch = None
    if what["scaling"] is not None:
        manifest = what["manifest"]
        launch = trtllm.Launch(what["scaling"], what["config"], manifest.drafter, manifest.drafter_dir)
        config = launch.llm_config(config)  # the drafter view: the proof directory travels in its config
        try:
            launch.gate(probe=True)  # the LLM class itself: no binding of it serves unchecked
        except ImportError:
            launch.close()
            raise
    config_file = tempfile.NamedTemporaryFile("w", prefix="sharpdraft-trtllm-", suffix=".yaml", delete=False)
    with config_file:
        config_file.write(trtllm_config.to_yaml(config))
    what["argv"][3] = config_file.name
    progress(f"trtllm-serve {' '.join(what['argv'][1:])}"
             + (f" (SharpDraft: ref_keys={what['scaling'].ref_keys})" if what["scaling"] else " (frozen)"))
    sys.argv = what["argv"]
    try:
        if hasattr(entry, "main"):  # a click command; our proof check's error propagates as is
            import click

            try:
                return entry.main(args=what["argv"][1:], prog_name="trtllm-serve", standalone_mode=False) or 0
            except click.ClickException as exc:  # its own usage errors, in its own words
                exc.show()
                return exc.exit_code
        return entry() or 0
    finally:
        if launch is not None:
            launch.close()
