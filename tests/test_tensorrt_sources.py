"""Our plugin against TensorRT's own `tensorrt.plugin` sources (tensorrt-cu12-bindings
10.16.1.11 and 11.4.0.106, tensorrt_bindings/plugin/*.py, imported on CPU over a stand-in
for the compiled module: tests/tensorrt_sources.py says which lines are real). The
registration, the creators' field conversion and the description run as TensorRT runs
them while parsing an ONNX plugin node; tests/fake_tensorrt.py's conversion is checked
against the real one, so the engine tests' stand-in cannot drift from it."""

import typing

import numpy as np
import pytest

import fake_tensorrt
import tensorrt_sources
from plugins import plugin_spec
from plugins import tensorrt as trt_plugin
from plugins.scaling import QueryScaling

SCALING = QueryScaling(ref_keys=2048, top_k=32, slope=5.0, max_log_scale=0.5)


@pytest.fixture(params=tensorrt_sources.VERSIONS)
def real(request, monkeypatch):
    version = request.param
    if tensorrt_sources.plugin_dir(version) is None:
        pytest.skip(tensorrt_sources.missing_reason(version))
    trt, trtp = tensorrt_sources.load(version, monkeypatch)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    return trt, trtp


def parser_fields(trt, creator):
    """The fields TensorRT's ONNX parser hands the creator for our node: each declared field
    from the node's attribute, as a one-element array of the declared type (ONNX INT and
    FLOAT attributes; the lookup keys plugin_version / plugin_namespace are not fields)."""
    numpy_of = {trt.PluginFieldType.INT32: np.int32, trt.PluginFieldType.FLOAT32: np.float32,
                trt.PluginFieldType.INT64: np.int64, trt.PluginFieldType.FLOAT64: np.float64}
    attributes = plugin_spec.onnx_attributes(SCALING)
    return [trt.PluginField(f.name, np.array([attributes[f.name]], dtype=numpy_of[f.type]), f.type)
            for f in creator.field_names]


def test_real_creator_creates_our_plugin_and_converts_its_fields(real):
    trt, trtp = real
    assert trt_plugin.register_plugin() == plugin_spec.PLUGIN_ID  # real register + aot_impl checks
    creator = trt.get_plugin_registry().get_creator(plugin_spec.PLUGIN_NAME, plugin_spec.PLUGIN_VERSION,
                                                    plugin_spec.PLUGIN_NAMESPACE)
    assert creator is not None  # what the parser finds by name + version + namespace
    plugin = creator.create_plugin(plugin_spec.PLUGIN_NAME, plugin_spec.PLUGIN_NAMESPACE,
                                   parser_fields(trt, creator), trt.TensorRTPhase.BUILD,
                                   trt.QuickPluginCreationRequest.STRICT_AOT)
    # The creator declares ONNX's attribute types: int32 and float32 fields.
    assert {f.name: f.type for f in creator.field_names} == {
        name: trt.PluginFieldType.INT32 if kind is int else trt.PluginFieldType.FLOAT32
        for name, kind in plugin_spec.FIELD_TYPES.items()}
    assert type(plugin).__name__ == "_TemplateAOTPlugin"
    back = plugin_spec.scaling_from_fields(plugin.attrs)
    assert (back.ref_keys, back.top_k) == (SCALING.ref_keys, SCALING.top_k)
    assert np.float32(back.slope) == np.float32(SCALING.slope)
    # TensorRT asks the plugin for its output types: our description, on real TensorDescs.
    assert plugin.get_output_data_types([trt.float16, trt.float16, trt.float16, trt.int64],
                                        [4, 4, 4, 2]) == [trt.float16]
    with pytest.raises(ValueError, match="visible must be int64"):
        plugin.get_output_data_types([trt.float16] * 3 + [trt.int32], [4, 4, 4, 2])
    trt_plugin._registered = False
    assert trt_plugin.register_plugin() == plugin_spec.PLUGIN_ID  # no "already has a definition"


