"""The KV cache layout: groups and tensor shapes derive from per-layer layouts."""

from __future__ import annotations

from deepinfer.engine.kv_layout import FULL, LATENT, SLIDING, KVCacheLayout, KVGroup, LayerKVLayout
from deepinfer.engine.model_config import ModelConfig


def gemma_like() -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 12,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "vocab_size": 100, "sliding_window": 32,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2})


def test_groups_put_full_layers_first_then_the_window():
    layout = gemma_like().kv_cache_layout()
    assert layout.groups() == (KVGroup(FULL, None, (5, 11), 2),
                             KVGroup(SLIDING, 32, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 10))
    assert [layout.group_of(i) for i in (0, 5, 6, 11)] == [1, 0, 1, 0]
    assert layout.layers_of(FULL) == [5, 11]


def test_entry_shapes_and_bytes_follow_the_layers():
    layout = gemma_like().kv_cache_layout()
    assert layout.layers[0].entry_shapes() == ((1, 16), (1, 16))
    assert layout.bytes_per_token(4) == 12 * 2 * 16 * 4
    assert layout.bytes_per_token(4, layout.layers_of(FULL)) == 2 * 2 * 16 * 4


def test_mla_layers_keep_a_latent_and_a_rope_key_in_the_full_group():
    """DeepSeek-V3: one 512-wide latent and one 64-wide rotary key per token and layer (not
    128 heads x (192 + 128)); its layers are full-attention layers for the scheduler."""
    cfg = ModelConfig.from_hf(dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=128, vocab_size=100,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        moe_intermediate_size=32, n_shared_experts=2))
    layout = cfg.kv_cache_layout()
    assert layout.layers[0].entry == LATENT
    assert layout.layers[0].entry_shapes() == ((1, 64), (1, 512))
    assert layout.bytes_per_token(2) == 3 * (512 + 64) * 2
    assert [(g.kind, g.layers) for g in layout.groups()] == [(FULL, (0, 1, 2))]
    assert cfg.mlp_only_layers == (0,) and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert cfg.router == "grouped_sigmoid" and cfg.shared_expert_intermediate_size == 64


def test_layers_with_other_windows_get_their_own_group():
    layout = KVCacheLayout((LayerKVLayout(SLIDING, 2, 8, 16), LayerKVLayout(FULL, 2, 8),
                        LayerKVLayout(SLIDING, 2, 8, 64), LayerKVLayout(SLIDING, 2, 8, 16)))
    assert [(g.kind, g.window, g.layers) for g in layout.groups()] == [
        (FULL, None, (1,)), (SLIDING, 16, (0, 3)), (SLIDING, 64, (2,))]
