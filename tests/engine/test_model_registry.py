"""The architecture registry (engine/model_registry.py): each entry's model class exists,
each model_type names one architecture, and the family facts reach ModelConfig."""

from __future__ import annotations

import importlib

import pytest

from deepinfer.engine.model_config import ModelConfig, ModelConfigError
from deepinfer.engine.model_registry import ARCHITECTURES, architecture

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100)


def test_every_entry_names_a_model_class_and_its_model_types_once():
    seen = {}
    for name, entry in ARCHITECTURES.items():
        module, cls = entry.model_class.split(":")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name
        for model_type in entry.model_types:
            assert seen.setdefault(model_type, name) == name
    assert {"llama", "qwen2", "gemma3_text", "deepseek_v3"} <= set(seen)


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(ModelConfigError, match="'GPT2LMHeadModel' is not supported"):
        architecture("GPT2LMHeadModel")


@pytest.mark.parametrize(("model_type", "facts"), [
    ("llama", {"architecture": "LlamaForCausalLM", "qkv_bias": False, "qk_norm": False}),
    ("qwen2", {"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "o_proj_bias": False}),
    ("qwen3", {"architecture": "Qwen3ForCausalLM", "qk_norm": True}),
    ("gemma3_text", {"architecture": "Gemma3ForCausalLM", "norm_offset": 1.0,
                     "embed_scale": 8.0, "qk_norm": True}),
])
def test_a_config_without_architectures_takes_its_model_types_facts(model_type, facts):
    cfg = ModelConfig.from_hf(dict(BASE, model_type=model_type))
    assert {k: getattr(cfg, k) for k in facts} == facts
