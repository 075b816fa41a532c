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

Compatibility is judged by structure alone, never by a version number: when a SharpDraft
drafter is built, every name, signature and metadata field its count reads is checked on
the loaded modules, and a release outside the range we read (pins.READ_RANGE) is named
untested in one line. A SharpDraft drafter that cannot be scaled stops its own build: the
constructor raises UnscalableDrafter, whose message is one line of ours naming the reason
(also recorded, plugins/trtllm/proof.py, so our launchers print only that line) -- unless
its config asks to run frozen then (`"sharpdraft": {..., "if_unscalable": "frozen"}`):
one startup line, a `frozen` proof record and the launch's sharpdraft_frozen_drafters
metric say so. Stock drafters and stock runs hear nothing from the hook, whatever the
release. Importing TensorRT-LLM's modules never raises because of us.

One hook per process: the launcher's copy (`plugins.trtllm`) and the autoloader's private
copy (`_sharpdraft_plugins.trtllm`) may both be loaded; whichever installs first owns the
import finder and the patches, and the other's install() defers to it. A finder never
asks another SharpDraft finder, so neither order can recurse, and each drafter is wrapped
once (its instance carries the mark) and scaled once.

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
from .kernels import (wrap_dflash_hybrid, wrap_fa4_fwd, wrap_flash_attn_with_kvcache, wrap_trtllm_gen_context,
                      wrap_trtllm_gen_decode)
from .rope import wrap_apply_rope, wrap_forward

__all__ = ["TrtllmHookError", "UnscalableDrafter", "install", "uninstall", "installed", "disabled",
           "check_version", "drafter_scaling", "HOOK_MARK"]

ORIGINALS = "_sharpdraft_originals"  # instance attribute: what the hook replaced on it
FAMILY = "_sharpdraft_family"  # marks a constructor the hook wrapped
SCALING = "_sharpdraft_scaling"  # instance attribute: the QueryScaling its own config carries
TALLY = "_sharpdraft_tally"  # instance attribute: its device counter of scaled calls (proof.Tally)
HOOK_MARK = "_sharpdraft_hook"  # on our import finder: the .pth's lazy loader stands aside


class TrtllmHookError(ImportError):
    """The hook cannot vouch for this TensorRT-LLM installation (one line).

    An ImportError, so the command line's one-line handling (runtime/cli.py) applies."""


class UnscalableDrafter(RuntimeError):
    """Raised out of a SharpDraft drafter's constructor that the hook cannot scale: the
    build stops, and the error TensorRT-LLM reports ends with this one line of ours. (Not
    an ImportError: TensorRT-LLM's own fallbacks catch those.) It pickles as a plain
    RuntimeError with the same line: a worker's error reaches a launcher that never loaded
    the hook's copy (the autoloader's private one) intact."""

    def __reduce__(self):
        return RuntimeError, (str(self),)


class _State:
    def __init__(self):
        self.finder: _Finder | None = None
        self.delegate = None  # another copy's finder, installed first in this process: it does the work
        self.classes: dict[tuple[str, str], tuple[type, object]] = {}  # -> (class, original __init__)
        self.instances: weakref.WeakSet = weakref.WeakSet()
        self.version: str | None = None
        self.disabled: str | None = None  # what moved: SharpDraft drafters are refused when built
        self.serial = 0  # drafters wrapped in this process (names their proof units)
        self.warned: str | None = None  # the untested release already named on stderr


_state = _State()


def _other_hook():
    """Another copy's SharpDraft finder on sys.meta_path (the launcher's or the autoloader's)."""
    return next((f for f in sys.meta_path if getattr(f, HOOK_MARK, False) and not isinstance(f, _Finder)), None)


def installed() -> bool:
    """Whether a SharpDraft hook is active in this process (this copy's, or another copy's
    that installed first)."""
    return _state.finder is not None or (_state.delegate is not None and _state.delegate in sys.meta_path)


def disabled() -> str | None:
    """What a loaded drafter module lacks (the first such name; None: nothing moved): a
    SharpDraft drafter of the family it belongs to is refused when built, other families'
    are not. Stock drafters build either way."""
    return _state.disabled


def drafter_scaling(drafter) -> QueryScaling | None:
    """The QueryScaling a wrapped drafter applies (None: not wrapped, or the hook is off)."""
    return vars(drafter).get(SCALING) if installed() else None


