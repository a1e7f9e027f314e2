"""DeepSeek-V4 MTP drafts against a reference built from transformers' DeepSeek-V4 layers, run over
the whole sequence without a cache.

transformers drops V4's `mtp.*` weights, so the reference loads the MTP block as the extra
decoder layer of a model one layer deeper (the block is a V4 decoder layer with window attention
and a routed MoE) and wires the rest as DeepSeek's reference describes it: the target's residual
streams h_i (the input of that extra layer) and the next token's embedding enter as
e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(h_i)) in every stream, and the block's output
streams, collapsed by its own stream head and normed by its own norm, go through the target's
LM head; further drafts chain the block on its own output streams. The engine's block keeps its
own paged window cache, fed after every step; a stale or missing position would change its drafts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import SamplingParams, TokenizedRequest, pack_ids, unpack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.tiny_models import add_mtp_weights, save_tiny_model

OUT = 10  # output tokens a request


class ReferenceV4Mtp:
    def __init__(self, model_dir, tmp) -> None:
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM

        deeper = tmp / "deeper"
        deeper.mkdir()
        raw = json.loads((model_dir / "config.json").read_text())
        n = self.n = raw["num_hidden_layers"]
        raw.update(num_hidden_layers=n + 1, layer_types=[*raw["layer_types"], "sliding_attention"],
                   mlp_layer_types=[*raw["mlp_layer_types"], "moe"])
        (deeper / "config.json").write_text(json.dumps(raw))
        mtp = load_file(str(model_dir / "model-mtp.safetensors"))
        self.own = {k.removeprefix("mtp.0."): v for k, v in mtp.items()}
        block = {f"model.layers.{n}.{k}": v for k, v in self.own.items()
                 if not k.startswith(("e_proj", "h_proj", "enorm", "hnorm", "norm.", "hc_head"))}
        for path in model_dir.glob("model*.safetensors"):  # one file: transformers reads one
            if path.name != "model-mtp.safetensors":
                block.update(load_file(str(path)))
        save_file(block, str(deeper / "model.safetensors"))
        self.model = AutoModelForCausalLM.from_pretrained(str(deeper), dtype=torch.float32).eval()
        self.eps, self.hc_eps = raw["rms_norm_eps"], raw["hc_eps"]

    def _norm(self, x, name):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.own[name]

    def _mtp_input(self, ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        e = self._norm(self.model.model.embed_tokens(ids), "enorm.weight") @ self.own[
            "e_proj.weight"].T
        h = self._norm(streams, "hnorm.weight") @ self.own["h_proj.weight"].T
        return h + e[..., None, :]

    def _layer_n(self, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the deeper model over len(x) rows with the extra layer's input replaced by x
        (None: left as the target computed it): (that input, the extra layer's output)."""
        layer = self.model.model.layers[self.n]
        seen = {}

        def pre(module, args):
            seen["in"] = args[0]
            return (x[None], *args[1:]) if x is not None else None

        def post(module, args, out):
            seen["out"] = out

        hooks = [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
        try:
            length = x.shape[0] if x is not None else self._length
            self.model.model(torch.tensor([self._tokens[:length]]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        return seen["in"][0], seen["out"][0]

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(-2)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(flat @ self.own["hc_head_fn"].T * self.own["hc_head_scale"]
                            + self.own["hc_head_base"]) + self.hc_eps
        collapsed = (pre[..., None] * streams).sum(-2)
        return self.model.lm_head(self._norm(collapsed, "norm.weight"))

    @torch.no_grad()
    def distributions(self, tokens: list[int], p: int, drafts: list[int]) -> torch.Tensor:
        """The block's next-token distributions for the drafts after position p (t_p the input
        token), each given the drafts before it: [len(drafts), V]."""
        self._tokens, self._length = tokens + [0] * len(drafts), p + 1
        target, _ = self._layer_n(None)  # the target's streams h_0..h_p
        x = self._mtp_input(torch.tensor(tokens[1:p + 1]), target[:p])  # rows 0..p-1
        out = []
        for draft in drafts:
            _, y = self._layer_n(x)
            out.append(torch.softmax(self._logits(y[-1]), dim=-1))
            x = torch.cat([x, self._mtp_input(torch.tensor([draft]), y[-1:])])
        return torch.stack(out)


@pytest.fixture(scope="module")
def v4_mtp_model(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("v4-mtp"), "deepseek_v4")
    add_mtp_weights(model_dir)
    return model_dir


def test_v4_mtp_drafts_match_the_reference_block(v4_mtp_model, tmp_path):
    from deepinfer.workers.model_runner import ModelRunner

    k = 2
    cfg = EngineConfig(model=str(v4_mtp_model), num_kv_blocks=96, block_size=4,
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
        num_blocks=96, block_size=4, max_num_batched_tokens=16, prefill_chunk_size=8,
        kv_groups=cfg.model_config().kv_cache_layout().groups(), num_speculative_tokens=k))
    rng = np.random.default_rng(3)
    # Past the window of 8 and across HCA windows, chunked; a short one beside.
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([5, 19])}
    greedy = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=OUT, temperature=1.0, seed=7, ignore_eos=True)
    for i, (rid, ids) in enumerate(prompts.items()):
        sched.add(TokenizedRequest(rid, pack_ids(ids), greedy if i % 2 else sampled))
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    while sched.has_work():
        step = sched.schedule()
        for delta in sched.update(step, runner.execute(step.plan)):
            tokens[delta.request_id] += unpack_ids(delta.token_ids).tolist()
    assert all(len(tokens[rid]) == len(prompts[rid]) + OUT for rid in prompts)
    ref = ReferenceV4Mtp(v4_mtp_model, tmp_path)
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
    # Every decode after the first speculates (OUT outputs each, k = 2).
    assert checked["tokens"] >= OUT // (k + 1) and checked["probs"] >= OUT // (k + 1)
