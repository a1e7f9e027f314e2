"""Model registry: HF `architectures` name -> model class."""

from __future__ import annotations

from workers.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str):
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported (supported: {sorted(MODELS)})"
        ) from None
