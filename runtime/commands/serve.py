"""`python -m runtime serve`: write the Triton model repository for an engine and, with
--start, run tritonserver on it until Ctrl-C / SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading

from runtime.backends import BACKENDS
from runtime.backends.bf16_prefill import ROWS as PREFILL_ROWS, chunk_problem
from runtime.cli import UsageError, add_device_options, device_options, progress
from runtime.serve.protocol import DEFAULT_MAX_NEW_TOKENS_LIMIT
from runtime.serve.repository import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK

API_KEY_ENV = "SHARPDRAFT_API_KEY"


def add_parser(sub):
    p = sub.add_parser("serve", help="write a Triton model repository (and start the server)")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--model-repository", required=True, metavar="OUT")
    p.add_argument("--model-name", help="default: the engine directory's name")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances (processes), each loading the engine once")
    p.add_argument("--streaming", action="store_true",
                   help="also write NAME-stream, a decoupled model: one response per verify step")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="each model's in-flight batch: requests join running decoding steps "
                        "up to this many sequences per instance (1: one at a time; default "
                        "%(default)s)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting for a batch row per instance before new ones are "
                        "refused as unavailable (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="chunked prefill: a joining prompt prefills this many tokens between "
                        "two steps of the running requests (0: whole; default %(default)s)")
    p.add_argument("--max-new-tokens-limit", type=int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                   help="refuse requests above this (default %(default)s)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="torch/onnxruntime/tensorrt: our Python-backend model runs the engine with "
                        "this backend instead of the one engine.json names; trtllm: TensorRT-LLM's "
                        "llmapi model with SharpDraft's hook, for engines built with --backend trtllm")
    add_device_options(p)
    p.add_argument("--threads", default="auto",
                   help="torch threads per instance ('auto': cores / instances)")
    p.add_argument("--llmapi-model", metavar="DIR",
                   help="trtllm: TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm, copied "
                        "in (else 1/model.py finds it through $SHARPDRAFT_LLMAPI_MODEL)")
    p.add_argument("--start", action="store_true", help="run tritonserver on --host")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address every port binds to (default %(default)s: this host only; "
                        "0.0.0.0: every interface -- put a TLS proxy in front, docs/serving.md)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on the OpenAI endpoint and on "
                        f"Triton's HTTP/gRPC inference (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, metavar="PORT",
                   help="also serve the OpenAI API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health) on --host:PORT in front of the streaming model (implies "
                        "--streaming; needs --start)")
    p.add_argument("--tritonserver", metavar="PATH",
                   help="server binary (default: tritonserver on PATH, else the nvidia-pytriton "
                        "wheel from `make setup`)")
    p.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument("--server-log", metavar="FILE", help="server output here instead of stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verify", action="store_true",
                   help="hash every file the engine depends on (default: size/mtime stamp)")
    p.add_argument("--debug", action="store_true")


def run(args) -> int:
    from pathlib import Path

    from runtime.serve import repository, server
    from runtime.spec import open_spec

    # the spec opened once, here: the repository writers, the HTTP body bound and the
    # OpenAI endpoint get it; each Triton model process opens its own once, where it loads
    options = device_options(args)  # the loader's options: runtime.backends.OPTIONS' keys
    spec = open_spec(args.engine_dir, args.backend, verify="full" if args.verify else "quick",
                     **options)
    if spec.refusals:
        raise UsageError(spec.refusals[0])
    if not spec.can.triton:  # an engine that serves itself (vLLM's OpenAI server)
        raise UsageError(f"{args.engine_dir} runs in {spec.can.runs_in}, which serves it itself: "
                         f"python -m runtime {spec.backend}-serve --engine-dir {args.engine_dir}")
    if spec.own_loop:
        return _write_trtllm(args, spec)
    if args.llmapi_model:
        raise UsageError("--llmapi-model goes with a backend that runs its own loop (--backend trtllm)")
    grid = PREFILL_ROWS if options.get("prefill_dtype") == "bfloat16" else None
    if problem := chunk_problem(args.prefill_chunk, grid):
        raise UsageError(problem)
    limit = args.max_new_tokens_limit
    ports = server.Ports(args.http_port, args.grpc_port, args.metrics_port)
    try:
        ports.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if (args.host != "127.0.0.1" or args.api_key is not None) and not args.start:
        raise UsageError("--host and --api-key are for the server: add --start")
    # the environment's key only where a server starts (writing a repository needs none)
    if args.start and args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not _token(args.api_key):
        raise UsageError(f"--api-key (or ${API_KEY_ENV}) must be 8 to 256 printable ASCII characters "
                         "with no space, ',', ':' or '=' (Triton's restricted-API options carry it)")
    if args.openai_port is not None:
        if not args.start:
            raise UsageError("--openai-port serves next to a running tritonserver: add --start")
        if not 1 <= args.openai_port <= 65535 or args.openai_port in dataclasses.astuple(ports):
            raise UsageError(f"--openai-port must be in 1..65535 and differ from the Triton ports, "
                             f"got {args.openai_port}")
        args.streaming = True  # the endpoint speaks to the streaming (in-flight batched) model
    install = None
    if args.start:  # find the server before writing anything: a missing one is the likely error
        try:
            install = server.find_tritonserver(args.tritonserver)
        except server.ServerError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 1
    try:
        models = repository.write_repository(spec, args.model_repository,
                                             args.model_name, args.instances, args.streaming,
                                             limit, args.threads,
                                             backend=args.backend, max_batch=args.max_batch,
                                             max_queue=args.max_queue,
                                             prefill_chunk=args.prefill_chunk,
                                             options=options)
    except ValueError as exc:
        if type(exc) is ValueError:  # our own argument checks; EngineError keeps its exit code
            raise UsageError(str(exc)) from None
        raise
    out = Path(args.model_repository)
    result = {"model_repository": str(out.resolve()), "models": models, "max_new_tokens_limit": limit}
    if not args.start:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"model repository written to {out} (models: {', '.join(models)})")
            print(f"next: python -m runtime serve --engine-dir {args.engine_dir} "
                  f"--model-repository {out} --start")
        return 0
    return _run(args, spec, out, models, ports, install, result)


def _token(key: str) -> bool:
    return 8 <= len(key) <= 256 and all(33 <= ord(c) < 127 and c not in ",:=" for c in key)


def _write_trtllm(args, spec) -> int:
    """--backend trtllm: TensorRT-LLM's llmapi model layout, written here; it runs on a GPU
    host's tritonserver (a TensorRT-LLM container), not on this one."""
    from runtime.serve import repository

    if args.start:
        raise UsageError("--backend trtllm writes the repository only: start tritonserver where "
                         "TensorRT-LLM runs (docs/trtllm.md)")
    try:
        models = repository.write_trtllm_repository(spec, args.model_repository, args.model_name,
                                                    args.llmapi_model, args.streaming)
    except ValueError as exc:
        if type(exc) is ValueError:
            raise UsageError(str(exc)) from None
        raise
    from pathlib import Path

    out = Path(args.model_repository)
    result = {"model_repository": str(out.resolve()), "models": models, "backend": spec.backend}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model repository written to {out} (TensorRT-LLM llmapi model {models[0]} with "
              "SharpDraft's hook)")
        print("next, on the GPU host: tritonserver --model-repository "
              f"{out}  (see docs/trtllm.md)")
    return 0


