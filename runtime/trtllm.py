"""Where runtime/ reaches TensorRT-LLM: everything of it lives in plugins/trtllm/ (the
configuration writers in config.py, the launch in launch.py); this module only names them
for the runtime's callers (runtime/commands/generate.py, runtime/serve/repository.py)."""

from plugins.trtllm import pins  # noqa: F401
from plugins.trtllm.config import (DRAFTER_DIR, FAMILIES, LLM_API_CONFIG, ConfigFieldError,  # noqa: F401
                                   check_fields, family_settings, llm_api_config, llm_api_yaml, model_yaml,
                                   to_yaml, world_sizes, write_drafter_dir)
from plugins.trtllm.launch import (Launch, LaunchError, build_llm, generate, installed_version,  # noqa: F401
                                   refuse_inexact, require_tensorrt_llm)
