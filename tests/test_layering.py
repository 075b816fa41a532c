"""The dependency direction docs/layering.md states, enforced on every module we ship, and
imports without side effects. Each layer imports only from itself and the layers left of it:

    plugins  <-  runtime core  <-  build  <-  commands  <-  scripts

runtime core: runtime/ but runtime/commands/ and runtime/__main__.py; commands: those two
and build_engine.py. Within the commands, build_engine.py (the builder's command) imports
no runtime command (what the build measures lives in the runtime core: runtime/measure.py),
and a runtime command may run the builder only through its entry point, build_engine.main
(demo builds the default engine).
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LAYERS = ("plugins", "runtime", "build", "commands", "scripts")


def layer_of_module(name: str) -> str | None:
    """The layer an imported (dotted) module name belongs to; None: not ours."""
    top = name.split(".")[0]
    if name == "runtime.__main__" or name.startswith("runtime.commands") or top == "build_engine":
        return "commands"
    if top in ("plugins", "runtime", "build", "scripts"):
        return top
    return None


def layer_of_path(path: Path) -> str:
    rel = path.relative_to(REPO)
    if rel.parts[0] == "runtime" and (rel.parts[1] == "commands" or rel.name == "__main__.py"):
        return "commands"
    if rel.name == "build_engine.py":
        return "commands"
    return rel.parts[0]


def imports(path: Path) -> list[str]:
    """Dotted names of the modules a file imports, lazily inside functions too
    (`from x import y` gives x.y as well, since y may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_every_import_points_down_the_layers():
    assert upward_imports(shipped()) == []


def test_the_check_sees_each_layer_it_covers(tmp_path):
    """The check itself can fail: build_engine.py, build/, the runtime core, plugins/ and a
    command are each classified, and an upward import in each is caught."""
    assert {layer_of_path(p) for p in shipped()} == set(LAYERS)
    assert layer_of_path(REPO / "build_engine.py") == "commands"
    assert layer_of_path(REPO / "runtime" / "commands" / "demo.py") == "commands"
    assert layer_of_path(REPO / "runtime" / "engine.py") == "runtime"
    probe = REPO / "build" / "_layering_probe.py"
    assert not probe.exists()
    try:
        probe.write_text("def f():\n    from runtime.commands import bench\n")
        assert upward_imports([probe]) == [
            "build/_layering_probe.py imports runtime.commands (commands)",
            "build/_layering_probe.py imports runtime.commands.bench (commands)"]
    finally:
        probe.unlink()


def test_the_builder_imports_no_runtime_command():
    assert [n for n in imports(REPO / "build_engine.py") if n.startswith("runtime.commands")
            or n == "runtime.__main__"] == []


def test_runtime_commands_run_the_builder_only_through_its_entry_point():
    for path in sorted((REPO / "runtime" / "commands").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "build_engine":
                raise AssertionError(f"{path.name}: from build_engine import ...")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "build_engine"):
                assert node.attr == "main", f"{path.name} reaches build_engine.{node.attr}"


def test_engine_compares_no_backend_family_or_style_names():
    """Engine and the decoder factory look backends up in the loaders' registry and ask
    the table's predicates: no `== "torch"` / `!= "tree"` ladders (a new backend or device
    must not add a branch to each)."""
    from runtime import modes

    names = set(modes.BACKENDS) | set(modes.FAMILIES) | {s for s in modes.FAMILIES.values() if s}
    for path in (REPO / "runtime" / "engine.py", REPO / "runtime" / "assembly.py"):
        compared = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                compared += [o.value for o in operands if isinstance(o, ast.Constant)
                             and o.value in names]
        assert compared == [], f"{path.name} compares {compared}"


def test_importing_registers_nothing_and_leaves_the_environment_alone():
    probe = """
import os, sys
before = dict(os.environ)
import onnx.defs, torch
import plugins.attention, plugins.onnx, plugins.triton_kernel, runtime.engine, runtime.serve.protocol
import build.export, build_engine
from runtime.__main__ import main
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(changed, hasattr(torch.ops.sharpdraft, "attention"),
      onnx.defs.has("SharpDraftAttention", "ai.onnx.contrib"))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    # the torch op is the one registration an import makes (plugins/attention.py, issue 55):
    # a compiled step may be a process's first caller, and dynamo cannot trace its definition
    assert done.stdout.split() == ["[]", "True", "False"]
