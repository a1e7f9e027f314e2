"""The Triton kernels (kernels/triton) that layers call on a GPU in place of the CPU's native ops:
the fused residual add + RMSNorm, rotary + KV-cache store, SiLU·mul. A layer decides once, at
finalize, by where its weights live (`wanted`); a call whose tensors do not fit the fused form
takes the plain-torch reference, as on the CPU. Imported lazily: CPU workers never load them."""

from __future__ import annotations

import torch


def wanted(t: torch.Tensor) -> bool:
    """True for a tensor on a CUDA device (the tests also send CPU tensors through the Triton
    interpreter by replacing this)."""
    return t.is_cuda


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    from deepinfer.kernels.triton.rmsnorm import add_rms_norm as kernel

    return kernel(x, residual, weight, eps)


def rope_store_kv(*args: torch.Tensor | None) -> None:
    from deepinfer.kernels.triton.rotary_kv import rope_store_kv as kernel

    kernel(*args)


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """--deterministic: a linear whose rows never depend on the batch (kernels/triton/matmul)."""
    from deepinfer.kernels.triton.matmul import linear_rows as kernel

    return kernel(x, w, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from deepinfer.kernels.triton.silu_mul import silu_and_mul as kernel

    return kernel(x)
