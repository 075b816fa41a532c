"""install() / uninstall(): SharpDraft inside TensorRT-LLM's drafters, keyed on the drafter.

The switch is the drafter artifact, not the process: a drafter is scaled if and only if
the config it is built from carries SharpDraft's parameters (`"sharpdraft": {QueryScaling}`
in the drafter directory's config.json, written by `build_engine.py --backend trtllm
--sharpdraft`), and then with exactly those parameters. TensorRT-LLM hands that config to
the drafter's constructor: `ModelConfig.from_pretrained(speculative_model)` loads the
directory's config.json through transformers (unknown keys become attributes of
`pretrained_config`) and the registered builder calls `DFlashForCausalLM(draft_config, ...)`,
`Eagle3ForCausalLM(draft_config, ...)`, `PARDForCausalLM(draft_config)`
(pins.SOURCES["draft_config"], ["modeling_dflash"]). A stock drafter directory is never
touched, whatever else runs on the host, and two drafters in one process each get their
own parameters.

Nothing here imports TensorRT-LLM. `install()` puts an import hook at the front of
sys.meta_path that patches the drafter modules the moment they finish loading (and
patches them at once if they are loaded already).

What gets patched (names and sources: plugins/trtllm/pins.py, PATCH_POINTS):
- `DFlashForCausalLM.__init__` (modeling_dflash, or modeling_speculative in the older
  layout) and known subclasses (`DFlashLagunaForCausalLM`, wrapped when it overrides only
  the audited methods, pins.DFLASH_AUDITED_OVERRIDES): the attention kernel the instance
  holds (VANILLA / TRTLLM / FA4) is wrapped (plugins/trtllm/kernels.py).
- `Eagle3ForCausalLM.__init__`, `PARDForCausalLM.__init__`: `forward` and `apply_rope` of
  every `Attention` instance inside the drafter are wrapped (plugins/trtllm/rope.py), with
  the TRTLLM attention backend only (pins.AUDITED_ATTN_BACKENDS; FLASHINFER's draft view
  and the others are refused when the drafter is built, and by our launchers before).
- MLA drafters and drafter-named classes nobody audited are refused when built.

Compatibility is judged by structure: a release newer than the tested range is accepted
(one line on stderr names it untested) when every pinned name is present; a missing name
disables the hook, in one line naming it. Inside TensorRT-LLM's import and model
construction the hook never raises; refusals are recorded (plugins/trtllm/proof.py) and
our launchers refuse from there.

CUDA graphs: a captured graph keeps the beta constants (and the wrappers) it was captured
with. `uninstall()` restores the Python objects, but a graph captured before it keeps
scaling; changing a drafter's parameters means rebuilding the drafter directory and
restarting the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import os
import re
import sys
import weakref

from ..scaling import QueryScaling
from . import pins, proof, versions
from .kernels import (wrap_fa4_fwd, wrap_flash_attn_with_kvcache, wrap_trtllm_gen_context,
                                    wrap_trtllm_gen_decode)
from .rope import wrap_apply_rope, wrap_forward

__all__ = ["TrtllmHookError", "install", "uninstall", "installed", "disabled", "check_version",
           "drafter_scaling", "HOOK_MARK"]

ORIGINALS = "_sharpdraft_originals"  # instance attribute: what the hook replaced on it
FAMILY = "_sharpdraft_family"  # marks a constructor the hook wrapped
SCALING = "_sharpdraft_scaling"  # instance attribute: the QueryScaling its own config carries
HOOK_MARK = "_sharpdraft_hook"  # on our import finder: the .pth's lazy loader stands aside


class TrtllmHookError(ImportError):
    """The hook cannot vouch for this TensorRT-LLM installation (one line).

    An ImportError, so the command line's one-line handling (runtime/cli.py) applies."""


class _State:
    def __init__(self):
        self.finder: _Finder | None = None
        self.classes: dict[tuple[str, str], tuple[type, object]] = {}  # -> (class, original __init__)
        self.instances: weakref.WeakSet = weakref.WeakSet()
        self.version: str | None = None
        self.disabled: str | None = None  # why the hook stood down in this process
        self.serial = 0  # drafters wrapped in this process (names their proof units)
        self.warned: str | None = None  # the untested release already named on stderr


_state = _State()


def installed() -> bool:
    return _state.finder is not None


def disabled() -> str | None:
    """Why the hook stood down in this process (None: it did not)."""
    return _state.disabled


def drafter_scaling(drafter) -> QueryScaling | None:
    """The QueryScaling a wrapped drafter applies (None: not wrapped, or the hook is off)."""
    return vars(drafter).get(SCALING) if installed() else None


