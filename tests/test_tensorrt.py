"""The TensorRT side: plugin identity and fields (plugins/plugin_spec.py), the plugin's glue
(plugins/tensorrt.py) against a stand-in of tensorrt.plugin, the kernel compiled ahead of
time exactly as TensorRT will launch it (PTX for sm_90, built here without a GPU), the
engine builder's profiles and errors. Engine builds need TensorRT and a GPU: those tests
skip with the reason where either is missing."""

import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper

import fake_tensorrt
from build import tensorrt_build as trt_build
from plugins import plugin_spec
from plugins import tensorrt as trt_plugin
from plugins.attention import reference_attention
from plugins.scaling import QueryScaling
from runtime.families import FAMILIES

PRESETS = {name: f.preset for name, f in FAMILIES.items() if f.preset}  # the families' presets

REPO = Path(__file__).resolve().parent.parent
AVAILABLE, WHY_NOT = trt_build.tensorrt_available()
needs_tensorrt = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)

scalings = st.builds(QueryScaling, ref_keys=st.integers(2, 1 << 20), top_k=st.just(1),
                     slope=st.floats(0.05, 50), max_log_scale=st.floats(0, 3))


# --- plugin identity and fields (no TensorRT needed) -------------------------------------

def test_plugin_identity_is_what_the_onnx_node_names():
    assert (plugin_spec.PLUGIN_NAME, plugin_spec.PLUGIN_VERSION, plugin_spec.PLUGIN_NAMESPACE) == (
        "SharpDraftAttention", "1", "sharpdraft")
    assert plugin_spec.PLUGIN_ID == "sharpdraft::SharpDraftAttention"
    assert plugin_spec.INPUTS == ("q", "k", "v", "visible")


@pytest.mark.parametrize("scaling", list(PRESETS.values()), ids=list(PRESETS))
def test_plugin_fields_match_scaling_values(scaling):
    fields = plugin_spec.plugin_fields(scaling)
    assert fields == scaling.to_dict()
    assert {name: type(value) for name, value in fields.items()} == plugin_spec.FIELD_TYPES


@settings(max_examples=50, deadline=None)
@given(scaling=scalings)
def test_plugin_fields_round_trip_to_query_scaling(scaling):
    assert plugin_spec.scaling_from_fields(plugin_spec.plugin_fields(scaling)) == scaling


@settings(max_examples=50, deadline=None)
@given(scaling=scalings)
def test_fields_stored_as_onnx_float32_attributes_keep_beta(scaling):
    # ONNX float attributes are float32 and TensorRT hands them on as one-element arrays.
    stored = {name: np.array([value], dtype=np.int32 if isinstance(value, int) else np.float32)
              for name, value in plugin_spec.plugin_fields(scaling).items()}
    back = plugin_spec.scaling_from_fields(stored)
    assert (back.ref_keys, back.top_k) == (scaling.ref_keys, scaling.top_k)
    n = torch.tensor([1.0, scaling.ref_keys + 1.0, 4.0 * scaling.ref_keys, 1e7], dtype=torch.float64)
    assert torch.allclose(back.beta(n), scaling.beta(n), rtol=1e-6, atol=0)


def test_plugin_fields_refuse_what_is_not_a_scaling():
    with pytest.raises(ValueError, match="QueryScaling"):
        plugin_spec.plugin_fields(None)
    with pytest.raises(ValueError, match="missing field"):
        plugin_spec.scaling_from_fields({"ref_keys": 2048, "top_k": 32, "slope": 5.0})
    with pytest.raises(ValueError, match="whole number"):
        plugin_spec.scaling_from_fields({"ref_keys": 2048.5, "top_k": 32, "slope": 5.0, "max_log_scale": 0.5})


