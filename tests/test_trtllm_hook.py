"""install()/uninstall() (plugins/trtllm/hook.py) against a stand-in `tensorrt_llm`
package: the pinned module paths and class names, written to a temporary directory and
imported through the real import machinery (or placed in sys.modules beforehand). The
hook patches once, on load or at install; uninstall restores every original; no version
number is refused; a SharpDraft drafter that cannot be scaled stops its own build with one
line of ours naming why."""

import json
import os
import sys

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import disabled, drafter_scaling, install, installed, pins, proof, uninstall
from plugins.trtllm.hook import UnscalableDrafter
from plugins.trtllm import __main__ as trtllm_cli
from plugins.trtllm import versions
from plugins.trtllm.kernels import WRAPPED

SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)

from tests.trtllm_package import Metadata, draft_config, forget_tensorrt_llm, write_package  # noqa: E402

CONFIG = draft_config(SCALING)  # what a SharpDraft drafter directory's config.json gives the constructor


def load(name):
    import importlib

    return importlib.import_module(name)


def refused(build, *words):
    """The build stops with one line of ours naming the reason, recorded as 'refused'."""
    with pytest.raises(UnscalableDrafter) as exc:
        build()
    text = one_line(exc)
    assert text.startswith("sharpdraft: ") and all(w in text for w in words), text
    return text


def test_install_imports_nothing_and_hooks_the_modules_when_they_load(standin):
    write_package(standin)
    install()
    assert installed() and "tensorrt_llm" not in sys.modules  # nothing imported eagerly
    dflash = load(pins.DFLASH_MODULE)
    drafter = dflash.DFlashForCausalLM(CONFIG, dflash_attention_backend="VANILLA")
    from plugins.trtllm import standins as k

    assert getattr(drafter._dflash_flash_attention, WRAPPED) is k.flash_attn_with_kvcache


def test_install_twice_hooks_once_and_uninstall_restores_every_original(standin):
    write_package(standin)
    dflash = load(pins.DFLASH_MODULE)  # already loaded: install patches it at once
    spec = load(pins.SPECULATIVE_MODULE)
    originals = {cls: cls.__dict__["__init__"] for cls in
                 (dflash.DFlashForCausalLM, spec.Eagle3ForCausalLM, spec.PARDForCausalLM)}
    install()
    install()
    for cls, original in originals.items():
        assert cls.__init__ is not original and cls.__init__.__wrapped__ is original  # one layer
    drafter = dflash.DFlashForCausalLM(CONFIG, dflash_attention_backend="TRTLLM")
    ops = drafter._dflash_trtllm_gen_ops
    assert getattr(getattr(ops.batch_decode_with_kv_cache, WRAPPED), WRAPPED, None) is None
    assert getattr(ops.batch_context_with_kv_cache, WRAPPED) is not None
    pard = spec.PARDForCausalLM(CONFIG)
    uninstall()
    for cls, original in originals.items():
        assert cls.__init__ is original
    assert drafter._dflash_trtllm_gen_ops is not ops  # the unwrapped ops are back
    assert not hasattr(drafter._dflash_trtllm_gen_ops.batch_decode_with_kv_cache, WRAPPED)
    assert all("apply_rope" not in vars(m) for m in pard.modules())
    assert not installed() and not any(type(f).__name__ == "_Finder" for f in sys.meta_path)


def test_stand_in_modules_placed_in_sys_modules_are_patched(standin):
    import types

    module = types.ModuleType(pins.DFLASH_MODULE)

    class DFlashForCausalLM(torch.nn.Module):
        def __init__(self, draft_config):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].self_attn = torch.nn.Module()
            self.model.layers[0].self_attn.qkv_proj = torch.nn.Identity()
            self.dflash_attention_backend = "FA4"
            self._dflash_fa4_fwd = (lambda q, k, v, cu_seqlens_q=None, seqused_k=None, page_table=None, causal=False,
                                    window_size_left=None, window_size_right=None: (q, None))

    module.DFlashForCausalLM = DFlashForCausalLM
    version = types.ModuleType(pins.VERSION_MODULE)
    version.__version__ = pins.PINNED
    sys.modules[pins.VERSION_MODULE] = version
    sys.modules[pins.DFLASH_MODULE] = module
    install()
    assert getattr(DFlashForCausalLM(CONFIG)._dflash_fa4_fwd, WRAPPED) is not None