def install() -> None:
    """Watch TensorRT-LLM's drafter modules (idempotent). Drafters built from now on whose
    config carries SharpDraft's parameters are scaled with those; others are untouched.
    Never raises for the installation it finds: see `disabled()`."""
    _state.disabled = None
    if _state.finder is None:
        _state.finder = _Finder()
        sys.meta_path.insert(0, _state.finder)
    for name in pins.WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)


def uninstall() -> None:
    """Undo what install did to Python objects: the import hook, the patched constructors,
    the wrappers on drafter instances built meanwhile (idempotent). A CUDA graph captured
    before this call keeps the scaled kernels it recorded: restart the engine to drop them."""
    if _state.finder is not None and _state.finder in sys.meta_path:
        sys.meta_path.remove(_state.finder)
    _state.finder = None
    for cls, original in _state.classes.values():
        cls.__init__ = original
    _state.classes.clear()
    for instance in list(_state.instances):
        _restore(instance)
    _state.instances = weakref.WeakSet()
    _state.version = None
    _state.disabled = None


# --- the version guard --------------------------------------------------------------------

def check_version(version: str | None, warn: bool = True) -> str:
    """version if the hook may run on it: at least pins.MIN_VERSION (older releases lack
    the drafters); newer than the tested range is allowed (with `warn`, one line on stderr
    says so): whether it works is decided by the pinned names being present, not by its
    number. TrtllmHookError (one line) otherwise."""
    if version is None:
        raise TrtllmHookError(f"TensorRT-LLM has no {pins.VERSION_MODULE}.__version__ — SharpDraft's hook "
                              "cannot tell which release it is in")
    try:
        older = versions.parse(version) < versions.parse(pins.MIN_VERSION)
    except ValueError:
        raise TrtllmHookError(f"TensorRT-LLM's version {version!r} is not a version number") from None
    if older:
        raise TrtllmHookError(f"TensorRT-LLM {version} is older than {pins.MIN_VERSION}, the first release "
                              "with the drafters SharpDraft's hook wraps")
    if warn and not versions.is_tested(version, pins.MIN_VERSION, pins.MAX_VERSION) and _state.warned != version:
        _state.warned = version
        sys.stderr.write(f"sharpdraft: TensorRT-LLM {version} is newer than the releases the hook was "
                         f"tested on ({versions.describe_range(pins.MIN_VERSION, pins.MAX_VERSION)}): "
                         "untested, accepted because every pinned name is present\n")
    return version


def _version() -> str:
    if _state.version is None:
        try:
            module = sys.modules.get(pins.VERSION_MODULE) or importlib.import_module(pins.VERSION_MODULE)
            _state.version = str(module.__version__)
        except (ImportError, AttributeError):
            _state.version = None
    # a stock run on an untested release hears nothing from us; the line comes with the
    # first SharpDraft drafter (prepare_drafter)
    return check_version(_state.version, warn=False)


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
        proof.record("disabled", drafter=None, reason=first)
    _state.disabled = first


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
    _sharpdraft_hook = True  # HOOK_MARK: autoload's lazy finder sees the hook is already here

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


def draft_config_of(args, kwargs):
    """The ModelConfig a drafter constructor was called with: its first positional argument
    or `draft_config=` / `model_config=` (pins.SOURCES["draft_config"], ["modeling_dflash"])."""
    for name in pins.DRAFT_CONFIG_ARGUMENTS:
        if name in kwargs:
            return kwargs[name]
    return args[0] if args else None


def sharpdraft_parameters(draft_config) -> dict | None:
    """The SharpDraft parameters the drafter's own config.json carries (its
    `pretrained_config.sharpdraft`), or None for a stock drafter."""
    pretrained = getattr(draft_config, pins.PRETRAINED_CONFIG, None)
    value = getattr(pretrained, pins.SHARPDRAFT_KEY, None)
    if value is None and isinstance(pretrained, dict):
        value = pretrained.get(pins.SHARPDRAFT_KEY)
    return value


def _after_init(original, family: str):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        outer = type(self).__init__
        if not installed() or (outer is not __init__ and hasattr(outer, FAMILY)):
            return  # hook off, or a patched subclass's constructor (running around us) decides
        draft_config = draft_config_of(args, kwargs)
        parameters = sharpdraft_parameters(draft_config)
        if parameters is None:
            return  # a stock drafter: never scaled, leaves no record
        try:
            scaling = QueryScaling.from_dict(dict(parameters))
            prepare_drafter(self, family, scaling, draft_config)
        except (TrtllmHookError, TypeError, ValueError, KeyError) as exc:
            # never raise out of TensorRT-LLM's model construction: recorded, and our
            # launchers refuse from the record
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            sys.stderr.write(f"sharpdraft: {type(self).__name__} runs WITHOUT SharpDraft: {reason}\n")
            proof.record("refused", drafter=type(self).__name__, family=family, reason=reason,
                         scaling=parameters if isinstance(parameters, dict) else None)

    setattr(__init__, FAMILY, family)
    return __init__


