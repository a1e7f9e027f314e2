"""Build-on-first-use native CPU ops (torch cpp_extension), shared by the CPU kernels.

A NativeOp compiles its C++ source once (~10 s, cached under the torch extensions dir, keyed by
the CPU's flags and the torch version, since the code is built with -march=native) and never
raises from `available()`: callers fall back to plain torch when there is no compiler. That
fallback is logged once per op, as a warning with the build error: it costs several times the
decode speed, and must not pass unnoticed (as it did when an installed wheel lacked csrc/).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("deepinfer.kernels")

_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_tag() -> str:
    """Keys the cached build: -march=native code must not run on another CPU, nor an old build
    against another torch; and two installs (a checkout, a wheel) must not rebuild each other's
    copy on every start, as they would under one name with different source paths."""
    flags = f"{platform.machine()} {torch.__version__} {Path(__file__).parent.resolve()}"
    for header in sorted((Path(__file__).parent / "csrc").glob("*.h")):  # not tracked by torch
        flags += header.read_text()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


class NativeOp:
    def __init__(self, name: str, source: str, op_name: str) -> None:
        self.name = name
        self.source = Path(__file__).parent / "csrc" / source
        self.op_name = op_name  # registered as torch.ops.deepinfer_cpu.<op_name>
        self._lock = threading.Lock()
        self.op: Callable[..., torch.Tensor] | None = None
        self.error: str | None = None

    def load(self) -> Callable[..., torch.Tensor] | None:
        if self.op is not None or self.error is not None:
            return self.op
        with self._lock:
            if self.op is None and self.error is None:
                try:
                    if shutil.which("ninja") is None:  # the pip wheel's binary, venv inactive
                        import ninja

                        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]
                    from torch.utils.cpp_extension import load

                    load(name=f"deepinfer_{self.name}_{_build_tag()}",
                         sources=[str(self.source)], extra_cflags=_FLAGS,
                         extra_ldflags=["-fopenmp"], is_python_module=False)
                    self.op = getattr(torch.ops.deepinfer_cpu, self.op_name)
                except Exception as e:  # no compiler / ninja / headers: callers fall back
                    self.error = f"{type(e).__name__}: {e}"
                    log.warning(
                        "native CPU op %s could not be built from %s, so DeepInfer falls back to "
                        "plain torch for it (CPU decode several times slower): %s",
                        self.name, self.source, self.error)
        return self.op

    def available(self, *tensors: torch.Tensor | None) -> bool:
        """True when built (building it on first call) and the tensors (None allowed, e.g. a
        missing bias) are float32 on the CPU."""
        try:
            if not all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
                       for t in tensors):
                return False
        except AttributeError:  # not a tensor
            return False
        return self.load() is not None

    def __call__(self, *args) -> torch.Tensor:
        op = self.op if self.op is not None else self.load()
        if op is None:
            raise RuntimeError(f"native op {self.name} unavailable: {self.error}")
        return op(*args)

    def sibling(self, op_name: str) -> Callable[..., torch.Tensor]:
        """Another op registered by the same source file (call `available` first)."""
        if self.load() is None:
            raise RuntimeError(f"native op {self.name} unavailable: {self.error}")
        return getattr(torch.ops.deepinfer_cpu, op_name)