def write_attention_graph(path: Path, scaling=None, elem=TensorProto.FLOAT, head_dim=64) -> Path:
    """A graph of one attention: the plugin node, or (scaling=None) plain ops only."""
    shapes = {"q": [1, 4, 16, head_dim], "k": [1, 2, "kv", head_dim], "v": [1, 2, "kv", head_dim]}
    inputs = [helper.make_tensor_value_info(n, elem, s) for n, s in shapes.items()]
    inputs.append(helper.make_tensor_value_info("visible", TensorProto.INT64, [1, 16]))
    output = helper.make_tensor_value_info("out", elem, shapes["q"])
    if scaling is None:
        nodes = [helper.make_node("Identity", ["q"], ["out"])]
    else:
        nodes = [helper.make_node(plugin_spec.PLUGIN_NAME, list(plugin_spec.INPUTS), ["out"],
                                  name="attention0", **plugin_spec.onnx_attributes(scaling))]
    graph = helper.make_graph(nodes, "sharpdraft_attention", inputs, [output])
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_onnx_plugin_node_carries_lookup_keys_and_fields(tmp_path):
    path = write_attention_graph(tmp_path / "plugin.onnx", QueryScaling())
    node = onnx.load(str(path)).graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "SharpDraftAttention"
    assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b"sharpdraft"
    fields = {name: attrs[name] for name in plugin_spec.FIELD_TYPES}
    assert plugin_spec.scaling_from_fields(fields) == QueryScaling()
    assert trt_build.plugin_nodes(path) == 1
    assert trt_build.plugin_nodes(write_attention_graph(tmp_path / "plain.onnx")) == 0


# --- TensorRT missing: one-line errors ---------------------------------------------------

def test_tensorrt_missing_error_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(trt_plugin.TensorRTUnavailable) as caught:
        trt_plugin.import_tensorrt()
    message = str(caught.value)
    assert message == trt_plugin.TENSORRT_MISSING and "\n" not in message
    assert "--backend onnxruntime" in message
    assert trt_build.tensorrt_available() == (False, message)
    with pytest.raises(trt_plugin.TensorRTUnavailable, match="not installed"):
        trt_build.build_engine(write_attention_graph(tmp_path / "g.onnx", QueryScaling()),
                               tmp_path / "g.engine", [], "float32")


def test_build_engine_names_a_missing_onnx_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="export the drafter"):
        trt_build.build_engine(tmp_path / "absent.onnx", tmp_path / "e.engine", [], "float16")
    with pytest.raises(ValueError, match="dtype"):
        trt_build.build_engine(tmp_path / "absent.onnx", tmp_path / "e.engine", [], "int8")


# --- optimisation profiles ----------------------------------------------------------------

def test_context_profile_spans_min_opt_max_context():
    profile = trt_build.context_profile({"k": (1, 8, "context+16", 128), "visible": (1, 16)},
                                        max_seq_len=65536, min_seq_len=16)
    assert profile["k"] == ((1, 8, 32, 128), (1, 8, 32784, 128), (1, 8, 65552, 128))
    assert profile["visible"] == ((1, 16),) * 3
    assert trt_build.context_profile({"k": ("context",)}, 100, opt_seq_len=7)["k"] == ((1,), (7,), (100,))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_seq_len=0), "min_seq_len"),
    (dict(max_seq_len=10, opt_seq_len=11), "opt_seq_len"),
    (dict(max_seq_len=10, inputs={"k": ("ctx",)}), "context\\+N"),
])
def test_context_profile_refuses_bad_lengths(kwargs, message):
    kwargs.setdefault("inputs", {"k": ("context",)})
    with pytest.raises(ValueError, match=message):
        trt_build.context_profile(**kwargs)


# --- the plugin's glue, against the stand-in ---------------------------------------------

@pytest.fixture
def stand_in(monkeypatch):
    trtp = fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    assert trt_plugin.register_plugin() == plugin_spec.PLUGIN_ID
    return trtp


def test_plugin_registers_inputs_and_fields_from_plugin_spec(stand_in):
    describe = stand_in.registered[(plugin_spec.PLUGIN_ID, "register")]
    compile_kernel = stand_in.registered[(plugin_spec.PLUGIN_ID, "aot_impl")]
    fields = list(plugin_spec.FIELD_TYPES)
    described = inspect.signature(describe).parameters
    assert list(described) == [*plugin_spec.INPUTS, *fields]
    # One-element numpy fields of ONNX's attribute types (int32, float32), which both
    # TensorRT 10's and 11's creators convert with astype (test_tensorrt_sources.py).
    want = {int: np.int32, float: np.float32}
    assert [typing.get_args(typing.get_args(described[f].annotation)[1])[0] for f in fields] == [
        want[kind] for kind in plugin_spec.FIELD_TYPES.values()]
    assert all(described[t].annotation is stand_in.TensorDesc for t in plugin_spec.INPUTS)
    # tensorrt.plugin's documented aot_impl schema: tensors, attributes, outputs, tactic.
    assert list(inspect.signature(compile_kernel).parameters) == [*plugin_spec.INPUTS, *fields, "outputs", "tactic"]
    assert len(typing.get_args(inspect.signature(compile_kernel).return_annotation)) == 4
    assert trt_plugin.register_plugin() == plugin_spec.PLUGIN_ID  # idempotent: no second definition


