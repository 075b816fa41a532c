"""The hook in TensorRT-LLM's worker processes, through a lazy import hook and nothing else.

TensorRT-LLM's LLM API builds the drafter in worker processes it spawns through mpi4py
(tensorrt_llm/llmapi/mpi_session.py, pins.SOURCES["mpi_session"]), not in the process that
called LLM() or trtllm-serve, so an `install()` there never reaches them. A `.pth` file in
site-packages runs in every interpreter of that environment, workers included.
`python -m plugins.trtllm autoload install` writes one line there that runs THIS file
(runpy.run_path: nothing is added to sys.path), which only puts a `LazyFinder` first on
sys.meta_path. Until a process imports one of TensorRT-LLM's drafter modules
(pins.WATCHED) the finder does nothing else; a process that never imports them -- every
ordinary Python process of the environment -- loads none of our code and gets none of our
names (`plugins`, `runtime`, `build` stay unimportable from this checkout).

When a drafter module is imported, the finder loads this checkout's `plugins/` package
under ONE private name (`_sharpdraft_plugins`, from its folder: the hook's modules import
each other relatively) and installs the hook, which from then on patches the drafter
modules as they load. The hook scales only drafters whose own config carries SharpDraft's
parameters (plugins/trtllm/hook.py): there is no activation file, nonce, pid file or
environment variable to select a launch, so a stock run beside a SharpDraft launch is
never scaled. Where our hook is already installed (our launchers, which import it under
its public name) the finder stands aside; where this finder loaded the private copy first,
a launcher's install() later defers to it (one hook per process, plugins/trtllm/hook.py).

It never raises: a failure is one line on stderr and the process goes on without the hook
(its launcher's proof check then refuses a SharpDraft launch, in one line).

Cost to every Python process of the environment: running this small file at start-up
(no imports beyond the standard library's already-loaded ones) and one name test per
import.
"""

import os
import sys

PTH_NAME = "sharpdraft_trtllm.pth"
PRIVATE = "_sharpdraft_plugins"  # the one name our code loads under in a foreign process
# The modules whose import wakes the finder: pins.WATCHED (a test keeps the two equal; this
# file imports nothing of ours, so it cannot read pins).
WATCHED = ("tensorrt_llm._torch.models.modeling_dflash", "tensorrt_llm._torch.models.modeling_speculative")
PLUGINS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's plugins/
HOOK_MARK = "_sharpdraft_hook"  # hook.HOOK_MARK: set on the hook's own finder


def pth_line(site=None) -> str:
    """The .pth line: site.py executes lines that start with `import`. Where this file is
    gone (the checkout moved or was deleted), the line says so in one line on stderr instead
    of site's "Error processing line 1" traceback."""
    where = os.path.join(str(site), PTH_NAME) if site is not None else PTH_NAME
    stale = (f"sharpdraft: {where} points at %s, which is gone (the checkout moved): remove it, or run "
             "`python -m plugins.trtllm autoload install` from the checkout\n")
    return (f"import os, runpy, sys; _sharpdraft = {os.path.abspath(__file__)!r}; "
            "runpy.run_path(_sharpdraft, run_name='sharpdraft_trtllm_autoload') if os.path.isfile(_sharpdraft) "
            f"else sys.stderr.write({stale!r} % _sharpdraft)\n")


def load_private():
    """This checkout's plugins/ package under PRIVATE (its hook modules), importing nothing
    under the public names."""
    import importlib.util

    module = sys.modules.get(PRIVATE)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            PRIVATE, os.path.join(PLUGINS, "__init__.py"), submodule_search_locations=[PLUGINS])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PRIVATE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[PRIVATE]
            raise
    return importlib.import_module(PRIVATE + ".trtllm")


class LazyFinder:
    """A meta-path finder that wakes on TensorRT-LLM's drafter modules only (first on
    sys.meta_path, so it is asked before the path finder that would load them)."""

    _sharpdraft_lazy = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: the hook's own finder takes over
        if any(getattr(f, HOOK_MARK, False) for f in sys.meta_path):
            return None  # our hook is installed already (a launcher of ours): it patches
        try:
            trtllm = load_private()
            trtllm.install()
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            sys.stderr.write(f"sharpdraft: hook not loaded in pid {os.getpid()}: {first}\n")
            return None
        for finder in sys.meta_path:
            if getattr(finder, HOOK_MARK, False):
                return finder.find_spec(fullname, path, target)
        return None


def activate() -> None:
    """Put one LazyFinder first on sys.meta_path (idempotent): what the .pth runs."""
    if not any(getattr(f, "_sharpdraft_lazy", False) for f in sys.meta_path):
        sys.meta_path.insert(0, LazyFinder())


def find_site():
    """The site-packages folder of this environment that holds our .pth (None: the
    autoloader is not installed)."""
    import sysconfig

    candidates = [sysconfig.get_paths()["purelib"], *[p for p in sys.path if p.endswith("-packages")]]
    for folder in dict.fromkeys(candidates):
        if os.path.isfile(os.path.join(folder, PTH_NAME)):
            return folder
    return None


if __name__ == "sharpdraft_trtllm_autoload":  # run from the .pth line
    try:
        activate()
    except Exception as exc:  # a broken file must not break every Python process
        sys.stderr.write(f"sharpdraft: lazy hook not added in pid {os.getpid()}: {exc}\n")