def install() -> None:
    """Watch TensorRT-LLM's drafter modules (idempotent). Drafters built from now on whose
    config carries SharpDraft's parameters are scaled with those; others are untouched.
    Never raises for the installation it finds. Where another copy of the hook installed
    first (the autoloader's private one, or a launcher's), that one stays the only hook."""
    _state.disabled = None
    if _state.finder is None:
        other = _other_hook()
        if other is not None:
            _state.delegate = other
            return
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
    _state.delegate = None
    for cls, original in _state.classes.values():
        cls.__init__ = original
    _state.classes.clear()
    for instance in list(_state.instances):
        _restore(instance)
    _state.instances = weakref.WeakSet()
    _state.version = None
    _state.disabled = None
    proof.unguard_captures()


# --- the version guard --------------------------------------------------------------------

def check_version(version: str | None, warn: bool = True) -> str | None:
    """The release, never refused for its number: compatibility is decided by the names the
    hook reads. With `warn`, a release outside the range we read (pins.READ_RANGE), or one
    whose number cannot be read, gets one line on stderr naming it untested (once)."""
    label = version if version is not None else "(version unknown)"
    if (warn and not versions.is_tested(str(version), *pins.READ_RANGE) and _state.warned != label
            and os.environ.get(proof.UNTESTED_ENV) != label):  # our launcher named it already
        _state.warned = label
        sys.stderr.write(f"sharpdraft: TensorRT-LLM {label} is untested (read: "
                         f"{versions.describe_range(*pins.READ_RANGE)}); accepted because every name "
                         "SharpDraft reads is present\n")
    return version


def _version() -> str | None:
    if _state.version is None:
        try:
            module = sys.modules.get(pins.VERSION_MODULE) or importlib.import_module(pins.VERSION_MODULE)
            _state.version = str(module.__version__)
        except (ImportError, AttributeError):
            _state.version = None
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
    _sharpdraft_hook = True  # HOOK_MARK: autoload's lazy finder and the other copy see the hook is here

    def find_spec(self, fullname, path, target=None):
        if fullname not in pins.WATCHED:
            return None
        for finder in list(sys.meta_path):
            # never ask another SharpDraft finder (the other copy's hook, the lazy autoloader):
            # two of them asking each other is the recursion one hook per process rules out
            if (finder is self or getattr(finder, HOOK_MARK, False) or getattr(finder, "_sharpdraft_lazy", False)
                    or not hasattr(finder, "find_spec")):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _patch_module(module) -> None:
    """Patch the module's drafter classes (never raises: this runs inside `import
    tensorrt_llm...` of every process). A required name that moved does not stop the
    import: the drafter classes present are patched to refuse a SharpDraft drafter when it
    is built, naming what moved; stock drafters build as ever, and nothing is printed. What
    moved disables only its own drafter family: a renamed EAGLE-3 class does not stop a
    DFlash drafter defined beside it (the older layout) from being scaled."""
    _version()
    plan, drift = [], {}  # drift: family -> the first pinned name of it that moved
    for point in pins.PATCH_POINTS:
        if point.module != module.__name__:
            continue
        class_name = point.attribute.split(".")[0]
        cls = getattr(module, class_name, None)
        if cls is None:
            if point.required:
                drift.setdefault(point.family, f"{point.module}.{point.attribute}")
            continue
        if cls.__dict__.get("__init__") is None:
            drift.setdefault(point.family, f"{point.module}.{class_name}.__init__ (defined on the class itself)")
            continue
        plan.append((class_name, cls, point.family))
    known = {name for name, _, _ in plan} | {p.attribute.split(".")[0] for p in pins.PATCH_POINTS}
    for name, value in vars(module).items():  # drafter classes nobody pinned: refuse when built
        if (isinstance(value, type) and name not in known and re.search(pins.DRAFTER_CLASS_PATTERN, name)
                and getattr(value, "__module__", None) == module.__name__ and "__init__" in value.__dict__):
            plan.append((name, value, "unknown"))
    if drift:
        _state.disabled = f"{next(iter(drift.values()))} is missing"
    for class_name, cls, family in plan:
        key = (module.__name__, class_name)
        if key in _state.classes:
            continue
        original = cls.__dict__["__init__"]
        cls.__init__ = _after_init(original, family, drift.get(family))
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


