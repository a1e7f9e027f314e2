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


def int8_dynamic_activations() -> bool:
    """DEEPINFER_INT8_DYNAMIC_ACTIVATIONS=1: int8 linears take more than 4 rows through FBGEMM's
    u8 x s8 GEMM with per-token activations (W8A8: faster for prefill and big batches, but the
    7-bit activations change the default model's greedy text early; workers/quantization)."""
    return os.environ.get("DEEPINFER_INT8_DYNAMIC_ACTIVATIONS", "") not in ("", "0")


def cluster_secret() -> bytes | None:
    """The secret DeepInfer's servers, router and nodes share (DEEPINFER_CLUSTER_SECRET;
    `--cluster-secret-file` sets it for the processes a command starts): what they
    authenticate each other with (engine/trust.py). None when unset."""
    value = os.environ.get("DEEPINFER_CLUSTER_SECRET", "")
    return value.encode() if value else None
