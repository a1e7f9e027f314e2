"""DeepSeek MTP drafts against a reference MTP layer built from transformers' DeepSeek-V3 decoder
layer, run over the whole sequence without a cache.

The engine's MTP layer keeps its own paged latent cache, fed after every step with what the
target computed; if it ever attended to a stale or missing position, its drafts would differ
from the reference's. HF cannot run MTP itself (it drops the weights), so the reference wires
the checkpoint's MTP weights around HF's decoder layer as DeepSeek describes: the layer at
position i reads hnorm(h_i) and enorm(embed(t_{i+1})) through eh_proj, and its shared head
predicts t_{i+2}; further drafts chain the layer on its own output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import SamplingParams, TokenizedRequest, pack_ids, unpack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.tiny_models import add_mtp_weights, save_tiny_model


class ReferenceMtp:
    def __init__(self, model_dir) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
            DeepseekV3RotaryEmbedding,
        )

        self.target = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                           dtype=torch.float32).eval()
        cfg = self.target.config
        n = cfg.num_hidden_layers
        w = {k.removeprefix(f"model.layers.{n}."): v
             for k, v in load_file(str(model_dir / "model-mtp.safetensors")).items()}
        self.layer = DeepseekV3DecoderLayer(cfg, n).eval()  # an MoE layer, as the MTP layer is
        self.layer.load_state_dict({k: v for k, v in w.items() if k.startswith(
            ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))})
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norm = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data = w[f"{name}.weight"]
            self.norms[name] = norm
        self.eh_proj, self.embed = w["eh_proj.weight"], w["embed_tokens.weight"]
        self.head = w["shared_head.head.weight"]
        self.rotary = DeepseekV3RotaryEmbedding(cfg)

    @torch.no_grad()
    def distributions(self, tokens: list[int], p: int, drafts: list[int]) -> torch.Tensor:
        """The MTP layer's next-token distributions for the drafts after position p, given
        tokens[0..p] (t_p is the input token) and the drafts before each: [len(drafts), V]."""
        h = self.target.model(torch.tensor([tokens[:p + 1]])).last_hidden_state[0]
        x = torch.cat([self.norms["enorm"](self.embed[torch.tensor(tokens[1:p + 1])]),
                       self.norms["hnorm"](h[:p])], dim=-1) @ self.eh_proj.T  # rows 0..p-1
        out = []
        for draft in drafts:
            pos = torch.arange(x.shape[0])[None]
            y = self.layer(x[None], position_embeddings=self.rotary(x[None], pos))[0]
            logits = self.norms["shared_head.norm"](y[-1]) @ self.head.T
            out.append(torch.softmax(logits, dim=-1))
            nxt = torch.cat([self.norms["enorm"](self.embed[draft]),
                             self.norms["hnorm"](y[-1])]) @ self.eh_proj.T
            x = torch.cat([x, nxt[None]])
        return torch.stack(out)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("ds-mtp"), "deepseek_v3")
    add_mtp_weights(model_dir)
    return model_dir


def test_mtp_drafts_match_the_reference_layer(mtp_model):
    from deepinfer.workers.model_runner import ModelRunner

    k = 2
    cfg = EngineConfig(model=str(mtp_model), num_kv_blocks=64, block_size=4,
                       speculative_method="mtp", num_speculative_tokens=k)
    runner = ModelRunner(cfg)
    proposed: list = []  # (request, input position, Draft)
    propose = runner.spec.proposer.propose

    def recording(step, requests):
        drafts = propose(step, requests)
        proposed.extend((r.request_id, r.start, d) for r, d in zip(requests, drafts))
        return drafts

    runner.spec.proposer.propose = recording
    sched = Scheduler(SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=16, prefill_chunk_size=8,
        kv_groups=cfg.model_config().kv_cache_layout().groups(), num_speculative_tokens=k))
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist()
               for i, n in enumerate([5, 19, 11, 8])}
    # Greedy requests check the draft tokens; sampled ones the distributions drawn from.
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    for i, (rid, ids) in enumerate(prompts.items()):
        sched.add(TokenizedRequest(rid, pack_ids(ids), greedy if i % 2 else sampled))
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    while sched.has_work():
        step = sched.schedule()
        for delta in sched.update(step, runner.execute(step.plan)):
            tokens[delta.request_id] += unpack_ids(delta.token_ids).tolist()
    assert all(len(tokens[rid]) == len(prompts[rid]) + 12 for rid in prompts)
    ref = ReferenceMtp(mtp_model)
    checked = {"tokens": 0, "probs": 0}
    for rid, start, draft in proposed:
        if not draft.tokens:
            continue
        expected = ref.distributions(tokens[rid], start, draft.tokens)
        if draft.probs is None:
            assert draft.tokens == expected.argmax(dim=-1).tolist(), (rid, start)
            checked["tokens"] += 1
        else:
            diff = (draft.probs - expected).abs().max().item()
            assert diff < 1e-4, (rid, start, diff)
            checked["probs"] += 1
    # Every decode after the first speculates (12 outputs each, k = 2).
    assert checked["tokens"] >= 2 * 4 and checked["probs"] >= 2 * 4
