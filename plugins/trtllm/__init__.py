"""SharpDraft inside TensorRT-LLM (PyTorch backend): the drafter-attention hook.

    from plugins.trtllm import install
    install(QueryScaling(ref_keys=2048))   # before tensorrt_llm builds the drafter
    llm = tensorrt_llm.LLM(model, speculative_config=...)

Modules: pins.py (every TensorRT-LLM name relied on, with its source and commit),
kernels.py (DFlash's attention kernels, wrapped), rope.py (generic Attention.apply_rope,
wrapped per drafter instance: EAGLE-3, PARD), hook.py (install/uninstall, import hook,
version guard), versions.py (release ranges), proof.py (what each process that built a
drafter reports, and the launcher's check), autoload.py (the .pth loader for worker
processes: activation file or environment),
__main__.py (`python -m plugins.trtllm check | autoload ...`).
"""

from plugins.trtllm.hook import TrtllmHookError, active_scaling, disabled, install, installed, uninstall

__all__ = ["TrtllmHookError", "active_scaling", "disabled", "install", "installed", "uninstall"]