def test_eagle3_and_pard_wrap_the_drafters_attention_instances_only(standin):
    write_package(standin)
    install()
    spec = load(pins.SPECULATIVE_MODULE)
    pard, eagle, target = spec.PARDForCausalLM(CONFIG), spec.Eagle3ForCausalLM(CONFIG), spec.Target()
    attention = load("tensorrt_llm._torch.modules.attention").Attention
    for drafter in (pard, eagle):
        layers = [m for m in drafter.modules() if isinstance(m, attention)]
        assert layers and all("apply_rope" in vars(m) and "forward" in vars(m) for m in layers)
    assert all("apply_rope" not in vars(m) for m in target.modules())  # shared class untouched
    layer = next(m for m in pard.modules() if isinstance(m, attention))
    # three context requests of one new token each over 1, 100 and 4001 keys
    qkv = torch.ones(3, layer.q_size + 16, dtype=torch.float64)
    out = layer(torch.tensor([[0, 200, 4000]]), qkv, Metadata([1, 1, 1], [1, 100, 4001], 3))
    assert out[0, 0] == 1.0 and out[2, 0] == pytest.approx(SCALING.cap) and (out[:, layer.q_size:] == 1).all()
    assert SCALING.beta(100) not in (1.0, SCALING.cap) and out[1, 0] == pytest.approx(SCALING.beta(100))


def test_each_drafter_scales_with_its_own_config_and_a_stock_one_is_left_alone(standin, tmp_path):
    """Two SharpDraft drafters built in one process from directories carrying different
    parameters each apply their own; one built from a stock directory is not wrapped and
    leaves no record."""
    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)
        other = QueryScaling(ref_keys=4096, top_k=8, slope=1.0, max_log_scale=0.5)
        mine, theirs, stock = (spec.PARDForCausalLM(CONFIG), spec.PARDForCausalLM(draft_config(other)),
                               spec.PARDForCausalLM(draft_config(None)))
        assert drafter_scaling(mine) == SCALING and drafter_scaling(theirs) == other
        assert drafter_scaling(stock) is None and not any("apply_rope" in vars(m) for m in stock.modules())
        layer = lambda d: next(m for m in d.modules() if "apply_rope" in vars(m))  # noqa: E731
        qkv = torch.ones(1, layer(mine).q_size + 16, dtype=torch.float64)
        for drafter, scaling in ((mine, SCALING), (theirs, other)):
            out = layer(drafter)(torch.tensor([[99]]), qkv, Metadata([1], [100], 1))
            assert out[0, 0] == pytest.approx(scaling.beta(100))
        assert sorted(r["scaling"]["ref_keys"] for r in proof.read(tmp_path) if r["kind"] == "wrapped") == [64, 4096]
        uninstall()
        assert drafter_scaling(mine) is None  # Python objects restored (a captured graph would keep its scale)
    finally:
        proof.set_directory(None)


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_release_before_the_range_we_read_is_not_refused_for_its_number(standin, tmp_path, capsys):
    """No floor: an old number with the names present scales, one line naming it untested;
    a stock drafter on it hears nothing."""
    write_package(standin, version="1.2.1")
    proof.set_directory(tmp_path / "proof")
    try:
        install()
        dflash = load(pins.DFLASH_MODULE)
        dflash.DFlashForCausalLM(draft_config(), dflash_attention_backend="VANILLA")  # stock
        assert capsys.readouterr().err == ""
        drafter = dflash.DFlashForCausalLM(CONFIG, dflash_attention_backend="VANILLA")
        assert getattr(drafter._dflash_flash_attention, WRAPPED, None) is not None and disabled() is None
        err = capsys.readouterr().err
        assert "TensorRT-LLM 1.2.1 is untested" in err and "hook disabled" not in err
    finally:
        proof.set_directory(None)


@pytest.mark.parametrize("version,read", [("1.4.0rc1", True), ("1.4.0rc1.post1", True), ("1.4.0rc2+cu130.git1", True),
                                          ("1.4.0rc4", True), ("1.3.0rc27", True), ("1.3.0rc30", True),
                                          ("1.4.0", False), ("2.0.0", False), ("1.3.0rc26", False),
                                          ("1.2.1", False), ("nightly", False), (None, False)])
def test_the_version_is_compared_as_a_version_and_only_ever_named_untested(version, read, capsys):
    from plugins.trtllm import hook

    hook._state.warned = None
    assert hook.check_version(version) == version  # never refused
    err = capsys.readouterr().err
    assert err.count("\n") == (0 if read else 1) and (read or "untested" in err)


