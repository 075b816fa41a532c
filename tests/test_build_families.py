"""The build's drafter families are one registry (build/families.py FAMILIES):
build_engine.py dispatches through a family's record and compares no family name itself,
and every family the runtime knows (runtime/modes.py FAMILIES) has a build record."""

import ast
import re
from pathlib import Path

from build import families
from runtime import modes

BUILD_ENGINE = Path(__file__).resolve().parent.parent / "build_engine.py"


def compared_names(source: str, names) -> list[str]:
    """'line: name' for every family name a comparison (==, !=, in, not in, is) in
    `source` holds as an operand or inside a tuple / list / set operand."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            hits += [f"{node.lineno}: {item.value}" for item in items
                     if isinstance(item, ast.Constant) and item.value in names]
    return hits


def test_build_engine_compares_no_family_name():
    source = BUILD_ENGINE.read_text()
    assert compared_names(source, set(modes.FAMILIES)) == []
    # and the same as text, quotes of either kind, either side of the operator
    name = "|".join(map(re.escape, modes.FAMILIES))
    quoted = rf"""["']({name})["']"""
    strings = r"""(?:["'][^"'\n]*["']\s*,\s*)*"""  # earlier items of a tuple / list / set
    text = re.findall(rf"(?:==|!=)\s*{quoted}|\bin\s*[(\[{{]?\s*{strings}{quoted}"
                      rf"|{quoted}\s*(?:==|!=|\bin\b|\bnot in\b)", source)
    assert text == []


def test_build_engine_and_build_compare_no_backend_name():
    """build_engine.py and build/ ask the backend registry (build/backends.py BUILDS,
    runtime/modes.py BACKENDS) what to do for a backend; none compares a backend's name."""
    names = set(modes.BACKENDS)
    for path in [BUILD_ENGINE, *sorted((BUILD_ENGINE.parent / "build").glob("*.py"))]:
        assert compared_names(path.read_text(), names) == [], path.name


def test_every_backend_has_a_build_record():
    from build import backends

    assert set(backends.BUILDS) == set(modes.BACKENDS)
    for name, build in backends.BUILDS.items():
        # an own-loop backend is built by its own configure, nothing of ours timed or exported
        assert (build.configure is not None) == modes.BACKENDS[name].own_loop, name


def test_the_check_sees_a_comparison():
    names = set(modes.FAMILIES)
    assert compared_names('if args.drafter == "eagle3": pass', names) == ["1: eagle3"]
    assert compared_names('x = "pard" != d', names) == ["1: pard"]
    assert compared_names('y = d in ("dflash", "other")', names) == ["1: dflash"]
    assert compared_names('p.add_argument("--drafter", default="dflash")', names) == []


def test_every_runtime_family_has_a_build_record():
    assert set(families.FAMILIES) == set(modes.FAMILIES)
    for name, family in families.FAMILIES.items():
        assert callable(family.load) and callable(family.files) and callable(family.check)
        # the model-less family (n-gram lookup) is the one with no drafting style
        assert (family.lookup is not None) == (modes.FAMILIES[name].style is None), name
        # --backend trtllm configures drafter models only
        assert (families.trtllm_config(name) is None) == (family.lookup is not None), name


def test_a_drafter_only_tensorrt_llm_runs_is_configured_from_its_checkpoint():
    assert families.trtllm_config("some-trtllm-only-drafter") is families.trtllm_from_checkpoint


def test_what_engine_json_records_of_how_each_family_drafts():
    import build_engine

    def provenance(*argv):
        args = build_engine.parse(list(argv))
        return families.FAMILIES[args.drafter].provenance(args, None)

    assert provenance("--drafter", "ngram", "--num-draft-tokens", "3") == {
        "ngram": {"method": "ngram", "max_ngram": 3, "min_ngram": 1, "num_draft_tokens": 3}}
    assert provenance("--drafter", "eagle3", "--tree-top-k", "1", "--num-draft-tokens", "3") == {
        "eagle3": {"top_k": 1, "depth": 3, "total_tokens": 4}}
    assert provenance("--drafter", "pard") == {}


def test_auto_builds_tensorrt_plans_only_for_a_family_tensorrt_drafts(monkeypatch):
    """Where TensorRT works, --backend auto builds plans for the drafting TensorRT's
    backend runs (DFlash's blocks; n-gram has no drafter); a chain (PARD) or tree
    (EAGLE-3) family gets the ONNX graphs instead of plans it would then refuse."""
    import build_engine
    from build import backends

    monkeypatch.setattr(backends, "tensorrt_usable", lambda: None)  # as on a TensorRT host
    picked = {name: build_engine.build_backend(name, "auto") for name in modes.FAMILIES}
    assert picked == {"dflash": "tensorrt", "ngram": "tensorrt", "pard": "onnxruntime",
                      "eagle3": "onnxruntime"}
    for name in modes.FAMILIES:  # an explicit backend is taken as asked (refused later if need be)
        assert build_engine.build_backend(name, "torch") == "torch"


def test_a_failed_build_leaves_no_half_engine(tmp_path):
    """Every builder writes through build/engine_dirs.py: a build that fails midway removes
    its scratch directory and leaves `out` as it was."""
    import pytest

    from build.engine_dirs import engine_dir

    out = tmp_path / "eng"
    with pytest.raises(RuntimeError, match="boom"):
        with engine_dir(out) as partial:
            (partial / "engine.json").write_text("{}")
            raise RuntimeError("boom")
    assert not partial.exists() and not out.exists()
