"""SharpDraft in front of TensorRT-LLM's stock llmapi Triton model (Python backend).

Copied into <repository>/<name>/1/model.py by `python -m runtime serve --backend trtllm`.
TritonPythonModel below is the stock class with one change, around initialize():

- before the stock initialize() imports TensorRT-LLM and builds `LLM(**model.yaml)`:
  SharpDraft's launch (runtime.trtllm.Launch) — the version guard and the refusals in one
  line, the hook in this (Triton stub) process, and, where the .pth autoloader is
  installed, the activation file that reaches the LLM API's MPI worker, which builds the
  drafter (stock LLM() spawns one even on one GPU unless TLLM_WORKER_USE_SINGLE_PROCESS
  is set; this model sets it for one GPU unless you did);
- after it: the proof that a drafter was wrapped where it runs, else the model refuses to
  load with one line ("SharpDraft was requested but no drafter was wrapped in the worker
  processes: ..."). The applied scaling is logged and kept as `sharpdraft_applied`
  (written to sharpdraft_applied.json beside this file for clients and health checks).

An engine built without --sharpdraft (frozen drafter) needs none of this. model.yaml
beside this file is what the stock model passes to LLM(). The stock model is looked for
in 1/llmapi/ (copied by --llmapi-model), then in $SHARPDRAFT_LLMAPI_MODEL (TensorRT-LLM's
triton_backend/all_models/llmapi/tensorrt_llm or its 1/ folder).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STOCK_ENV = "SHARPDRAFT_LLMAPI_MODEL"
SETTINGS = json.loads((HERE / "sharpdraft.json").read_text())
APPLIED = "sharpdraft_applied.json"


def _checkout():
    root = str((HERE / SETTINGS["repo_root"]).resolve())
    if root not in sys.path:
        sys.path.append(root)  # appended: the server's own packages keep precedence


def _launch():
    """runtime.trtllm.Launch for this model's engine, or None for a frozen engine."""
    scaling = SETTINGS.get("query_scaling")
    _checkout()
    from runtime import trtllm

    if not scaling:  # an engine built without --sharpdraft: the drafter runs frozen
        trtllm.stand_down()  # and no activation left by a dead launch reaches its workers
        return None
    import yaml

    from plugins.scaling import QueryScaling
    from runtime.manifest import read_manifest

    config = yaml.safe_load((HERE / "model.yaml").read_text())
    config.pop("triton_config", None)
    family = drafter_dir = None
    engine_dir = SETTINGS.get("engine_dir")
    if engine_dir and (Path(engine_dir) / "engine.json").is_file():
        manifest = read_manifest(engine_dir)
        family, drafter_dir = manifest.drafter, manifest.drafter_dir
    launch = trtllm.Launch(QueryScaling.from_dict(scaling), config, family, drafter_dir)
    for key, value in launch.env().items():
        os.environ.setdefault(key, value)
    return launch


def _stock_model():
    candidates = [HERE / "llmapi" / "model.py"]
    if os.environ.get(STOCK_ENV):
        base = Path(os.environ[STOCK_ENV])
        candidates += [base / "model.py", base / "1" / "model.py"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ImportError(f"TensorRT-LLM's llmapi model.py was not found in {HERE / 'llmapi'} or "
                          f"${STOCK_ENV} — regenerate with --llmapi-model DIR or set {STOCK_ENV}")
    sys.path.insert(0, str(path.parent))  # it imports `helpers` from beside itself
    spec = importlib.util.spec_from_file_location("sharpdraft_llmapi_stock", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_stock = _stock_model()


class TritonPythonModel(_stock.TritonPythonModel):
    """TensorRT-LLM's llmapi model; SharpDraft's launch around its initialize()."""

    def initialize(self, args):
        launch = _launch()  # refuses in one line before TensorRT-LLM builds anything
        try:
            result = super().initialize(args)
        except BaseException:
            if launch is not None:
                launch.close()
            raise
        self.sharpdraft_applied = None
        if launch is None:
            return result
        try:
            self.sharpdraft_applied = launch.require()
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
