"""install(scaling) / uninstall(): SharpDraft switched on inside TensorRT-LLM's drafters.

Nothing here imports TensorRT-LLM. `install` puts an import hook at the front of
sys.meta_path that patches the modeling modules the moment they finish loading (and
patches them at once if they are loaded already), because TensorRT-LLM is imported late
on purpose (its Triton model defers the import until CUDA_VISIBLE_DEVICES is set) and
because importing it needs a GPU driver.

What gets patched (names and sources: plugins/trtllm/pins.py, PATCH_POINTS):
- `DFlashForCausalLM.__init__` (modeling_dflash, or modeling_speculative in the older
  layout): once a DFlash drafter is built, the attention kernel it calls (VANILLA / TRTLLM
  / FA4 on the instance; flash_attn_with_kvcache imported inside dflash_forward in the
  older layout) is wrapped (plugins/trtllm/kernels.py).
- `Eagle3ForCausalLM.__init__`, `PARDForCausalLM.__init__`: once built, `forward` and
  `apply_rope` of every `Attention` instance inside the drafter are wrapped
  (plugins/trtllm/rope.py). The target's attention, built from the same classes, is never
  touched.
- MLA drafters (Eagle3 with kv_lora_rank, i.e. Eagle3DeepSeekV3; MistralLarge3Eagle) and
  any other drafter-named class of those modules are *refused* when built.

Every drafter built with the hook installed leaves a proof record (plugins/trtllm/proof.py):
wrapped (class, layers, scaling, pid) or refused (why). Inside TensorRT-LLM's import and
model construction the hook never raises: a version outside the tested range or a
missing name disables it and records why; our launchers refuse in one line from there.
`TrtllmHookError` remains for direct callers (`prepare_drafter`, `check_version`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import re
import sys
import weakref

from plugins.scaling import QueryScaling
from plugins.trtllm import pins, proof, versions
from plugins.trtllm.kernels import (wrap_fa4_fwd, wrap_flash_attn_with_kvcache, wrap_trtllm_gen_context,
                                    wrap_trtllm_gen_decode)
from plugins.trtllm.rope import wrap_apply_rope, wrap_forward

__all__ = ["TrtllmHookError", "install", "uninstall", "installed", "active_scaling", "disabled",
           "check_version"]

ORIGINALS = "_sharpdraft_originals"  # instance attribute: what the hook replaced on it
FAMILY = "_sharpdraft_family"  # marks a constructor the hook wrapped


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
        self.disabled: str | None = None  # why the hook stood down in this process
        self.serial = 0  # drafters wrapped in this process (names their proof units)


_state = _State()


def active_scaling() -> QueryScaling | None:
    """The scaling every wrapper applies now (None: the hook is off; wrappers pass through)."""
    return _state.scaling


def installed() -> bool:
    return _state.finder is not None


def disabled() -> str | None:
    """Why the hook stood down in this process (None: it did not)."""
    return _state.disabled


def install(scaling: QueryScaling) -> None:
    """Switch SharpDraft on for TensorRT-LLM drafters built from now on (idempotent;
    calling again with another QueryScaling changes the scale the wrappers apply).
    Never raises for the installation it finds: see `disabled()`."""
    if not isinstance(scaling, QueryScaling):
        raise TypeError(f"install() takes a QueryScaling, got {type(scaling).__name__}")
    _state.scaling = scaling
    _state.disabled = None
    if _state.finder is None:
        _state.finder = _Finder()
        sys.meta_path.insert(0, _state.finder)
    for name in pins.WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)


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
    _state.disabled = None


# --- the version guard --------------------------------------------------------------------

def check_version(version: str | None) -> str:
    """version if it is in the tested range; TrtllmHookError (one line) otherwise."""
    rng = versions.describe_range(pins.MIN_VERSION, pins.MAX_VERSION)
    if version is None:
        raise TrtllmHookError(f"TensorRT-LLM has no {pins.VERSION_MODULE}.__version__ — SharpDraft's hook "
                              f"was checked against {rng} only")
    if not versions.is_tested(version, pins.MIN_VERSION, pins.MAX_VERSION):
        raise TrtllmHookError(f"TensorRT-LLM {version} is outside the releases SharpDraft's hook was "
                              f"checked against ({rng}); its names (DFlashForCausalLM.__init__, "
                              "Attention.apply_rope, ...) are pinned in plugins/trtllm/pins.py")
    return version


def _version() -> str:
    if _state.version is None:
        try:
            module = sys.modules.get(pins.VERSION_MODULE) or importlib.import_module(pins.VERSION_MODULE)
            _state.version = str(module.__version__)
        except (ImportError, AttributeError):
            _state.version = None
    return check_version(_state.version)


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


def _disable(reason: str) -> None:
    """Stand down in this process: never raise inside TensorRT-LLM's import, record why."""
    first = reason.splitlines()[0] if reason else "?"
    if _state.disabled is None:
        sys.stderr.write(f"sharpdraft: hook disabled in this process: {first}\n")
        proof.record("disabled", drafter=None, reason=first, scaling=_scaling_dict())
    _state.disabled = first


