"""The rules docs/layering.md states, enforced on every file we ship: imports point one way
along the top-level folders,

    plugins  <-  runtime  <-  build  <-  build_engine.py, scripts

no shipped file imports tests/, no sys.path edits outside runtime/serve/'s Triton models
and scripts/, and importing sets no environment variable and registers no ONNX schema.
"""

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LAYERS = ("plugins", "runtime", "build", "top")
# the modules under tests/ (a script that put tests/ on its path would import them bare)
TEST_MODULES = {"tests"} | {p.stem for p in (REPO / "tests").glob("*.py")}


def layer_of_module(name: str) -> str | None:
    """The layer an imported (dotted) module name belongs to; None: not ours."""
    top = name.split(".")[0]
    if top in ("plugins", "runtime", "build"):
        return top
    if top in ("build_engine", "scripts"):
        return "top"
    return None


def layer_of_path(path: Path) -> str:
    rel = path.relative_to(REPO)
    return "top" if rel.parts[0] in ("build_engine.py", "scripts") else rel.parts[0]


@functools.lru_cache(maxsize=None)
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def parsed(path: Path) -> ast.Module:
    """path's syntax tree, parsed once per source text in this run: four checks walk every
    shipped file (parsing them took ~2 s of this file's ~6 s); keyed by the text, so a file
    that changes (the probe files below) is parsed again. Trees are only read."""
    return _parse(path.read_text())


def imports(path: Path) -> list[str]:
    """Dotted names of the modules a file imports, lazily inside functions too
    (`from x import y` gives x.y as well, since y may be a module)."""
    names = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def shipped() -> list[Path]:
    files = [REPO / "build_engine.py"]
    for package in ("plugins", "runtime", "build", "scripts"):
        files += sorted((REPO / package).rglob("*.py"))
    return files


def upward_imports(files) -> list[str]:
    """'file imports module (layer)' for every import that points right of the file's layer."""
    bad = []
    for path in files:
        mine = LAYERS.index(layer_of_path(path))
        for name in imports(path):
            theirs = layer_of_module(name)
            if theirs is not None and LAYERS.index(theirs) > mine:
                bad.append(f"{path.relative_to(REPO)} imports {name} ({theirs})")
    return sorted(set(bad))


def reaches_tests(files) -> list[str]:
    """'file: how' for every shipped file that imports a tests/ module, or builds a path
    into the tests/ folder (`REPO / "tests" / ...`: a module loaded from there by path)."""
    bad = []
    for path in files:
        rel = path.relative_to(REPO)
        bad += [f"{rel}: imports {name}" for name in imports(path)
                if name.split(".")[0] in TEST_MODULES]
        bad += [f"{rel}:{node.lineno}: builds a path into tests/"
                for node in ast.walk(parsed(path))
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)
                and re.fullmatch(r"tests(/.*)?", node.right.value)]
    return sorted(set(bad))


def edits_sys_path(files) -> list[str]:
    """'file:line' for every sys.path.insert/append/extend/remove or assignment to sys.path."""
    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    bad = []
    for path in files:
        for node in ast.walk(parsed(path)):
            call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and is_sys_path(node.func.value)
                    and node.func.attr in ("insert", "append", "extend", "remove"))
            assign = isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
            if call or assign:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return bad


def path_bound() -> list[Path]:
    """The files that run from the repository root and so never need sys.path: plugins/,
    runtime/ but runtime/serve/ (Triton models a foreign process loads), build/ and
    build_engine.py."""
    return [p for p in shipped() if p.relative_to(REPO).parts[0] != "scripts"
            and p.relative_to(REPO).parts[:2] != ("runtime", "serve")]


def test_every_import_points_down_the_layers():
    assert upward_imports(shipped()) == []


def test_no_shipped_file_reaches_into_tests():
    assert reaches_tests(shipped()) == []


def test_no_sys_path_edits_outside_the_triton_models_and_scripts():
    assert edits_sys_path(path_bound()) == []


