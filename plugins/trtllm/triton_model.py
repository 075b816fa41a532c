"""SharpDraft in front of TensorRT-LLM's stock llmapi Triton model (Python backend).

Copied into <repository>/<name>/1/model.py by `python -m runtime serve --backend trtllm`.
TritonPythonModel below is the stock class with one change, around initialize():

- before the stock initialize() imports TensorRT-LLM and builds `LLM(**model.yaml)`:
  SharpDraft's launch (plugins/trtllm/launch.py) -- the release and structure check, the
  refusals in one line, the drafter directory's own SharpDraft parameters, the hook in this
  (Triton stub) process. The LLM API's MPI worker, which builds the drafter, is reached by
  the .pth lazy hook where it is installed (stock LLM() spawns one even on one GPU unless
  TLLM_WORKER_USE_SINGLE_PROCESS is set; this model sets it for one GPU only where the
  autoloader is not installed, and says why, unless you set it);
- after it: the proof that a drafter was wrapped on every rank, then one short request of
  ours through the stock model's LLM and the device counts of scaled calls, which must
  have grown on every wrapped layer, else the model refuses to load with one line. The
  applied scaling and counts are logged and kept as `sharpdraft_applied` (written to
  sharpdraft_applied.json beside this file for clients and health checks).

An engine built without --sharpdraft (frozen drafter) needs none of this: its model.yaml
names the stock checkpoint, which no hook scales. Our code is loaded from the checkout
under one private package name (nothing is put on sys.path); the stock model is looked
for in 1/llmapi/ (copied by --llmapi-model), then in $SHARPDRAFT_LLMAPI_MODEL (TensorRT-LLM's
triton_backend/all_models/llmapi/tensorrt_llm or its 1/ folder), and its `helpers` module
is loaded from beside it.
"""

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STOCK_ENV = "SHARPDRAFT_LLMAPI_MODEL"
SETTINGS = json.loads((HERE / "sharpdraft.json").read_text())
APPLIED = "sharpdraft_applied.json"
PRIVATE = "_sharpdraft_plugins"  # autoload.PRIVATE: the one name our code loads under here


def _load(name, path, package=False):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(Path(path).parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _plugins():
    """This checkout's plugins/ package, loaded under PRIVATE."""
    if PRIVATE not in sys.modules:
        root = (HERE / SETTINGS["repo_root"]).resolve()
        _load(PRIVATE, root / "plugins" / "__init__.py", package=True)
    return importlib.import_module(PRIVATE + ".trtllm.launch")


def _launch():
    """The SharpDraft launch for this model's engine, or None for a frozen engine."""
    scaling = SETTINGS.get("query_scaling")
    if not scaling:  # an engine built without --sharpdraft: the drafter runs frozen
        return None
    import yaml

    launch = _plugins()
    scaling_module = importlib.import_module(PRIVATE + ".scaling")
    config = yaml.safe_load((HERE / "model.yaml").read_text())
    config.pop("triton_config", None)
    # the drafter family, as serve read it from the spec (this process reads no engine.json);
    # a repository written before serve handed it down says so
    if "drafter" not in SETTINGS:
        raise launch.LaunchError(f"{HERE / 'sharpdraft.json'} names no drafter family — regenerate the "
                                 "repository with `python -m runtime serve --backend trtllm`")
    result = launch.Launch(scaling_module.QueryScaling.from_dict(scaling), config, SETTINGS["drafter"])
    for key, value in result.env().items():
        os.environ.setdefault(key, value)
    # the stock initialize() builds LLM(**model.yaml): the gate on the LLM class hands it this
    # launch's drafter view (whose config carries the proof directory); the probe runs below
    try:
        result.gate(probe=False)
    except ImportError:
        result.close()
        raise
    return result


def _stock_model():
    candidates = [HERE / "llmapi" / "model.py"]
    if os.environ.get(STOCK_ENV):
        base = Path(os.environ[STOCK_ENV])
        candidates += [base / "model.py", base / "1" / "model.py"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ImportError(f"TensorRT-LLM's llmapi model.py was not found in {HERE / 'llmapi'} or "
                          f"${STOCK_ENV} — regenerate with --llmapi-model DIR or set {STOCK_ENV}")
    if (path.parent / "helpers.py").is_file() and "helpers" not in sys.modules:
        _load("helpers", path.parent / "helpers.py")  # it imports `helpers` from beside itself
    return _load("sharpdraft_llmapi_stock", path)


_stock = _stock_model()


class TritonPythonModel(_stock.TritonPythonModel):
    """TensorRT-LLM's llmapi model; SharpDraft's launch around its initialize()."""

    def initialize(self, args):
        launch = _launch()  # refuses in one line before TensorRT-LLM builds anything
        try:
            if launch is None:
                result = super().initialize(args)
            else:
                with launch.built():  # a drafter the hook could not scale stops it: our one line
                    result = super().initialize(args)
        except BaseException:
            if launch is not None:
                launch.close()
            raise
        self.sharpdraft_applied = None
        if launch is None:
            return result
        try:
            llm = getattr(self, "llm", None)
            if llm is None:
                raise _plugins().LaunchError("the stock llmapi model keeps no .llm: SharpDraft cannot send "
                                             "the request that proves its drafter runs scaled")
            self.sharpdraft_applied = launch.probe(llm)
        except Exception:
            try:
                self.finalize()  # stop the engine the stock initialize() started
            except Exception:
                pass
            launch.close()
            raise
        self._sharpdraft_launch = launch
        (HERE / APPLIED).write_text(json.dumps(self.sharpdraft_applied, sort_keys=True) + "\n")
        sys.stderr.write(json.dumps({"sharpdraft_applied": self.sharpdraft_applied}) + "\n")
        return result

    def finalize(self):
        result = super().finalize() if hasattr(super(), "finalize") else None
        launch = getattr(self, "_sharpdraft_launch", None)
        if launch is not None:
            launch.close()
            self._sharpdraft_launch = None
        return result
