"""Model registry: HF `architectures` name -> the model class, imported only when used."""

from __future__ import annotations

import importlib

from deepinfer.engine.model_config import ModelConfigError

# architecture -> "module:class" (one module per model family)
ARCHITECTURES = {
    "LlamaForCausalLM": "deepinfer.workers.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "deepinfer.workers.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "deepinfer.workers.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "deepinfer.workers.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "deepinfer.workers.models.moe:MoeForCausalLM",
    "Qwen2MoeForCausalLM": "deepinfer.workers.models.moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "deepinfer.workers.models.moe:MoeForCausalLM",
    "Gemma3ForCausalLM": "deepinfer.workers.models.gemma3:Gemma3ForCausalLM",
    "DeepseekV3ForCausalLM": "deepinfer.workers.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "deepinfer.workers.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def model_class(architecture: str) -> type:
    target = ARCHITECTURES.get(architecture)
    if target is None:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
