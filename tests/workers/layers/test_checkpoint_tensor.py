"""Checkpoint tensors are read only where a layer narrowed them (a parallel rank's part)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.workers.layers.checkpoint_tensor import LazyTensor, materialize


def test_narrowed_reads_equal_narrowed_tensors(tmp_path):
    full = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)
    save_file({"w": full}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        source = f.get_slice("w")
        lazy = LazyTensor(source, tuple(source.get_shape()))
        part = lazy.narrow(0, 1, 2).narrow(1, 3, 3).narrow(-1, 1, 4)
        assert part.shape == torch.Size([2, 3, 4])
        assert torch.equal(materialize(part), full.narrow(0, 1, 2).narrow(1, 3, 3)
                           .narrow(2, 1, 4))
        assert torch.equal(materialize(lazy), full)
        with pytest.raises(ValueError, match="outside"):
            lazy.narrow(1, 4, 3)
    assert materialize(full) is full
