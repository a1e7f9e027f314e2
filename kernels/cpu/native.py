"""Build-on-first-use native CPU ops (torch cpp_extension), shared by the CPU kernels.

A NativeOp compiles its C++ source once (~10 s, cached under the torch extensions dir in a folder
keyed by all that changes the build: see _build_tag) and never raises from `available()`:
callers fall back to plain torch when there is no compiler. That fallback is logged once per op,
as a warning with the build error: it costs several times the decode speed, and must not pass
unnoticed (as it did when an installed wheel lacked csrc/).

A build is announced (INFO), one process builds a folder at a time, and a lock left by a process
killed while it built no longer hangs every later start (build_lock.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer.kernels.cpu.build_lock import build_lock

log = logging.getLogger("deepinfer.kernels")

_FLAGS = ["-O3", "-march=native", "-fopenmp"]
# How long a load waits for another process's build of the same op (one takes ~10 s, longer
# on a busy machine) before it gives up and falls back to plain torch.
BUILD_WAIT_S = 300.0


def _ensure_ninja() -> None:
    if shutil.which("ninja") is None:  # the pip wheel's binary, venv inactive
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]


@functools.cache
def _ninja_version() -> str:
    return subprocess.run(["ninja", "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _build_tag() -> str:
    """Keys the cached build: -march=native code must not run on another CPU, nor an old build
    against another torch; nor two toolchains: the compiler command is in build.ninja, and
    ninja 1.11 and 1.13 hash commands differently in .ninja_log, so processes that found
    different ones (a test run, a server started from an activated venv) rebuilt each other's
    op at every start; nor two torch installs (build.ninja names torch's headers by their path:
    two venvs would rebuild each other's op). Not the sources' path: each op compiles a copy of
    its source kept in its build folder (NativeOp._copied_source), so installs of DeepInfer at
    other paths over one torch (a checkout, a wheel) share one build."""
    from torch.utils.cpp_extension import get_cxx_compiler

    flags = f"{platform.machine()} {torch.__version__} {Path(torch.__file__).parent}"
    flags += f" {get_cxx_compiler()} ninja {_ninja_version()}"
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

    def library_name(self) -> str:
        """Named by the build tag and the source's content: another version of the source builds
        in its own folder instead of rebuilding over this one."""
        _ensure_ninja()
        content = hashlib.sha1(self.source.read_bytes()).hexdigest()[:8]
        return f"deepinfer_{self.name}_{_build_tag()}{content}"

    def build_dir(self) -> Path:
        """Where torch builds it (under TORCH_EXTENSIONS_DIR, or torch's default root)."""
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(self.library_name(), verbose=False))

    def load(self) -> Callable[..., torch.Tensor] | None:
        if self.op is not None or self.error is not None:
            return self.op
        with self._lock:
            if self.op is None and self.error is None:
                try:
                    self._build()
                    self.op = getattr(torch.ops.deepinfer_cpu, self.op_name)
                except Exception as e:  # no compiler / ninja / headers: callers fall back
                    self.error = f"{type(e).__name__}: {e}"
                    log.warning(
                        "native CPU op %s could not be built from %s, so DeepInfer falls back to "
                        "plain torch for it (CPU decode several times slower): %s",
                        self.name, self.source, self.error)
        return self.op

    def _build(self) -> None:
        """Build (if needed) and load the library, holding its folder against other processes."""
        from torch.utils.cpp_extension import load

        build_dir = self.build_dir()
        name = build_dir.name  # torch's folder is named after the library
        with build_lock(build_dir, self.name, BUILD_WAIT_S):
            library = build_dir / f"{name}.so"
            built = library.stat().st_mtime_ns if library.exists() else None
            if built is None:
                log.info("building native op %s (first use, ~10 s) in %s", self.name, build_dir)
            start = time.monotonic()
            load(name=name, sources=[str(self._copied_source(build_dir))], extra_cflags=_FLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                 is_python_module=False)
            if built is not None and library.stat().st_mtime_ns != built:
                log.info("rebuilt native op %s in %.0f s (its source changed)", self.name,
                         time.monotonic() - start)

    def _copied_source(self, build_dir: Path) -> Path:
        """The source and the headers beside it, copied into the build folder (rewritten only
        when they differ, so ninja sees no change): build.ninja then names no path of this
        install, and every install with the same sources finds the build done."""
        copies = build_dir / "src"
        copies.mkdir(exist_ok=True)
        for path in (self.source, *sorted(self.source.parent.glob("*.h"))):
            data, copy = path.read_bytes(), copies / path.name
            if not copy.exists() or copy.read_bytes() != data:
                copy.write_bytes(data)
        return copies / self.source.name

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
