"""A stand-in `tensorrt` module for machines where TensorRT cannot be installed: exactly the
TensorRT Python API calls our code makes (plugins/tensorrt.py, build/tensorrt_build.py,
runtime/backends/tensorrt_plans.py), with TensorRT 11's names and parameter names (read from the
tensorrt-cu12-bindings 11.4 wheel's docstrings and NVIDIA's Python API docs), and nothing
else: any other name, on the module or on one of its objects, raises AttributeError and is
recorded in `tensorrt.missing`, so a call TensorRT has but the stand-in lacks (or a name
TensorRT does not have at all) fails the test even where our code catches the error.

Flavours (`install(version=...)`): "11.4.0" (default), "10.16.1" (TensorRT 10: networks
strongly typed only by flag, the 10.x plugin creator's field conversion) and "10.8.0" (no
ahead-of-time Python plugins: no `QuickPluginCreationRequest`, no `KernelLaunchParams`).

What it enforces, as the real one does (tensorrt_cu12_bindings 10.16.1.11 / 11.4.0.106,
tensorrt/plugin/*.py; tests/test_tensorrt_sources.py runs those files themselves and checks
this stand-in against them):
- `tensorrt.plugin.register` defines `op.<namespace>.<name>` once: a second definition
  raises "already has a definition" (_lib.py, register).
- The parser finds a plugin by op_type, `plugin_version` (default "1") and
  `plugin_namespace`; the Python creators are registered as version "1"
  (_lib.py, _TemplatePluginCreator). It hands the node's other attributes to the creator as
  one-element arrays (INT -> int32, FLOAT -> float32), which converts each by the
  attribute's annotation exactly as that version's `create_plugin` does -- 10.x calls
  `int(f.data)` on a builtin-typed field, which numpy 2 refuses for a 1-d array -- and
  then calls the registered description with the node's input descriptors (shape
  inference gives them) and the converted fields, as TensorRT does while building.
- `KernelLaunchParams` has only grid_x/y/z, block_x/y/z, shared_mem (anything else raises,
  _tensor.py); `SymInt32` takes an int or a symbolic expression and refuses anything else
  (the real one silently keeps no expression, which fails only at launch).
- `set_tensor_address` refuses an address that is not 256-byte aligned (NvInferRuntime.h:
  "The pointer must have at least 256-byte alignment") and returns False.

What it does:
- `tensorrt.plugin`: records what the plugin registers (register / aot_impl), following
  tensorrt.plugin's documented calling convention.
- Builder / OnnxParser / IBuilderConfig / IOptimizationProfile: parse_from_file reads the
  ONNX graph's inputs (dynamic dims -1, element types as TensorRT types) and refuses a
  plugin node whose creator was not registered (as TensorRT's parser does);
  build_serialized_network checks the profile as IOptimizationProfile.set_shape's docs
  require and serializes a "plan": the profile, the I/O table and the ONNX model with its
  external weights inlined (a real plan is self-contained too).
- Runtime / ICudaEngine / IExecutionContext: set_input_shape checks the profile;
  get_tensor_shape derives output shapes from the graph's named dimensions;
  set_tensor_address takes raw addresses; execute_async_v3 reads every input from the
  memory at its address (dense, row-major, the engine's dtype -- what TensorRT assumes),
  runs the ONNX graph with ONNX Runtime (plugin nodes through plugins/onnx.py's op) and
  writes every output to the memory at its address.

What it can prove: our code calls only these names with these arguments, builds a profile
that admits every shape it later binds, and binds the right memory (address, shape, dtype,
contiguity) -- including the KV buffers TensorRT updates in place -- so tokens can be
compared with the onnxruntime backend. What it cannot: that TensorRT's parser accepts the
graphs (beyond the lookup and field conversion above), that the plugin's AOT kernel runs
(aot_impl is not called: its PTX is checked by tests/test_tensorrt.py), TensorRT's numerics, or CUDA semantics (device
memory, stream ordering): addresses here are host memory, because the backend's `gpu()`
is replaced by the CPU for the run. Those need a GPU host (scripts/gpu_check.py).

Shape expressions of the plugin API are plain ints here: plugins.triton_kernel.launch_grid
and contiguous_scalars use only +, *, // so they run on both.
"""