def test_a_missing_required_class_refuses_only_its_own_family_and_leaves_stock_ones_alone(standin, tmp_path,
                                                                                          capsys):
    """PARD's class moved: a SharpDraft drafter of the moved class is refused in one line
    naming it, while an EAGLE-3 one beside it is scaled (issue 69: a rename in one family
    refuses no other) and stock drafters hear nothing."""
    write_package(standin, drop=("modeling_speculative.py", "PARDForCausalLM"))
    proof.set_directory(tmp_path)
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)  # imports: never an error of ours there
        spec.Eagle3ForCausalLM(draft_config())  # stock: builds, hears nothing
        assert capsys.readouterr().err == ""
        spec.Eagle3ForCausalLM(CONFIG)  # another family: wrapped
        assert [r["kind"] for r in proof.read(tmp_path)] == ["wrapped"]
        refused(lambda: spec._removed_PARDForCausalLM(CONFIG), "_removed_PARDForCausalLM")
        assert sorted(r["kind"] for r in proof.read(tmp_path)) == ["refused", "wrapped"]
    finally:
        proof.set_directory(None)


def test_a_drafter_without_its_kernel_stops_its_build_in_one_line(standin, tmp_path):
    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        dflash = load(pins.DFLASH_MODULE)
        dflash.DFlashForCausalLM.__init__.__wrapped__  # patched
        module = sys.modules[pins.DFLASH_MODULE]
        original = module.k.flash_attn_with_kvcache
        module.k.flash_attn_with_kvcache = None  # the instance holds no VANILLA kernel
        try:
            refused(lambda: dflash.DFlashForCausalLM(CONFIG, dflash_attention_backend="VANILLA"),
                    "_dflash_flash_attention")
        finally:
            module.k.flash_attn_with_kvcache = original
        [record] = proof.read(tmp_path)
        assert record["kind"] == "refused" and "_dflash_flash_attention" in record["reason"]
        with pytest.raises(proof.ProofError) as exc:
            proof.require(tmp_path, SCALING)
        assert "DFlashForCausalLM" in one_line(exc)
    finally:
        proof.set_directory(None)


def test_a_drafter_whose_config_asks_to_run_frozen_runs_frozen_and_says_so(standin, tmp_path, capsys):
    write_package(standin)
    proof.set_directory(tmp_path)
    frozen = draft_config()
    frozen.pretrained_config.sharpdraft = SCALING.to_dict() | {pins.IF_UNSCALABLE: proof.FROZEN}
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)
        drafter = spec.Eagle3ForCausalLM(frozen, kv_lora_rank=512)  # MLA: cannot be scaled
        assert not any("apply_rope" in vars(m) for m in drafter.modules())
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "runs FROZEN" in err and "MLA" in err
        with pytest.raises(proof.ProofError, match="frozen"):
            proof.require(tmp_path, SCALING)
        held = proof.require(tmp_path, SCALING, frozen_allowed=True)
        summary = proof.summary(held)
        assert summary["metrics"]["sharpdraft_frozen_drafters"] == 1 and not summary["sharpdraft"]
        assert "MLA" in summary["frozen"][0]["reason"]
    finally:
        proof.set_directory(None)


