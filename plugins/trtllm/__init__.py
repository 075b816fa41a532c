"""SharpDraft inside TensorRT-LLM (PyTorch backend): the drafter-attention hook.

The drafter directory is the switch: `build_engine.py --backend trtllm --sharpdraft`
writes one whose config.json carries SharpDraft's parameters; the hook scales a drafter
built from such a directory with exactly those parameters, and nothing else.

    from plugins.trtllm import install
    install()                       # before tensorrt_llm builds the drafter
    llm = tensorrt_llm.LLM(model, speculative_config={..., "speculative_model": DRAFTER_DIR})

Modules: the hook, loaded inside TensorRT-LLM's processes (under a private package name
when the .pth's lazy finder loads it, so it imports only relatively): pins.py (every
TensorRT-LLM name relied on, with its source and commit), hook.py (install/uninstall,
import hook, structure checks when a drafter is built, one hook per process), kernels.py (DFlash's attention kernels,
wrapped), rope.py (generic Attention.apply_rope, wrapped per drafter instance: EAGLE-3,
PARD), versions.py, proof.py (what each process that built a drafter reports, and its device counts of
scaled calls),
autoload.py (the .pth's lazy import hook). Around it, for our own launchers and tools
(never loaded by the hook): structure.py (the installed release's names, read from its
source files), standins.py (plain-torch stand-ins of the kernels, for tests and
scripts/gpu_trtllm.py), __main__.py (`python -m plugins.trtllm check | autoload ...`).
"""

from .hook import TrtllmHookError, disabled, drafter_scaling, install, installed, uninstall

__all__ = ["TrtllmHookError", "disabled", "drafter_scaling", "install", "installed", "uninstall"]