import ctypes
import importlib.machinery
import json
import sys
import types

import numpy as np

VERSION = "11.4.0"
PLAN_MAGIC = b"stand-in tensorrt plan\n"


class TensorDesc:
    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.shape_expr = tuple(shape)
        self.dtype = dtype
        self.ndim = len(shape)

    def like(self):
        return TensorDesc(self.shape, self.dtype)


class SymInt32:
    def __init__(self, value):
        # tensorrt/plugin/_tensor.py takes an int, an IDimensionExpr or a SymIntExpr; any
        # other value (a numpy int, a float) silently becomes no expression and fails at
        # launch. Refuse it here, where the test can see it.
        if isinstance(value, SymInt32):
            value = value.value
        if not isinstance(value, int) or isinstance(value, np.integer):
            raise TypeError(f"SymInt32 takes an int or a symbolic expression, got {type(value).__name__}")
        self.value = value


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, values):
        return cls(v if isinstance(v, SymInt32) else SymInt32(v) for v in values)


class KernelLaunchParams:
    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for name in self.FIELDS:
            setattr(self, name, 0 if name == "shared_mem" else 1)

    def __setattr__(self, name, value):  # as _tensor.py's KernelLaunchParams
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        self.__dict__[name] = SymInt32(value)


def convert_field(version: str, annotation, data):
    """What a plugin's `create_plugin` makes of one field (tensorrt/plugin/_lib.py,
    _TemplatePluginCreator.create_plugin, in the wheel of that version)."""
    import typing

    if annotation is np.ndarray or typing.get_origin(annotation) is np.ndarray:
        np_type = typing.get_args(typing.get_args(annotation)[1])[0]
        if np_type == np.float16:
            return np.frombuffer(data.tobytes(), dtype=np.float16)
        return data.astype(np_type)
    if issubclass(annotation, str):
        return data.tobytes().decode("utf-8")
    if int(version.split(".")[0]) >= 11 and isinstance(data, np.ndarray) and data.size == 1:
        return annotation(data[0])  # 11.x unwraps one-element fields
    return annotation(data)  # 10.x: int(np.array([7])) raises TypeError on numpy 2


# --- the core API -------------------------------------------------------------------------

MISSING: list = []  # names asked for that the stand-in does not implement (per install)
BOUND: list = []  # every (tensor name, address) set_tensor_address accepted (per install)
ALIGNMENT = 256  # bytes; IExecutionContext::setTensorAddress's requirement


class StandIn:
    """Base of every stand-in object: an attribute it lacks is recorded, then refused."""

    def __getattr__(self, name):
        if not name.startswith("__"):
            MISSING.append(f"{type(self).__name__}.{name}")
        raise AttributeError(f"the stand-in tensorrt's {type(self).__name__} has no {name!r}")


class DataType:  # members are plain strings, as the plugin tests compare them
    FLOAT, HALF, BF16, INT64, INT32, BOOL = "FLOAT", "HALF", "BF16", "INT64", "INT32", "BOOL"


ONNX_TYPES = {1: DataType.FLOAT, 10: DataType.HALF, 16: DataType.BF16, 7: DataType.INT64,
              6: DataType.INT32, 9: DataType.BOOL}
NUMPY_TYPES = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT64: np.int64,
               DataType.INT32: np.int32, DataType.BOOL: np.bool_}


class TensorIOMode:
    NONE, INPUT, OUTPUT = "NONE", "INPUT", "OUTPUT"


class BuilderFlag:
    TF32 = "TF32"


class NetworkDefinitionCreationFlag:
    STRONGLY_TYPED = 1  # TensorRT 11 networks are strongly typed anyway


class ILogger:
    class Severity:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self):
        pass


class Logger(ILogger):
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self, min_severity=ILogger.Severity.WARNING):
        ILogger.__init__(self)
        self.min_severity = min_severity

    def log(self, severity, msg):
        if severity <= self.min_severity:
            print(f"[stand-in tensorrt] {msg}", file=sys.stderr)


