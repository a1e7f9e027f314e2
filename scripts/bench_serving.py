"""Serving benchmark: same as `deepinfer bench serve ...` (see frontend/bench_serving.py)."""

from __future__ import annotations

import sys

from deepinfer.frontend.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
