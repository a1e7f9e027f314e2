"""Every environment variable DeepInfer reads, in one typed place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where prepared models live (DEEPINFER_CACHE, default ~/.cache/deepinfer)."""
    return Path(os.environ.get("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer")))


def worker_threads() -> int | None:
    """Intra-op threads per worker (DEEPINFER_WORKER_THREADS); None means the cores it owns."""
    value = os.environ.get("DEEPINFER_WORKER_THREADS")
    return int(value) if value else None


def log_level() -> str:
    return os.environ.get("DEEPINFER_LOG_LEVEL", "INFO").upper()
