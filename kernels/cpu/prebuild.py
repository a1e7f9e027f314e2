"""Build every native CPU op now, two at a time, instead of on first use:
`python -m deepinfer.kernels.cpu.prebuild`. `make test` runs it before pytest, whose workers
would otherwise wait on each other's builds one op at a time (~1-2 min in a fresh venv).
Exits 1, naming the op and why, if one cannot be built."""

from __future__ import annotations

import importlib
import sys
from concurrent.futures import ProcessPoolExecutor

# The modules that each hold one NativeOp (their `_OP`).
OP_MODULES = ("attention", "bf16_linear", "decode_layer", "fused", "kquant_linear", "linear",
              "lora", "quant_linear")


def build(module: str) -> str | None:
    """Build (or find built) the op of `module`: None, or why it could not be built."""
    op = importlib.import_module(f"deepinfer.kernels.cpu.{module}")._OP
    return None if op.load() is not None else f"{op.name}: {op.error}"


def main() -> int:
    with ProcessPoolExecutor(2) as pool:
        errors = [error for error in pool.map(build, OP_MODULES) if error]
    for error in errors:
        print(f"native op not built: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