def _after_init(original, family: str, moved: str | None = None):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        outer = type(self).__init__
        if not installed() or (outer is not __init__ and hasattr(outer, FAMILY)):
            return  # hook off, or a patched subclass's constructor (running around us) decides
        draft_config = draft_config_of(args, kwargs)
        parameters = sharpdraft_parameters(draft_config)
        if parameters is None:
            return  # a stock drafter: never scaled, leaves no record, hears nothing
        carried = dict(parameters) if isinstance(parameters, dict) else parameters
        policy = carried.pop(pins.IF_UNSCALABLE, None) if isinstance(carried, dict) else None
        # the launch's proof directory, carried in the drafter view's config (proof.py)
        where = carried.pop(pins.PROOF_KEY, None) if isinstance(carried, dict) else None
        try:
            if moved is not None:  # a pinned name of this drafter's family moved: refused, naming it
                raise _missing(moved)
            scaling = QueryScaling.from_dict(carried)
            prepare_drafter(self, family, scaling, draft_config, where)
        except (TrtllmHookError, TypeError, ValueError, KeyError, AttributeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            name = type(self).__name__
            if policy == proof.FROZEN:
                sys.stderr.write(f"sharpdraft: rank {proof.rank()} pid {os.getpid()}: {name} runs FROZEN "
                                 f"(its config says if_unscalable: frozen): {reason}\n")
                proof.record(proof.FROZEN, where, drafter=name, family=family, reason=reason, scaling=carried,
                             stage=pipeline_stage(draft_config))
                return
            proof.record("refused", where, drafter=name, family=family, reason=reason,
                         scaling=carried if isinstance(carried, dict) else None)
            raise UnscalableDrafter(f"sharpdraft: {name} carries SharpDraft's parameters but cannot be scaled: "
                                    f"{reason} (to run it frozen instead, set \"{pins.IF_UNSCALABLE}\": "
                                    f"\"{proof.FROZEN}\" in its config's \"{pins.SHARPDRAFT_KEY}\")") from None

    setattr(__init__, FAMILY, family)
    return __init__


# --- drafter instances --------------------------------------------------------------------

def pipeline_stage(draft_config) -> dict | None:
    """The drafter's pipeline stage, from TensorRT-LLM's own mapping on the config it is
    built from (ModelConfig.mapping: pp_rank, pp_size, is_last_pp_rank(); pins.MAPPING_STAGE):
    {pp_rank, pp_size, last}, or None where the config carries no readable mapping."""
    mapping = getattr(draft_config, pins.MAPPING_FIELD, None)
    rank_name, size_name, last_name = pins.MAPPING_STAGE
    try:
        return {"pp_rank": int(getattr(mapping, rank_name)), "pp_size": int(getattr(mapping, size_name)),
                "last": bool(getattr(mapping, last_name)())}
    except (AttributeError, TypeError, ValueError):
        return None


def prepare_drafter(drafter, family: str, scaling: QueryScaling, draft_config=None, where=None) -> None:
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
    check_version(_version())  # one line on stderr, once, when the release is outside what we read
    _state.serial += 1
    prefix = f"{type(drafter).__name__}#{_state.serial}"
    if family == "dflash":
        originals, tally = _prepare_dflash(drafter, prefix, scaling, where)
    else:
        _check_metadata_fields()
        originals, tally = _prepare_attention(drafter, family, prefix, scaling, draft_config, where)
    units = tally.units
    vars(drafter)[TALLY] = tally  # the counter lives as long as its drafter (proof.py keeps weak references)
    proof.start_reporter()  # answers the launcher's requests for the device counts
    vars(drafter)[ORIGINALS] = originals
    vars(drafter)[SCALING] = scaling
    _state.instances.add(drafter)
    proof.record("wrapped", tally.where, drafter=type(drafter).__name__, family=family, layers=len(units),
                 units=units, scaling=scaling.to_dict(), version=_state.version, stage=pipeline_stage(draft_config))
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


def _check_metadata_fields() -> None:
    """Drift, refused when the drafter is built: every AttentionMetadata field the EAGLE-3 /
    PARD count reads (pins.METADATA) must be on the loaded metadata classes (as a class
    attribute, a dataclass field or annotation, or set in their module's source)."""
    import inspect

    modules = []
    for name in pins.METADATA_MODULES:  # TensorRT-LLM's own modules, loaded by then in its processes
        try:
            modules.append(sys.modules.get(name) or importlib.import_module(name))
        except Exception:  # the other layout's path
            continue
    classes = [getattr(m, c) for m in modules for c in pins.METADATA_CLASSES if isinstance(getattr(m, c, None), type)]
    if not classes:
        raise _missing(f"{pins.METADATA_CLASSES[0]} (in {' or '.join(pins.METADATA_MODULES[::2])})")
    texts = []
    for module in modules:
        try:
            texts.append(inspect.getsource(module))
        except (OSError, TypeError):
            pass
    text = "\n".join(texts)
    for field in pins.METADATA.values():
        declared = any(hasattr(c, field) or any(field in vars(k).get("__annotations__", {}) for k in c.__mro__)
                       for c in classes)
        if not declared and not re.search(rf"\.{field}\b|\b{field}\s*[:=]", text):
            raise _missing(f"{pins.METADATA_CLASSES[0]}.{field} (read to count visible keys)")


def _layer_marks(drafter, name: str) -> list:
    """Tell DFlash's draft layers apart by the layer object: dflash_forward calls each draft
    layer's self_attn.qkv_proj on the block right before that layer's kernel call
    (pins.DFLASH_LAYER_QUERY), so a wrapper on that instance's forward names the layer the
    next kernel call serves. Host-side, it runs while a graph is captured or traced; the
    index it sets is baked into the captured counter op, so every replay counts its own
    layer. Returns [current index] (a cell the kernel wrapper reads)."""
    layers = list(getattr(getattr(drafter, "model", None), "layers", None) or ())
    if not layers:
        raise _missing(f"{name}.model.layers")
    current = [None]
    attribute, projection = pins.DFLASH_LAYER_QUERY
    for index, layer in enumerate(layers):
        module = getattr(getattr(layer, attribute, None), projection, None)
        if module is None or not callable(getattr(module, "forward", None)):
            raise _missing(f"{name}.model.layers[{index}].{attribute}.{projection}")
        vars(module)["forward"] = _marking(module.forward, current, index)
        _state.instances.add(module)
        vars(module)[ORIGINALS] = {"forward": None}
    return current


def _marking(forward, current: list, index: int):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        current[0] = index
        return forward(*args, **kwargs)

    return wrapper


def _counter(tally: proof.Tally, current: list):
    def count(like):
        tally.add(current[0], like)
        current[0] = None  # the next kernel call must be claimed by its own layer's projection

    return count


def _prepare_dflash(drafter, prefix: str, scaling: QueryScaling, where=None) -> tuple[dict, proof.Tally]:
    """Wrap every kernel the DFlash drafter can reach: the one its attention backend holds
    on the instance (or, in the oldest layout, flash_attn imported at call time) and the
    hybrid-context kernel of dflash_hybrid_attn where the release has it; one proof unit
    (device counter slot) per draft layer."""
    name = type(drafter).__name__
    _dflash_audit(drafter)
    backend = getattr(drafter, pins.DFLASH_BACKEND_ATTRIBUTE, None)
    current = _layer_marks(drafter, name)
    tally = proof.Tally([f"{prefix}.model.layers.{i}" for i in range(len(drafter.model.layers))], where)
    count = _counter(tally, current)
    get = _getter(scaling)
    originals: dict = {}
    swaps = _hybrid_sites(drafter, name, get, count, originals)
    if backend is None:  # oldest layout: dflash_forward imports flash_attn_with_kvcache at call time
        swaps.append((lambda: sys.modules.get(pins.FLASH_ATTN_MODULE)
                      or importlib.import_module(pins.FLASH_ATTN_MODULE), pins.FLASH_ATTN_KERNEL,
                      wrap_flash_attn_with_kvcache))
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
            wrapped = _wrap_dflash_kernel(backend, kernel, name, attribute, get, count)
        except TypeError as exc:  # a kernel whose signature cannot be read or moved: refused, one line
            raise TrtllmHookError(str(exc).splitlines()[0]) from None
        setattr(drafter, attribute, wrapped)
        originals[attribute] = kernel
    if swaps:
        forward = getattr(drafter, pins.DFLASH_FORWARD, None)
        if forward is None:
            raise _missing(f"{name}.{pins.DFLASH_FORWARD}")
        vars(drafter)[pins.DFLASH_FORWARD] = _swapping(forward, swaps, get, count)
        originals[pins.DFLASH_FORWARD] = None
    return originals, tally


def _hybrid_sites(drafter, name, get, count, originals) -> list:
    """Where the hybrid-context kernel (pins.DFLASH_HYBRID_KERNEL) can be reached from, as
    swaps for the drafter's forward: its module's attribute and every DFlash module global
    bound to it (no stored copy shows the caller, so every binding is covered); a drafter
    attribute holding it is wrapped on the instance. [] where the release has no such module.
    A public function of that module we do not know is an unknown DFlash kernel: refused."""
    module = sys.modules.get(pins.DFLASH_HYBRID_MODULE)
    if module is None:
        try:
            module = importlib.import_module(pins.DFLASH_HYBRID_MODULE)
        except Exception:  # absent from this release (or unimportable: then no drafter calls it)
            return []
    known = {pins.DFLASH_HYBRID_KERNEL, *pins.DFLASH_HYBRID_UNUSED}
    unknown = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__ and n not in known)
    if unknown:
        raise TrtllmHookError(f"{pins.DFLASH_HYBRID_MODULE} holds DFlash kernel(s) {', '.join(unknown)} that "
                              f"SharpDraft does not wrap: {name} could run one unscaled — refused")
    kernel = getattr(module, pins.DFLASH_HYBRID_KERNEL, None)
    if kernel is None:
        raise _missing(f"{pins.DFLASH_HYBRID_MODULE}.{pins.DFLASH_HYBRID_KERNEL}")
    try:
        wrap_dflash_hybrid(kernel, get, count)  # its signature is checked now, not at the first call
    except TypeError as exc:
        raise TrtllmHookError(str(exc).splitlines()[0]) from None
    for attribute, value in list(vars(drafter).items()):
        if value is kernel:
            setattr(drafter, attribute, wrap_dflash_hybrid(kernel, get, count))
            originals[attribute] = kernel
    holders = [module] + [sys.modules[m] for m in pins.WATCHED
                          if getattr(sys.modules.get(m), pins.DFLASH_HYBRID_KERNEL, None) is kernel]
    return [((lambda held=holder: held), pins.DFLASH_HYBRID_KERNEL, wrap_dflash_hybrid) for holder in holders]