def test_plugin_output_is_like_q_and_bad_types_are_refused(stand_in):
    describe = stand_in.registered[(plugin_spec.PLUGIN_ID, "register")]
    desc = stand_in.TensorDesc
    q, k, visible = desc((1, 4, 16, 64), "HALF"), desc((1, 2, -1, 64), "HALF"), desc((1, 16), "INT64")
    fields = plugin_spec.plugin_fields(QueryScaling())
    out = describe(q, k, k, visible, **fields)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    with pytest.raises(ValueError, match="visible must be int64"):
        describe(q, k, k, desc((1, 16), "INT32"), **fields)
    with pytest.raises(ValueError, match="share one of"):
        describe(q, desc((1, 2, -1, 64), "FLOAT"), k, visible, **fields)


def parse(path):
    """The stand-in's ONNX parser on one file: (ok, first error's description)."""
    import tensorrt as trt

    network = trt.Builder(trt.Logger()).create_network(0)
    parser = trt.OnnxParser(network, trt.Logger())
    ok = parser.parse_from_file(str(path))
    return ok, (parser.get_error(0).desc() if parser.num_errors else "")


def test_stand_in_parser_finds_plugins_by_name_version_and_namespace(stand_in, tmp_path):
    path = write_attention_graph(tmp_path / "ok.onnx", QueryScaling())
    assert parse(path) == (True, "")
    model = onnx.load(str(path))
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "plugin_version":
            attribute.s = b"2"
    onnx.save(model, str(tmp_path / "v2.onnx"))
    ok, why = parse(tmp_path / "v2.onnx")
    assert not ok and "Plugin not found" in why and "version 2" in why


def test_stand_in_parser_calls_the_description_with_converted_fields(stand_in, tmp_path):
    # The description runs at parse time (TensorRT asks for output types while building).
    path = write_attention_graph(tmp_path / "bad.onnx", QueryScaling())
    model = onnx.load(str(path))
    model.graph.input[3].type.tensor_type.elem_type = TensorProto.INT32  # visible
    onnx.save(model, str(path))
    ok, why = parse(path)
    assert not ok and "visible must be int64" in why


@pytest.mark.parametrize("version, fails", [("10.16.1", True), ("11.4.0", False)])
def test_stand_in_converts_builtin_fields_as_each_version_does(monkeypatch, tmp_path, version, fails):
    trtp = fake_tensorrt.install(monkeypatch, version=version)

    @trtp.register("probe::Probe")
    def describe(q: trtp.TensorDesc, n: int) -> trtp.TensorDesc:
        return q.like()

    trtp.aot_impl("probe::Probe")(lambda q, n, outputs, tactic: None)
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("Probe", ["q"], ["out"], domain="probe", plugin_namespace="probe", n=7)
    graph = helper.make_graph([node], "g", [q], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("probe", 1)])
    onnx.save(model, str(tmp_path / "probe.onnx"))
    ok, why = parse(tmp_path / "probe.onnx")
    assert ok != fails and ("0-dimensional" in why) == fails


def test_stand_in_launch_types_refuse_what_tensorrt_refuses(stand_in):
    params = stand_in.KernelLaunchParams()
    params.grid_x = 3
    with pytest.raises(AttributeError, match="no attribute 'threads'"):
        params.threads = 128
    for value in (np.int64(3), 3.0, "3"):
        with pytest.raises(TypeError, match="SymInt32 takes an int"):
            stand_in.SymInt32(value)
    assert [s.value for s in stand_in.SymIntExprs.from_tuple([1, stand_in.SymInt32(2)])] == [1, 2]


