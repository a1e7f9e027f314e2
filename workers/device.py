"""Which device a worker rank computes on (--device, engine/config.py DEVICES).

auto takes a CUDA GPU when torch sees one, else the CPU; cuda insists on one. A node's ranks
take its GPUs in order (rank r of a node with P ranks: GPU r % P, wrapping when P exceeds them,
as a multi-node run places P = world / nnodes ranks per host).
"""

from __future__ import annotations

import torch

from deepinfer.engine.config import EngineConfig, ModelConfigError


class DeviceError(ModelConfigError):
    """--device names a device this machine or this config cannot use (the user's to fix: the
    worker reports it without a traceback)."""


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (CUDA build: "
            f"{torch.version.cuda or 'none'}); use --device cpu or auto")
    problems = config.cpu_only_features()
    if problems:  # under auto: --device cuda refused these before any process started
        raise DeviceError(f"a CUDA GPU was found (--device {config.device}), but "
                          + "; ".join(problems) + ": pass --device cpu")
    per_node = max(1, config.tensor_parallel_size // max(1, config.nnodes))
    return torch.device("cuda", (rank % per_node) % torch.cuda.device_count())
