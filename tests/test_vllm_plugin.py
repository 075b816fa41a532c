"""The vLLM plugin's logic without vLLM (the fast tier): N per query row from vLLM-shaped
attention metadata, the wrapped call against the beta reference, the device count, the
structure checks' one-line refusals, the drafter directory `build_engine.py --backend vllm`
writes and the launcher's refusals. tests/test_vllm.py runs the same code inside real vLLM."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import proof
from plugins.vllm import ARCHITECTURE, launch, pins, scaled

SCALING = QueryScaling(ref_keys=64, top_k=4, slope=2.5, max_log_scale=0.75)


@dataclasses.dataclass
class FakeAttentionMetadata:  # the fields vLLM's CPU and flash metadata share
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_actual_tokens: int = 0


class FakeImpl:
    """An attention impl with vLLM's forward signature that records what it was given."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        self.seen = query.clone()
        return query


class FakeAttention:
    def __init__(self):
        self.impl = FakeImpl()
        self.layer_name = "model.layers.0.self_attn.attn"


def metadata(query_lens, seq_lens):
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return FakeAttentionMetadata(loc, torch.tensor(seq_lens, dtype=torch.int32))


def test_every_dflash_row_sees_its_requests_seq_len_and_causal_rows_see_their_prefix():
    md = metadata([3, 2], [103, 52])
    assert scaled.visible_keys(md.query_start_loc, md.seq_lens, 5, causal=False).tolist() == [103, 103, 103, 52, 52]
    assert scaled.visible_keys(md.query_start_loc, md.seq_lens, 5, causal=True).tolist() == [101, 102, 103, 51, 52]
    # rows padded past the batch (a captured size) read the last request's count
    assert scaled.visible_keys(md.query_start_loc, md.seq_lens, 7, causal=False).tolist()[5:] == [52, 52]


@pytest.mark.parametrize("causal", [False, True])
def test_the_wrapped_call_scales_each_row_by_the_reference_beta_and_counts_on_the_device(causal):
    attention, tally = FakeAttention(), proof.Tally(["layer0"])
    scaled.wrap(attention, SCALING, causal, tally, 0)
    scaled.wrap(attention, SCALING, causal, tally, 0)  # idempotent: one wrapper, one scale
    md = metadata([4, 4], [2000, 60])
    q = torch.randn(8, 3, 16, dtype=torch.float64)
    attention.impl.forward(attention, q, None, None, None, md, torch.empty(0))
    n = scaled.visible_keys(md.query_start_loc, md.seq_lens, 8, causal).tolist()
    want = torch.stack([q[i] * SCALING.beta(n[i]) for i in range(8)])
    assert torch.allclose(attention.impl.seen, want, rtol=1e-12)
    assert SCALING.beta(n[0]) > 1.5 and SCALING.beta(n[-1]) == 1.0  # long rows sharpened, short ones not
    attention.impl.forward(attention, q, None, None, None, None, torch.empty(0))  # vLLM's profiling run
    assert torch.equal(attention.impl.seen, q)  # unscaled and uncounted
    assert tally.read() == {"layer0": 1}


def test_the_wrapper_reads_no_tensor_value_on_the_host(monkeypatch):
    """No .item()/.tolist()/bool() of a tensor inside the wrapped call: a CUDA graph could
    not capture it (vLLM captures the drafter on GPUs)."""
    attention, tally = FakeAttention(), proof.Tally(["layer0"])
    scaled.wrap(attention, SCALING, False, tally, 0)
    md = metadata([2], [500])

    def forbidden(*args, **kwargs):
        raise AssertionError("host read inside the wrapped call")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    attention.impl.forward(attention, torch.randn(2, 4), None, None, None, md, None)


def test_structure_misses_are_refused_in_one_line_naming_them():
    pins.check_attention("layer", FakeAttention())  # the shape we read in vLLM passes

    class Renamed(FakeImpl):
        def forward(self, layer, query, key, value, kv_cache, metadata, output=None):
            return query

    attention = FakeAttention()
    attention.impl = Renamed()
    with pytest.raises(pins.PluginError, match=r"Renamed.forward takes \(.*metadata.*\), expected") as err:
        pins.check_attention("layer", attention)
    assert "\n" not in str(err.value)

    class NoImpl:
        pass

    with pytest.raises(pins.PluginError, match="layer.impl.forward not found"):
        pins.check_attention("layer", NoImpl())

    class Model:  # a drafter whose layers moved
        model = None

    with pytest.raises(pins.PluginError, match="Model.model.layers not found"):
        pins.draft_layers(Model())