AOT_SCRIPT = r"""
import json, re, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import fake_tensorrt
trtp = fake_tensorrt.install()
from plugins import plugin_spec, tensorrt as trt_plugin, triton_kernel
from plugins.scaling import QueryScaling
trt_plugin.build_arch = lambda: 90  # H100/H200; no GPU needed to emit PTX
trt_plugin.build_sm_count = lambda: 132
trt_plugin.register_plugin()
compile_kernel = trtp.registered[(plugin_spec.PLUGIN_ID, "aot_impl")]
TD = trtp.TensorDesc
q, k, vis = TD((1, 8, 16, 64), "HALF"), TD((1, 2, 4096, 64), "HALF"), TD((1, 16), "INT64")
k.shape = (1, 2, -1, 64)  # the context length is dynamic in the engine
import numpy as np
fields = {n: np.array([v], np.int32 if isinstance(v, int) else np.float32)  # as a creator gives them
          for n, v in plugin_spec.plugin_fields(QueryScaling()).items()}
name, ptx, params, scalars = compile_kernel(q, k, k, vis, **fields, outputs=(q.like(),), tactic=0)
open(sys.argv[2], "w").write(ptx)
entry = ptx[ptx.index(".entry " + name):]
plain = triton_kernel.aot_compile("fp16", 64, None, 90, rows_hint=64)
globals_ = re.findall(r"^\.global \.align 16 \.b8 (\w+)\[(\d+)\];", ptx, re.M)
print(json.dumps(dict(
    name=name, params=re.findall(r"\.param \.(\w+)", entry[:entry.index(")")]),
    grid=[params.grid_x.value, params.grid_y.value, params.grid_z.value], block=params.block_x.value,
    shared=params.shared_mem.value,
    scalars=[s.value for s in scalars], target=re.search(r"\.target (\w+)", ptx).group(1),
    beta_changes_ptx=plain.ptx != ptx, globals=globals_,
    global_addresses=[g for g, _ in globals_ if re.search(r"mov\.u64 %rd\d+, " + g + ";", entry)])))
"""


def ptxas_for(ptx: str):
    """A ptxas that knows this PTX's .version: Triton ships two (CUDA 12.x and 13.x)."""
    import shutil

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for candidate in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas", shutil.which("ptxas")):
        if candidate and Path(candidate).is_file():
            version = subprocess.run([str(candidate), "--version"], capture_output=True, text=True).stdout
            if "release 13" in version or "cuda_13" in version:
                return str(candidate)
    return None


