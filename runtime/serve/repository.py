"""Engine directory in, Triton model repository out: <name>/config.pbtxt (tensors from
protocol.py, the engine and limits as parameters) and <name>/1/model.py (the
Python-backend model), plus <name>-stream (decoupled) with --streaming. For trtllm engines
(GPU hosts) it writes TensorRT-LLM's `llmapi` model instead, with SharpDraft's hook in
front of it (write_trtllm_repository)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from runtime.serve import protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_TEMPLATE = Path(__file__).with_name("model.py")
STREAM_SUFFIX = "-stream"
# Triton takes the directory name as the model name and puts it in URLs
# (/v2/models/<name>/generate): keep it to characters that need no escaping.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def model_name(engine_dir: Path, name: str | None) -> str:
    name = name or Path(engine_dir).resolve().name
    if not NAME.match(name):
        raise ValueError(f"model name {name!r} may hold only letters, digits, '_', '.', '-' "
                         "(and start with a letter or digit) — pass --model-name")
    return name


def _tensor_block(kind: str, tensors) -> str:
    entries = []
    for t in tensors:
        lines = [f'    name: "{t.name}"', f"    data_type: {t.triton_type}",
                 f"    dims: [ {', '.join(str(d) for d in t.dims)} ]"]
        if t.optional:
            lines.append("    optional: true")
        entries.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE = 8, 64  # in-flight batching, per instance
# Chunked prefill (scheduler.py): a joining prompt prefills this many target tokens between
# two steps of the running rows (0: whole). A multiple of the ONNX Runtime target's own
# prefill chunk (128, runtime/backends/onnxruntime.py: HOST_PREFILL_CHUNK), so a chunked
# prefill there runs the very passes of a whole one. 128, measured (scripts/
# chunked_prefill_ab.py, 4,096-token prompts at concurrency 4, docs/serving.md): the
# running streams' ITL p99 (AIPerf's, per request) 42.5-43.1% of a whole prefill's in
# three runs, 59-104% at 256; the joining requests' TTFT p50 is the price (48-52 s
# against 34 s at 256 there): --prefill-chunk 256 or 512 favours it.
DEFAULT_PREFILL_CHUNK = 128


def config_pbtxt(name: str, model_dir: Path, engine_dir: Path, instances: int, streaming: bool,
                 max_new_tokens_limit: int, threads: str = "auto", backend: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_queue: int = DEFAULT_MAX_QUEUE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, options: dict | None = None) -> str:
    # Paths relative to the model's own directory (model.py resolves them against the
    # model_repository path Triton hands it), so a copied or moved checkout still serves.
    def relative(path: Path) -> str:
        return os.path.relpath(Path(path).resolve(), Path(model_dir).resolve())

    # Requests join a running batch at step boundaries (model.py, scheduler.py), on the
    # plain model as on the streaming one.
    params = {"engine_dir": relative(engine_dir), "repo_root": relative(REPO_ROOT),
              "max_new_tokens_limit": str(max_new_tokens_limit), "threads": threads,
              "max_batch": str(max_batch), "max_queue": str(max_queue),
              "prefill_chunk": str(prefill_chunk)}
    if backend:  # else the backend engine.json names
        params["backend"] = backend
    params.update(options or {})  # the loader's options (runtime.backends.OPTIONS), for Engine
    text = [f'# Written by `python -m runtime serve`; regenerate rather than edit.\n'
            f'name: "{name}"\nbackend: "python"\n'
            # Triton hands execute() single requests; the model batches them itself, in
            # flight (max_batch below), so Triton's own batcher stays off.
            "max_batch_size: 0\n"]
    if streaming:
        text.append("model_transaction_policy {\n  decoupled: true\n}\n")
    text.append(_tensor_block("input", protocol.INPUTS))
    text.append(_tensor_block("output", protocol.OUTPUTS))
    text.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n")
    for key, value in params.items():
        text.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: {json.dumps(value)} }}\n}}\n')
    return "".join(text)


def write_model(out: Path, name: str, engine_dir: Path, instances: int, streaming: bool,
                max_new_tokens_limit: int, threads: str = "auto", backend: str | None = None,
                max_batch: int = DEFAULT_MAX_BATCH, max_queue: int = DEFAULT_MAX_QUEUE,
                prefill_chunk: int = DEFAULT_PREFILL_CHUNK, options: dict | None = None) -> Path:
    model_dir = out / name
    if model_dir.exists():  # a previous run's model of the same name: replace it whole
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(
        config_pbtxt(name, model_dir, engine_dir, instances, streaming, max_new_tokens_limit, threads,
                     backend, max_batch, max_queue, prefill_chunk, options))
    shutil.copyfile(MODEL_TEMPLATE, model_dir / "1" / "model.py")
    return model_dir


def write_repository(spec, out: str | Path, name: str | None = None,
                     instances: int = 1, streaming: bool = False,
                     max_new_tokens_limit: int = protocol.DEFAULT_MAX_NEW_TOKENS_LIMIT,
                     threads: str = "auto", backend: str | None = None,
                     max_batch: int = DEFAULT_MAX_BATCH, max_queue: int = DEFAULT_MAX_QUEUE,
                     prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                     options: dict | None = None) -> list[str]:
    """Write the model(s) for the engine `spec` describes (runtime/spec.py: open_spec, where
    a missing or stale engine is refused, not at server start) into the repository `out`;
    returns their names. `options`: the loader's (runtime.backends.OPTIONS: the commands'
    --device, --dtype, --steps, --prefill-dtype)."""
    engine_dir = spec.dir
    if instances < 1:
        raise ValueError(f"--instances must be >= 1, got {instances}")
    if max_new_tokens_limit < 1:
        raise ValueError(f"--max-new-tokens-limit must be >= 1, got {max_new_tokens_limit}")
    if max_batch < 1 or max_queue < 0:
        raise ValueError(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch}, {max_queue}")
    if prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 (0: prompts prefill whole), got {prefill_chunk}")
    if threads != "auto" and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(f"--threads must be 'auto' or a whole number >= 1, got {threads!r}")
    name = model_name(engine_dir, name)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    names = [name] + ([name + STREAM_SUFFIX] if streaming else [])
    for n in names:
        write_model(out, n, engine_dir, instances, n != name, max_new_tokens_limit, threads, backend,
                    max_batch, max_queue, prefill_chunk, options)
    return names


# --- TensorRT-LLM (GPU hosts): the llmapi model with SharpDraft's hook -------------------

TRTLLM_MODEL = "tensorrt_llm"  # the llmapi model's usual name in its repository
TRTLLM_TEMPLATE = REPO_ROOT / "plugins" / "trtllm" / "triton_model.py"  # copied as 1/model.py
TRTLLM_SETTINGS = "sharpdraft.json"  # read by 1/model.py at import: scaling + checkout
STOCK_DIR = "llmapi"  # 1/llmapi/{model.py,helpers.py}: TensorRT-LLM's own model, when copied in

# Tensors of the stock llmapi model (its config.pbtxt, pins.SOURCES["llmapi_model"]'s
# directory) that a generate request needs; --llmapi-model copies its full config instead.
# The stock _create_response sends finish_reason only when the request sets
# return_finish_reason, and the speculative-decoding statistics only when it sets
# sampling_param_return_perf_metrics (helpers.py, pins.SOURCES["llmapi_helpers"]); it sends
# every extra output with text_output's dtype, so they are strings here too.
TRTLLM_INPUTS = (("text_input", "TYPE_STRING", "-1", False), ("streaming", "TYPE_BOOL", "1", True),
                 ("sampling_param_temperature", "TYPE_FP32", "1", True),
                 ("sampling_param_top_k", "TYPE_INT32", "1", True),
                 ("sampling_param_top_p", "TYPE_FP32", "1", True),
                 ("sampling_param_max_tokens", "TYPE_INT32", "1", True),
                 ("sampling_param_seed", "TYPE_UINT64", "1", True),
                 ("return_finish_reason", "TYPE_BOOL", "1", True),
                 ("sampling_param_return_perf_metrics", "TYPE_BOOL", "1", True))
TRTLLM_OUTPUTS = (("text_output", "TYPE_STRING", "-1"), ("finish_reason", "TYPE_STRING", "-1"),
                  ("acceptance_rate", "TYPE_STRING", "-1"),
                  ("total_accepted_draft_tokens", "TYPE_STRING", "-1"),
                  ("total_draft_tokens", "TYPE_STRING", "-1"))


def trtllm_config_pbtxt(name: str, llmapi_model: Path | None) -> str:
    if llmapi_model is not None:  # the stock model's own tensors, under our model name
        text = (llmapi_model / "config.pbtxt").read_text()
        return re.sub(r'(?m)^name:\s*"[^"]*"', f'name: "{name}"', text, count=1)
    inputs = ",\n".join(f'  {{\n    name: "{n}"\n    data_type: {t}\n    dims: [ {d} ]'
                        + ("\n    optional: true" if optional else "") + "\n  }"
                        for n, t, d, optional in TRTLLM_INPUTS)
    outputs = ",\n".join(f'  {{\n    name: "{n}"\n    data_type: {t}\n    dims: [ {d} ]\n  }}'
                         for n, t, d in TRTLLM_OUTPUTS)
    return (f"# Written by `python -m runtime serve --backend trtllm`; regenerate rather than edit.\n"
            f"# max_batch_size and decoupled come from 1/model.yaml's triton_config (the llmapi model\n"
            f"# sets them itself).\n"
            f'name: "{name}"\nbackend: "python"\n'
            "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n")


def write_trtllm_repository(spec, out: str | Path, name: str | None = None,
                            llmapi_model: str | Path | None = None, streaming: bool = False) -> list[str]:
    """<out>/<name>/{config.pbtxt, 1/model.py, 1/model.yaml, 1/sharpdraft.json}: TensorRT-LLM's
    llmapi Triton model layout. 1/model.py installs SharpDraft's hook, then defers to the
    stock llmapi model (copied into 1/llmapi/ from `llmapi_model`, TensorRT-LLM's
    triton_backend/all_models/llmapi/tensorrt_llm, or found at run time through
    $SHARPDRAFT_LLMAPI_MODEL). model.yaml holds the engine's LLM() arguments; sharpdraft.json
    what 1/model.py needs of the spec (the scaling, the drafter family), so that process
    reads no engine.json. `spec`: the engine's (runtime/spec.py), on a backend that runs its
    own loop; its refusals (an engine built for another backend) in one line."""
    if not spec.own_loop or spec.refusals:
        raise ValueError(spec.refusals[0] if spec.refusals else
                         f"{spec.dir}: backend {spec.backend!r} runs our loop, not its own")
    manifest, engine_dir = spec.manifest, spec.dir
    stock = Path(llmapi_model) if llmapi_model else None
    if stock is not None and not ((stock / "config.pbtxt").is_file() and (stock / "1" / "model.py").is_file()):
        raise ValueError(f"{stock} is not TensorRT-LLM's llmapi model directory (config.pbtxt, 1/model.py) — "
                         "pass <TensorRT-LLM>/triton_backend/all_models/llmapi/tensorrt_llm")
    name = name or TRTLLM_MODEL
    if not NAME.match(name):
        raise ValueError(f"model name {name!r} may hold only letters, digits, '_', '.', '-' — pass --model-name")
    model_dir = Path(out) / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version = model_dir / "1"
    version.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(trtllm_config_pbtxt(name, stock))
    loop = spec.loader(engine_dir, manifest, spec.drafting)
    (version / "model.yaml").write_text(loop.model_yaml(decoupled=streaming))
    (version / TRTLLM_SETTINGS).write_text(json.dumps({
        "engine_dir": str(engine_dir.resolve()),
        "repo_root": os.path.relpath(REPO_ROOT, version.resolve()),
        "query_scaling": manifest.query_scaling.to_dict() if manifest.query_scaling else None,
        "drafter": manifest.drafter,
    }, indent=2) + "\n")
    shutil.copyfile(TRTLLM_TEMPLATE, version / "model.py")
    if stock is not None:
        (version / STOCK_DIR).mkdir()
        for file in ("model.py", "helpers.py"):
            if (stock / "1" / file).is_file():
                shutil.copyfile(stock / "1" / file, version / STOCK_DIR / file)
    return [name]
