"""Tiny random Hugging Face checkpoints of every supported architecture, for tests and benchmarks
(reference models: transformers builds and saves them; DeepInfer loads them)."""

from __future__ import annotations

import shutil
from pathlib import Path

from deepinfer.engine.config import DEFAULT_MODEL_NAME
from deepinfer.engine.envs import cache_dir
from deepinfer.engine.model_store import prepare

# arch -> transformers' class prefix (Qwen2: q/k/v biases; Qwen3: qk-norm)
# arch -> (transformers config class, model class) name prefixes
TINY_ARCHS = {"llama": ("Llama", "Llama"), "mistral": ("Mistral", "Mistral"),
              "qwen2": ("Qwen2", "Qwen2"), "qwen3": ("Qwen3", "Qwen3"),
              "qwen3_moe": ("Qwen3Moe", "Qwen3Moe"), "qwen2_moe": ("Qwen2Moe", "Qwen2Moe"),
              "mixtral": ("Mixtral", "Mixtral"), "gemma3": ("Gemma3Text", "Gemma3"),
              "deepseek_v3": ("DeepseekV3", "DeepseekV3"),
              "deepseek_v4": ("DeepseekV4", "DeepseekV4")}
# 4 experts, top-2, 32 wide (Mixtral's experts take intermediate_size); dense Qwen MoE layers
# keep the base intermediate_size.
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_DEFAULTS = {
    "qwen3_moe": _QWEN_MOE,
    "qwen2_moe": dict(_QWEN_MOE, shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    # MLA (a q bottleneck, a 16-wide latent, 8 rope + 8 nope dims, 12-wide values), layer 0
    # dense, then 8 routed experts in 4 groups (top-2 within the best 2 groups) + 1 shared.
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, tie_word_embeddings=False),
    # A window of 8; CSA every 2 tokens (3 picked by the indexer) and HCA every 8, small
    # rates so that every path runs in a short prompt; 8 index heads, so that a tie at zero
    # (every head's ReLU 0) rarely decides a pick; 2 residual streams; one hash-routed
    # MoE layer; 8 experts, top 2 (intermediate_size is V4's expert width).
    "deepseek_v4": dict(num_key_value_heads=1, head_dim=32, q_lora_rank=24, intermediate_size=16,
                        n_routed_experts=8, num_experts_per_tok=2, sliding_window=8,
                        o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
                        index_topk=3, partial_rotary_factor=0.25, hc_mult=2,
                        compress_rates={"compressed_sparse_attention": 2,
                                        "heavily_compressed_attention": 8},
                        num_hidden_layers=4,
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                        tie_word_embeddings=False),
}


def save_tiny_model(out: Path, arch: str = "llama", tokenizer_from: Path | None = None,
                    **overrides) -> Path:
    """Save a tiny random HF model with the default model's tokenizer (real chat template;
    `tokenizer_from`: its directory, else the default model prepared in DeepInfer's cache)."""
    import torch
    import transformers

    base = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=136,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    )
    base.update(MOE_DEFAULTS.get(arch, {}))
    base.update(overrides)
    if arch in ("qwen3", "gemma3"):
        base.setdefault("head_dim", 16)
    if arch == "gemma3":  # sandwich norms, GeGLU, scaled embeddings, per-kind RoPE
        base.setdefault("query_pre_attn_scalar", 24)
        base.setdefault("rms_norm_eps", 1e-6)
    config_prefix, model_prefix = TINY_ARCHS[arch]
    cfg = getattr(transformers, f"{config_prefix}Config")(**base)
    cls = getattr(transformers, f"{model_prefix}ForCausalLM")
    torch.manual_seed(base.get("seed", 0) if "seed" in base else 0)
    model = _randomized(cls(cfg).to(torch.float32).eval(), cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    src = tokenizer_from or prepare(DEFAULT_MODEL_NAME, cache_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def _randomized(model, cfg):
    """transformers' random init, made decisive and nonzero where real checkpoints are."""
    import torch

    # Random init is small; widen the logit spread so greedy choices are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
        # Zero at init (real values come from checkpoints): the tests would prove little.
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
            elif name.endswith(("sinks", "position_bias")):
                t.copy_(torch.randn(t.shape))
            elif name.endswith("tid2eid"):  # each token's experts, distinct
                t.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[: t.shape[1]]
                                     for _ in range(t.shape[0])]))
    return model