def _run(args, spec, out, models, ports, install, result) -> int:
    from runtime.serve import server

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    # Installed before the server starts, so a signal during start-up stops it cleanly too.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    log = open(args.server_log, "a", buffering=1) if args.server_log else None
    srv = server.Server(out, models, ports, install, log=log, host=args.host, api_key=args.api_key,
                        http_max_input=_http_max_input(spec))
    frontend = None
    try:
        pid = srv.start()
        progress(f"tritonserver ({install.kind}: {install.binary}) pid {pid}, loading "
                 f"{', '.join(models)} …")
        if srv.http_max_input and "--http-max-input-size" not in srv.accepts({}):
            progress("this tritonserver has no --http-max-input-size (2.51 has not): its HTTP "
                     "port reads bodies of any size; keep it behind the proxy (docs/serving.md)")
        if not srv.wait_ready(args.ready_timeout, cancel=stop):
            progress("stopping before the server was ready")
            return 130
        endpoints = srv.endpoints() | {"pid": pid} | result
        if args.openai_port is not None:
            try:
                frontend = _start_openai(args, spec, models, srv, result["max_new_tokens_limit"])
            except RuntimeError as exc:
                raise server.ServerError(str(exc)) from None
            endpoints["openai"] = frontend.url
        if args.json:
            print(json.dumps(endpoints), flush=True)
        else:
            print(server.describe(endpoints), flush=True)
            if frontend is not None:
                print(f"  OpenAI API: {frontend.url}  (model {models[0]!r})", flush=True)
        progress("Ctrl-C or SIGTERM stops the server")
        watch = server.Supervisor(srv, args.ready_timeout, progress,
                                  on_down=frontend.ready.clear if frontend else None,
                                  on_up=frontend.ready.set if frontend else None, cancel=stop)
        while not stop.is_set():
            watch.check()  # a dead model instance: the server restarts, its requests fail
            stop.wait(watch.POLL_S)
        progress("stopping tritonserver …")
        return 0
    except server.ServerError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    finally:
        if frontend is not None:  # stop taking OpenAI requests before Triton goes away
            frontend.stop()
        code = srv.stop()
        if code not in (None, 0):
            progress(f"tritonserver exited with code {code}")
        if log:
            log.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _http_max_input(spec) -> int | None:
    """The biggest HTTP body Triton need read for this engine (its spec): a prompt the
    context can hold (protocol.prompt_byte_limit), each byte JSON-escaped at worst
    (\\u00XX: 6 bytes), plus room for the other fields. None where the context is not
    recorded."""
    from runtime.engine import load_tokenizer
    from runtime.serve.protocol import prompt_byte_limit

    if spec.context is None:
        return None
    return 6 * prompt_byte_limit(load_tokenizer(spec.manifest.target_dir), spec.context) + 2**16


def _start_openai(args, spec, models, srv, limit):
    from runtime.serve.openai_api import OpenAIServer, Settings

    # the spec knows where the engine is served (its placement), for the measured default
    host = f"[{srv.HOST}]" if ":" in srv.HOST else srv.HOST
    settings = Settings(spec, models[0], models[1], f"{host}:{srv.ports.grpc}", limit,
                        api_key=args.api_key)
    frontend = OpenAIServer(settings, args.openai_port, args.host)
    frontend.start()
    return frontend
