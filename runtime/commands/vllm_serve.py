"""`python -m runtime vllm-serve --engine-dir DIR [-- vllm serve options]`: vLLM's own
OpenAI-compatible server for an engine built with `build_engine.py --backend vllm`, started
in vLLM's environment (plugins/vllm/launch.py), on loopback unless --host says otherwise.

For a SharpDraft engine it serves only after the proof gate: every draft layer wrapped with
the engine's QueryScaling, and each layer's device count of scaled calls grown across one
short request of ours; otherwise it stops vLLM and says why in one line (exit 2). What was
checked is printed as one JSON line ("sharpdraft_applied"). --no-sharpdraft serves the stock
checkpoint (frozen). vLLM's /metrics then shows its own speculative-decoding counters
(`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`: MAL = 1 + accepted / drafts)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser("vllm-serve", help="vLLM's OpenAI server for a vllm engine, SharpDraft's plugin proven")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--no-sharpdraft", action="store_true", help="serve the stock drafter (frozen)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients send (default: the engine directory's name)")
    p.add_argument("--vllm-python", metavar="PATH", help="the interpreter of an environment with vllm and this "
                   "project installed (default: .cache/vllm-venv, made by `make vllm`)")
    p.add_argument("--log", metavar="FILE", help="vLLM's output (default: ENGINE_DIR/vllm-serve.log)")
    p.add_argument("--check-only", action="store_true", help="start, run the proof gate, stop")
    p.add_argument("serve_args", nargs="*", metavar="-- OPTION",
                   help="passed on to `vllm serve` (after --), e.g. -- --max-num-seqs 8")


def run(args) -> int:
    from plugins.vllm import launch
    from runtime.backends import SERVES_ITSELF
    from runtime.cli import UsageError, progress
    from runtime.spec import open_spec

    spec = open_spec(Path(args.engine_dir))
    if spec.backend not in SERVES_ITSELF or spec.refusals:
        raise UsageError(spec.refusals[0] if spec.refusals else
                         f"{args.engine_dir} was built for backend {spec.backend!r}; vllm-serve serves "
                         "engines built with build_engine.py --backend vllm")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    loop = spec.loader(spec.dir, spec.manifest, spec.drafting)
    sharpdraft = spec.scaling is not None and not args.no_sharpdraft
    vllm = spec.manifest.extra["vllm"]["speculative"]
    name = args.served_model_name or spec.dir.name
    log = Path(args.log or spec.dir / "vllm-serve.log")

    def ready(base: str, applied: dict) -> None:
        print(json.dumps({"sharpdraft_applied": applied}), file=sys.stderr, flush=True)
        progress(f"serving {name} at {base}/v1 (vLLM, {'SharpDraft' if sharpdraft else 'frozen drafter'}; "
                 f"log {log})")

    # SIGTERM (a supervisor's stop, `kill`) unwinds like Ctrl-C, so the launcher stops vLLM,
    # which runs in its own process group, instead of leaving it serving orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        launch.serve(spec.manifest.target_dir, loop.drafter_dir(sharpdraft), vllm["method"],
                     vllm["num_speculative_tokens"], port=args.port, host=args.host, name=name,
                     max_model_len=spec.manifest.extra["max_seq_len"], log=log, python=args.vllm_python,
                     extra_args=args.serve_args, parallel=vllm.get("parallel_drafting", False),
                     on_ready=ready, stop_after_check=args.check_only)
    except launch.LaunchError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        progress("stopped")
    return 0