def test_aot_kernel_follows_tensorrt_launch_convention(tmp_path):
    # TRITON_INTERPRET must be off to compile: run where conftest has not switched it on.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    ptx_path = tmp_path / "kernel.ptx"
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT, str(REPO), str(ptx_path)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    from plugins import triton_kernel  # noqa: E402 -- constants only, no kernel launch

    # Exactly what TensorRT launches (aot_impl's contract): the (q, k, v, visible) pointers,
    # the int32 extra arguments, the out pointer -- the single-launch kernel's scratch
    # pointers become module globals and Triton's two trailing scratch pointers are dropped
    # from the PTX we ship (plugins/tensorrt.tensorrt_ptx).
    n_scalars = len(triton_kernel.SCALAR_ARGS) + len(triton_kernel.SLICE_ARGS)
    assert got["params"] == ["u64"] * 4 + ["u32"] * n_scalars + ["u64"]
    assert got["scalars"] == list(triton_kernel.contiguous_scalars(8, 16, 2, 4096, 64)
                                  + triton_kernel.aot_slice_scalars(132))
    # 16 queries x group 4 = 64 rows: one tile per KV head; key slices for 2 programs per SM
    assert got["grid"] == [1, 2, triton_kernel.aot_slices(2, 132)] and got["grid"][2] > 1
    assert got["block"] == 128 and 0 < got["shared"] <= triton_kernel.AOT_SHARED_MEMORY_LIMIT
    assert got["target"].startswith("sm_90") and got["name"] == "_single_launch_kernel"
    rows = triton_kernel.AOT_SCRATCH_ROWS
    assert [int(size) for _, size in got["globals"]] == [rows * 64 * 4, rows * 4, triton_kernel.AOT_COUNTERS * 4]
    assert got["global_addresses"] == [name for name, _ in got["globals"]]  # each one read by address
    assert got["beta_changes_ptx"]  # the beta constants are compiled in
    # The edited PTX is still valid: ptxas assembles it for sm_90a, and the cubin's kernel
    # takes exactly those 26 parameters.
    ptxas = ptxas_for(ptx_path.read_text())
    if ptxas is None:
        pytest.skip("no ptxas of CUDA 13 (Triton's wheel ships one) to assemble the PTX")
    cubin = tmp_path / "kernel.cubin"
    done = subprocess.run([ptxas, "-arch=sm_90a", str(ptx_path), "-o", str(cubin)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cuobjdump = Path(ptxas).with_name("cuobjdump")
    if cuobjdump.is_file():
        elf = subprocess.run([str(cuobjdump), "-elf", str(cubin)], capture_output=True, text=True).stdout
        assert elf.count("EIATTR_KPARAM_INFO") == len(got["params"])


def test_tensorrt_ptx_drops_only_unread_trailing_parameters():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n"
           "\t.param .u32 k_param_1,\n\t.param .u64 .ptr .global .align 1 k_param_2,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_3\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n}\n")
    shipped = trt_plugin.tensorrt_ptx(ptx, "k", 2)
    assert "k_param_1\n)" in shipped and "k_param_2" not in shipped and "k_param_3" not in shipped
    assert trt_plugin.tensorrt_ptx(ptx, "k", 4) == ptx.replace("(\n\t", "(\n\t")  # nothing to drop
    with pytest.raises(RuntimeError, match="reads parameter"):
        trt_plugin.tensorrt_ptx(ptx.replace("[k_param_0]", "[k_param_3]"), "k", 2)
    with pytest.raises(RuntimeError, match="declares 4 parameters, TensorRT launches 5"):
        trt_plugin.tensorrt_ptx(ptx, "k", 5)


def test_tensorrt_ptx_turns_scratch_parameters_into_module_globals():
    ptx = (".version 8.7\n.address_size 64\n\n\t// .globl\tk\n.visible .entry k(\n"
           "\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_4\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n"
           "\tld.param.b64 %rd7, [k_param_2];\n\tst.global.b32 [%rd7], %r1;\n}\n")
    shipped = trt_plugin.tensorrt_ptx(ptx, "k", 2, scratch=(4096,))
    assert ".global .align 16 .b8 k_scratch_0[4096];\n.visible .entry k(" in shipped
    assert "mov.u64 %rd7, k_scratch_0;" in shipped and "k_param_2" not in shipped
    assert "k_param_1\n)" in shipped and "k_param_3" not in shipped
    with pytest.raises(RuntimeError, match="other than by one 64-bit load"):
        trt_plugin.tensorrt_ptx(ptx.replace("st.global.b32 [%rd7]", "st.global.b32 [k_param_2]"), "k", 2,
                                scratch=(4096,))


# --- real TensorRT (GPU hosts only) ------------------------------------------------------

@needs_tensorrt
@pytest.mark.parametrize("dtype, elem, tolerance", [("float32", TensorProto.FLOAT, 1e-5),
                                                     ("float16", TensorProto.FLOAT16, 2e-3)])
def test_plugin_engine_matches_reference_op(tmp_path, dtype, elem, tolerance):
    import tensorrt as trt

    scaling = QueryScaling(ref_keys=64, top_k=8)
    onnx_path = write_attention_graph(tmp_path / "attention.onnx", scaling, elem)
    profile = trt_build.context_profile({"k": (1, 2, "context", 64), "v": (1, 2, "context", 64)},
                                        max_seq_len=4096, min_seq_len=16)
    built = trt_build.build_engine(onnx_path, tmp_path / "attention.engine", [profile], dtype)
    assert built["plugin_nodes"] == 1 and (tmp_path / built["file"]).stat().st_size > 0

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, 16, 64, device="cuda", generator=g).to(torch_dtype)
    k = torch.randn(1, 2, 3000, 64, device="cuda", generator=g).to(torch_dtype)
    v = torch.randn(1, 2, 3000, 64, device="cuda", generator=g).to(torch_dtype)
    visible = torch.arange(2985, 3001, device="cuda")[None]
    out = torch.empty_like(q)
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
        (tmp_path / built["file"]).read_bytes())
    context = engine.create_execution_context()
    for name, tensor in dict(q=q, k=k, v=v, visible=visible, out=out).items():
        if name != "out":
            context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    want = reference_attention(q, k, v, visible, None, scaling)
    assert (out.float() - want.float()).abs().max().item() <= tolerance


@needs_tensorrt
def test_engine_build_refuses_a_graph_of_another_dtype(tmp_path):
    onnx_path = write_attention_graph(tmp_path / "a.onnx", QueryScaling(), TensorProto.FLOAT)
    profile = trt_build.context_profile({"k": (1, 2, "context", 64), "v": (1, 2, "context", 64)}, 256)
    with pytest.raises(trt_build.EngineBuildError, match="export the ONNX graph at the engine's dtype"):
        trt_build.build_engine(onnx_path, tmp_path / "a.engine", [profile], "float16")
