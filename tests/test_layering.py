"""The dependency direction the README's layout states, and imports without side effects:

    plugins  <-  runtime (core)  <-  build  <-  commands (build_engine.py, runtime/__main__.py,
                                                runtime/commands/)
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_packages(path: Path) -> set[str]:
    """Top-level names of our packages a module imports, lazily inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name.split(".")[0] if not name.startswith("runtime.commands") else "runtime.commands"
            for name in names}


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_plugins_import_nothing_of_ours_but_plugins():
    for path in modules("plugins"):
        assert not imported_packages(path) & {"runtime", "runtime.commands", "build",
                                              "build_engine"}, path


def test_the_runtime_core_never_imports_build_or_commands():
    commands = REPO / "runtime" / "commands"
    for path in modules("runtime"):
        if commands in path.parents or path.name == "__main__.py":
            continue
        assert not imported_packages(path) & {"build", "build_engine", "runtime.commands"}, path


def test_build_never_imports_commands():
    for path in modules("build"):
        assert not imported_packages(path) & {"runtime.commands", "build_engine"}, path


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
    assert done.stdout.split() == ["[]", "False", "False"]
