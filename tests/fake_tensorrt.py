"""A stand-in for the few `tensorrt` / `tensorrt.plugin` names plugins/tensorrt.py uses, so
its glue code runs on machines where TensorRT cannot be installed. It records what the
plugin registers and mimics the documented calling convention (tensorrt.plugin's
register / aot_impl docs); it proves nothing about TensorRT itself -- the skipped tests
in test_tensorrt.py do that on a GPU host.

Shape expressions are plain ints here: plugins.triton_kernel.launch_grid and
contiguous_scalars use only +, *, // so they run on both.
"""

import sys
import types


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
        self.value = value.value if isinstance(value, SymInt32) else value


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, values):
        return cls(values)


class KernelLaunchParams:
    def __init__(self):
        self.grid_x = self.grid_y = self.grid_z = 1
        self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


def install(monkeypatch=None) -> types.ModuleType:
    """Put fake `tensorrt` and `tensorrt.plugin` modules in sys.modules; returns the plugin
    module, whose `registered` maps (plugin_id, "register" | "aot_impl") -> function."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.1.0"
    trt.float32, trt.float16, trt.bfloat16, trt.int64, trt.int32 = (
        "FLOAT", "HALF", "BF16", "INT64", "INT32")
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.registered = {}

    def decorator(kind):
        def bind(plugin_id):
            def record(function):
                trtp.registered[(plugin_id, kind)] = function
                return function
            return record
        return bind

    trtp.register, trtp.aot_impl = decorator("register"), decorator("aot_impl")
    trtp.TensorDesc, trtp.SymInt32, trtp.SymExprs = TensorDesc, SymInt32, SymExprs
    trtp.SymIntExprs, trtp.KernelLaunchParams = SymIntExprs, KernelLaunchParams
    trt.plugin = trtp
    for name, module in (("tensorrt", trt), ("tensorrt.plugin", trtp)):
        if monkeypatch is None:
            sys.modules[name] = module
        else:
            monkeypatch.setitem(sys.modules, name, module)
    return trtp
