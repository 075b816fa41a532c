"""install(scaling) / uninstall(): SharpDraft switched on inside TensorRT-LLM's drafters.

Nothing here imports TensorRT-LLM. `install` puts an import hook at the front of
sys.meta_path that patches the modeling modules the moment they finish loading (and
patches them at once if they are loaded already), because TensorRT-LLM is imported late
on purpose (its Triton model defers the import until CUDA_VISIBLE_DEVICES is set) and
because importing it needs a GPU driver.

What gets patched (names and sources: plugins/trtllm/pins.py):
- `DFlashForCausalLM.__init__`: once a DFlash drafter is built, the attention kernel its
  instance holds (VANILLA / TRTLLM / FA4) is replaced by the matching wrapper of
  plugins/trtllm/kernels.py.
- `Eagle3ForCausalLM.__init__`, `PARDForCausalLM.__init__`: once built, `apply_rope` of
  every `Attention` instance inside the drafter is wrapped (plugins/trtllm/rope.py). The
  target's attention, built from the same classes, is never touched.

Before patching, the installed version must be one of pins.VERSIONS and every pinned
name must exist; otherwise one line names the version and the missing name
(TrtllmHookError), never a silent no-op.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import sys
import weakref

from plugins.scaling import QueryScaling
from plugins.trtllm import pins
from plugins.trtllm.kernels import (wrap_fa4_fwd, wrap_flash_attn_with_kvcache, wrap_trtllm_gen_context,
                                    wrap_trtllm_gen_decode)
from plugins.trtllm.rope import wrap_apply_rope

__all__ = ["TrtllmHookError", "install", "uninstall", "installed", "active_scaling"]

ORIGINALS = "_sharpdraft_originals"  # instance attribute: what the hook replaced on it


class TrtllmHookError(ImportError):
    """The hook cannot vouch for this TensorRT-LLM installation (one line).

    An ImportError, so the command line's one-line handling (runtime/cli.py) applies."""


class _State:
    def __init__(self):
        self.scaling: QueryScaling | None = None
        self.finder: _Finder | None = None
        self.classes: dict[tuple[str, str], tuple[type, object]] = {}  # -> (class, original __init__)
        self.instances: weakref.WeakSet = weakref.WeakSet()
        self.version: str | None = None


_state = _State()


def active_scaling() -> QueryScaling | None:
    """The scaling every wrapper applies now (None: the hook is off; wrappers pass through)."""
    return _state.scaling


def installed() -> bool:
    return _state.finder is not None


def install(scaling: QueryScaling) -> None:
    """Switch SharpDraft on for TensorRT-LLM drafters built from now on (idempotent;
    calling again with another QueryScaling changes the scale the wrappers apply)."""
    if not isinstance(scaling, QueryScaling):
        raise TypeError(f"install() takes a QueryScaling, got {type(scaling).__name__}")
    _state.scaling = scaling
    if _state.finder is None:
        _state.finder = _Finder()
        sys.meta_path.insert(0, _state.finder)
    try:
        for name in pins.WATCHED:
            module = sys.modules.get(name)
            if module is not None:
                _patch_module(module)
    except BaseException:
        uninstall()
        raise


def uninstall() -> None:
    """Undo everything install did: the import hook, the patched constructors, and the
    wrappers on drafter instances built meanwhile (idempotent)."""
    if _state.finder is not None and _state.finder in sys.meta_path:
        sys.meta_path.remove(_state.finder)
    _state.finder = None
    for cls, original in _state.classes.values():
        cls.__init__ = original
    _state.classes.clear()
    for instance in list(_state.instances):
        _restore(instance)
    _state.instances = weakref.WeakSet()
    _state.scaling = None
    _state.version = None


# --- the version guard --------------------------------------------------------------------

def _version() -> str:
    if _state.version is None:
        try:
            module = sys.modules.get(pins.VERSION_MODULE) or importlib.import_module(pins.VERSION_MODULE)
            _state.version = str(module.__version__)
        except (ImportError, AttributeError):
            raise TrtllmHookError(f"TensorRT-LLM has no {pins.VERSION_MODULE}.__version__ — SharpDraft's "
                                  f"hook was checked against {', '.join(pins.VERSIONS)} only") from None
    if _state.version not in pins.VERSIONS:
        raise TrtllmHookError(f"TensorRT-LLM {_state.version} is not a version SharpDraft's hook was "
                              f"checked against ({', '.join(pins.VERSIONS)}); its names "
                              "(DFlashForCausalLM.__init__, Attention.apply_rope, ...) are pinned in "
                              "plugins/trtllm/pins.py")
    return _state.version


def _missing(what: str) -> TrtllmHookError:
    return TrtllmHookError(f"TensorRT-LLM {_state.version or '?'}: {what} is missing — SharpDraft's "
                           "hook cannot apply beta there (pinned names: plugins/trtllm/pins.py)")


def resolve(module, dotted: str):
    """module.a.b for dotted 'a.b', or None when any part is missing."""
    value = module
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


# --- patching on import -------------------------------------------------------------------

class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch, once its code has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if installed():
            _patch_module(module)

    def __getattr__(self, name):  # get_source, get_code, is_package ... for introspection
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in pins.WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