def add_mtp_weights(model_dir: Path, seed: int = 1) -> None:
    """Give a tiny DeepSeek-V3 or V4 checkpoint one random MTP layer (HF drops them on save),
    named as DeepSeek's checkpoints name it: V3 `model.layers.{num_hidden_layers}.*`, V4
    `mtp.0.*` (written to model-mtp.safetensors)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    if cfg.model_type == "deepseek_v4":
        save_file(v4_mtp_tensors(model_dir, seed), str(model_dir / "model-mtp.safetensors"))
        return
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(cfg, n).float()
    tensors = {}
    for name, t in list(layer.state_dict().items()):
        t = torch.randn(t.shape) * (0.1 if t.dim() > 1 else 0.02)
        if name.endswith("layernorm.weight"):
            t = 1.0 + t
        tensors[name] = t
    tensors.update({
        "enorm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "hnorm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        "embed_tokens.weight": torch.randn(cfg.vocab_size, hidden),
        "shared_head.norm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "shared_head.head.weight": 0.2 * torch.randn(cfg.vocab_size, hidden),
    })
    save_file({f"model.layers.{n}.{k}": v.contiguous() for k, v in tensors.items()},
              str(model_dir / "model-mtp.safetensors"))


def v4_mtp_tensors(model_dir: Path, seed: int = 1) -> dict:
    """A random DeepSeek-V4 MTP block for a tiny V4 checkpoint, in DeepSeek's names (`mtp.0.*`):
    a decoder layer with window attention and a routed MoE (transformers builds it as layer
    `num_hidden_layers` of a model one layer deeper, and saves it in those names), then the
    block's own norms, projections and stream head."""
    import json
    import tempfile

    import torch
    import transformers
    from safetensors.torch import load_file

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    n, hidden, hc = raw["num_hidden_layers"], raw["hidden_size"], raw["hc_mult"]
    raw.update(num_hidden_layers=n + 1,
               layer_types=[*raw["layer_types"][:n], "sliding_attention"],
               mlp_layer_types=[*raw["mlp_layer_types"][:n], "moe"])
    for key in ("architectures", "transformers_version", "model_type", "dtype"):
        raw.pop(key, None)
    cfg = transformers.DeepseekV4Config(**raw)
    torch.manual_seed(seed)
    deeper = _randomized(transformers.DeepseekV4ForCausalLM(cfg).to(torch.float32).eval(), cfg)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp, safe_serialization=True)
        saved = {}
        for path in Path(tmp).glob("*.safetensors"):
            saved.update(load_file(str(path)))
    layer = f"model.layers.{n}."
    tensors = {PREFIX_MTP + k.removeprefix(layer): v for k, v in saved.items()
               if k.startswith(layer)}
    tensors.update({PREFIX_MTP + k: v for k, v in {
        "e_proj.weight": 0.3 * torch.randn(hidden, hidden),
        "h_proj.weight": 0.3 * torch.randn(hidden, hidden),
        "enorm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "hnorm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "norm.weight": 1.0 + 0.02 * torch.randn(hidden),
        "hc_head_fn": 0.1 * torch.randn(hc, hc * hidden),
        "hc_head_base": 0.1 * torch.randn(hc),
        "hc_head_scale": torch.ones(1),
    }.items()})
    return {k: v.contiguous() for k, v in tensors.items()}


PREFIX_MTP = "mtp.0."


def add_dspark_weights(target_dir: Path, out_dir: Path, seed: int = 2, block_size: int = 4,
                       num_layers: int = 2, layer_ids: list[int] | None = None) -> Path:
    """A tiny random DSpark drafter (DeepSpec's layout: workers/spec_decode/dspark_model.py)
    for a tiny target: Qwen3-style draft layers of the target's width over its chosen layers
    (default: the first and the one before the last; a DeepSeek-V4 layer's residual streams
    flattened), the target's embedding and head copied in, a rank-16 vanilla Markov head and a
    confidence head reading it. The mask token is the vocabulary's last id."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    raw = json.loads((target_dir / "config.json").read_text())
    n, hidden, vocab = raw["num_hidden_layers"], raw["hidden_size"], raw["vocab_size"]
    streams = raw.get("hc_mult", 1) if raw.get("model_type") == "deepseek_v4" else 1
    layer_ids = layer_ids if layer_ids is not None else [0, n - 2]
    heads, kv_heads, head_dim, inter, rank = 4, 2, 16, 96, 16
    cfg = dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=hidden,
               num_hidden_layers=num_layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
               rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab,
               max_position_embeddings=raw.get("max_position_embeddings", 4096),
               attention_bias=False, block_size=block_size, mask_token_id=vocab - 1,
               target_layer_ids=layer_ids, num_anchors=512, markov_rank=rank,
               markov_head_type="vanilla", enable_confidence_head=True,
               confidence_head_with_markov=True)
    target = {}
    for path in target_dir.glob("*.safetensors"):
        target.update(load_file(str(path)))
    embed = target["model.embed_tokens.weight"]
    head = target.get("head.weight", target.get("lm_head.weight", embed))
    torch.manual_seed(seed)

    def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return scale * torch.randn(*shape)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.02 * torch.randn(dim)

    tensors = {"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone(),
               "fc.weight": w(hidden, len(layer_ids) * streams * hidden, scale=0.1),
               "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden),
               "markov_head.markov_w1.weight": w(vocab, rank, scale=1.0),
               "markov_head.markov_w2.weight": w(vocab, rank, scale=0.5),
               "confidence_head.proj.weight": w(1, hidden + rank, scale=1.0),
               "confidence_head.proj.bias": torch.tensor([1.0])}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden)})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.float().contiguous() for k, v in tensors.items()},
              str(out_dir / "model.safetensors"))
    return out_dir