def test_check_says_in_one_line_that_tensorrt_llm_is_not_importable_here(capsys):
    forget_tensorrt_llm()
    assert trtllm_cli.main(["check"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "not importable here" in line]
    assert len(lines) == 1 and pins.PINNED in out and pins.READ_RANGE[0] in out
    for point in pins.PATCH_POINTS:
        assert f"{point.module}.{point.attribute}" in out


def test_check_reports_found_names_on_an_installation(standin, capsys):
    write_package(standin)
    assert trtllm_cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["importable"] and report["version_read"] and report["missing"] == []
    assert all(p["found"] for p in report["patch_points"] if p["required"])


def test_the_real_tensorrt_llm_has_every_pinned_name():
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as exc:  # its import needs libcuda and NVIDIA's wheels
        pytest.skip(f"tensorrt_llm cannot be imported here: {type(exc).__name__}: {str(exc)[:120]}")
    report = trtllm_cli.check()
    assert report["missing"] == [], report["missing"]


# --- every drafter class TensorRT-LLM can build: wrapped or refused, never skipped ---------

def built(standin, tmp_path, **package):
    write_package(standin, **package)
    proof.set_directory(tmp_path / "proof")
    install()
    return load(pins.SPECULATIVE_MODULE)


def test_dflash_defined_in_modeling_speculative_gets_its_kernel_wrapped(standin, tmp_path):
    """The older layout: DFlashForCausalLM in modeling_speculative, its dflash_forward
    importing flash_attn_with_kvcache at call time."""
    try:
        spec = built(standin, tmp_path, old_dflash=True)
        drafter = spec.DFlashForCausalLM(CONFIG)
        [record] = proof.read(tmp_path / "proof")
        assert record["kind"] == "wrapped" and record["drafter"] == "DFlashForCausalLM" and record["family"] == "dflash"
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, 4, 8, generator=g, dtype=torch.float64)
        k_cache, v_cache = (torch.randn(1, 1, 300, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        lens = torch.tensor([300], dtype=torch.int32)
        from plugins.trtllm import standins as k

        [got] = drafter.dflash_forward(q, k_cache, v_cache, lens)  # the pooled cache: [pool, layers, ...]
        want = k.reference(k.flash_attn_with_kvcache, SCALING, q, k_cache[:, 0], v_cache[:, 0], cache_seqlens=lens)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        import flash_attn

        assert getattr(flash_attn.flash_attn_with_kvcache, WRAPPED, None) is None  # module restored after the call
    finally:
        proof.set_directory(None)


@pytest.mark.parametrize("build", ["eagle3_mla", "mistral_large3", "pard_compressed", "eagle3_chunked"])
def test_drafters_whose_count_or_query_path_we_cannot_handle_are_refused_when_built(standin, tmp_path, build):
    try:
        spec = built(standin, tmp_path)
        make = {"eagle3_mla": lambda: spec.Eagle3ForCausalLM(CONFIG, kv_lora_rank=512),  # Eagle3DeepSeekV3
                "mistral_large3": lambda: spec.MistralLarge3EagleForCausalLM(CONFIG),
                "pard_compressed": lambda: spec.PARDForCausalLM(CONFIG, sparse_attention_config={"algorithm": "rocket"}),
                "eagle3_chunked": lambda: spec.Eagle3ForCausalLM(CONFIG, attention_chunk_size=8192)}[build]
        why = {"eagle3_mla": "MLA", "mistral_large3": "MLA", "pard_compressed": "sparse_attention_config",
               "eagle3_chunked": "attention_chunk_size"}[build]
        refused(make, why)  # the build stops: a SharpDraft drafter never runs unscaled
        [record] = proof.read(tmp_path / "proof")
        assert record["kind"] == "refused"
        with pytest.raises(proof.ProofError) as exc:
            proof.require(tmp_path / "proof", SCALING)
        text = one_line(exc)
        assert text.startswith("SharpDraft was requested but") and why in text
    finally:
        proof.set_directory(None)


def test_a_drafter_class_nobody_pinned_is_refused_not_run_unscaled(standin, tmp_path):
    write_package(standin)
    path = standin / "tensorrt_llm/_torch/models/modeling_speculative.py"
    path.write_text(path.read_text() + "\nclass Eagle4ForCausalLM(torch.nn.Module):\n"
                    "    def __init__(self, draft_config):\n        super().__init__()\n")
    proof.set_directory(tmp_path)
    try:
        install()
        refused(lambda: load(pins.SPECULATIVE_MODULE).Eagle4ForCausalLM(CONFIG), "Eagle4ForCausalLM")
        [record] = proof.read(tmp_path)
        assert record["kind"] == "refused" and record["drafter"] == "Eagle4ForCausalLM"
    finally:
        proof.set_directory(None)


def test_wrapped_drafters_leave_proof_the_launcher_accepts(standin, tmp_path):
    try:
        spec = built(standin, tmp_path)
        spec.Eagle3ForCausalLM(CONFIG)
        spec.PARDForCausalLM(CONFIG)
        wrapped = proof.require(tmp_path / "proof", SCALING)
        assert sorted(r["drafter"] for r in wrapped) == ["Eagle3ForCausalLM", "PARDForCausalLM"]
        assert {r["layers"] for r in wrapped} == {1, 2} and {r["pid"] for r in wrapped} == {os.getpid()}
        summary = proof.summary(wrapped)
        assert summary["scaling"] == SCALING.to_dict() and summary["sharpdraft"]
        with pytest.raises(proof.ProofError) as exc:  # another engine's scaling is not proof
            proof.require(tmp_path / "proof", QueryScaling(ref_keys=4096))
        assert "QueryScaling" in one_line(exc)
    finally:
        proof.set_directory(None)


# --- proof of application, per rank; audited attention only ---------------------------------

def test_a_layer_whose_count_did_not_grow_is_refused_after_the_first_requests(standin, tmp_path):
    """Construction is not application: PARD's drafter has two wrapped Attention layers;
    after requests that ran only the first (the second's query took a path around our
    wrappers), the launcher's check names the idle layer; once it has run, it passes. The
    counts are the device counters the scaling itself adds to, read on request."""
    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)
        attention = load("tensorrt_llm._torch.modules.attention")
        pard = spec.PARDForCausalLM(CONFIG)
        held = proof.require(tmp_path, SCALING)  # built and wrapped: construction alone passes
        before = proof.request_counts(tmp_path, held, timeout=10)
        attention.run_attention(pard, skip=(1,))
        with pytest.raises(proof.ProofError) as exc:
            proof.require_growth(held, before, proof.request_counts(tmp_path, held, timeout=10))
        assert "stayed at 0" in one_line(exc) and "draft_model_full.1.self_attn" in one_line(exc)
        attention.run_attention(pard)
        attention.run_attention(pard)
        after = proof.require_growth(held, before, proof.request_counts(tmp_path, held, timeout=10))
        [record] = held
        assert [after[os.getpid()][u] for u in record["units"]] == [3, 2]  # each layer counts its own calls
    finally:
        proof.set_directory(None)


def test_every_rank_of_the_world_must_prove_it_wrapped_its_drafter(tmp_path):
    def wrapped(pid, rank):
        (tmp_path / f"wrapped-{pid}-{rank}.json").write_text(json.dumps(
            {"kind": "wrapped", "pid": pid, "rank": rank, "drafter": "Eagle3ForCausalLM", "units": [],
             "scaling": SCALING.to_dict()}))

    wrapped(101, 0)
    assert proof.require(tmp_path, SCALING, world=1)
    with pytest.raises(proof.ProofError) as exc:
        proof.require(tmp_path, SCALING, world=2)
    assert "rank(s) 1 of 2" in one_line(exc) and "rank 0 pid 101" in one_line(exc)
    wrapped(101, 1)  # the same process claiming a second rank is not a second rank
    with pytest.raises(proof.ProofError, match="distinct processes"):
        proof.require(tmp_path, SCALING, world=2)
    (tmp_path / "wrapped-101-1.json").unlink()
    wrapped(102, 1)
    assert {e["rank"] for e in proof.require(tmp_path, SCALING, world=2)} == {0, 1}


def test_an_attention_subclass_that_overrides_preprocess_qkv_is_refused_when_the_drafter_is_built(
        standin, tmp_path):
    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)
        refused(lambda: spec.Eagle3ForCausalLM(CONFIG, qk_norm="gate"), "preprocess_qkv")
        [record] = proof.read(tmp_path)
        assert record["kind"] == "refused" and "QKNormRoPEAttention overrides preprocess_qkv" in record["reason"]
        with pytest.raises(proof.ProofError):
            proof.require(tmp_path, SCALING)
        for path in tmp_path.glob("*.json"):
            path.unlink()
        # the audited case: the fused gate off, preprocess_qkv defers to Attention's
        audited = spec.Eagle3ForCausalLM(CONFIG, qk_norm=True)
        assert any("apply_rope" in vars(m) for m in audited.modules())
        assert proof.require(tmp_path, SCALING)
    finally:
        proof.set_directory(None)


