"""Rotary position embeddings (HF "rotate half" layout) with default, linear, llama3 and YaRN
scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.workers.layers import gpu_kernels


def inverse_frequencies(params: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the config's rope type."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(params, rotary_dim, base)
    raise NotImplementedError(f"rope_type {kind!r} is not supported yet")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(params: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V3's long context): interpolated low frequencies, extrapolated high ones,
    a linear ramp between, and cos/sin scaled by the attention factor."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict) -> None:
        super().__init__()
        inv, scale = inverse_frequencies(params, head_dim)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
        self.native = False  # set by finalize(), once the model has its final dtype and device
        self.triton = False

    def finalize(self) -> None:
        self.native = cpu_fused.available(self.cos)
        self.triton = gpu_kernels.wanted(self.cos)

    def apply_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor | None = None,
                        v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None
                        ) -> None:
        """Rotate q [T, H, D] and k [T, KVH, D] in place at `positions`, then write k, v to
        the cache `slots` (-1: not written): one fused pass on CPU float32."""
        fits = (k.shape[-1] == v.shape[-1]
                and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
                and (k_cache is None or (k_cache.is_contiguous() and v_cache.is_contiguous())))
        if self.native and fits and q.dtype == torch.float32:
            fn = cpu_fused.rope_store_kv
        elif self.triton and fits:
            fn = gpu_kernels.rope_store_kv
        else:
            fn = cpu_fused.rope_store_kv_ref
        fn(q, k, v, self.cos, self.sin, positions, k_cache, v_cache, slots)
