"""The trtllm backend's loader (runtime/backends/__init__.py: LOADERS): an engine built for
TensorRT-LLM is configuration (plugins/trtllm/config.py) that TensorRT-LLM runs in its own
decode loop, with SharpDraft's hook installed where the drafter runs (plugins/trtllm/).
Its capability says so (runtime/modes.py BACKENDS: own_loop), so the commands ask the
spec, never the backend's name; what it hands out is that loop, not our roles."""

from __future__ import annotations

from pathlib import Path

from runtime.manifest import Manifest


class TensorRTLLMLoop:
    """A trtllm engine directory: TensorRT-LLM's LLM with its speculative_config, SharpDraft's
    hook installed first. Nothing is loaded until a prompt runs (generate)."""

    def __init__(self, engine_dir: str | Path, manifest: Manifest, drafting=None):
        self.dir, self.manifest = Path(engine_dir), manifest

    @staticmethod
    def takes_window(manifest: Manifest) -> bool:
        return False  # TensorRT-LLM's drafters take no draft window

    def generate(self, prompt: str, max_new_tokens: int, sampling, sharpdraft: bool,
                 speculative: bool) -> dict:
        """One prompt through TensorRT-LLM: text, token ids, its speculative statistics and
        what the proof check saw (sharpdraft_applied: drafter, layers, processes)."""
        from plugins.trtllm.launch import generate

        return generate(self.manifest, prompt, max_new_tokens, sampling.temperature,
                        sampling.top_p, sampling.seed, sharpdraft=sharpdraft,
                        speculative=speculative)

    def model_yaml(self, decoupled: bool) -> str:
        """The LLM() arguments TensorRT-LLM's llmapi Triton model reads (1/model.yaml)."""
        from plugins.trtllm.config import llm_api_config, model_yaml

        return model_yaml(llm_api_config(self.manifest), self.dir, decoupled=decoupled)
