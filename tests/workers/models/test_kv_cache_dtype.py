"""--kv-cache-dtype float16 / bfloat16 under a float32 model: logits against HF transformers
whose attention reads K/V rounded the same way.

Every attention in the engine reads K/V as the cache stores them (a fresh prefill chunk rounds
its own keys too), so the reference is HF's float32 model with its keys and values rounded to
the cache's type before attention: what remains between the two is the order of reductions
(~1e-6), plus the rare element whose rounding flips because HF's projection differs from ours in
the last bit (one half-type ulp: 2^-11 relative in float16, 2^-8 in bfloat16; up to ~2e-4 in
the logits here). Against HF's unrounded attention the same logits differ by several times more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.config import EngineConfig, ModelConfigError
from scripts.tiny_models import save_tiny_model
from tests.workers.engine_steps import run_engine

CONFIGS = {
    "llama": ("llama", {}),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=2)),
    "gemma3-hybrid": ("gemma3", dict(num_hidden_layers=4, sliding_window=6,
                                     num_key_value_heads=1,
                                     layer_types=["sliding_attention"] * 3 + ["full_attention"])),
}
# max |logit difference| against the rounded-K/V reference (see the module docstring). Measured
# here: float16 <= 1.8e-4 (a flipped rounding), bfloat16 <= 6e-6; against unrounded K/V the
# same logits differ by 8e-4 to 1.4e-3 (float16) and 6e-3 to 1.4e-2 (bfloat16).
TOLERANCE = {"float16": 5e-4, "bfloat16": 1e-3}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    return save_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def hf_model(model_dir, kv_dtype: torch.dtype | None):
    """HF's float32 model; with `kv_dtype`, its attention reads keys and values rounded to it."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def rounded(module, query, key, value, *args, **kwargs):
        key, value = (t.to(kv_dtype).to(t.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    impl = "sdpa"
    if kv_dtype is not None:
        impl = f"rounded_kv_{kv_dtype}".replace(".", "_")
        AttentionInterface.register(impl, rounded)
        AttentionMaskInterface.register(impl, sdpa_mask)  # sdpa's masks (sliding windows)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation=impl).eval()


def hf_logits(model_dir, ids: list[int], kv_dtype: torch.dtype | None) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir, kv_dtype)(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_logits_match_hf_with_rounded_kv(tiny, kv_cache_dtype, kernels, monkeypatch):
    """Chunked prefills and decode steps (the native decode layer, or with `torch` every native
    op unavailable: the fallbacks) over a half cache."""
    from deepinfer.kernels.cpu.native import NativeOp

    if kernels == "torch":
        monkeypatch.setattr(NativeOp, "available", lambda self, *tensors: False)
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist()
               for i, n in enumerate([5, 23, 12])}
    runner, got, tokens, steps = run_engine(tiny, prompts, max_tokens=4,
                                            kv_cache_dtype=kv_cache_dtype)
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert steps > 4
    kv_dtype = getattr(torch, kv_cache_dtype)
    for rid, ids in prompts.items():
        seq = ids + tokens[rid][:-1]  # the decode steps' inputs: the tokens sampled before
        ours = got[rid]
        ref = hf_logits(tiny, seq, kv_dtype)
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff < TOLERANCE[kv_cache_dtype], f"{rid}: max abs logit diff {diff}"
        unrounded = (ours - hf_logits(tiny, seq, None)).abs().max().item()
        assert unrounded > diff, "the rounding should show against unrounded K/V"


def test_block_budget_and_checks(tiny, tmp_path):
    """Half the bytes a block: twice the blocks in the same --kv-cache-gb; a bad value or a model
    whose cache holds more than keys and values is refused, naming the flag."""
    full = EngineConfig(model=str(tiny), kv_cache_gb=0.01)
    half = EngineConfig(model=str(tiny), kv_cache_gb=0.01, kv_cache_dtype="float16")
    assert half.kv_bytes_per_block() * 2 == full.kv_bytes_per_block()
    assert half.kv_blocks() in (2 * full.kv_blocks(), 2 * full.kv_blocks() + 1)
    assert half.kv_dtype() == "float16" and full.kv_dtype() == "float32"
    assert EngineConfig(model=str(tiny), dtype="bfloat16").kv_dtype() == "bfloat16"
    half.check_kv_cache_dtype()
    with pytest.raises(ModelConfigError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model=str(tiny), kv_cache_dtype="fp4").check_kv_cache_dtype()
    with pytest.raises(ModelConfigError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model=str(tiny), kv_cache_dtype="fp4", device="cuda").check_device()
    with pytest.raises(ModelConfigError, match="--device cuda: --kv-cache-dtype float16"):
        EngineConfig(model=str(tiny), kv_cache_dtype="float16", device="cuda").check_device()
    assert any("--kv-cache-dtype" in p for p in half.cpu_only_features())
    assert not EngineConfig(model=str(tiny), kv_cache_dtype="float32").cpu_only_features()
    mla = save_tiny_model(tmp_path / "v3", "deepseek_v3")
    with pytest.raises(ModelConfigError, match="--kv-cache-dtype float16: the model's latent"):
        EngineConfig(model=str(mla), kv_cache_dtype="float16").check_kv_cache_dtype()