def _wrap_dflash_kernel(backend, kernel, name, attribute, get, count):
    if backend == "VANILLA":
        wrapped = wrap_flash_attn_with_kvcache(kernel, get, count)
    elif backend == "FA4":
        wrapped = wrap_fa4_fwd(kernel, get, count)
    else:  # TRTLLM: a frozen dataclass of flashinfer ops; wrap the two attention calls
        if not dataclasses.is_dataclass(kernel) or not all(
                hasattr(kernel, field) for field in pins.TRTLLM_GEN_FIELDS):
            raise _missing(f"{name}.{attribute}.{' / '.join(pins.TRTLLM_GEN_FIELDS)}")
        wrapped = dataclasses.replace(kernel, **{
            pins.TRTLLM_GEN_FIELDS[0]: wrap_trtllm_gen_decode(getattr(kernel, pins.TRTLLM_GEN_FIELDS[0]), get, count),
            pins.TRTLLM_GEN_FIELDS[1]: wrap_trtllm_gen_context(getattr(kernel, pins.TRTLLM_GEN_FIELDS[1]), get,
                                                               count)})
    return wrapped


def _swapping(dflash_forward, swaps, get, count):
    """dflash_forward, during which each swap's module attribute -- a kernel DFlash looks
    up at call time (the oldest layout's `from flash_attn import ...` inside dflash_forward,
    the hybrid kernel's module global) -- is our wrapper of it, restored after (the target
    never calls these kernels; one model forward at a time). swaps: (module getter,
    attribute, wrap)."""
    cache = {}

    @functools.wraps(dflash_forward)
    def wrapper(*args, **kwargs):
        saved = []
        try:
            for module_of, attribute, wrap in swaps:
                module = module_of()
                original = getattr(module, attribute)
                if original not in cache:
                    cache[original] = wrap(original, get, count)
                setattr(module, attribute, cache[original])
                saved.append((module, attribute, original))
            return dflash_forward(*args, **kwargs)
        finally:
            for module, attribute, original in reversed(saved):
                setattr(module, attribute, original)

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
                       draft_config=None, where=None) -> tuple[dict, proof.Tally]:
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
    units = [f"{prefix}.{layer_name or 'self'}" for layer_name, _ in named]
    tally = proof.Tally(units, where)
    for index, (layer_name, layer) in enumerate(named):
        # Instance attributes shadow the class's methods for this layer only; the layer is the
        # wrapped instance itself, so its counter slot is exact.
        vars(layer)[pins.ATTENTION_FORWARD] = wrap_forward(getattr(layer, pins.ATTENTION_FORWARD), layer)
        vars(layer)[pins.ATTENTION_METHOD] = wrap_apply_rope(
            getattr(layer, pins.ATTENTION_METHOD), _getter(scaling), int(layer.q_size), layer,
            functools.partial(tally.add, index))
        _state.instances.add(layer)
        vars(layer)[ORIGINALS] = {pins.ATTENTION_METHOD: None, pins.ATTENTION_FORWARD: None}
    return {}, tally


def _restore(instance) -> None:
    vars(instance).pop(SCALING, None)
    vars(instance).pop(TALLY, None)
    originals = vars(instance).pop(ORIGINALS, None)
    for attribute, original in (originals or {}).items():
        if original is None:
            vars(instance).pop(attribute, None)
        else:
            setattr(instance, attribute, original)
