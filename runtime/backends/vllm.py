"""The vllm backend's loader (runtime/backends/__init__.py: LOADERS): an engine built for
vLLM (`build_engine.py --backend vllm`) is configuration that vLLM runs in its own loop, in
its own environment, with SharpDraft's plugin where the drafter directory asks for it
(plugins/vllm/). Its capability says so (runtime/modes.py BACKENDS: own_loop), so the
commands ask the spec, never the backend's name; what it hands out is that loop."""

from __future__ import annotations

from pathlib import Path

from runtime.manifest import Manifest, resolve_path


class VLLMLoop:
    """A vllm engine directory: vLLM's LLM with the engine's speculative_config, the
    SharpDraft drafter (or the stock checkpoint, frozen). Nothing is loaded until a prompt
    runs (generate), in vLLM's environment."""

    def __init__(self, engine_dir: str | Path, manifest: Manifest, drafting=None):
        self.dir, self.manifest = Path(engine_dir), manifest

    @staticmethod
    def takes_window(manifest: Manifest) -> bool:
        return False  # vLLM's drafters take no draft window

    def drafter_dir(self, sharpdraft: bool) -> Path:
        """The drafter vLLM loads: the engine's SharpDraft directory, or the stock checkpoint
        for a frozen run (extra.vllm.stock_drafter)."""
        if sharpdraft:
            return self.manifest.drafter_dir
        return resolve_path(self.manifest.extra["vllm"]["stock_drafter"])

    def speculative_config(self, sharpdraft: bool, speculative: bool) -> dict | None:
        if not speculative:
            return None
        return self.manifest.extra["vllm"]["speculative"] | {"model": str(self.drafter_dir(sharpdraft).resolve())}

    def generate(self, prompt: str, max_new_tokens: int, sampling, sharpdraft: bool,
                 speculative: bool) -> dict:
        """One prompt through vLLM: text, token ids, its speculative statistics and what the
        proof check saw (sharpdraft_applied)."""
        from plugins.vllm import launch

        scaling = self.manifest.query_scaling if sharpdraft else None
        run = {"name": "generate", "speculative_config": self.speculative_config(sharpdraft, speculative),
               "sharpdraft_proof": str(launch.proof_dir(self.drafter_dir(True))) if scaling else None,
               "scaling": scaling.to_dict() if scaling else None}
        job = {"target": str(self.manifest.target_dir), "max_model_len": self.manifest.extra["max_seq_len"],
               "max_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
               "seed": sampling.seed, "ignore_eos": False, "prompts": [prompt], "runs": [run]}
        try:
            answer = launch.run_job(job)["runs"][0]
        except launch.LaunchError as exc:
            from runtime.manifest import EngineError

            raise EngineError(str(exc)) from None
        done = answer["prompts"][0]
        stats = done["spec"]
        mal = 1 + stats["accepted"] / stats["drafts"] if stats["drafts"] else None
        return {"text": done["text"], "tokens": done["tokens"], "speculation": stats,
                "mean_accepted_length": mal,
                "sharpdraft_applied": answer.get("sharpdraft_proof", {"sharpdraft": False})}
