"""The exported graphs: valid ONNX, the plugin node in the form TensorRT's parser reads,
engine.json's record of them, and the same numbers as the torch models from one token
of context to 3000."""

import json

import numpy as np
import onnx
import pytest
import torch

import build_engine
from build import export
from runtime.backends.roles import TokenRows
from runtime.manifest import EngineError, read_manifest
from plugins.onnx import DOMAIN
from plugins.plugin_spec import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, plugin_fields
from runtime.backends.onnxruntime import BoundBatchDFlash, OnnxBatchDFlash, open_session
from runtime.cli import run
from runtime.engine import Engine
from runtime.spec import open_spec

CONTEXTS = (1, 17, 600, 3000)
ATOL = 1e-4  # fp32


def graphs(engine_dir, native_drafter_graph):
    return sorted(engine_dir.glob("*.onnx")) + [native_drafter_graph]


def test_every_exported_graph_passes_the_full_onnx_checker(onnx_engine, native_drafter_graph):
    paths = graphs(onnx_engine, native_drafter_graph)
    assert {p.name for p in paths} >= {"target.onnx", "drafter.onnx", "drafter-frozen.onnx"}
    for path in paths:
        export.check_graph(path)
        model = onnx.load(str(path))
        assert {o.domain: o.version for o in model.opset_import}[""] >= 18


def test_plugin_graph_has_one_sharpdraft_node_per_layer_in_tensorrt_form(onnx_engine, torch_engine):
    model = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_engine / "drafter.onnx")))
    nodes = [n for n in model.graph.node if n.op_type == PLUGIN_NAME]
    assert len(nodes) == torch_engine.drafter_model.config.num_layers
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(model.graph.value_info) + list(model.graph.input)}
    expected = plugin_fields(torch_engine.scaling)
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.pop("plugin_version") == PLUGIN_VERSION.encode()
        assert attrs.pop("plugin_namespace") == PLUGIN_NAMESPACE.encode()
        assert attrs.keys() == expected.keys()
        for name, value in expected.items():
            assert attrs[name] == pytest.approx(value, rel=1e-7)
        assert node.domain == DOMAIN and len(node.input) == 4 and len(node.output) == 1
        assert types[node.input[3]] == onnx.TensorProto.INT64  # visible-key counts
        assert types[node.input[0]] == types[node.output[0]] == onnx.TensorProto.FLOAT


def test_native_frozen_and_target_graphs_use_only_standard_ops(onnx_engine, native_drafter_graph):
    for path in (native_drafter_graph, onnx_engine / "drafter-frozen.onnx", onnx_engine / "target.onnx"):
        model = onnx.load(str(path))
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, path.name


def test_manifest_records_the_build(onnx_engine, torch_engine):
    data = json.loads((onnx_engine / "engine.json").read_text())
    assert data["backend"] == "onnxruntime"
    assert data["query_scaling"] == torch_engine.scaling.to_dict()
    record = data["extra"]["onnx"]
    assert record["opset"] == export.OPSET and record["attention"] == "plugin"
    assert {k: record["plugin"][k] for k in ("name", "version", "namespace")} == {
        "name": PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE}
    assert record["plugin"]["fields"] == plugin_fields(torch_engine.scaling)
    target = record["graphs"]["target"]
    assert [i["name"] for i in target["inputs"]] == list(export.TARGET_INPUTS)
    assert [o["name"] for o in target["outputs"]] == list(export.TARGET_OUTPUTS)
    assert target["inputs"][2]["shape"][0] == "past_len"
    assert target["inputs"][0]["shape"] == ["batch", "q_len"]
    drafter = record["graphs"]["drafter"]
    assert [i["name"] for i in drafter["inputs"]] == list(export.DRAFTER_INPUTS)
    # block 4 -> 3 drafts, over the drafter's 256-token draft vocabulary (draft-vocab.npy)
    assert drafter["outputs"][0]["shape"] == ["batch", 3, 256]
    assert record["draft_vocab"] == {"file": "draft-vocab.npy", "target_vocab_size": 320}
    assert drafter["plugin_nodes"] == 1 and record["graphs"]["drafter_frozen"]["plugin_nodes"] == 0
    # The plugin form keeps both drafters in the portable graphs (none over cache buffers).
    assert set(record["graphs"]) == {"target", "target_kv", "drafter", "drafter_frozen"}
    on_disk = {p.name for p in onnx_engine.iterdir()} - {"engine.json", ".verified.json"}
    assert set(data["artifacts"]) == on_disk
    read_manifest(onnx_engine, verify="full")  # every sha256 matches