class ITensor(StandIn):
    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype = name, shape, dtype


class INetworkDefinition(StandIn):
    def __init__(self):
        self.onnx_path = None
        self.tensors = []

    @property
    def num_inputs(self):
        return len(self.tensors)

    def get_input(self, index):
        return self.tensors[index]


class ParserError(StandIn):
    def __init__(self, node, operator, description):
        self._node, self._operator, self._desc = node, operator, description

    def node_name(self):
        return self._node

    def node_operator(self):
        return self._operator

    def desc(self):
        return self._desc


class OnnxParser(StandIn):
    def __init__(self, network, logger):
        self.network, self.logger, self.errors = network, logger, []

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, index):
        return self.errors[index]

    def parse_from_file(self, model):
        import onnx

        graph = onnx.load(model, load_external_data=False).graph
        descs = None
        for node in graph.node:
            # An op_type ONNX does not define is a plugin, whatever the node's domain.
            if node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type):
                continue
            # TensorRT looks a plugin up by op_type, plugin_version and plugin_namespace.
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            key = (node.op_type, attrs.pop("plugin_version", b"1").decode(),
                   attrs.pop("plugin_namespace", b"").decode())
            plugin = _PLUGIN.creators.get(key)
            if plugin is None or plugin.aot_impl is None:
                self.errors.append(ParserError(node.name, node.op_type,
                                               f"Plugin not found, are the plugin name, version, and "
                                               f"namespace correct? ({key[2]}::{key[0]} version {key[1]})"))
                return False
            descs = _input_descs(model) if descs is None else descs
            try:
                plugin.create(node, attrs, [descs.get(name) for name in node.input])
            except Exception as exc:  # TensorRT reports a failed creation as a parser error
                self.errors.append(ParserError(node.name, node.op_type, f"{type(exc).__name__}: {exc}"))
                return False
        initializers = {t.name for t in graph.initializer}
        for value in graph.input:
            if value.name in initializers:
                continue
            t = value.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
            self.network.tensors.append(ITensor(value.name, shape, ONNX_TYPES[t.elem_type]))
        self.network.onnx_path = model
        return True


def _input_descs(model_path) -> dict:
    """Tensor name -> TensorDesc (shape with -1 where unknown, TensorRT dtype) for every
    tensor ONNX shape inference can type: what TensorRT knows of a plugin node's inputs."""
    import onnx

    from plugins.onnx import register_schema

    register_schema()
    model = onnx.load(model_path, load_external_data=False)
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # an op it cannot type: what the graph declares is all there is
        inferred = model
    descs = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info]:
        t = value.type.tensor_type
        if t.elem_type in ONNX_TYPES and t.HasField("shape"):
            descs[value.name] = TensorDesc([d.dim_value if d.HasField("dim_value") else -1
                                            for d in t.shape.dim], ONNX_TYPES[t.elem_type])
    return descs


class _PluginDef:
    """One plugin tensorrt.plugin defines: its description (register), its AOT
    implementation, and how that version's creator converts fields."""

    def __init__(self, version, describe):
        import inspect

        self.version, self.describe, self.aot_impl = version, describe, None
        parameters = inspect.signature(describe).parameters
        self.attrs = {name: p.annotation for name, p in parameters.items()
                      if p.annotation is not TensorDesc}

    def create(self, node, attrs, inputs):
        fields = {}
        for name, value in attrs.items():
            if name not in self.attrs:  # _lib.py: "Unexpected attribute ... provided to create_plugin"
                raise AssertionError(f"Unexpected attribute {name} provided to create_plugin")
            # The ONNX parser's fields: INT -> int32, FLOAT -> float32, one-element arrays.
            data = np.array([value], dtype=np.int32 if isinstance(value, int) else np.float32) \
                if isinstance(value, (int, float)) else np.frombuffer(bytes(value), np.int8)
            fields[name] = convert_field(self.version, self.attrs[name], data)
        if None in inputs:
            raise ValueError(f"{node.name}: shape inference cannot type every input")
        out = self.describe(*inputs, **fields)  # TensorRT calls it for the output types
        if not isinstance(out, TensorDesc):
            raise TypeError(f"{node.op_type}'s description returned {type(out).__name__}, not a TensorDesc")
        return out


