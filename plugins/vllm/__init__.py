"""SharpDraft inside vLLM: a general plugin, keyed on the drafter directory.

The drafter directory is the switch, as for TensorRT-LLM (plugins/trtllm/): `build_engine.py
--backend vllm --sharpdraft` writes one whose config.json names the architecture
`DFlashSharpDraftModel` and carries SharpDraft's parameters under "sharpdraft". vLLM loads
the project's installed distribution's `vllm.general_plugins` entry point in every process
it starts (pyproject.toml: `pip install .` installs this folder's package under the private
name `sharpdraft_plugins`, never a checkout on sys.path); `register()` maps that one
architecture to `SharpDraftDFlash` (models.py), a subclass of vLLM's own DFlash drafter
(the proposer checks isinstance), which wraps each draft layer's attention so that every
query row is multiplied by beta(N) of the keys it sees. Stock drafters (`DFlashDraftModel`)
and every other model vLLM serves are untouched: register() names one architecture and
imports nothing of vLLM's model code.

Modules: pins.py (every vLLM name relied on, with the file and release it was read from,
and the structure checks), scaled.py (the wrapped attention call: N per row from vLLM's
own attention metadata, beta from plugins/scaling.py, a device-side count; no host read,
so CUDA graphs capture it), models.py (the drafter class, imported only by vLLM when it
builds a SharpDraft drafter), launch.py (our launcher's side: the vLLM command line, the
proof check; runs in our environment, imports no vLLM).
"""

ARCHITECTURE = "DFlashSharpDraftModel"  # vLLM keeps names that start with "DFlash" as they are


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM calls it in every process it starts,
    possibly more than once): map ARCHITECTURE to our drafter class, lazily (a
    "module:class" string, so no vLLM model code is imported here)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}.models:SharpDraftDFlash")
