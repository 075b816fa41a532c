"""SharpDraft in front of TensorRT-LLM's stock llmapi Triton model (Python backend).

Copied into <repository>/<name>/1/model.py by `python -m runtime serve --backend trtllm`.
At import, before anything imports tensorrt_llm (the stock model defers that import to
initialize()), it installs SharpDraft's hook with the engine's QueryScaling from
sharpdraft.json beside it, and exports SHARPDRAFT_TRTLLM so TensorRT-LLM's worker
processes install it too where the .pth autoloader is set up (docs/trtllm.md). Then it
loads the stock model and serves it unchanged: TritonPythonModel below is the stock
class. model.yaml beside this file is what the stock model passes to LLM().

The stock model is looked for in 1/llmapi/ (copied by --llmapi-model), then in the
directory named by $SHARPDRAFT_LLMAPI_MODEL (TensorRT-LLM's
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


def _install_hook():
    scaling = SETTINGS.get("query_scaling")
    if not scaling:  # an engine built without --sharpdraft: the drafter runs frozen
        return
    root = str((HERE / SETTINGS["repo_root"]).resolve())
    if root not in sys.path:
        sys.path.append(root)  # appended: the server's own packages keep precedence
    from plugins.scaling import QueryScaling
    from plugins.trtllm import autoload, install

    scaling = QueryScaling.from_dict(scaling)
    os.environ[autoload.ENV] = autoload.env_value(scaling)
    install(scaling)


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


_install_hook()
_stock = _stock_model()


class TritonPythonModel(_stock.TritonPythonModel):
    """TensorRT-LLM's llmapi model, unchanged: SharpDraft lives in the hook installed above."""
