"""Model registry: HF `architectures` name -> the model class, imported only when used."""

from __future__ import annotations

import importlib

from engine.model_config import ModelConfigError

# architecture -> "module:class" (one module per model family)
ARCHITECTURES = {
    "LlamaForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "workers.models.moe:MoeForCausalLM",
    "Qwen2MoeForCausalLM": "workers.models.moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "workers.models.moe:MoeForCausalLM",
    "Gemma3ForCausalLM": "workers.models.gemma3:Gemma3ForCausalLM",
    "DeepseekV3ForCausalLM": "workers.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "workers.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def model_class(architecture: str) -> type:
    target = ARCHITECTURES.get(architecture)
    if target is None:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