class IOptimizationProfile(StandIn):
    def __init__(self):
        self.shapes = {}

    def set_shape(self, input, min, opt, max):
        self.shapes[input] = [list(min), list(opt), list(max)]


class IBuilderConfig(StandIn):
    def __init__(self):
        self.flags = {BuilderFlag.TF32}  # on by default, as in TensorRT
        self.profiles = []

    def clear_flag(self, flag):
        self.flags.discard(flag)

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder(StandIn):
    def __init__(self, logger):
        if not _STATE["gpu"]:  # what TensorRT does without a CUDA device
            logger.log(ILogger.Severity.ERROR, "CUDA initialization failure with error: 100")
            raise TypeError("pybind11::init(): factory function returned nullptr")
        self.logger = logger

    def create_network(self, flags=0):
        network = INetworkDefinition()
        # TensorRT 11 networks are always strongly typed; TensorRT 10's only with the flag.
        network.strongly_typed = _STATE["major"] >= 11 or bool(
            flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        return network

    def create_builder_config(self):
        return IBuilderConfig()

    def create_optimization_profile(self):
        return IOptimizationProfile()

    def build_serialized_network(self, network, config):
        import onnx

        if not network.strongly_typed:  # build/tensorrt_build.py's dtype check assumes it
            self.logger.log(ILogger.Severity.ERROR, "the stand-in builds strongly typed networks only")
            return None
        if len(config.profiles) != 1:
            self.logger.log(ILogger.Severity.ERROR, "the stand-in builds one optimisation profile")
            return None
        shapes = config.profiles[0].shapes
        for tensor in network.tensors:  # IOptimizationProfile.set_shape's conditions
            if tensor.name not in shapes:
                if -1 in tensor.shape:
                    self.logger.log(ILogger.Severity.ERROR, f"{tensor.name}: dynamic, no profile")
                    return None
                shapes[tensor.name] = [list(tensor.shape)] * 3
            low, opt, high = shapes[tensor.name]
            if not len(low) == len(opt) == len(high) == len(tensor.shape) or any(
                    not 0 <= a <= b <= c or (s != -1 and not a == b == c == s)
                    for a, b, c, s in zip(low, opt, high, tensor.shape)):
                self.logger.log(ILogger.Severity.ERROR, f"{tensor.name}: profile {low} {opt} {high} "
                                f"does not fit {list(tensor.shape)}")
                return None
        model = onnx.load(network.onnx_path)  # external weights inlined, as in a real plan
        outputs = [{"name": v.name, "dtype": ONNX_TYPES[v.type.tensor_type.elem_type],
                    "dims": [d.dim_value if d.HasField("dim_value") else d.dim_param
                             for d in v.type.tensor_type.shape.dim]} for v in model.graph.output]
        declared = {v.name: v for v in model.graph.input}
        inputs = [{"name": t.name, "dtype": t.dtype,
                   "dims": [d.dim_value if d.HasField("dim_value") else d.dim_param
                            for d in declared[t.name].type.tensor_type.shape.dim]}
                  for t in network.tensors]
        header = json.dumps({"version": VERSION, "profile": shapes, "inputs": inputs,
                             "outputs": outputs, "tf32": BuilderFlag.TF32 in config.flags}).encode()
        return PLAN_MAGIC + len(header).to_bytes(8, "little") + header + model.SerializeToString()


class Runtime(StandIn):
    def __init__(self, logger):
        if not _STATE["gpu"]:
            raise TypeError("pybind11::init(): factory function returned nullptr")
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine):
        data = bytes(serialized_engine)
        if not data.startswith(PLAN_MAGIC):
            self.logger.log(ILogger.Severity.ERROR, "not a plan")
            return None
        start = len(PLAN_MAGIC) + 8
        size = int.from_bytes(data[len(PLAN_MAGIC):start], "little")
        return ICudaEngine(json.loads(data[start:start + size]), data[start + size:])