FAMILIES = {  # patch point -> drafter family it builds
    "DFlashForCausalLM.__init__": "dflash",
    "Eagle3ForCausalLM.__init__": "eagle3",
    "PARDForCausalLM.__init__": "pard",
}


def _patch_module(module) -> None:
    _version()
    for point in pins.PATCH_POINTS:
        if point.module != module.__name__:
            continue
        target = resolve(module, point.attribute)
        if target is None:
            raise _missing(f"{point.module}.{point.attribute}")
        class_name = point.attribute.split(".")[0]
        key = (point.module, class_name)
        if key in _state.classes:
            continue
        cls = getattr(module, class_name)
        original = cls.__dict__.get("__init__")
        if original is None:
            raise _missing(f"{point.module}.{class_name}.__init__ (defined on the class itself)")
        cls.__init__ = _after_init(original, FAMILIES[point.attribute])
        _state.classes[key] = (cls, original)


def _after_init(original, family: str):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _state.scaling is not None:
            prepare_drafter(self, family)

    return __init__


# --- drafter instances --------------------------------------------------------------------

def prepare_drafter(drafter, family: str) -> None:
    """Wrap what this drafter instance calls (idempotent). Raises TrtllmHookError when an
    expected name is missing on it."""
    if ORIGINALS in vars(drafter):
        return
    originals = _prepare_dflash(drafter) if family == "dflash" else _prepare_attention(drafter, family)
    vars(drafter)[ORIGINALS] = originals
    _state.instances.add(drafter)


def _scaling_now():
    return _state.scaling


def _prepare_dflash(drafter) -> dict:
    name = type(drafter).__name__
    backend = getattr(drafter, pins.DFLASH_BACKEND_ATTRIBUTE, None)
    if backend is None:
        raise _missing(f"{name}.{pins.DFLASH_BACKEND_ATTRIBUTE}")
    attribute = pins.DFLASH_KERNELS.get(backend)
    if attribute is None:
        raise TrtllmHookError(f"TensorRT-LLM {_state.version or '?'}: DFlash attention_backend "
                              f"{backend!r} has no SharpDraft wrapper (known: "
                              f"{', '.join(pins.DFLASH_KERNELS)})")
    kernel = vars(drafter).get(attribute)
    if kernel is None:
        raise _missing(f"{name}.{attribute} (the {backend} attention kernel)")
    if backend == "VANILLA":
        wrapped = wrap_flash_attn_with_kvcache(kernel, _scaling_now)
    elif backend == "FA4":
        wrapped = wrap_fa4_fwd(kernel, _scaling_now)
    else:  # TRTLLM: a frozen dataclass of flashinfer ops; wrap the two attention calls
        if not dataclasses.is_dataclass(kernel) or not all(
                hasattr(kernel, field) for field in pins.TRTLLM_GEN_FIELDS):
            raise _missing(f"{name}.{attribute}.{' / '.join(pins.TRTLLM_GEN_FIELDS)}")
        wrapped = dataclasses.replace(kernel, **{
            pins.TRTLLM_GEN_FIELDS[0]: wrap_trtllm_gen_decode(getattr(kernel, pins.TRTLLM_GEN_FIELDS[0]),
                                                              _scaling_now),
            pins.TRTLLM_GEN_FIELDS[1]: wrap_trtllm_gen_context(getattr(kernel, pins.TRTLLM_GEN_FIELDS[1]),
                                                               _scaling_now)})
    setattr(drafter, attribute, wrapped)
    return {attribute: kernel}


def attention_class():
    """TensorRT-LLM's Attention class, from whichever pinned module is loaded."""
    for module_name in pins.ATTENTION_MODULES:
        module = sys.modules.get(module_name)
        cls = getattr(module, pins.ATTENTION_CLASS, None) if module else None
        if cls is not None and hasattr(cls, pins.ATTENTION_METHOD):
            return cls
    raise _missing(f"{pins.ATTENTION_CLASS}.{pins.ATTENTION_METHOD} (looked in "
                   f"{' and '.join(pins.ATTENTION_MODULES)})")


def _prepare_attention(drafter, family: str) -> dict:
    cls = attention_class()
    layers = [m for m in drafter.modules() if isinstance(m, cls)]
    if not layers:
        raise _missing(f"an {pins.ATTENTION_CLASS} layer inside {type(drafter).__name__} ({family} drafter)")
    for layer in layers:
        q_size = getattr(layer, pins.ATTENTION_Q_SIZE, None)
        if q_size is None:
            raise _missing(f"{type(layer).__name__}.{pins.ATTENTION_Q_SIZE}")
        # An instance attribute shadows the class's method for this layer only.
        vars(layer)[pins.ATTENTION_METHOD] = wrap_apply_rope(getattr(layer, pins.ATTENTION_METHOD),
                                                             _scaling_now, int(q_size))
        _state.instances.add(layer)
        vars(layer)[ORIGINALS] = {pins.ATTENTION_METHOD: None}  # None: fall back to the class
    return {}


def _restore(instance) -> None:
    originals = vars(instance).pop(ORIGINALS, None)
    for attribute, original in (originals or {}).items():
        if original is None:
            vars(instance).pop(attribute, None)
        else:
            setattr(instance, attribute, original)
