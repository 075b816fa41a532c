"""install()/uninstall() (plugins/trtllm/hook.py) against a stand-in `tensorrt_llm`
package: the pinned module paths and class names, written to a temporary directory and
imported through the real import machinery (or placed in sys.modules beforehand). The
hook patches once, on load or at install; uninstall restores every original; an unknown
version or a missing name stops with one line naming both."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from plugins.scaling import QueryScaling
from plugins.trtllm import TrtllmHookError, install, installed, pins, uninstall
from plugins.trtllm import __main__ as trtllm_cli
from plugins.trtllm import autoload
from plugins.trtllm.kernels import WRAPPED

SCALING = QueryScaling(ref_keys=64, top_k=8, slope=1.0, max_log_scale=0.5)

FILES = {
    "tensorrt_llm/__init__.py": "",
    "tensorrt_llm/version.py": "__version__ = {version!r}\n",
    "tensorrt_llm/_torch/__init__.py": "",
    "tensorrt_llm/_torch/models/__init__.py": "",
    "tensorrt_llm/_torch/modules/__init__.py": "",
    "tensorrt_llm/_torch/speculative/__init__.py": "",
    "tensorrt_llm/_torch/speculative/dflash_attention.py": """
        from dataclasses import dataclass
        from typing import Callable
        from tests import trtllm_standins as k

        @dataclass(frozen=True)
        class DFlashTrtllmGenOps:
            append_paged_kv_cache: Callable
            batch_context_with_kv_cache: Callable
            batch_decode_with_kv_cache: Callable

        def get_dflash_trtllm_gen_ops():
            return DFlashTrtllmGenOps(None, k.trtllm_batch_context_with_kv_cache,
                                      k.trtllm_batch_decode_with_kv_cache)
        """,
    "tensorrt_llm/_torch/modules/attention.py": """
        import torch

        class Attention(torch.nn.Module):
            def __init__(self, heads=4, head_dim=8):
                super().__init__()
                self.q_size = heads * head_dim

            def apply_rope(self, q, k, v, position_ids):
                return q, k, v
        """,
    "tensorrt_llm/_torch/models/modeling_dflash.py": """
        import torch
        from tests import trtllm_standins as k
        from ..speculative.dflash_attention import get_dflash_trtllm_gen_ops

        class DFlashForCausalLM(torch.nn.Module):
            def __init__(self, draft_config=None, *, dflash_attention_backend="VANILLA"):
                super().__init__()
                self.dflash_attention_backend = dflash_attention_backend
                if dflash_attention_backend == "VANILLA":
                    self._dflash_flash_attention = k.flash_attn_with_kvcache
                elif dflash_attention_backend == "TRTLLM":
                    self._dflash_trtllm_gen_ops = get_dflash_trtllm_gen_ops()
                elif dflash_attention_backend == "FA4":
                    self._dflash_fa4_fwd = k._flash_attn_fwd
        """,
    "tensorrt_llm/_torch/models/modeling_speculative.py": """
        import torch
        from ..modules.attention import Attention

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = Attention()

        class Eagle3ForCausalLM(torch.nn.Module):
            def __init__(self, draft_config=None, num_layers=0):
                super().__init__()
                self.layers = torch.nn.ModuleList([Layer()])

        class PARDForCausalLM(torch.nn.Module):
            def __init__(self, draft_config=None):
                super().__init__()
                self.draft_model_full = torch.nn.ModuleList([Layer(), Layer()])

        class Target(torch.nn.Module):  # built from the same classes as PARD's drafter
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([Layer()])
        """,
}


def write_package(root: Path, version: str = pins.PINNED, drop: tuple[str, str] | None = None) -> None:
    for rel, text in FILES.items():
        text = textwrap.dedent(text).format(version=version) if "version" in rel else textwrap.dedent(text)
        if drop and rel.endswith(drop[0]):
            text = text.replace(drop[1], "_removed_" + drop[1])
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def forget_tensorrt_llm():
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def standin(tmp_path):
    """A stand-in tensorrt_llm importable from tmp_path; cleaned up whatever happens."""
    sys.path.insert(0, str(tmp_path))
    forget_tensorrt_llm()
    try:
        yield tmp_path
    finally:
        uninstall()
        forget_tensorrt_llm()
        sys.path.remove(str(tmp_path))


def load(name):
    import importlib

    return importlib.import_module(name)


def test_install_imports_nothing_and_hooks_the_modules_when_they_load(standin):
    write_package(standin)
    install(SCALING)
    assert installed() and "tensorrt_llm" not in sys.modules  # nothing imported eagerly
    dflash = load(pins.DFLASH_MODULE)
    drafter = dflash.DFlashForCausalLM(dflash_attention_backend="VANILLA")
    from tests import trtllm_standins as k

    assert getattr(drafter._dflash_flash_attention, WRAPPED) is k.flash_attn_with_kvcache


def test_install_twice_hooks_once_and_uninstall_restores_every_original(standin):
    write_package(standin)
    dflash = load(pins.DFLASH_MODULE)  # already loaded: install patches it at once
    spec = load(pins.SPECULATIVE_MODULE)
    originals = {cls: cls.__dict__["__init__"] for cls in
                 (dflash.DFlashForCausalLM, spec.Eagle3ForCausalLM, spec.PARDForCausalLM)}
    install(SCALING)
    install(SCALING)
    for cls, original in originals.items():
        assert cls.__init__ is not original and cls.__init__.__wrapped__ is original  # one layer
    drafter = dflash.DFlashForCausalLM(dflash_attention_backend="TRTLLM")
    ops = drafter._dflash_trtllm_gen_ops
    assert getattr(getattr(ops.batch_decode_with_kv_cache, WRAPPED), WRAPPED, None) is None
    assert getattr(ops.batch_context_with_kv_cache, WRAPPED) is not None
    pard = spec.PARDForCausalLM()
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
        def __init__(self):
            super().__init__()
            self.dflash_attention_backend = "FA4"
            self._dflash_fa4_fwd = lambda q, k, v, seqused_k=None, causal=False: (q, None)

    module.DFlashForCausalLM = DFlashForCausalLM
    version = types.ModuleType(pins.VERSION_MODULE)
    version.__version__ = pins.PINNED
    sys.modules[pins.VERSION_MODULE] = version
    sys.modules[pins.DFLASH_MODULE] = module
    install(SCALING)
    assert getattr(DFlashForCausalLM()._dflash_fa4_fwd, WRAPPED) is not None


def test_eagle3_and_pard_wrap_the_drafters_attention_instances_only(standin):
    write_package(standin)
    install(SCALING)
    spec = load(pins.SPECULATIVE_MODULE)
    pard, eagle, target = spec.PARDForCausalLM(), spec.Eagle3ForCausalLM(), spec.Target()
    attention = load("tensorrt_llm._torch.modules.attention").Attention
    for drafter in (pard, eagle):
        layers = [m for m in drafter.modules() if isinstance(m, attention)]
        assert layers and all("apply_rope" in vars(m) for m in layers)
    assert all("apply_rope" not in vars(m) for m in target.modules())  # shared class untouched
    layer = next(m for m in pard.modules() if isinstance(m, attention))
    qkv = torch.ones(3, layer.q_size + 16, dtype=torch.float64)
    out = layer.apply_rope(qkv, None, None, torch.tensor([[0, 200, 4000]]))[0]
    assert out[0, 0] == 1.0 and out[2, 0] == pytest.approx(SCALING.cap) and (out[:, layer.q_size:] == 1).all()


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_an_unknown_version_is_refused_with_one_line_naming_it(standin):
    write_package(standin, version="9.9.9")
    install(SCALING)
    with pytest.raises(TrtllmHookError) as exc:
        load(pins.DFLASH_MODULE)
    text = one_line(exc)
    assert "9.9.9" in text and pins.PINNED in text and "DFlashForCausalLM.__init__" in text


def test_a_missing_attribute_is_refused_with_one_line_naming_it_and_the_version(standin):
    write_package(standin, drop=("modeling_speculative.py", "PARDForCausalLM"))
    install(SCALING)
    with pytest.raises(TrtllmHookError) as exc:
        load(pins.SPECULATIVE_MODULE)
    text = one_line(exc)
    assert pins.PINNED in text and "modeling_speculative.PARDForCausalLM.__init__" in text


def test_a_drafter_without_its_kernel_is_refused_with_one_line(standin):
    write_package(standin)
    install(SCALING)
    dflash = load(pins.DFLASH_MODULE)
    with pytest.raises(TrtllmHookError) as exc:
        dflash.DFlashForCausalLM(dflash_attention_backend="FA5")
    assert "FA5" in one_line(exc)


def test_install_refuses_a_non_scaling():
    with pytest.raises(TypeError):
        install({"ref_keys": 2048})
    assert not installed()


def test_check_says_in_one_line_that_tensorrt_llm_is_not_importable_here(capsys):
    forget_tensorrt_llm()
    assert trtllm_cli.main(["check"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "not importable here" in line]
    assert len(lines) == 1 and pins.PINNED in out
    for point in pins.PATCH_POINTS:
        assert f"{point.module}.{point.attribute}" in out


def test_check_reports_found_names_on_an_installation(standin, capsys):
    write_package(standin)
    assert trtllm_cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["importable"] and report["version_known"]
    assert all(p["found"] for p in report["patch_points"])


def test_autoload_pth_installs_the_hook_only_when_the_variable_is_set(tmp_path, capsys):
    site = tmp_path / "site"
    site.mkdir()
    assert trtllm_cli.main(["autoload", "install", "--site-packages", str(site)]) == 0
    pth = site / autoload.PTH_NAME
    assert pth.read_text().count("\n") == 1 and pth.read_text().startswith("import ")
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); "
             "m = sys.modules.get('plugins.trtllm.hook'); print(bool(m and m.installed()))")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    runs = {}
    for label, extra in (("unset", {}), ("set", {autoload.ENV: autoload.env_value(SCALING)})):
        done = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, env=env | extra,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[label] = done.stdout.strip()
    assert runs == {"unset": "False", "set": "True"}
    assert trtllm_cli.main(["autoload", "uninstall", "--site-packages", str(site)]) == 0
    assert not pth.exists()


def test_the_real_tensorrt_llm_has_every_pinned_name():
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as exc:  # its import needs libcuda and NVIDIA's wheels
        pytest.skip(f"tensorrt_llm cannot be imported here: {type(exc).__name__}: {str(exc)[:120]}")
    report = trtllm_cli.check()
    assert report["version_known"], report.get("version")
    assert all(p["found"] for p in report["patch_points"])
