"""DSpark drafts and their confidence-chosen lengths against a reference written from DeepSpec's
description, run over the whole sequence without a cache.

The reference reads the target's chosen layers from transformers (`output_hidden_states`: entry
l + 1 is layer l's output; for a DeepSeek-V4 target, make test-slow, each layer's residual
streams flattened, through hooks), and the drafter's weights from its files: context rows
hidden_norm(fc([h_l ...])) at positions 0..p-1; the block [t_p, mask, mask, mask] at p..p+3,
whose queries see every context row and the whole block (DeepSpec's mask: context before the
anchor, the anchor's own block), Qwen3 layers (q/k norms, rotate-half RoPE); draft j is the
argmax of output j's logits plus markov_w2(markov_w1(previous token)); the confidence head
reads [output j, markov_w1(previous token)], and the running product of its sigmoids picks how
many drafts are verified. The engine keeps the context's K/V paged and fed after every step:
a stale or missing row would change its drafts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import SamplingParams, TokenizedRequest, pack_ids, unpack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.tiny_models import add_dspark_weights, save_tiny_model

K = 3
THRESHOLD = 0.3


class ReferenceDSpark:
    def __init__(self, target_dir, drafter_dir) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir),
                                                           dtype=torch.float32).eval()
        self.cfg = json.loads((drafter_dir / "config.json").read_text())
        self.w = load_file(str(drafter_dir / "model.safetensors"))

    def _norm(self, x, name):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * \
            self.w[name]

    def _rope(self, x, positions):
        d = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        freqs = positions.float()[:, None] * inv[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat(
            [freqs, freqs], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    def _states(self, tokens: list[int]) -> torch.Tensor:
        """The chosen layers' outputs, concatenated per token (a DeepSeek-V4 layer's residual
        streams flattened: read with hooks, transformers returns them collapsed)."""
        ids = self.cfg["target_layer_ids"]
        if self.target.config.model_type != "deepseek_v4":
            states = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            return torch.cat([states[i + 1][0] for i in ids], -1)
        seen = {}
        hooks = [self.target.model.layers[i].register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i, out[0].flatten(-2))) for i in ids]
        try:
            self.target.model(torch.tensor([tokens]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([seen[i] for i in ids], -1)

    @torch.no_grad()
    def proposal(self, tokens: list[int], p: int) -> tuple[list[int], list[float]]:
        """Greedy drafts after t_p and the estimated acceptance of each prefix."""
        c, w = self.cfg, self.w
        ctx = self._norm(self._states(tokens[:p]) @ w["fc.weight"].T, "hidden_norm.weight")
        n = c["block_size"]
        ids = torch.tensor([tokens[p]] + [c["mask_token_id"]] * (n - 1))
        x = w["embed_tokens.weight"][ids]
        pos_ctx, pos_blk = torch.arange(p), torch.arange(p, p + n)
        heads, kvh, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        for i in range(c["num_hidden_layers"]):
            L = f"layers.{i}."
            h = self._norm(x, L + "input_layernorm.weight")
            q = self._norm((h @ w[L + "self_attn.q_proj.weight"].T).view(n, heads, d),
                           L + "self_attn.q_norm.weight")
            src = torch.cat([ctx, h])
            k = self._norm((src @ w[L + "self_attn.k_proj.weight"].T).view(-1, kvh, d),
                           L + "self_attn.k_norm.weight")
            v = (src @ w[L + "self_attn.v_proj.weight"].T).view(-1, kvh, d)
            q = self._rope(q, pos_blk)
            k = self._rope(k, torch.cat([pos_ctx, pos_blk]))
            k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
            att = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
            out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1)
            x = x + out @ w[L + "self_attn.o_proj.weight"].T
            h = self._norm(x, L + "post_attention_layernorm.weight")
            x = x + (F.silu(h @ w[L + "mlp.gate_proj.weight"].T)
                     * (h @ w[L + "mlp.up_proj.weight"].T)) @ w[L + "mlp.down_proj.weight"].T
        out = self._norm(x, "norm.weight")
        base = out @ w["lm_head.weight"].T
        drafts, chance, prev, running = [], [], tokens[p], 1.0
        for j in range(n):
            emb = w["markov_head.markov_w1.weight"][prev]
            logits = base[j] + emb @ w["markov_head.markov_w2.weight"].T
            conf = torch.sigmoid(torch.cat([out[j], emb]) @ w["confidence_head.proj.weight"][0]
                                 + w["confidence_head.proj.bias"][0])
            running *= float(conf)
            chance.append(running)
            prev = int(logits.argmax())
            drafts.append(prev)
        return drafts, chance


@pytest.fixture(scope="module", params=["llama", pytest.param("deepseek_v4",
                                                              marks=pytest.mark.slow)])
def target_dspark(request, tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("target"), request.param)
    drafter = add_dspark_weights(target, tmp_path_factory.mktemp("dspark"))
    return target, drafter


def run_engine(target, drafter, prompts, params, threshold):
    from deepinfer.workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(target), num_kv_blocks=96, block_size=4,
                       speculative_method="dspark", speculative_model=str(drafter),
                       num_speculative_tokens=K, speculative_confidence_threshold=threshold)
    runner = ModelRunner(cfg)
    proposed: list = []  # (request, input position, Draft)
    propose = runner.spec.proposer.propose

    def recording(step, requests):
        drafts = propose(step, requests)
        proposed.extend((r.request_id, r.start, d) for r, d in zip(requests, drafts))
        return drafts

    runner.spec.proposer.propose = recording
    sched = Scheduler(SchedulerConfig(
        num_blocks=96, block_size=4, max_num_batched_tokens=16, prefill_chunk_size=8,
        kv_groups=cfg.model_config().kv_cache_layout().groups(), num_speculative_tokens=K))
    for rid, ids in prompts.items():
        sched.add(TokenizedRequest(rid, pack_ids(ids), params))
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    while sched.has_work():
        step = sched.schedule()
        for delta in sched.update(step, runner.execute(step.plan)):
            tokens[delta.request_id] += unpack_ids(delta.token_ids).tolist()
    return proposed, tokens


def test_dspark_drafts_and_lengths_match_the_reference(target_dspark):
    target, drafter = target_dspark
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([5, 19])}
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    proposed, tokens = run_engine(target, drafter, prompts, greedy, THRESHOLD)
    ref = ReferenceDSpark(target, drafter)
    lengths = set()
    for rid, start, draft in proposed:
        drafts, chance = ref.proposal(tokens[rid], start)
        slots = min(K, len(tokens[rid]) - start - 2)  # the scheduler's slots near the end
        keep = min(slots, sum(c >= THRESHOLD for c in chance))
        assert draft.tokens == drafts[:keep], (rid, start, chance)
        assert len(draft.tokens) == keep
        lengths.add(keep)
    assert len(proposed) >= 4
    assert len(lengths) > 1, lengths  # the confidence head chose different lengths
