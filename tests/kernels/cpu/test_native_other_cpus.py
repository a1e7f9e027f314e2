"""The native sources compile for CPUs other than this one: the ops build with -march=native, so
the AVX2-only and pre-AVX2 branches (no AVX512-VNNI, no AVX512-BF16) are never built by the
suite itself, and a constant or helper defined only inside an AVX512 section would break every
op of that file on such a CPU (they would fall back to plain torch, correct but slow). A syntax
check per file and target finds that in seconds, without linking."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[3] / "kernels" / "cpu" / "csrc"
SOURCES = sorted(p.name for p in CSRC.glob("*.cpp"))
# x86-64-v3: AVX2 and FMA (Haswell, Zen 1-3); x86-64-v2: SSE4.2, none of the vector paths.
TARGETS = ["x86-64-v3", "x86-64-v2"]
COMPILER = shutil.which("c++") or shutil.which("g++")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")]


def test_every_source_is_checked() -> None:
    assert {"kquant_linear.cpp", "quant_linear.cpp", "bf16_linear.cpp"} <= set(SOURCES)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_for(source: str, target: str) -> None:
    cmd = [COMPILER, "-fsyntax-only", "-std=c++20", "-fopenmp", f"-march={target}",
           *(f"-I{p}" for p in include_paths()), str(CSRC / source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
