"""DeepSeek-V4's indexer picks: ties go to the lower index, and nothing from the future.

transformers' reference calls torch.topk, which breaks ties arbitrarily; ReLU scores tie at
exactly 0.0 whenever every head's dot product is negative, so its own decode can disagree with
its full forward. The engine's pick is deterministic: among equal scores the lower index wins.
"""

from __future__ import annotations

import torch

from scripts.tiny_models import save_tiny_model


def test_ties_go_to_the_lower_index_and_future_entries_are_never_picked(tmp_path):
    from deepinfer.engine.model_config import ModelConfig
    from deepinfer.workers.models.deepseek_v4 import DeepseekV4Model

    model_dir = save_tiny_model(tmp_path / "v4", "deepseek_v4")
    cfg = ModelConfig.from_dir(str(model_dir))
    indexer = DeepseekV4Model(cfg, None).layers[1].self_attn.compressor.indexer
    torch.nn.init.normal_(indexer.q_b_proj.weight)
    torch.nn.init.constant_(indexer.scorer.weights_proj.weight, 0.1)
    q_residual = torch.randn(3, cfg.q_lora_rank)
    x = torch.ones(3, cfg.hidden_size)  # every head weight positive
    positions = torch.tensor([5, 11, 40])  # sees 3, 6 and all 8 entries (rate 2)
    keys = torch.zeros(8, cfg.compressed.index_head_dim)  # every score exactly 0: all tie
    with torch.no_grad():  # except entry 6: the last query's first head, a positive score
        q = indexer.rope(indexer.q_b_proj(q_residual).view(3, indexer.heads, -1), positions)
        keys[6] = q[2, 0]
        chosen = indexer.select(q_residual, x, positions, keys)
    k = cfg.compressed.index_topk
    assert k == 3
    assert chosen[0].nonzero().flatten().tolist() == [0, 1, 2]  # all it may see
    assert chosen[1].nonzero().flatten().tolist() == [0, 1, 2]  # 6 ties: the lowest three
    assert chosen[2].nonzero().flatten().tolist() == [0, 1, 6]  # the best, then ties
