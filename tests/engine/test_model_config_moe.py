"""ModelConfig's mixture-of-experts fields from the config.json of each family."""

from __future__ import annotations

from deepinfer.engine.model_config import ModelConfig

BASE = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
            vocab_size=100)


def test_dense_configs_have_no_experts() -> None:
    cfg = ModelConfig.from_hf(dict(BASE, model_type="llama"))
    assert cfg.num_experts == 0
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def test_qwen3_moe_saved_with_mixtrals_expert_count_name() -> None:
    cfg = ModelConfig.from_hf(dict(
        BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
        norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 8, False)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert cfg.qk_norm and not cfg.qkv_bias


def test_mixtral_experts_take_intermediate_size_and_renormalize() -> None:
    cfg = ModelConfig.from_hf(dict(BASE, model_type="mixtral", num_local_experts=4,
                                   num_experts_per_tok=2))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 24, True)
    assert all(cfg.is_moe_layer(i) for i in range(4))


def test_qwen2_moe_shared_expert_and_qkv_bias() -> None:
    cfg = ModelConfig.from_hf(dict(
        BASE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=12, qkv_bias=True))
    assert cfg.shared_expert_intermediate_size == 12
    assert cfg.qkv_bias and not cfg.o_proj_bias