def test_metadata_without_a_field_the_count_reads_is_refused(monkeypatch):
    @dataclasses.dataclass
    class FakeAttentionMetadata:  # noqa: F811 -- this module's metadata, without seq_lens
        query_start_loc: torch.Tensor

    monkeypatch.setitem(globals(), "FakeAttentionMetadata", FakeAttentionMetadata)
    with pytest.raises(pins.PluginError, match="FakeAttentionMetadata has no seq_lens"):
        pins.check_attention("layer", FakeAttention())


def test_a_drafter_dir_that_carries_parameters_under_a_stock_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"],
                                                       "sharpdraft": SCALING.to_dict()}))
    with pytest.raises(launch.LaunchError, match="which vLLM builds unscaled"):
        launch.drafter_scaling(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE],
                                                       "sharpdraft": SCALING.to_dict()}))
    assert launch.drafter_scaling(tmp_path) == SCALING
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    assert launch.drafter_scaling(tmp_path) is None  # a stock drafter


def test_build_engine_writes_what_vllm_serves(tmp_path):
    """--backend vllm: engine.json naming the target vLLM loads and the speculative config;
    with --sharpdraft, drafter/ naming the plugin's architecture and carrying the engine's
    QueryScaling, its weights linked to the checkpoint's (whose draft head vLLM reads)."""
    from safetensors import safe_open

    import build_engine
    from runtime.manifest import read_manifest

    out = tmp_path / "eng"
    assert build_engine.main(["--drafter", "dflash", "--sharpdraft", "--backend", "vllm",
                              "--output", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest.backend == "vllm" and (manifest.target_dir / "config.json").is_file()
    assert manifest.extra["vllm"]["speculative"] == {"method": "dflash", "num_speculative_tokens": 7}
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert QueryScaling.from_dict(config["sharpdraft"]) == manifest.query_scaling
    assert (out / "drafter" / "model.safetensors").is_symlink()
    with safe_open(out / "drafter" / "lm_head.safetensors", "pt") as f:  # vLLM reads every file
        assert f.get_slice("lm_head.weight").get_shape() == [config["draft_vocab_size"], config["hidden_size"]]
    assert launch.drafter_scaling(out / "drafter") == manifest.query_scaling


@pytest.mark.slow  # fresh interpreters: the fast tier keeps the plugin's one-line refusals
# (test_structure_misses_are_refused_in_one_line_naming_them, test_a_launch_without_vllm_installed_is_one_line)
def test_the_own_loop_refusals_name_vllm(tmp_path, capsys):
    """Flags for our loop, Triton serving and EAGLE-3 / PARD with --sharpdraft: one line each."""
    import build_engine
    from runtime.cli import run

    out = tmp_path / "eng"
    assert run(build_engine.main, ["--drafter", "dflash", "--backend", "vllm", "--output", str(out)]) == 0
    for argv, want in (
            (["--drafter", "eagle3", "--sharpdraft", "--backend", "vllm", "--output", str(tmp_path / "e")],
             "vLLM's EAGLE-3 drafter (llama_eagle3) is not scaled by the plugin yet"),
            (["--drafter", "pard", "--sharpdraft", "--backend", "vllm", "--output", str(tmp_path / "p")],
             "the plugin does not scale yet")):
        capsys.readouterr()
        assert run(build_engine.main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert want in err[-1] and err[-1].startswith("error:")
    for argv, want in ((["generate", "--engine-dir", str(out), "--prompt", "x", "--device", "cpu"],
                        "runs in vLLM: drop --device"),
                       (["serve", "--engine-dir", str(out), "--model-repository", str(tmp_path / "r")], "which serves it itself: python -m runtime vllm-serve")):
        done = subprocess.run([sys.executable, "-m", "runtime", *argv], capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and want in lines[0], done.stderr


def test_a_launch_without_vllm_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .cache/vllm-venv here
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(launch.LaunchError, match="vLLM is not installed here: `make vllm`"):
        launch.vllm_python()
