"""Is the installed TensorRT-LLM the structure the hook was written against? Read from its
source files, without importing it (importing tensorrt_llm needs libcuda).

Our launchers run this before TensorRT-LLM builds anything, and it alone decides: no version
number is compared. Required (pins.py): each drafter family's class in one of its layouts
(DFlash in modeling_dflash.py or, in the older layout, modeling_speculative.py) with the
constructor parameters the hook reads; the generic Attention's methods; every metadata field
the EAGLE-3 / PARD count reads; and the DFlash kernel attribute of the attention backend this
launch uses only (a VANILLA launch needs no FA4). A missing one refuses the launch in one
line naming it. The hook re-checks the same names on the loaded modules when a SharpDraft
drafter is built (plugins/trtllm/hook.py), so a file read here that differs from the code
that runs still cannot make it scale the wrong thing.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from . import pins

__all__ = ["package_root", "missing_names", "families", "mapping_missing"]


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


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def _classes(path: Path) -> dict[str, ast.ClassDef] | None:
    text = _read(path)
    try:
        tree = ast.parse(text) if text is not None else None
    except (SyntaxError, ValueError):
        return None
    return None if tree is None else {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _parameters(function: ast.FunctionDef) -> list[str]:
    a = function.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _family_found(root: Path, family: str) -> tuple[bool, str]:
    """(found, what is missing) for one drafter family across its layouts."""
    points = [p for p in pins.PATCH_POINTS if p.family == family and p.attribute.split(".")[0] == pins.FAMILIES[family]]
    why = []
    for point in points:
        class_name, _, method = point.attribute.partition(".")
        classes = _classes(_module_file(root, point.module)) or {}
        if class_name not in classes:
            why.append(f"{point.module}.{class_name}")
            continue
        methods = _methods(classes[class_name])
        if method not in methods:
            why.append(f"{point.module}.{point.attribute}")
            continue
        parameters = _parameters(methods[method])[1:]
        wanted = pins.CONSTRUCTOR_PARAMETERS.get(family, ())
        if not parameters:
            why.append(f"{point.module}.{point.attribute} (no draft_config parameter)")
        elif family == "dflash" and not set(wanted) <= set(parameters) and pins.DFLASH_FORWARD not in methods:
            why.append(f"{point.module}.{point.attribute}({', '.join(wanted)}=...)")
        elif family != "dflash" and not set(wanted) <= set(parameters):
            why.append(f"{point.module}.{point.attribute}({', '.join(wanted)}=...)")
        else:
            return True, ""
    return False, " or ".join(why[:2])


def _dflash_texts(root: Path) -> str:
    texts = []
    for point in pins.PATCH_POINTS:
        if point.family == "dflash":
            text = _read(_module_file(root, point.module))
            if text and "class DFlashForCausalLM" in text:
                texts.append(text)
    return "\n".join(dict.fromkeys(texts))


def families(root: Path | None = None) -> dict[str, str]:
    """{family: what is missing ('' when present)} for every drafter family: `check` reports
    them all, a launch needs its own only."""
    root = root if root is not None else package_root()
    out = {}
    for family in pins.FAMILIES:
        found, why = _family_found(root, family) if root is not None else (False, "tensorrt_llm")
        out[family] = "" if found else why
    return out


def mapping_missing(root: Path | None = None) -> bool:
    """Whether the installed Mapping lacks what tells a rank's pipeline stage
    (pins.MAPPING_STAGE), read from its source."""
    root = root if root is not None else package_root()
    text = _read(_module_file(root, pins.MAPPING_MODULE)) if root is not None else None
    return not text or not all(re.search(rf"\b{name}\b", text) for name in pins.MAPPING_STAGE)


def missing_names(root: Path | None = None, dflash_backend: str | None = None, family: str | None = None) -> list[str]:
    """What the installed source lacks for a launch of `family` (None: every family), each
    as 'module.Class.method' or a field name; [] when everything the hook reads there is
    present. Another family's drafter class moving does not refuse this launch (`check`
    reports it apart: families()). dflash_backend: the DFlash attention backend this launch
    uses (its kernel attribute is required; None: no DFlash kernel required); EAGLE-3 and
    PARD need the generic Attention and the metadata fields their count reads, DFlash
    neither."""
    root = root if root is not None else package_root()
    if root is None:
        return ["tensorrt_llm (package folder not found)"]
    missing = []
    wanted = [family] if family in pins.FAMILIES else list(pins.FAMILIES)
    for name in wanted:
        found, why = _family_found(root, name)
        if not found:
            missing.append(why)
    if wanted == ["dflash"]:
        return missing + _dflash_kernel_missing(root, dflash_backend)
    attention = [c for c in (_classes(_module_file(root, m)) for m in pins.ATTENTION_MODULES) if c]
    found = [c[pins.ATTENTION_CLASS] for c in attention if pins.ATTENTION_CLASS in c]
    if not found:
        missing.append(f"{pins.ATTENTION_CLASS} (in {' or '.join(pins.ATTENTION_MODULES)})")
    elif not any({pins.ATTENTION_METHOD, pins.ATTENTION_FORWARD} <= set(_methods(c)) for c in found):
        missing.append(f"{pins.ATTENTION_CLASS}.{pins.ATTENTION_METHOD} / .{pins.ATTENTION_FORWARD}")
    metadata = "\n".join(t for t in (_read(_module_file(root, m)) for m in pins.METADATA_MODULES) if t)
    if not metadata:
        missing.append(f"{pins.METADATA_CLASSES[0]} (in {' or '.join(pins.METADATA_MODULES[::2])})")
    else:
        for field in pins.METADATA.values():
            if not re.search(rf"\b{field}\b", metadata):
                missing.append(f"{pins.METADATA_CLASSES[0]}.{field}")
    return missing + _dflash_kernel_missing(root, dflash_backend)


def _dflash_kernel_missing(root: Path, dflash_backend: str | None) -> list[str]:
    """The DFlash kernels this launch needs: its attention backend's, and no public function
    of the hybrid-context module that SharpDraft does not know (pins.DFLASH_HYBRID_*)."""
    missing = []
    hybrid = _read(_module_file(root, pins.DFLASH_HYBRID_MODULE))
    if hybrid is not None and dflash_backend is not None:
        try:
            defined = [n.name for n in ast.parse(hybrid).body if isinstance(n, ast.FunctionDef)]
        except SyntaxError:
            defined = []
        known = {pins.DFLASH_HYBRID_KERNEL, *pins.DFLASH_HYBRID_UNUSED}
        unknown = [n for n in defined if not n.startswith("_") and n not in known]
        if unknown:
            missing.append(f"a SharpDraft wrapper for DFlash kernel(s) {', '.join(unknown)} "
                           f"(in {pins.DFLASH_HYBRID_MODULE})")
    if dflash_backend is not None:
        attribute = pins.DFLASH_KERNELS.get(str(dflash_backend).upper())
        text = _dflash_texts(root)
        if attribute is None:
            missing.append(f"a SharpDraft wrapper for DFlash attention_backend {dflash_backend!r} "
                           f"(known: {', '.join(pins.DFLASH_KERNELS)})")
        elif text and not re.search(rf"\b{attribute}\b", text) and not (str(dflash_backend).upper() == "VANILLA"
                                                      and pins.FLASH_ATTN_KERNEL in text):
            # the oldest copies import flash_attn_with_kvcache inside dflash_forward (VANILLA only)
            missing.append(f"{pins.DFLASH_CLASS}.{attribute} (the {dflash_backend} kernel)")
    return missing
