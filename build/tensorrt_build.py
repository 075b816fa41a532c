"""ONNX drafter graph -> serialized TensorRT engine, on a host with TensorRT and an NVIDIA
GPU (the engine is built for, and runs on, that GPU). The graph carries SharpDraft either as
SharpDraftAttention plugin nodes (registered here from plugins/tensorrt.py) or as plain
ONNX ops that TensorRT parses natively. Everything TensorRT is imported inside functions.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from plugins import plugin_spec
from plugins.tensorrt import TensorRTUnavailable, import_tensorrt, register_plugin
from runtime.placement import DTYPES


Shape = Sequence[int]
Profile = Mapping[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max) shape


class EngineBuildError(ValueError):
    """TensorRT refused the graph or the build; the message is one line."""


def tensorrt_available() -> tuple[bool, str]:
    """(True, "TensorRT <version> on <GPU>") where engines can be built here, else (False,
    why, in one line). Checks what building needs: tensorrt imports, a CUDA device is
    visible (runtime/backends/tensorrt_plans.gpu, the device the plans will run on), and
    TensorRT can create a builder there (it cannot without a working CUDA driver)."""
    from runtime.backends.tensorrt_plans import device_name, gpu, no_gpu_reason

    try:
        trt = import_tensorrt()
    except TensorRTUnavailable as exc:
        return False, str(exc)
    device = gpu()
    if device is None:
        return False, f"TensorRT {trt.__version__} is installed but {no_gpu_reason()}"
    log = _make_logger(trt, lambda message: None)
    try:
        builder = trt.Builder(log)
    except Exception as exc:  # pybind11 raises TypeError when the C++ factory returns null
        return False, (f"TensorRT {trt.__version__} cannot create a builder on "
                       f"{device_name(device)}: {log.last_error or str(exc).splitlines()[0]}")
    if builder is None:
        return False, f"TensorRT {trt.__version__} cannot create a builder: {log.last_error or 'no reason given'}"
    return True, f"TensorRT {trt.__version__} on {device_name(device)}"


def context_profile(inputs: Mapping[str, Sequence[int | str]], max_seq_len: int,
                    opt_seq_len: int | None = None, min_seq_len: int = 1) -> dict:
    """One optimisation profile over the context length.

    `inputs` gives each dynamic input's shape with "context" (or "context+N", e.g. the
    drafter's keys = context + block) where the context length goes, e.g.
    {"k": (1, 8, "context+16", 128), "visible": (1, 16)}. opt defaults to half of max: a
    long-context drafter spends most steps well past its shortest contexts.
    """
    if not 1 <= min_seq_len <= max_seq_len:
        raise ValueError(f"need 1 <= min_seq_len ({min_seq_len}) <= max_seq_len ({max_seq_len})")
    opt_seq_len = max(min_seq_len, max_seq_len // 2) if opt_seq_len is None else opt_seq_len
    if not min_seq_len <= opt_seq_len <= max_seq_len:
        raise ValueError(f"opt_seq_len {opt_seq_len} must lie in [{min_seq_len}, {max_seq_len}]")

    def at(shape, length):
        dims = []
        for dim in shape:
            if isinstance(dim, int):
                dims.append(dim)
                continue
            match = re.fullmatch(r"\s*context\s*(?:\+\s*(\d+))?\s*", str(dim))
            if not match:
                raise ValueError(f"profile dimension {dim!r}: use an int, 'context' or 'context+N'")
            dims.append(length + int(match.group(1) or 0))
        return tuple(dims)

    return {name: (at(shape, min_seq_len), at(shape, opt_seq_len), at(shape, max_seq_len))
            for name, shape in inputs.items()}


def plugin_nodes(onnx_path: Path) -> int:
    """How many SharpDraftAttention plugin nodes the graph holds (0: the plain-op form)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graphs, count = [model.graph], 0
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            count += node.op_type == plugin_spec.PLUGIN_NAME
            graphs.extend(a.g for a in node.attribute if a.HasField("g"))
    for function in model.functions:
        count += sum(node.op_type == plugin_spec.PLUGIN_NAME for node in function.node)
    return count