# --- drafter instances --------------------------------------------------------------------

def prepare_drafter(drafter, family: str, scaling: QueryScaling, draft_config=None) -> None:
    """Wrap what this drafter instance calls with `scaling` (idempotent), record one proof
    'wrapped' record and write one startup line. Raises TrtllmHookError (one line) where it
    cannot: a missing name, an MLA or unknown drafter, an unaudited attention backend or
    subclass, a configuration whose key count cannot be derived exactly."""
    if ORIGINALS in vars(drafter):
        return
    if not isinstance(scaling, QueryScaling):
        raise TypeError(f"prepare_drafter takes a QueryScaling, got {type(scaling).__name__}")
    if family == "mla":
        raise TrtllmHookError(f"{type(drafter).__name__} uses MLA (latent) attention, whose query path "
                              "SharpDraft does not wrap — build the drafter without --sharpdraft")
    if family == "unknown":
        raise TrtllmHookError(f"{type(drafter).__name__} is a drafter class SharpDraft's hook does not "
                              f"know (TensorRT-LLM {_state.version or '?'}; pinned: plugins/trtllm/pins.py)")
    if _state.version is not None:
        check_version(_state.version)  # one line on stderr, once, when the release is untested
    _state.serial += 1
    prefix = f"{type(drafter).__name__}#{_state.serial}"
    if family == "dflash":
        originals, units = _prepare_dflash(drafter, prefix, scaling)
    else:
        originals, units = _prepare_attention(drafter, family, prefix, scaling, draft_config)
    vars(drafter)[ORIGINALS] = originals
    vars(drafter)[SCALING] = scaling
    _state.instances.add(drafter)
    proof.record("wrapped", drafter=type(drafter).__name__, family=family, layers=len(units), units=units,
                 scaling=scaling.to_dict(), version=_state.version)
    sys.stderr.write(f"sharpdraft: rank {proof.rank()} pid {os.getpid()}: "
                     f"{type(drafter).__name__} ({family}), {len(units)} layer(s) wrapped, "
                     f"{scaling.describe()}\n")


def _getter(scaling: QueryScaling):
    """What a wrapper asks for its scale: this drafter's parameters while the hook is
    installed, None (pass through) once it is uninstalled."""
    return lambda: scaling if installed() else None


def _dflash_audit(drafter) -> None:
    """A DFlash subclass is wrapped only when every method it overrides was read and found
    outside the query path (pins.DFLASH_AUDITED_OVERRIDES: DFlashLagunaForCausalLM's gate,
    feature norm and weight loading); refused otherwise."""
    base = next((c for c in type(drafter).__mro__ if c.__name__ == pins.DFLASH_CLASS), None)
    if base is None:
        return
    for cls in type(drafter).__mro__:
        if cls is base:
            break
        extra = sorted(n for n, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod))
                       if n not in pins.DFLASH_AUDITED_OVERRIDES and not (n.startswith("__") and n != "__call__"))
        if extra:
            raise TrtllmHookError(f"{cls.__name__} overrides {', '.join(extra)} of {pins.DFLASH_CLASS}, which "
                                  "may change the query path: not audited for SharpDraft — refused")


class _LayerCounter:
    """Which DFlash draft layer a kernel call belongs to: the block decode calls the kernel
    once per draft layer, in order, within one drafter forward (modeling_dflash.py), so
    the i-th call since the forward began is layer i. Host-side Python only: under CUDA
    graphs it runs at capture, never at replay."""

    def __init__(self, units: list[str]):
        self.units = units
        self.calls = 0

    def reset(self):
        self.calls = 0

    def next_unit(self) -> str:
        unit = self.units[self.calls % len(self.units)]
        self.calls += 1
        return unit


def _counting_forward(forward, counter: _LayerCounter):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        counter.reset()
        return forward(*args, **kwargs)

    return wrapper