def _scaling_dict():
    return _state.scaling.to_dict() if _state.scaling is not None else None


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


def _patch_module(module) -> None:
    """Patch the module's drafter classes; on any doubt, disable the hook and record why
    (never raise: this runs inside `import tensorrt_llm...` of every process)."""
    try:
        _version()
        plan = []
        for point in pins.PATCH_POINTS:
            if point.module != module.__name__:
                continue
            class_name = point.attribute.split(".")[0]
            cls = getattr(module, class_name, None)
            if cls is None:
                if point.required:
                    raise _missing(f"{point.module}.{point.attribute}")
                continue
            if cls.__dict__.get("__init__") is None:
                raise _missing(f"{point.module}.{class_name}.__init__ (defined on the class itself)")
            plan.append((class_name, cls, point.family))
        known = {name for name, _, _ in plan} | {p.attribute.split(".")[0] for p in pins.PATCH_POINTS}
        for name, value in vars(module).items():  # drafter classes nobody pinned: refuse when built
            if (isinstance(value, type) and name not in known and re.search(pins.DRAFTER_CLASS_PATTERN, name)
                    and getattr(value, "__module__", None) == module.__name__ and "__init__" in value.__dict__):
                plan.append((name, value, "unknown"))
    except TrtllmHookError as exc:
        _disable(str(exc))
        return
    for class_name, cls, family in plan:
        key = (module.__name__, class_name)
        if key in _state.classes:
            continue
        original = cls.__dict__["__init__"]
        cls.__init__ = _after_init(original, family)
        _state.classes[key] = (cls, original)


def _after_init(original, family: str):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        outer = type(self).__init__
        if _state.scaling is None or (outer is not __init__ and hasattr(outer, FAMILY)):
            return  # hook off, or a patched subclass's constructor (running around us) reports
        try:
            prepare_drafter(self, family)
        except (TrtllmHookError, TypeError, ValueError) as exc:  # never raise out of TensorRT-LLM's
            # model construction: a kernel whose signature cannot be read, a name we cannot vouch for
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            sys.stderr.write(f"sharpdraft: {type(self).__name__} runs WITHOUT SharpDraft: {reason}\n")
            proof.record("refused", drafter=type(self).__name__, family=family, reason=reason,
                         scaling=_scaling_dict())

    setattr(__init__, FAMILY, family)
    return __init__


# --- drafter instances --------------------------------------------------------------------

def prepare_drafter(drafter, family: str) -> None:
    """Wrap what this drafter instance calls (idempotent) and record the proof. Raises
    TrtllmHookError (one line) where it cannot: a missing name, an MLA or unknown drafter,
    a configuration whose key count cannot be derived exactly."""
    if ORIGINALS in vars(drafter):
        return
    if family == "mla":
        raise TrtllmHookError(f"{type(drafter).__name__} uses MLA (latent) attention, whose query path "
                              "SharpDraft does not wrap — run it without --sharpdraft")
    if family == "unknown":
        raise TrtllmHookError(f"{type(drafter).__name__} is a drafter class SharpDraft's hook does not "
                              f"know (TensorRT-LLM {_state.version or '?'}; pinned: plugins/trtllm/pins.py)")
    _state.serial += 1
    prefix = f"{type(drafter).__name__}#{_state.serial}"
    if family == "dflash":
        originals, layers, units = _prepare_dflash(drafter, prefix)
    else:
        originals, layers, units = _prepare_attention(drafter, family, prefix)
    vars(drafter)[ORIGINALS] = originals
    _state.instances.add(drafter)
    proof.record("wrapped", drafter=type(drafter).__name__, family=family, layers=layers, units=units,
                 scaling=_scaling_dict(), version=_state.version)