def test_the_checks_see_each_layer_and_can_fail():
    """Each check can fail: build_engine.py, scripts/, build/, the runtime (its commands
    included) and plugins/ are each classified; a runtime command that ran the builder, and
    an import of a tests/ module, a path into tests/ and a sys.path edit in build/, planted
    in probe files, are each caught."""
    assert {layer_of_path(p) for p in shipped()} == set(LAYERS)
    assert layer_of_path(REPO / "build_engine.py") == "top"
    assert layer_of_path(REPO / "scripts" / "compare_outputs.py") == "top"
    assert layer_of_path(REPO / "runtime" / "commands" / "demo.py") == "runtime"
    assert layer_of_path(REPO / "build" / "calibrate.py") == "build"
    assert REPO / "build" / "export.py" in path_bound()
    assert REPO / "runtime" / "serve" / "model.py" not in path_bound()
    command = REPO / "runtime" / "commands" / "_layering_probe.py"
    recipe = REPO / "build" / "_layering_probe.py"
    assert not command.exists() and not recipe.exists()
    try:
        command.write_text("def run(args):\n    import build_engine\n    from build import export\n")
        recipe.write_text("import sys\n\ndef f():\n    import tiny\n    sys.path.insert(0, 'x')\n"
                          "    return REPO / 'tests' / 'tiny.py'\n")
        assert upward_imports([command, recipe]) == [
            "runtime/commands/_layering_probe.py imports build (build)",
            "runtime/commands/_layering_probe.py imports build.export (build)",
            "runtime/commands/_layering_probe.py imports build_engine (top)"]
        assert reaches_tests([command, recipe]) == ["build/_layering_probe.py: imports tiny",
                                                    "build/_layering_probe.py:6: builds a path into tests/"]
        assert edits_sys_path([command, recipe]) == ["build/_layering_probe.py:5"]
    finally:
        command.unlink(missing_ok=True)
        recipe.unlink(missing_ok=True)


def test_the_document_states_the_order_the_test_checks():
    text = (REPO / "docs" / "layering.md").read_text()
    assert "plugins  <-  runtime  <-  build  <-  build_engine.py, scripts" in text
    assert "tests/test_layering.py" in text


def test_the_command_line_offers_device_choices_without_loading_the_torch_backend():
    """runtime/cli.py reads --device/--dtype/--steps/--prefill-dtype from names
    (runtime/placement.py): building the commands' parsers imports no torch backend
    (it imported runtime.compiled, and with it runtime.backends.pytorch, before)."""
    probe = """
import sys
from runtime.__main__ import main
for command in ("generate", "bench", "serve", "loadtest"):
    try:
        main([command, "--help"])
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m.startswith(
    ("runtime.compiled", "runtime.backends.pytorch", "runtime.backends.torch"))))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_engine_compares_no_backend_family_or_style_names():
    """Engine and the decoder factory look backends up in the loaders' registry and ask
    the table's predicates: no `== "torch"` / `!= "tree"` ladders (a new backend or device
    must not add a branch to each)."""
    from runtime import modes

    names = set(modes.BACKENDS) | set(modes.FAMILIES) | {f.style for f in modes.FAMILIES.values() if f.style}
    for path in (REPO / "runtime" / "engine.py", REPO / "runtime" / "assembly.py"):
        compared = []
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                compared += [o.value for o in operands if isinstance(o, ast.Constant)
                             and o.value in names]
        assert compared == [], f"{path.name} compares {compared}"


def test_importing_leaves_the_environment_and_onnx_schemas_alone():
    """Importing any layer sets no environment variable (HF_HUB_OFFLINE is the entry
    point's to set) and registers no ONNX schema (an export does, when it needs one). The
    torch op is not asserted either way: plugins/attention.py decides when it registers."""
    probe = """
import os, sys
before = dict(os.environ)
import onnx.defs, torch
import plugins.attention, plugins.onnx, plugins.triton_kernel, runtime.engine, runtime.serve.protocol
import build.export, build.calibrate, build_engine
from runtime.__main__ import main
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(changed, onnx.defs.has("SharpDraftAttention", "ai.onnx.contrib"))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False"]
