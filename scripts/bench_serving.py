"""Serving benchmark: same as `deepinfer bench serve ...` (see frontend/bench_serving.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from frontend.bench.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
