"""Is the installed TensorRT-LLM the structure the hook was written against? Read from its
source files, without importing it (importing tensorrt_llm needs libcuda).

Our launchers run this before TensorRT-LLM builds anything: every required pinned name
(pins.PATCH_POINTS, the generic Attention's methods, the DFlash kernel attributes) must be
found in the installed files, whatever the release number says. A release newer than the
tested range is accepted on that evidence, with one line on stderr naming it untested; a
missing name refuses the launch in one line naming it. The hook re-checks the same names
on the loaded modules (plugins/trtllm/hook.py), so a file read here that differs from the
code that runs still cannot make it scale the wrong thing.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from . import pins

__all__ = ["package_root", "missing_names"]


def package_root() -> Path | None:
    """The installed tensorrt_llm package folder (find_spec of a top-level name runs none
    of its code), or None."""
    try:
        spec = importlib.util.find_spec("tensorrt_llm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _module_file(root: Path, module: str) -> Path:
    return root.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _classes(path: Path) -> dict[str, ast.ClassDef] | None:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_names(root: Path | None = None) -> list[str]:
    """The pinned names the installed source lacks, each as 'module.Class.method (file)';
    [] when every one is there. Optional patch points (other layouts) are not required."""
    root = root if root is not None else package_root()
    if root is None:
        return ["tensorrt_llm (package folder not found)"]
    missing = []
    for point in pins.PATCH_POINTS:
        if not point.required:
            continue
        class_name, _, method = point.attribute.partition(".")
        path = _module_file(root, point.module)
        classes = _classes(path)
        if classes is None:
            missing.append(f"{point.module} ({path.name} not found)")
        elif class_name not in classes:
            missing.append(f"{point.module}.{class_name}")
        elif method and method not in _methods(classes[class_name]):
            missing.append(f"{point.module}.{point.attribute}")
    attention = [c for c in (_classes(_module_file(root, m)) for m in pins.ATTENTION_MODULES) if c]
    found = [c[pins.ATTENTION_CLASS] for c in attention if pins.ATTENTION_CLASS in c]
    if not found:
        missing.append(f"{pins.ATTENTION_CLASS} (in {' or '.join(pins.ATTENTION_MODULES)})")
    elif not any({pins.ATTENTION_METHOD, pins.ATTENTION_FORWARD} <= _methods(c) for c in found):
        missing.append(f"{pins.ATTENTION_CLASS}.{pins.ATTENTION_METHOD} / .{pins.ATTENTION_FORWARD}")
    dflash = _module_file(root, pins.DFLASH_MODULE)
    try:
        text = dflash.read_text()
    except OSError:
        text = ""
    for backend, attribute in pins.DFLASH_KERNELS.items():
        if text and attribute not in text:
            missing.append(f"{pins.DFLASH_MODULE}: {pins.DFLASH_CLASS}.{attribute} (the {backend} kernel)")
    return missing