def build_engine(onnx_path: Path | str, out_path: Path | str, profiles: Sequence[Profile],
                 dtype: str = "float16", progress: Callable[[str], None] = lambda message: None) -> dict:
    """Build and write a serialized engine; returns what was built (for engine.json).

    The network is strongly typed (the only kind TensorRT 11 has): precision comes from the
    ONNX graph, so `dtype` is checked against the graph's floating inputs rather than
    applied with the old FP16/BF16 builder flags -- export at the engine's dtype. For
    float32, TF32 is switched off so fp32 engines match the fp32 reference op.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"{onnx_path} does not exist; export the drafter to ONNX first")
    trt = import_tensorrt()
    plugins = plugin_nodes(onnx_path)
    if plugins:
        register_plugin()
        progress(f"      {plugins} {plugin_spec.PLUGIN_NAME} plugin node(s): kernels compiled ahead of time")

    log = _make_logger(trt, progress)
    builder = trt.Builder(log)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # strongly typed is opt-in before TensorRT 11
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log)
    progress(f"      parsing {onnx_path}")
    if not parser.parse_from_file(str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        first = errors[0] if errors else None
        where = f" at node {first.node_name()} ({first.node_operator()})" if first and first.node_name() else ""
        raise EngineBuildError(f"TensorRT's ONNX parser refused {onnx_path.name}{where}: "
                               f"{first.desc() if first else log.last_error or 'no reason given'}")
    _check_input_dtypes(trt, network, dtype)

    config = builder.create_builder_config()
    if dtype == "float32":
        config.clear_flag(trt.BuilderFlag.TF32)
    dynamic = {network.get_input(i).name for i in range(network.num_inputs)
               if any(d < 0 for d in network.get_input(i).shape)}
    if dynamic and not profiles:
        raise EngineBuildError(f"inputs {', '.join(sorted(dynamic))} have dynamic shapes; give an "
                               "optimisation profile (context_profile(..., max_seq_len))")
    for number, shapes in enumerate(profiles):
        missing = dynamic - set(shapes)
        unknown = set(shapes) - {network.get_input(i).name for i in range(network.num_inputs)}
        if missing or unknown:
            raise EngineBuildError(f"profile {number}: " + "; ".join(
                part for part in (f"no shapes for dynamic input(s) {', '.join(sorted(missing))}" if missing else "",
                                  f"no network input(s) named {', '.join(sorted(unknown))}" if unknown else "")
                if part))
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, tuple(low), tuple(opt), tuple(high))
        config.add_optimization_profile(profile)

    progress(f"      building the {dtype} engine (minutes for a long max context)")
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build the engine: {log.last_error or 'no reason given'}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "wb") as handle:
        handle.write(serialized)
    seconds = time.perf_counter() - started
    progress(f"      engine written to {out_path} ({out_path.stat().st_size / 2**20:.1f} MiB, {seconds:.0f} s)")
    return {"file": out_path.name, "bytes": out_path.stat().st_size, "dtype": dtype,
            "tensorrt": trt.__version__, "plugin_nodes": plugins,
            "profiles": [{name: [list(s) for s in shape] for name, shape in p.items()} for p in profiles],
            "build_seconds": round(seconds, 1)}


# What each named dimension of an exported graph (build/export.py) ranges over in the
# optimisation profile: (min, opt, max) as functions of the longest sequence and the block.
# Plans take per-sequence lengths as inputs (export version 3), but their profile still
# holds one sequence per step: the TensorRT backend has no batched roles yet.
def dimension_ranges(max_seq_len: int, block_size: int) -> dict[str, tuple[int, int, int]]:
    from runtime.backends.onnxruntime import PREFILL_CHUNK

    step = min(PREFILL_CHUNK, max_seq_len)  # a prefill chunk is the longest step
    half = max(1, max_seq_len // 2)
    return {"batch": (1, 1, 1),
            "q_len": (1, min(block_size, step), step),  # verify steps are one block
            "n_logits": (1, min(block_size, step), step),
            "capacity": (1, half, max_seq_len),  # the target's cache buffers
            "past_len": (0, half, max_seq_len),  # the drafter's committed cache
            "context_len": (1, min(block_size, max_seq_len), max_seq_len)}  # new target features


def graph_profile(inputs: Sequence[Mapping], ranges: Mapping[str, tuple[int, int, int]]) -> dict:
    """The profile of one graph from engine.json's record of its inputs (name, shape with
    our dimension names): each named dimension takes its range, fixed ones stay."""
    profile = {}
    for tensor in inputs:
        low, opt, high = [], [], []
        for dim in tensor["shape"]:
            if isinstance(dim, int):
                span = (dim, dim, dim)
            elif dim in ranges:
                span = ranges[dim]
            else:
                raise EngineBuildError(f"input {tensor['name']} has a dimension {dim!r} no profile "
                                       f"range covers (known: {', '.join(ranges)})")
            for shapes, value in zip((low, opt, high), span):
                shapes.append(value)
        profile[tensor["name"]] = (tuple(low), tuple(opt), tuple(high))
    return profile


PLANNED_GRAPHS = ("target_kv", "drafter", "drafter_frozen")  # target.onnx: the portable form only


def build(engine_dir: Path, onnx_record: Mapping, max_seq_len: int,
          progress: Callable[[str], None] = lambda message: None, block_size: int = 16,
          dtype: str = "float32") -> dict:
    """A plan per graph the runtime runs (target_kv, drafter, drafter_frozen), next to its
    ONNX file in engine_dir; returns engine.json's "tensorrt" record: the TensorRT version
    and GPU every plan was built with (a plan runs only there) and each plan's profile."""
    from runtime.backends.tensorrt_plans import PLAN_SUFFIX, device_name, gpu

    usable, why = tensorrt_available()
    if not usable:
        raise TensorRTUnavailable(why)
    trt = import_tensorrt()
    gpu_name = device_name(gpu())
    ranges = dimension_ranges(max_seq_len, block_size)
    plans = {}
    for name in PLANNED_GRAPHS:
        graph = onnx_record["graphs"].get(name)
        if graph is None:  # an n-gram engine has no drafter; a frozen one no SharpDraft graph
            continue
        onnx_path = Path(engine_dir) / graph["file"]
        plan_path = onnx_path.with_suffix(PLAN_SUFFIX)
        progress(f"      {plan_path.name}: from {onnx_path.name}, contexts up to {max_seq_len} tokens")
        built = build_engine(onnx_path, plan_path, [graph_profile(graph["inputs"], ranges)],
                             dtype, progress)
        plans[name] = built | {"onnx": onnx_path.name, "gpu": gpu_name}
    return {"version": trt.__version__, "gpu": gpu_name, "plans": plans}


def _check_input_dtypes(trt, network, dtype: str) -> None:
    want = {"float32": trt.float32, "float16": trt.float16, "bfloat16": trt.bfloat16}[dtype]
    floating = {trt.float32, trt.float16, trt.bfloat16}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.dtype in floating and tensor.dtype != want:
            raise EngineBuildError(f"input {tensor.name} is {tensor.dtype} but the engine dtype is {dtype}; "
                                   "export the ONNX graph at the engine's dtype (networks are strongly typed)")


def _make_logger(trt, progress):
    """A TensorRT logger that forwards warnings and errors to `progress` and remembers the
    last error, so a failed build can say why in one line."""

    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.last_error = ""

        def log(self, severity, message):
            errors = (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR)
            if severity in errors:
                self.last_error = str(message).splitlines()[0] if message else ""
            if severity in errors or severity == trt.ILogger.Severity.WARNING:
                progress(f"      tensorrt: {message}")

    return Log()