def prompt(n, seed=0):
    return torch.randint(4, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("context", CONTEXTS)
def test_target_graph_matches_torch(context, torch_engine, ort_engine):
    ids = prompt(context)
    runs = {}
    for name, engine in (("torch", torch_engine), ("ort", ort_engine)):
        target = engine.loaded.batch_target()  # a batch of one
        last, feats = target.add(ids, context + 8)
        step, step_feats = target.verify(TokenRows.of([prompt(5, seed=1)]))
        target.rollback([context + 2])  # keep two of the five, verify three others
        again, again_feats = target.verify(TokenRows.of([prompt(3, seed=2)]))
        runs[name] = (last, feats, step, step_feats, again, again_feats)
    for ours, theirs in zip(runs["ort"], runs["torch"]):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("context", CONTEXTS)
def test_drafter_graphs_match_torch(context, torch_engine, ort_engine, native_drafter_graph,
                                    native_ort_engine):
    scaling = torch_engine.scaling
    block = torch_engine.drafter_model.config.block_size
    native = OnnxBatchDFlash(open_session(native_drafter_graph), block,
                             torch_engine.drafter_model.config.mask_token_id, scaling)
    drafters = {"torch": torch_engine.drafter(), "plugin": ort_engine.drafter(),
                "native": native, "in place": native_ort_engine.drafter(),
                "torch frozen": torch_engine.drafter(scaled=False),
                "ort frozen": ort_engine.drafter(scaled=False),
                "in place frozen": native_ort_engine.drafter(scaled=False)}
    assert isinstance(drafters["in place"], BoundBatchDFlash)
    assert isinstance(drafters["in place frozen"], BoundBatchDFlash)
    features = torch.randn(context + 3, torch_engine.drafter_model.fc.in_features,
                           generator=torch.Generator().manual_seed(context))
    out = {}
    for name, drafter in drafters.items():  # each a batch of one
        drafter.add(context + 3, features[:context], 7)  # the prompt's features read
        first, n_first = drafter.draft([features[context:context + 1]], [9])
        second, n_second = drafter.draft([features[context + 1:]], [4])  # through the cache
        out[name] = (first, second)
        assert (int(n_first[0]), int(n_second[0])) == (context + 1 + block, context + 3 + block)
    for name in ("plugin", "native", "in place"):
        for ours, theirs in zip(out[name], out["torch"]):
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    for name in ("ort frozen", "in place frozen"):
        for ours, theirs in zip(out[name], out["torch frozen"]):
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # beta is 1 up to ref_keys (64) visible keys and > 1 beyond: the scale is really in.
    differs = not torch.allclose(out["plugin"][1], out["ort frozen"][1], atol=ATOL)
    assert differs == (scaling.beta(context + 3 + block) > 1.0)


def test_graphs_take_any_batch(onnx_engine, torch_engine):
    model = torch_engine.model
    step = export.TargetStep(model, torch_engine.drafter_model.config.target_layer_ids)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (3, 6), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([5, 0])
    past = torch.randn(11, c.num_layers, 3, c.num_kv_heads, c.head_dim,
                       generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = step(ids, positions, past, -past)
    session = open_session(onnx_engine / "target.onnx")
    got = session.run(None, {"ids": ids.numpy(), "logit_positions": positions.numpy(),
                             "past_keys": past.numpy(), "past_values": (-past).numpy()})
    assert got[0].shape == (3, 2, c.vocab_size) and got[2].shape == (6, c.num_layers, 3,
                                                                      c.num_kv_heads, c.head_dim)
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs.numpy(), atol=ATOL, rtol=0)


def test_build_without_tensorrt_is_one_line_error(capsys, tiny_target, tiny_drafter, tmp_path):
    if build_engine.tensorrt_usable() is None:
        pytest.skip("TensorRT can build engines on this machine")
    code = run(build_engine.main, ["--sharpdraft", "--backend", "tensorrt", "--target",
                                   str(tiny_target), "--drafter-checkpoint", str(tiny_drafter),
                                   "--output", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: TensorRT is not installed")
    assert not (tmp_path / "e").exists()


def test_build_reports_each_stage_and_torch_engines_have_no_graphs(capsys, tiny_target,
                                                                    tiny_drafter, tmp_path):
    out = tmp_path / "torch-engine"
    code = build_engine.main(["--sharpdraft", "--backend", "torch", "--max-seq-len", "300",
                              "--target", str(tiny_target), "--drafter-checkpoint",
                              str(tiny_drafter), "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and "engine written to" in captured.out
    stages = [line.split()[1].rstrip(":") for line in captured.err.splitlines()
              if line.startswith("[")]
    assert stages == ["load", "export", "check", "build", "measure"]
    engine = Engine(open_spec(out))
    assert engine.backend == "torch" and engine.context_limit == 300
    # The fast tier's one build that measures stage 5 (the suite's other builds record fixed
    # costs): step costs timed on this machine, then every mode decoded, the fastest kept.
    from runtime.step_costs import StepCosts, fixed_costs

    extra = json.loads((out / "engine.json").read_text())["extra"]
    costs = StepCosts.from_dict(extra["step_costs"]["torch"])
    assert costs != fixed_costs(True) and costs.verify_seconds(1, 64) > 0
    assert list(extra["default_mode"]["tokens_per_second"]) == [str(m) for m in engine.spec.modes]
    assert engine.spec.default_mode == extra["default_mode"]["mode"]
    with pytest.raises(EngineError, match="--backend onnxruntime"):
        Engine(open_spec(out, backend="onnxruntime"))


def test_max_seq_len_beyond_the_target_context_is_refused(capsys, tiny_target, tiny_drafter, tmp_path):
    code = run(build_engine.main, ["--backend", "torch", "--max-seq-len", "100000", "--target",
                                   str(tiny_target), "--drafter-checkpoint", str(tiny_drafter),
                                   "--output", str(tmp_path / "e")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: --max-seq-len")
    assert not (tmp_path / "e").exists()


def test_target_kv_graph_reads_the_cache_buffers_where_they_lie(onnx_engine, torch_engine):
    """In target-kv.onnx as ONNX Runtime optimises it, every cache buffer feeds matrix
    products only (FusedMatMul folds the keys' transpose): no Concat, Transpose, Expand
    or Slice copies the cache in a step. target.onnx concatenated it in every layer."""
    import onnxruntime

    layers = torch_engine.model.config.num_layers
    path = onnx_engine / export.TARGET_KV_FILE
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(onnx_engine.parent / "target-kv.optimized.onnx")
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(export.target_kv_inputs(layers))
    model = onnx.load(options.optimized_model_filepath, load_external_data=False)
    consumers = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    buffers = [i.name for i in model.graph.input if i.name.startswith("cache_")]
    assert len(buffers) == 2 * layers
    for name in buffers:
        assert set(consumers[name]) <= {"MatMul", "FusedMatMul", "Shape"}, (name, consumers[name])
        assert {"MatMul", "FusedMatMul"} & set(consumers[name]), name
    portable = onnx.load(str(onnx_engine / export.TARGET_FILE), load_external_data=False)
    assert any(n.op_type == "Concat" for n in portable.graph.node)  # what this graph avoids


def test_manifest_records_the_target_kv_graph(onnx_engine, torch_engine):
    record = json.loads((onnx_engine / "engine.json").read_text())["extra"]["onnx"]
    assert record["export_version"] == export.EXPORT_VERSION
    graph = record["graphs"]["target_kv"]
    c = torch_engine.model.config
    assert graph["file"] == export.TARGET_KV_FILE
    inputs = {i["name"]: i for i in graph["inputs"]}
    assert list(inputs) == list(export.target_kv_inputs(c.num_layers))
    assert inputs["cache_keys_0"]["shape"] == ["batch", c.num_kv_heads, "capacity", c.head_dim]
    # one committed length per sequence: a batch steps at different lengths
    assert inputs["past_len"]["shape"] == ["batch"] and inputs["past_len"]["dtype"] == "int64"
    assert [o["name"] for o in graph["outputs"]] == list(export.TARGET_KV_OUTPUTS)


def test_graphs_share_one_copy_of_their_weights(onnx_engine):
    """target.onnx and target-kv.onnx read the same bytes of weights.bin, the drafter
    graphs read the target's embedding there, and both drafter graphs one draft head."""
    def stored(name):
        model = onnx.load(str(onnx_engine / name), load_external_data=False)
        return {t.name: (t.external_data[0].value, {e.key: e.value for e in t.external_data})
                for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}

    target, kv = stored(export.TARGET_FILE), stored(export.TARGET_KV_FILE)
    assert target and all(location == export.WEIGHTS_FILE for location, _ in target.values())
    places = sorted((e["offset"], e["length"]) for _, e in target.values())
    assert sorted((e["offset"], e["length"]) for _, e in kv.values()) == places
    drafters = [{(e["offset"], e["length"]) for _, e in stored(name).values()}
                for name in (export.DRAFTER_FILE, export.FROZEN_FILE)]
    for places_of_drafter in drafters:
        assert len(places_of_drafter & set(places)) >= 1  # the target's embedding, stored once
    # This drafter has a draft vocabulary: its head (rows of the target's head) is not the
    # target's tensor, but both drafter graphs read one copy of it (and of their layers).
    assert len((drafters[0] & drafters[1]) - set(places)) >= 2


def test_target_kv_graph_takes_any_batch_and_ignores_the_buffer_past_the_length(
        onnx_engine, torch_engine):
    model = torch_engine.model
    layers = torch_engine.drafter_model.config.target_layer_ids
    c = model.config
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, c.vocab_size, (3, 6), generator=g)
    past, capacity = 11, 23
    cache = model.new_cache(capacity, batch=3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))  # past the length: garbage
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.length = past
    buffers = {f"cache_{kind}_{i}": tensor[i].numpy().copy()
               for kind, tensor in (("keys", cache.k), ("values", cache.v))
               for i in range(c.num_layers)}
    with torch.no_grad():
        logits, features = model(ids, cache, layers)
    session = open_session(onnx_engine / export.TARGET_KV_FILE)
    got = session.run(None, {"ids": ids.numpy(), "logit_positions": np.arange(6),
                             "past_len": np.full(3, past)} | buffers)
    expected = (logits, features, cache.k[:, :, :, past:past + 6], cache.v[:, :, :, past:past + 6])
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs.numpy(), atol=ATOL, rtol=0)


def test_onnxruntime_engines_default_to_the_native_form(native_engine):
    """ONNX Runtime runs the plugin node only through a Python bridge, so its engines
    carry beta in plain ONNX ops unless --attention plugin asks for the node (the
    TensorRT backend's default); both forms draft the same tokens (tested above).
    native_engine is built with --backend onnxruntime and no --attention."""
    record = json.loads((native_engine / "engine.json").read_text())["extra"]["onnx"]
    assert record["attention"] == "native" and record["graphs"]["drafter"]["plugin_nodes"] == 0


def test_native_engines_carry_the_drafters_over_cache_buffers(native_engine, torch_engine):
    """ONNX Runtime's default form: each drafter also as a graph over per-layer cache
    buffers [batch, kv_heads, capacity, head_dim], one committed length per sequence,
    returning only the step's new context keys/values; plain ONNX ops, checked in full."""
    record = json.loads((native_engine / "engine.json").read_text())["extra"]["onnx"]
    c = torch_engine.drafter_model.config
    files = {"drafter_kv": export.DRAFTER_KV_FILE, "drafter_frozen_kv": export.FROZEN_KV_FILE}
    for name, file in files.items():
        graph = record["graphs"][name]
        assert graph["file"] == file and graph["plugin_nodes"] == 0
        assert graph["attention"] == ("native" if name == "drafter_kv" else None)
        inputs = {i["name"]: i for i in graph["inputs"]}
        assert list(inputs) == list(export.drafter_kv_inputs(c.num_layers))
        assert inputs["cache_keys_0"]["shape"] == ["batch", c.num_kv_heads, "capacity", c.head_dim]
        assert inputs["past_lens"]["shape"] == ["batch"] and inputs["past_lens"]["dtype"] == "int64"
        outputs = {o["name"]: o for o in graph["outputs"]}
        assert list(outputs) == list(export.DRAFTER_KV_OUTPUTS)
        assert outputs["new_keys"]["shape"] == [c.num_layers, "batch", c.num_kv_heads,
                                                "context_len", c.head_dim]
        export.check_graph(native_engine / file)
        model = onnx.load(str(native_engine / file), load_external_data=False)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, file
    # the portable graphs stay, for TensorRT's parser and runtimes without buffers
    assert {"target", "drafter", "drafter_frozen"} <= set(record["graphs"])
    read_manifest(native_engine, verify="full")


@pytest.mark.parametrize("file", [export.DRAFTER_KV_FILE, export.FROZEN_KV_FILE])
def test_drafter_kv_graph_reads_the_cache_buffers_where_they_lie(file, native_engine, tmp_path):
    """As ONNX Runtime optimises drafter-kv.onnx, every cache buffer feeds matrix
    products only: no Concat, Transpose, Scatter or Slice copies the drafter's cache in
    a step (drafter.onnx copied all of it several times per layer)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(str(native_engine / file), options,
                                 providers=["CPUExecutionProvider"])
    model = onnx.load(options.optimized_model_filepath, load_external_data=False)
    consumers = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    buffers = [i.name for i in model.graph.input if i.name.startswith("cache_")]
    assert buffers
    for name in buffers:
        assert set(consumers[name]) <= {"MatMul", "FusedMatMul", "Shape"}, (name, consumers[name])
        assert {"MatMul", "FusedMatMul"} & set(consumers[name]), name
