"""Float32 linear for small batches (decode, M of 1..4) on CPU: a native weight-streaming kernel.

At decode batch sizes a linear is bound by reading its weight from memory. `linear_small_m`
reads each row of the plain [N, K] (Hugging Face layout) weight once for all M input rows:
threads take contiguous slices of output rows, several rows at a time with AVX-512 / AVX2 FMA
and software prefetch (csrc/linear.cpp). It is correct for any M, but meant for M <= 4; larger
batches belong to a GEMM. The C++ source is built by torch's cpp_extension on first use and
cached under the torch extensions dir. `available(*tensors)` says, never raising, whether it can
be used; callers fall back (F.linear / oneDNN) when it says no.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("cpu_linear", "linear.cpp", "linear_small_m")


def build_error() -> str | None:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _OP.error


def available(*tensors: torch.Tensor | None) -> bool:
    """True when the kernel is built (building it on first call) and takes these tensors."""
    return _OP.available(*tensors)


def linear_small_m(x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, w [N, K] float32 contiguous, bias [N] or None -> [..., N]; the same as
    F.linear(x, w, bias) up to float32 summation order. Call `available` first."""
    return _OP(x, w, bias)