def _prepare_dflash(drafter, prefix: str, scaling: QueryScaling) -> tuple[dict, list[str]]:
    """Wrap the DFlash drafter's kernel; one proof unit per draft layer."""
    name = type(drafter).__name__
    _dflash_audit(drafter)
    backend = getattr(drafter, pins.DFLASH_BACKEND_ATTRIBUTE, None)
    layers = len(getattr(getattr(drafter, "model", None), "layers", None) or ()) or 1
    units = [f"{prefix}.layers.{i}" for i in range(layers)]
    counter = _LayerCounter(units)
    get = _getter(scaling)
    originals = {pins.DRAFTER_FORWARD: None}
    if backend is None:
        forward = getattr(drafter, pins.DFLASH_FORWARD, None)
        if forward is None:
            raise _missing(f"{name}.{pins.DFLASH_BACKEND_ATTRIBUTE} or {name}.{pins.DFLASH_FORWARD}")
        vars(drafter)[pins.DFLASH_FORWARD] = _with_wrapped_flash_attn(forward, get, counter)  # older layout
        originals[pins.DFLASH_FORWARD] = None
    else:
        attribute = pins.DFLASH_KERNELS.get(backend)
        if attribute is None:
            raise TrtllmHookError(f"TensorRT-LLM {_state.version or '?'}: DFlash attention_backend "
                                  f"{backend!r} has no SharpDraft wrapper (known: "
                                  f"{', '.join(pins.DFLASH_KERNELS)})")
        kernel = vars(drafter).get(attribute)
        if kernel is None:
            raise _missing(f"{name}.{attribute} (the {backend} attention kernel)")
        try:
            wrapped = _wrap_dflash_kernel(backend, kernel, name, attribute, get, counter)
        except TypeError as exc:  # a kernel whose signature cannot be read: refused, one line
            raise TrtllmHookError(str(exc).splitlines()[0]) from None
        setattr(drafter, attribute, wrapped)
        originals[attribute] = kernel
    forward = getattr(drafter, pins.DRAFTER_FORWARD, None)
    if forward is not None:
        vars(drafter)[pins.DRAFTER_FORWARD] = _counting_forward(forward, counter)
    return originals, units


def _wrap_dflash_kernel(backend, kernel, name, attribute, get, counter):
    unit = counter.next_unit
    if backend == "VANILLA":
        wrapped = wrap_flash_attn_with_kvcache(kernel, get, unit)
    elif backend == "FA4":
        wrapped = wrap_fa4_fwd(kernel, get, unit)
    else:  # TRTLLM: a frozen dataclass of flashinfer ops; wrap the two attention calls
        if not dataclasses.is_dataclass(kernel) or not all(
                hasattr(kernel, field) for field in pins.TRTLLM_GEN_FIELDS):
            raise _missing(f"{name}.{attribute}.{' / '.join(pins.TRTLLM_GEN_FIELDS)}")
        wrapped = dataclasses.replace(kernel, **{
            pins.TRTLLM_GEN_FIELDS[0]: wrap_trtllm_gen_decode(getattr(kernel, pins.TRTLLM_GEN_FIELDS[0]), get, unit),
            pins.TRTLLM_GEN_FIELDS[1]: wrap_trtllm_gen_context(getattr(kernel, pins.TRTLLM_GEN_FIELDS[1]), get,
                                                               unit)})
    return wrapped


def _with_wrapped_flash_attn(dflash_forward, get, counter):
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
            cache[original] = wrap_flash_attn_with_kvcache(original, get, counter.next_unit)
        setattr(module, pins.FLASH_ATTN_KERNEL, cache[original])
        counter.reset()
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


def _prepare_attention(drafter, family: str, prefix: str, scaling: QueryScaling,
                       draft_config=None) -> tuple[dict, list[str]]:
    name = type(drafter).__name__
    backend = getattr(draft_config, pins.ATTN_BACKEND_FIELD, None) or pins.AUDITED_ATTN_BACKENDS[0]
    if str(backend).upper() not in pins.AUDITED_ATTN_BACKENDS:
        raise TrtllmHookError(f"{name} runs on attn_backend {backend!r}: SharpDraft counts visible keys from "
                              f"the {', '.join(pins.AUDITED_ATTN_BACKENDS)} backend's metadata only (FLASHINFER "
                              "drafts on a separate draft view) — refused")
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
                                                             _getter(scaling), int(layer.q_size), layer, unit)
        _state.instances.add(layer)
        vars(layer)[ORIGINALS] = {pins.ATTENTION_METHOD: None, pins.ATTENTION_FORWARD: None}
    return {}, units


def _restore(instance) -> None:
    vars(instance).pop(SCALING, None)
    originals = vars(instance).pop(ORIGINALS, None)
    for attribute, original in (originals or {}).items():
        if original is None:
            vars(instance).pop(attribute, None)
        else:
            setattr(instance, attribute, original)
