"""DeepSeek-V4: every layer attends over a sliding window of single-head K = V entries, plus
compressed entries of the whole past (CSA layers: one per `csa_rate` tokens, of which an indexer
picks the top k per query; HCA layers: one per `hca_rate` tokens, all of them).

- Attention: q through a low-rank bottleneck (q_a_proj, norm, q_b_proj, unweighted per-head
  norm); one K = V head (kv_proj, norm); RoPE on each head's trailing `rope_dim` dims, in
  interleaved pairs (the "main" table on sliding-only layers, the "compress" one elsewhere); a
  learned sink logit per head; the output's rotary dims rotated back by the query's position
  (V carried the keys' rotation); a grouped output projection (o_a_proj per head group, then
  o_b_proj).
- Compressors: each token's kv and gate projections are kept (a sliding cache entry); when a
  window of `rate` tokens completes, its entry is the softmax(gate + position bias)-weighted sum
  of its kv rows (CSA: over the previous window's first series and this window's second, two
  windows wide), normed and rotated at the window's first position; entries live in full cache
  entries, in the block where their window ends (engine/model_config.py).
- Indexer (CSA): the same compressor at index_head_dim gives index keys; a query's score for an
  entry is sum_h w_h relu(q_h . k) with per-query head weights; the top k among the entries
  whose windows ended before the query, ties to the lower index (torch.topk breaks ties
  arbitrarily, so HF's own decode can differ from its full forward there).
- Residual: `hc_mult` streams per token, collapsed before each sublayer and expanded after it
  by hyper-connections (weights from a projection of the streams; the mixing matrix made
  doubly stochastic by Sinkhorn iterations), collapsed once more before the final norm.
- MoE in every layer: sqrt(softplus) router scores (with a correction bias for top-k layers,
  a token-id table for hash layers), weights renormalized and scaled, clamped SwiGLU experts,
  one shared expert.
Everything runs in plain torch; tests hold it to transformers' reference on tiny configs.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.model_config import ModelConfig
from deepinfer.workers.attention import AttentionBackend, AttentionMetadata
from deepinfer.workers.layers.linear import Linear, MergedLinear, PlainWeight
from deepinfer.workers.layers.moe import FusedExperts, clamped_swiglu
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.layers.rotary import inverse_frequencies
from deepinfer.workers.models.llama import LlamaForCausalLM
from deepinfer.workers.models.moe import EXPERT_PARAMS


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class InterleavedRope(nn.Module):
    """RoPE on the trailing `dim` dims of the last axis, rotating pairs (x0, x1), (x2, x3), ..."""

    def __init__(self, params: dict, dim: int) -> None:
        super().__init__()
        inv, scale = inverse_frequencies(params, dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale, self.dim = scale, dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
                ) -> torch.Tensor:
        """x [T, ..., D] at positions [T]; `inverse` rotates back."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos = (freqs.cos() * self.scale).view(shape)
        sin = (freqs.sin() * self.scale).view(shape) * (-1.0 if inverse else 1.0)
        rope = x[..., -self.dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        return torch.cat([x[..., : -self.dim], rotated.flatten(-2).to(x.dtype)], dim=-1)


def _table(table) -> torch.Tensor:
    """A step's block table (a read-only view of the plan's bytes) as a tensor of its own."""
    return torch.tensor(table, dtype=torch.int64)


def slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` in a block table."""
    return table[positions // block_size] * block_size + positions % block_size


class Compressor(nn.Module):
    """One entry per window of `rate` tokens, from the kv and gate rows of its tokens (and, with
    `overlap`, the previous window's: two series, each half of the projections)."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float,
                 rope: InterleavedRope) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = Linear(hidden, series * width)
        self.score_proj = Linear(hidden, series * width)  # the checkpoint's gate_proj
        self.position_bias = nn.Parameter(torch.zeros(rate, series * width),
                                          requires_grad=False)
        self.kv_norm = RMSNorm(width, eps)
        self.rope = rope

    def sources(self, x: torch.Tensor) -> torch.Tensor:
        """What each token keeps for the windows it belongs to: [T, 2 * series * width]."""
        return torch.cat([self.kv_proj(x), self.score_proj(x)], dim=-1)

    def compress(self, rows: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """rows [E, span, sources] of windows [E] (span: rate, or 2 * rate with the previous
        window's rows first) -> entries [E, width], rotated at each window's first position."""
        kv, gate = rows.chunk(2, dim=-1)
        rate, w = self.rate, self.width
        if self.overlap:
            bias = self.position_bias
            prev_gate = gate[:, :rate, :w] + bias[:, :w]
            prev_gate = prev_gate.masked_fill((windows == 0)[:, None, None], float("-inf"))
            kv = torch.cat([kv[:, :rate, :w], kv[:, rate:, w:]], dim=1)
            gate = torch.cat([prev_gate, gate[:, rate:, w:] + bias[:, w:]], dim=1)
        else:
            gate = gate + self.position_bias
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        return self.rope(self.kv_norm(pooled.contiguous()), windows * rate)


class Indexer(Compressor):
    """Scores compressed index keys against per-head queries; picks the top k per query."""

    def __init__(self, cfg: ModelConfig, q_lora_rank: int, rope: InterleavedRope) -> None:
        c = cfg.compressed
        super().__init__(cfg.hidden_size, c.index_head_dim, c.csa_rate, True, cfg.rms_norm_eps,
                         rope)
        self.heads, self.topk = c.index_heads, c.index_topk
        self.q_b_proj = Linear(q_lora_rank, c.index_heads * c.index_head_dim)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(cfg.hidden_size, c.index_heads)

    def select(self, q_residual: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """[n, E] True where a query keeps an entry: its top k by score among the entries whose
        windows ended at or before it (all of them when there are at most k), ties to the lower
        index."""
        n, entries = q_residual.shape[0], keys.shape[0]
        q = self.rope(self.q_b_proj(q_residual).view(n, self.heads, self.width), positions)
        scores = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float()))
        scores = scores * self.width ** -0.5
        head_weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        scores = (scores * head_weights[..., None]).sum(dim=1)  # [n, E]
        visible = torch.arange(entries)[None] < ((positions + 1) // self.rate)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(visible)
        keep.scatter_(1, order[:, : min(self.topk, entries)], True)
        return keep & visible


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, main_rope: InterleavedRope,
                 compress_rope: InterleavedRope) -> None:
        super().__init__()
        c = cfg.compressed
        self.kind = c.attention[layer]
        self.heads, self.head_dim, self.window = cfg.num_heads, cfg.head_dim, c.window
        self.eps = cfg.rms_norm_eps
        self.o_groups = c.o_groups
        hidden, q_rank = cfg.hidden_size, cfg.q_lora_rank
        self.q_a_proj = Linear(hidden, q_rank)
        self.q_a_norm = RMSNorm(q_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(q_rank, self.heads * self.head_dim)
        self.kv_proj = Linear(hidden, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Per head group (read as a matrix, one product per group).
        self.o_a_proj = PlainWeight(self.heads * self.head_dim // c.o_groups,
                                    c.o_groups * c.o_lora_rank)
        self.o_b_proj = Linear(c.o_groups * c.o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.rope = main_rope if self.kind == "sliding" else compress_rope
        self.compressor: Compressor | None = None
        if self.kind != "sliding":
            rate = c.csa_rate if self.kind == "csa" else c.hca_rate
            self.compressor = Compressor(hidden, self.head_dim, rate, self.kind == "csa",
                                         cfg.rms_norm_eps, compress_rope)
            if self.kind == "csa":
                self.compressor.indexer = Indexer(cfg, q_rank, compress_rope)
        self.entries: dict[str, int] = {}  # cache entry per name (set by the model)
        self.groups: dict[str, int] = {}  # and the block group of each

    # ------------------------------------------------------------------ caches

    def _store(self, caches, metas, name: str, rows: torch.Tensor) -> None:
        """Write one row per token at this step's slots of a sliding entry."""
        meta = metas[self.groups[name]]
        cache = caches[self.entries[name]][0].view(-1, rows.shape[-1])
        keep = meta.row_slots >= 0
        cache.index_copy_(0, meta.row_slots[keep], rows[keep])

    def _rows(self, caches, name: str, table: torch.Tensor, positions: torch.Tensor,
              block_size: int) -> torch.Tensor:
        cache = caches[self.entries[name]][0]
        return cache.view(-1, cache.shape[-1])[slots(table, positions, block_size)]

    def _update_entries(self, comp: Compressor, caches, metas, src: str, dst: str) -> None:
        """Compress every window that ends in this step (and is not cached already) and write
        its entry over the last min(rate, block) slots of its window."""
        sliding, full = metas[self.groups[src]], metas[self.groups[dst]]
        bs, rate = full.block_size, comp.rate
        per = min(rate, bs)
        span = (2 if comp.overlap else 1) * rate
        for seq_src, seq_dst in zip(sliding.seqs, full.seqs):
            start, end = seq_src.start, seq_src.start + seq_src.num_tokens
            first = max(-(-(start + 1) // rate) - 1, -(-(seq_dst.write_from + 1) // rate) - 1)
            if end // rate <= max(first, 0):  # none ends here uncached (a replayed chunk)
                continue
            windows = torch.arange(max(first, 0), end // rate)
            pos = (windows[:, None] + 1) * rate - span + torch.arange(span)[None]
            src_table = _table(seq_src.table)
            rows = self._rows(caches, src, src_table, pos.clamp(min=0).flatten(), bs)
            entries = comp.compress(rows.view(len(windows), span, -1), windows)
            out = (windows[:, None] + 1) * rate - per + torch.arange(per)[None]
            cache = caches[self.entries[dst]][0]
            cache.view(-1, cache.shape[-1]).index_copy_(
                0, slots(_table(seq_dst.table), out.flatten(), bs),
                entries.reshape(-1, cache.shape[-1]))

    def _entries(self, caches, name: str, table: torch.Tensor, count: int, rate: int,
                 block_size: int) -> torch.Tensor:
        per = min(rate, block_size)
        pos = (torch.arange(count)[:, None] + 1) * rate - per + torch.arange(per)[None]
        return self._rows(caches, name, table, pos.flatten(), block_size).view(count, -1)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, positions: torch.Tensor, caches,
                metas: list[AttentionMetadata]) -> torch.Tensor:
        t = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(t, self.heads, self.head_dim),
                                self.eps)
        q = self.rope(q, positions)
        kv = self.rope(self.kv_norm(self.kv_proj(x)), positions)
        self._store(caches, metas, "window", kv)
        comp = self.compressor
        if comp is not None:
            self._store(caches, metas, "source", comp.sources(x))
            self._update_entries(comp, caches, metas, "source", "compressed")
            if self.kind == "csa":
                self._store(caches, metas, "index_source", comp.indexer.sources(x))
                self._update_entries(comp.indexer, caches, metas, "index_source", "index_keys")
        out = torch.empty_like(q)
        window_meta = metas[self.groups["window"]]
        full_meta = metas[self.groups["compressed"]] if comp is not None else None
        row = 0
        for i, seq in enumerate(window_meta.seqs):
            n = seq.num_tokens
            rows = slice(row, row + n)
            out[rows] = self._attend(q[rows], q_residual[rows], x[rows], positions[rows],
                                     caches, seq, full_meta.seqs[i] if full_meta else None,
                                     window_meta.block_size)
            row += n
        out = self.rope(out, positions, inverse=True)  # V carried the keys' rotation
        grouped = out.reshape(t, self.o_groups, -1)
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).reshape(t, -1))

    def _attend(self, q, q_residual, x, positions, caches, seq, full_seq, bs: int):
        """One seq's queries [n, H, D] over its window and compressed entries, with sinks."""
        start, end = seq.start, seq.start + seq.num_tokens
        first = max(seq.key_from, start - self.window + 1, 0)
        key_pos = torch.arange(first, end)
        keys = self._rows(caches, "window", _table(seq.table), key_pos, bs)
        visible = ((key_pos[None] <= positions[:, None])
                   & (key_pos[None] > positions[:, None] - self.window))
        comp = self.compressor
        if comp is not None and end // comp.rate:
            table = _table(full_seq.table)
            count = end // comp.rate
            entries = self._entries(caches, "compressed", table, count, comp.rate, bs)
            if self.kind == "csa":
                index_keys = self._entries(caches, "index_keys", table, count, comp.rate, bs)
                chosen = comp.indexer.select(q_residual, x, positions, index_keys)
            else:
                chosen = torch.arange(count)[None] < ((positions + 1) // comp.rate)[:, None]
            keys = torch.cat([keys, entries])
            visible = torch.cat([visible, chosen], dim=1)
        scale = self.head_dim ** -0.5
        logits = torch.einsum("nhd,kd->hnk", q, keys) * scale
        logits = logits.masked_fill(~visible[None], float("-inf"))
        sinks = self.sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1).to(logits.dtype)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hnk,kd->nhd", probs, keys)


class HyperConnection(nn.Module):
    """Collapse the streams for a sublayer; weights to expand its output and mix the streams."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c = cfg.compressed
        self.hc, self.iters, self.eps, self.norm_eps = (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
                                                        cfg.rms_norm_eps)
        size = (2 + self.hc) * self.hc
        self.fn = nn.Parameter(torch.zeros(size, self.hc * cfg.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, streams: torch.Tensor):
        """streams [T, hc, H] -> post [T, hc], comb [T, hc, hc], collapsed [T, H]."""
        hc = self.hc
        mixed = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps),
                         self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc),
                             dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post, comb) -> torch.Tensor:
        dtype = streams.dtype
        return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hc = cfg.compressed.hc_mult
        self.eps, self.norm_eps = cfg.compressed.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(hc), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixed = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps),
                         self.hc_fn.float())
        pre = torch.sigmoid(mixed * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class ClampedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": inter, "up": inter})
        self.down_proj = Linear(inter, cfg.hidden_size)
        self.limit = cfg.compressed.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class V4Router(Linear):
    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.num_experts)
        self.cfg, self.hashed = cfg, hashed
        if hashed:  # token id -> its experts
            self.tid2eid = nn.Parameter(
                torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long),
                requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts),
                                                        requires_grad=False)

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = self(x).float()
        fn = cfg.compressed.scoring_func
        scores = (F.softplus(logits).sqrt() if fn == "sqrtsoftplus"
                  else torch.sigmoid(logits) if fn == "sigmoid" else logits.softmax(dim=-1))
        if self.hashed:
            experts = self.tid2eid[ids]
        else:
            experts = torch.topk(scores + self.e_score_correction_bias.float(),
                                 cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * cfg.routed_scaling_factor).to(x.dtype), experts


class V4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = V4Router(cfg, layer in cfg.compressed.hash_layers)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                    cfg.compressed.swiglu_limit)
        self.shared_experts = ClampedMLP(cfg)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate.route(x, ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, main_rope, compress_rope) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, layer, main_rope, compress_rope)
        self.mlp = V4MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams, ids, positions, caches, metas):
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), positions, caches, metas)
        streams = HyperConnection.expand(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), ids)
        return HyperConnection.expand(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, mlp=None) -> None:
        # (`mlp`, the Llama family's MLP factory, does not apply: every layer is a V4 MoE.)
        super().__init__()
        c = cfg.compressed
        main = InterleavedRope(c.rope_main, c.rope_dim)
        compress = InterleavedRope(c.rope_compress, c.rope_dim)
        self.hc_mult = c.hc_mult
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, main, compress)
                                    for i in range(cfg.num_layers))
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ropes = nn.ModuleList([main, compress])
        layout = cfg.kv_cache_layout()  # entry names and groups do not depend on the block size
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            for e, entry in enumerate(layout.layers):
                if entry.layer == i:
                    attn.entries[entry.name] = e
                    attn.groups[entry.name] = layout.group_of(e)

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]):
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, kv_caches, metas)
        return self.norm(self.hc_head(streams).contiguous())


# DeepSeek's checkpoint names (as DeepSeek ships them and transformers saves them) -> ours, in
# order; per-expert w1 / w3 / w2 load through EXPERT_PARAMS.
RENAMES = [(re.compile(a), b) for a, b in [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".score_proj."),
    (r"\.norm\.weight$", ".kv_norm.weight"),
    (r"\.ape$", ".position_bias"),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]]


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = False  # its own attention and MoE layers
    stacked_params = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    expert_params = EXPERT_PARAMS
    model_class = DeepseekV4Model

    @staticmethod
    def rename_weight(name: str) -> str:
        if name.startswith("model.") and not name.startswith("model.layers."):
            return name  # already ours (embed_tokens, norm, hc_head)
        for pattern, target in RENAMES:
            name = pattern.sub(target, name)
        return name

    def skips_weight(self, name: str) -> bool:
        return name.startswith("mtp.")  # the MTP block: the proposer's (spec_decode/mtp_v4.py)