def _scaling_now():
    return _state.scaling


def _prepare_dflash(drafter, prefix: str) -> tuple[dict, int, list[str]]:
    """Wrap the DFlash drafter's kernel; its proof unit is the kernel (one per drafter: every
    draft layer calls it)."""
    name = type(drafter).__name__
    backend = getattr(drafter, pins.DFLASH_BACKEND_ATTRIBUTE, None)
    layers = len(getattr(getattr(drafter, "model", None), "layers", None) or ())
    if backend is None:
        forward = getattr(drafter, pins.DFLASH_FORWARD, None)
        if forward is None:
            raise _missing(f"{name}.{pins.DFLASH_BACKEND_ATTRIBUTE} or {name}.{pins.DFLASH_FORWARD}")
        unit = f"{prefix}.{pins.FLASH_ATTN_KERNEL}"
        vars(drafter)[pins.DFLASH_FORWARD] = _with_wrapped_flash_attn(forward, unit)  # older layout
        return {pins.DFLASH_FORWARD: None}, layers, [unit]
    attribute = pins.DFLASH_KERNELS.get(backend)
    if attribute is None:
        raise TrtllmHookError(f"TensorRT-LLM {_state.version or '?'}: DFlash attention_backend "
                              f"{backend!r} has no SharpDraft wrapper (known: "
                              f"{', '.join(pins.DFLASH_KERNELS)})")
    kernel = vars(drafter).get(attribute)
    if kernel is None:
        raise _missing(f"{name}.{attribute} (the {backend} attention kernel)")
    unit = f"{prefix}.{attribute}"
    try:
        wrapped = _wrap_dflash_kernel(backend, kernel, name, attribute, unit)
    except TypeError as exc:  # a kernel whose signature cannot be read: refused, one line
        raise TrtllmHookError(str(exc).splitlines()[0]) from None
    setattr(drafter, attribute, wrapped)
    return {attribute: kernel}, layers, [unit]


def _wrap_dflash_kernel(backend, kernel, name, attribute, unit):
    if backend == "VANILLA":
        wrapped = wrap_flash_attn_with_kvcache(kernel, _scaling_now, unit)
    elif backend == "FA4":
        wrapped = wrap_fa4_fwd(kernel, _scaling_now, unit)
    else:  # TRTLLM: a frozen dataclass of flashinfer ops; wrap the two attention calls
        if not dataclasses.is_dataclass(kernel) or not all(
                hasattr(kernel, field) for field in pins.TRTLLM_GEN_FIELDS):
            raise _missing(f"{name}.{attribute}.{' / '.join(pins.TRTLLM_GEN_FIELDS)}")
        wrapped = dataclasses.replace(kernel, **{
            pins.TRTLLM_GEN_FIELDS[0]: wrap_trtllm_gen_decode(getattr(kernel, pins.TRTLLM_GEN_FIELDS[0]),
                                                              _scaling_now, unit),
            pins.TRTLLM_GEN_FIELDS[1]: wrap_trtllm_gen_context(getattr(kernel, pins.TRTLLM_GEN_FIELDS[1]),
                                                               _scaling_now, unit)})
    return wrapped


def _with_wrapped_flash_attn(dflash_forward, unit: str):
    """The older DFlash layout imports flash_attn_with_kvcache inside dflash_forward at
    call time: for the duration of this drafter's call, the module attribute it imports is
    our wrapper (the target never calls flash_attn directly; one model forward at a time)."""
    cache = {}

    @functools.wraps(dflash_forward)
    def wrapper(*args, **kwargs):
        module = sys.modules.get(pins.FLASH_ATTN_MODULE) or importlib.import_module(pins.FLASH_ATTN_MODULE)
        original = getattr(module, pins.FLASH_ATTN_KERNEL)
        if original not in cache:
            cache.clear()
            cache[original] = wrap_flash_attn_with_kvcache(original, _scaling_now, unit)
        setattr(module, pins.FLASH_ATTN_KERNEL, cache[original])
        try:
            return dflash_forward(*args, **kwargs)
        finally:
            setattr(module, pins.FLASH_ATTN_KERNEL, original)

    return wrapper