def test_real_creators_on_builtin_int_fields_tensorrt_10_fails(real):
    # What main shipped (`ref_keys: int`): 10.x's creator calls int() on the 1-element
    # array and numpy 2 refuses; 11.x unwraps it. The stand-in's convert_field must agree.
    trt, trtp = real
    version = trt.__version__

    @trtp.register("probe::builtin_fields")
    def describe(x: trtp.TensorDesc, n: int, scale: float) -> trtp.TensorDesc:
        return x.like()

    creator = trt.get_plugin_registry().get_creator("builtin_fields", "1", "probe")
    fields = [trt.PluginField("n", np.array([7], dtype=np.int64), trt.PluginFieldType.INT64),
              trt.PluginField("scale", np.array([0.5], dtype=np.float64), trt.PluginFieldType.FLOAT64)]
    if version.startswith("10."):
        with pytest.raises(TypeError, match="0-dimensional"):
            creator.create_plugin("builtin_fields", "probe", fields, trt.TensorRTPhase.BUILD)
        with pytest.raises(TypeError, match="0-dimensional"):
            fake_tensorrt.convert_field(version, int, np.array([7], dtype=np.int32))
    else:
        plugin = creator.create_plugin("builtin_fields", "probe", fields, trt.TensorRTPhase.BUILD)
        assert plugin.attrs == {"n": 7, "scale": 0.5}
        assert fake_tensorrt.convert_field(version, int, np.array([7], dtype=np.int32)) == 7


def test_stand_in_converts_our_fields_as_the_real_creator_does(real):
    trt, trtp = real
    trt_plugin.register_plugin()
    creator = trt.get_plugin_registry().get_creator(plugin_spec.PLUGIN_NAME, "1", plugin_spec.PLUGIN_NAMESPACE)
    fields = parser_fields(trt, creator)
    plugin = creator.create_plugin(plugin_spec.PLUGIN_NAME, plugin_spec.PLUGIN_NAMESPACE, fields,
                                   trt.TensorRTPhase.BUILD, trt.QuickPluginCreationRequest.STRICT_AOT)
    annotations = typing.get_type_hints(trtp.op.sharpdraft.SharpDraftAttention.register_func)
    for field in fields:
        ours = fake_tensorrt.convert_field(trt.__version__, annotations[field.name], field.data)
        theirs = plugin.attrs[field.name]
        assert type(ours) is type(theirs) and ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_real_launch_types_take_what_our_aot_impl_sets(real, monkeypatch):
    # KernelLaunchParams refuses unknown attributes, SymInt32 is what get_launch_params
    # requires of every extra argument (_plugin_class.py); our aot_impl, given a stub kernel.
    trt, trtp = real
    trt_plugin.register_plugin()
    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1,\n"
           "\t.param .u64 k_param_2,\n\t.param .u64 k_param_3,\n\t.param .u32 k_param_4,\n"
           "\t.param .u64 k_param_5,\n\t.param .u64 k_param_6\n)\n{\n}\n")
    monkeypatch.setattr(trt_plugin, "build_arch", lambda: 90)
    monkeypatch.setattr(trt_plugin, "aot_launch", lambda q, k, dtype, scaling, arch: dict(
        name="k", ptx=ptx, threads=128, shared_mem=24576, grid=(1, 2), scalars=(16,)))
    definition = trtp.op.sharpdraft.SharpDraftAttention
    desc = trtp.TensorDesc()
    desc.dtype = trt.float16
    fields = {n: np.array([v], np.int32 if isinstance(v, int) else np.float32)
              for n, v in plugin_spec.plugin_fields(SCALING).items()}
    name, shipped, params, extra = definition.aot_impl_func(desc, desc, desc, desc, *fields.values(),
                                                              (desc,), 0)
    assert isinstance(params, trtp.KernelLaunchParams) and isinstance(extra, trtp.SymExprs)
    assert all(isinstance(arg, trtp.SymInt32) for arg in extra) and len(extra) == 1
    assert "k_param_6" not in shipped and "k_param_5" in shipped  # 4 inputs, 1 int32, out
    with pytest.raises(AttributeError, match="no attribute 'threads'"):
        params.threads = 128
