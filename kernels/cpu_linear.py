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

import hashlib
import os
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "linear.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_op: Callable[..., torch.Tensor] | None = None
_error: str | None = None


def _build_tag() -> str:
    """Keys the cached build: -march=native code must not run on another CPU, nor an old build
    against another torch."""
    flags = f"{platform.machine()} {torch.__version__}"
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _load() -> Callable[..., torch.Tensor] | None:
    global _op, _error
    if _op is not None or _error is not None:
        return _op
    with _lock:
        if _op is None and _error is None:
            try:
                if shutil.which("ninja") is None:  # the pip wheel's binary, venv not activated
                    import ninja

                    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
                from torch.utils.cpp_extension import load

                load(name=f"deepinfer_cpu_linear_{_build_tag()}", sources=[str(_SRC)],
                     extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
                _op = torch.ops.deepinfer_cpu.linear_small_m
            except Exception as e:  # no compiler / ninja / headers: callers fall back
                _error = f"{type(e).__name__}: {e}"
    return _op


def build_error() -> str | None:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _error


def available(*tensors: torch.Tensor | None) -> bool:
    """True when the kernel is built (building it on first call) and takes these tensors
    (None, for a missing bias, is accepted)."""
    try:
        if not all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
                   for t in tensors):
            return False
    except AttributeError:  # not a tensor
        return False
    return _load() is not None


def linear_small_m(x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, w [N, K] float32 contiguous, bias [N] or None -> [..., N]; the same as
    F.linear(x, w, bias) up to float32 summation order. Call `available` first."""
    op = _op if _op is not None else _load()
    if op is None:
        raise RuntimeError(f"small-M linear extension unavailable: {_error}")
    return op(x, w, bias)