def test_a_kernel_whose_signature_cannot_be_read_stops_the_build_in_one_line(standin, tmp_path, monkeypatch):
    from plugins.trtllm import standins as trtllm_standins

    class Opaque:  # a compiled op whose signature inspect cannot read
        __signature__ = "not a signature"

        def __call__(self, *args, **kwargs):
            raise AssertionError("never called")

    monkeypatch.setattr(trtllm_standins, "flash_attn_with_kvcache", Opaque())
    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        refused(lambda: load(pins.DFLASH_MODULE).DFlashForCausalLM(CONFIG, dflash_attention_backend="VANILLA"),
                "cannot read the signature")
        [record] = proof.read(tmp_path)
        assert record["kind"] == "refused" and "cannot read the signature" in record["reason"]
        assert "\n" not in record["reason"]
    finally:
        proof.set_directory(None)


def test_an_mla_drafter_of_the_newer_layout_is_refused_as_mla(standin, tmp_path):
    """MLA moved to _torch/attention/mla.py (pins.SOURCES["mla"]): a drafter built from that
    class is refused for what it is, not for lacking an Attention layer."""
    import types

    write_package(standin)
    proof.set_directory(tmp_path)
    try:
        install()
        spec = load(pins.SPECULATIVE_MODULE)
        mla_module = types.ModuleType("tensorrt_llm._torch.attention.mla")

        class MLA(torch.nn.Module):
            pass

        mla_module.MLA = MLA
        sys.modules[mla_module.__name__] = mla_module
        spec.MLA = MLA  # the drafter's layers come from the newer module
        refused(lambda: spec.PARDForCausalLM(CONFIG, mla=True), "MLA")
        [record] = proof.read(tmp_path)
        assert record["kind"] == "refused" and "MLA (latent) attention" in record["reason"], record
    finally:
        sys.modules.pop("tensorrt_llm._torch.attention.mla", None)
        proof.set_directory(None)
