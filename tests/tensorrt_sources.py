"""TensorRT's own `tensorrt.plugin` package (pure Python, from the tensorrt-cu12-bindings
wheels that `make setup` downloads into .cache/tensorrt-wheels) imported on a machine
without TensorRT, over a minimal stand-in for the compiled `tensorrt` module it imports.

Real: every line of tensorrt/plugin/*.py -- register / aot_impl and their signature
validation, the plugin creator's field conversion (`_TemplatePluginCreator.create_plugin`),
the AOT plugin class (`_TemplateAOTPlugin.get_output_data_types` calling our description),
TensorDesc, KernelLaunchParams, SymInt32, SymIntExprs. Stand-in (this file): the compiled
module's names those lines touch -- enums, PluginField / PluginFieldCollection, the plugin
registry, the base classes the plugin classes derive from. Not exercised: anything that
needs TensorRT's C++ (symbolic shape expressions, the builder calling get_launch_params).
"""

import enum
import importlib
import sys
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".cache" / "tensorrt-wheels"
VERSIONS = ("10.16.1.11", "11.4.0.106")  # the Makefile's TENSORRT_BINDINGS


def plugin_dir(version: str) -> Path | None:
    """The unpacked wheel's folder holding tensorrt/plugin (as `plugin/`), or None."""
    found = sorted(WHEELS.glob(f"tensorrt_cu12_bindings-{version}-*/tensorrt_bindings/plugin/_lib.py"))
    return found[0].parent.parent if found else None


def missing_reason(version: str) -> str:
    return (f"the tensorrt-cu12-bindings {version} wheel is not unpacked in {WHEELS} "
            "(make setup fetches it)")


class _Enum(enum.IntEnum):
    pass


def _enum(name, members):
    return _Enum(name, {m: i for i, m in enumerate(members)})


class PluginField:
    """The compiled PluginField: name, data (a numpy array, or bytes for CHAR/UNKNOWN), type."""

    def __init__(self, name="", data=None, type=None):
        self.name, self.type = name, type
        self.data = data if data is not None else np.array([])


class PluginRegistry:
    def __init__(self):
        self.creators = {}

    def register_creator(self, creator, namespace):
        self.creators[(creator.name, creator.plugin_version, namespace)] = creator
        return True

    def get_creator(self, name, version, namespace=""):
        return self.creators.get((name, version, namespace))


def compiled_module(bindings: Path) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__path__ = [str(bindings)]  # so `tensorrt.plugin` is the wheel's real package
    trt.__version__ = bindings.parent.name.split("-")[1]

    class Logger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self, *args):
            pass

        def log(self, severity, message):
            pass

    trt.Logger = Logger
    trt.PluginFieldType = _enum("PluginFieldType", ["FLOAT16", "FLOAT32", "FLOAT64", "INT8", "INT16",
                                                    "INT32", "CHAR", "DIMS", "UNKNOWN", "BF16", "INT64",
                                                    "FP8", "INT4", "FP4"])
    trt.DataType = _enum("DataType", ["FLOAT", "HALF", "INT8", "INT32", "BOOL", "UINT8", "FP8", "BF16",
                                      "INT64", "INT4", "FP4", "E8M0"])
    trt.float32, trt.float16, trt.bfloat16 = trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16
    trt.int32, trt.int64, trt.int8, trt.bool = (trt.DataType.INT32, trt.DataType.INT64,
                                                trt.DataType.INT8, trt.DataType.BOOL)
    trt.TensorFormat = _enum("TensorFormat", ["LINEAR", "CHW2", "HWC8", "CHW4", "CHW16", "CHW32"])
    trt.TensorRTPhase = _enum("TensorRTPhase", ["BUILD", "RUNTIME"])
    trt.QuickPluginCreationRequest = _enum("QuickPluginCreationRequest", [
        "UNKNOWN", "PREFER_JIT", "PREFER_AOT", "STRICT_JIT", "STRICT_AOT"])
    trt.DimensionOperation = _enum("DimensionOperation", [
        "SUM", "PROD", "MAX", "MIN", "SUB", "EQUAL", "LESS", "FLOOR_DIV", "CEIL_DIV"])
    trt.PluginArgType = _enum("PluginArgType", ["INT"])
    trt.PluginArgDataType = _enum("PluginArgDataType", ["INT8", "INT16", "INT32"])
    trt.PluginField = PluginField
    trt.PluginFieldCollection = list
    registry = PluginRegistry()
    trt.get_plugin_registry = lambda: registry
    # Base classes and types the package names at import time or in isinstance checks.
    for name in ("IPluginV3", "IPluginV3QuickCore", "IPluginV3QuickBuild", "IPluginV3QuickRuntime",
                 "IPluginV3QuickAOTBuild", "IPluginCreatorV3Quick", "IDimensionExpr", "ISymExpr",
                 "IExprBuilder", "DimsExprs", "Dims", "ITensor", "IPluginV3OneCore",
                 "PluginTensorDesc", "DynamicPluginTensorDesc"):
        setattr(trt, name, type(name, (), {"__init__": lambda self, *args, **kwargs: None}))
    trt.Dims.MAX_DIMS = 8  # nvinfer1::Dims::MAX_DIMS
    trt.nptype = lambda dtype: {trt.DataType.FLOAT: np.float32, trt.DataType.HALF: np.float16,
                                trt.DataType.INT32: np.int32, trt.DataType.INT64: np.int64}[dtype]
    return trt


def load(version: str, monkeypatch):
    """(tensorrt stand-in, the wheel's real tensorrt.plugin) in sys.modules for one test."""
    bindings = plugin_dir(version)
    for name in [n for n in sys.modules if n == "tensorrt" or n.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    trt = compiled_module(bindings)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    trtp = importlib.import_module("tensorrt.plugin")
    for name in [n for n in sys.modules if n.startswith("tensorrt.")]:
        # Out and back in through monkeypatch, which then removes it after the test.
        monkeypatch.setitem(sys.modules, name, sys.modules.pop(name))
    return trt, trtp