class ICudaEngine(StandIn):
    def __init__(self, header, model_bytes):
        self.header, self.model_bytes = header, model_bytes
        self.io = header["inputs"] + header["outputs"]
        self.modes = {t["name"]: TensorIOMode.INPUT for t in header["inputs"]}
        self.modes |= {t["name"]: TensorIOMode.OUTPUT for t in header["outputs"]}
        self.session = None

    @property
    def num_io_tensors(self):
        return len(self.io)

    def get_tensor_name(self, index):
        return self.io[index]["name"]

    def get_tensor_mode(self, name):
        return self.modes.get(name, TensorIOMode.NONE)

    def get_tensor_dtype(self, name):
        return next(t["dtype"] for t in self.io if t["name"] == name)

    def get_tensor_profile_shape(self, name, profile_index):
        return self.header["profile"].get(name, []) if profile_index == 0 else []

    def create_execution_context(self):
        return IExecutionContext(self)

    def run(self, feeds):
        if self.session is None:  # the plugin op (plugins/onnx.py) stands in for the kernel
            import onnxruntime
            from plugins.onnx import onnxruntime_session_options

            options = onnxruntime_session_options()
            options.intra_op_num_threads = 1
            self.session = onnxruntime.InferenceSession(self.model_bytes, options,
                                                        providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, feeds)))


def _memory(address, shape, dtype):
    """The dense row-major array of `shape` at a raw address (what TensorRT reads/writes)."""
    kind = np.dtype(NUMPY_TYPES[dtype])
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, kind)
    if not address:
        raise ValueError("null address for a non-empty tensor")
    buffer = (ctypes.c_char * (count * kind.itemsize)).from_address(address)
    return np.frombuffer(buffer, dtype=kind).reshape(shape)


class IExecutionContext(StandIn):
    def __init__(self, engine):
        self.engine = engine
        self.shapes, self.addresses = {}, {}

    def set_input_shape(self, name, shape):
        low, _, high = self.engine.get_tensor_profile_shape(name, 0)
        shape = list(shape)
        if len(shape) != len(low) or not all(a <= s <= b for a, s, b in zip(low, shape, high)):
            return False
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name):
        if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT:
            return self.shapes.get(name, [-1])
        sizes = {}  # named dimension -> its size, from the inputs' shapes
        for tensor in self.engine.header["inputs"]:
            for dim, size in zip(tensor["dims"], self.shapes.get(tensor["name"], [])):
                if isinstance(dim, str):
                    sizes[dim] = size
        dims = next(t["dims"] for t in self.engine.header["outputs"] if t["name"] == name)
        return [d if isinstance(d, int) else sizes.get(d, -1) for d in dims]

    def set_tensor_address(self, name, memory):
        if int(memory) % ALIGNMENT:
            print(f"[stand-in tensorrt] {name}: address {int(memory):#x} is not {ALIGNMENT}-byte "
                  "aligned", file=sys.stderr)
            return False
        self.addresses[name] = int(memory)
        BOUND.append((name, int(memory)))
        return True

    def execute_async_v3(self, stream_handle):
        engine = self.engine
        feeds = {}
        for tensor in engine.header["inputs"]:
            name = tensor["name"]
            if name not in self.shapes or name not in self.addresses:
                print(f"[stand-in tensorrt] {name}: shape or address not set", file=sys.stderr)
                return False
            feeds[name] = _memory(self.addresses[name], self.shapes[name], tensor["dtype"]).copy()
        results = engine.run(feeds)
        for tensor in engine.header["outputs"]:
            name, shape = tensor["name"], self.get_tensor_shape(tensor["name"])
            if name not in self.addresses or list(results[name].shape) != shape:
                print(f"[stand-in tensorrt] {name}: no address, or shape {list(results[name].shape)} "
                      f"!= {shape}", file=sys.stderr)
                return False
            np.copyto(_memory(self.addresses[name], shape, tensor["dtype"]), results[name])
        return True


# --- installing it --------------------------------------------------------------------------

_STATE = {"gpu": True, "major": 11}
_PLUGIN = None
FLAVOURS = ("11.4.0", "10.16.1", "10.8.0")  # 10.8: no QuickPluginCreationRequest (no AOT plugins)