def attention_class(name: str = pins.ATTENTION_CLASS):
    """TensorRT-LLM's Attention (or MLA) class, from whichever pinned module is loaded."""
    for module_name in (pins.MLA_MODULES if name == pins.MLA_CLASS else pins.ATTENTION_MODULES):
        module = sys.modules.get(module_name)
        cls = getattr(module, name, None) if module else None
        if cls is not None:
            return cls
    return None


def _unaudited_override(layer, base):
    """(method, class) where the layer's class overrides one of the methods that could route
    the query around apply_rope, in a subclass of `base` nobody audited; else None."""
    for method in pins.ATTENTION_BYPASSES:
        definer = next((c for c in type(layer).__mro__ if method in c.__dict__), None)
        if definer is None or definer is base or not issubclass(definer, base):
            continue
        condition = pins.AUDITED_ATTENTION.get((definer.__name__, method))
        if condition is None or getattr(layer, condition, True):
            return method, definer  # never audited, or audited only with `condition` off
    return None


def _prepare_attention(drafter, family: str, prefix: str) -> tuple[dict, int, list[str]]:
    name = type(drafter).__name__
    cls = attention_class()
    mla = tuple({getattr(sys.modules.get(m), pins.MLA_CLASS, None) for m in pins.MLA_MODULES} - {None})
    if getattr(drafter, "_use_mla", False) or (mla and any(isinstance(m, mla) for m in drafter.modules())):
        raise TrtllmHookError(f"{name} uses MLA (latent) attention (e.g. Eagle3DeepSeekV3), whose query "
                              "path SharpDraft does not wrap — run it without --sharpdraft")
    if cls is None or not hasattr(cls, pins.ATTENTION_METHOD):
        raise _missing(f"{pins.ATTENTION_CLASS}.{pins.ATTENTION_METHOD} (looked in "
                       f"{' and '.join(pins.ATTENTION_MODULES)})")
    named = [(n, m) for n, m in drafter.named_modules() if isinstance(m, cls)]
    layers = [m for _, m in named]
    if not layers:
        raise _missing(f"an {pins.ATTENTION_CLASS} layer inside {name} ({family} drafter)")
    config = getattr(drafter, pins.DRAFTER_MODEL_CONFIG, None)
    if getattr(config, pins.SPARSE_ATTENTION, None) is not None:
        raise TrtllmHookError(f"{name} runs with {pins.SPARSE_ATTENTION} (KV compression / sparse "
                              "attention): the keys a query sees are not the cache length — refused")
    for layer in layers:
        if getattr(layer, pins.CHUNK_ATTRIBUTE, None):
            raise TrtllmHookError(f"{name} has chunked attention ({pins.CHUNK_ATTRIBUTE}="
                                  f"{getattr(layer, pins.CHUNK_ATTRIBUTE)}): its per-row key count is not "
                                  "derived — refused")
        if getattr(layer, pins.ATTENTION_Q_SIZE, None) is None:
            raise _missing(f"{type(layer).__name__}.{pins.ATTENTION_Q_SIZE}")
        override = _unaudited_override(layer, cls)
        if override is not None:
            method, definer = override
            raise TrtllmHookError(f"{name}'s attention layer {definer.__name__} overrides {method} (e.g. "
                                  "QKNormRoPEAttention's fused norm + gate path), which may route the query "
                                  "around apply_rope: not audited for SharpDraft — refused")
    units = []
    for layer_name, layer in named:
        unit = f"{prefix}.{layer_name or 'self'}"
        units.append(unit)
        # Instance attributes shadow the class's methods for this layer only.
        vars(layer)[pins.ATTENTION_FORWARD] = wrap_forward(getattr(layer, pins.ATTENTION_FORWARD), layer)
        vars(layer)[pins.ATTENTION_METHOD] = wrap_apply_rope(getattr(layer, pins.ATTENTION_METHOD),
                                                             _scaling_now, int(layer.q_size), layer, unit)
        _state.instances.add(layer)
        vars(layer)[ORIGINALS] = {pins.ATTENTION_METHOD: None, pins.ATTENTION_FORWARD: None}
    return {}, len(layers), units


def _restore(instance) -> None:
    originals = vars(instance).pop(ORIGINALS, None)
    for attribute, original in (originals or {}).items():
        if original is None:
            vars(instance).pop(attribute, None)
        else:
            setattr(instance, attribute, original)
