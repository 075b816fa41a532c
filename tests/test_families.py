"""One record per drafter family (runtime/families.py): the one table of families, which
the modes table, the loaders, the build and the presets key off."""

import ast
from pathlib import Path

from runtime import families, modes
from test_layering import parsed

REPO = Path(__file__).resolve().parent.parent
# what the house spells (the engines' own hooks aside: plugins/trtllm pins TensorRT-LLM's names)
SHIPPED = [p for d in ("runtime", "build", "plugins") for p in (REPO / d).rglob("*.py")
           if "trtllm" not in p.relative_to(REPO).parts] + [REPO / "build_engine.py"]


def family_tables(path: Path) -> list[int]:
    """Lines of dict literals keyed by two or more family names in `path`."""
    names = set(families.FAMILIES)
    return [node.lineno for node in ast.walk(parsed(path))
            if isinstance(node, ast.Dict)
            and sum(isinstance(k, ast.Constant) and k.value in names for k in node.keys) >= 2]


def test_family_names_are_tabled_in_one_file_only():
    tabled = {str(p.relative_to(REPO)): family_tables(p) for p in SHIPPED}
    assert {p for p, lines in tabled.items() if lines} == set()  # the records are no dict literal


def test_the_check_sees_a_family_table(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('X = {"dflash": 1, "pard": 2}\nY = {"dflash": 1}\n')
    assert family_tables(probe) == [1]


def test_every_family_is_a_record_that_the_modes_table_reads():
    assert modes.FAMILIES is families.FAMILIES
    for name, family in families.FAMILIES.items():
        assert family.name == name and family.display
        assert family.style in (*families.STYLES, None)
        # a drafter model has a preset, a checkpoint reader and a loader; n-gram none
        assert (family.preset is None) == (family.style is None) == (family.load is None), name


def test_presets_are_the_papers():
    from plugins.scaling import QueryScaling

    assert families.preset("dflash") == QueryScaling(2048, 32, 5.0, 0.5)
    assert families.preset("pard").ref_keys == 8192


def test_every_loader_has_a_constructor_per_family():
    """Adding a family is its record plus one constructor per backend (`batch_<name>`)."""
    from runtime.backends.onnxruntime.loader import OnnxEngine
    from runtime.backends.pytorch.loader import TorchLoaded

    for name, family in families.FAMILIES.items():
        if family.style is not None:
            assert callable(getattr(TorchLoaded, "batch_" + name)), name
            assert callable(getattr(OnnxEngine, "_batch_" + name)), name


def test_one_class_named_request_in_the_runtime():
    """One request from the endpoint to the loop (runtime/request.py): no second class of
    that name, and it is built with keywords only."""
    import dataclasses

    from runtime.request import Request

    defined = [str(p.relative_to(REPO)) for p in (REPO / "runtime").rglob("*.py")
               for node in ast.walk(parsed(p))
               if isinstance(node, ast.ClassDef) and node.name == "Request"]
    assert defined == ["runtime/request.py"]
    assert all(f.kw_only for f in dataclasses.fields(Request))