def install(monkeypatch=None, gpu: bool = True, version: str = VERSION) -> types.ModuleType:
    """Put the stand-in `tensorrt` and `tensorrt.plugin` in sys.modules; returns the plugin
    module, whose `registered` maps (plugin_id, "register" | "aot_impl") -> function.
    gpu=False: TensorRT installed on a machine without a usable GPU (Builder and Runtime
    cannot be created, as with the real one). version: one of FLAVOURS. `tensorrt.missing`
    lists unimplemented names our code asked for; `BOUND` every address bound."""
    global _PLUGIN
    if version not in FLAVOURS:
        raise ValueError(f"stand-in flavours: {', '.join(FLAVOURS)}")
    major, minor = (int(x) for x in version.split(".")[:2])
    aot = (major, minor) >= (10, 9)
    _STATE.update(gpu=gpu, major=major)
    MISSING.clear()
    BOUND.clear()
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.missing = MISSING
    trt.DataType = DataType
    trt.float32, trt.float16, trt.bfloat16, trt.int64, trt.int32, trt.bool = (
        DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT64, DataType.INT32, DataType.BOOL)
    for cls in (TensorIOMode, BuilderFlag, NetworkDefinitionCreationFlag, ILogger, Logger,
                Builder, OnnxParser, Runtime, ICudaEngine, IExecutionContext, IBuilderConfig,
                IOptimizationProfile, INetworkDefinition, ITensor):
        setattr(trt, cls.__name__, cls)
    if aot:  # tensorrt/plugin/_export.py: IS_AOT_ENABLED = hasattr(trt, "QuickPluginCreationRequest")
        trt.QuickPluginCreationRequest = types.SimpleNamespace(
            UNKNOWN=0, PREFER_JIT=1, PREFER_AOT=2, STRICT_JIT=3, STRICT_AOT=4)

    def module_getattr(name):
        if not name.startswith("__"):
            MISSING.append(f"tensorrt.{name}")
        raise AttributeError(f"the stand-in tensorrt has no {name!r}")

    trt.__getattr__ = module_getattr
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.registered = {}
    trtp.creators = {}  # (name, version, namespace) -> _PluginDef, what the parser looks up
    trtp.op = types.ModuleType("tensorrt.plugin.op")

    def register(plugin_id):
        def record(function):
            namespace, name = plugin_id.split("::")
            space = trtp.op.__dict__.setdefault(namespace, types.ModuleType(f"tensorrt.plugin.op.{namespace}"))
            if hasattr(space, name):  # _lib.py's register refuses a second definition
                raise ValueError(f"'_Op' already has a defintion for '{name}'")
            setattr(space, name, function)
            trtp.registered[(plugin_id, "register")] = function
            trtp.creators[(name, "1", namespace)] = _PluginDef(version, function)
            return function
        return record

    def aot_impl(plugin_id):
        def record(function):
            namespace, name = plugin_id.split("::")
            if (name, "1", namespace) not in trtp.creators:
                raise ValueError(f"Plugin {plugin_id} is not registered. Did you register it with "
                                 "tensorrt.plugin.register API?")
            trtp.registered[(plugin_id, "aot_impl")] = function
            trtp.creators[(name, "1", namespace)].aot_impl = function
            return function
        return record

    # aot_impl is defined whatever the version (_lib.py does not guard it): only the
    # compiled module says whether TensorRT can build an AOT plugin.
    trtp.register, trtp.aot_impl = register, aot_impl
    trtp.TensorDesc, trtp.SymInt32, trtp.SymExprs, trtp.SymIntExprs = TensorDesc, SymInt32, SymExprs, SymIntExprs
    if aot:  # _tensor.py and _lib.py define these only where IS_AOT_ENABLED
        trtp.KernelLaunchParams = KernelLaunchParams
    trt.plugin = trtp
    _PLUGIN = trtp
    for name, module in (("tensorrt", trt), ("tensorrt.plugin", trtp)):
        # importlib.util.find_spec (transformers' probes, for one) needs a spec.
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        if monkeypatch is None:
            sys.modules[name] = module
        else:
            monkeypatch.setitem(sys.modules, name, module)
    return trtp
