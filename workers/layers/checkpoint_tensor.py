"""A checkpoint tensor not read yet: narrowing it narrows what will be read.

The loader hands these to the layers, which keep the part they hold (a tensor-parallel shard,
an expert-parallel share of the experts) with `narrow` and read it with `materialize`, so each
rank of a parallel group reads only its part of each weight from disk.
"""

from __future__ import annotations

import torch

from deepinfer.workers.quantization.weight import QuantizedWeight


class LazyTensor:
    def __init__(self, source, shape: tuple[int, ...], index: tuple[slice, ...] | None = None
                 ) -> None:
        self._source = source  # a safetensors slice: source[index] reads
        self._full = shape
        self._index = index or tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= len(self._index)
        index = list(self._index)
        base = index[dim].start
        if start < 0 or base + start + length > index[dim].stop:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside {tuple(self.shape)}")
        index[dim] = slice(base + start, base + start + length)
        return LazyTensor(self._source, self._full, tuple(index))

    @property
    def is_bfloat16(self) -> bool:
        """Stored as bfloat16 (a safetensors slice names its dtype)."""
        return getattr(self._source, "get_dtype", lambda: "")() == "BF16"

    def read(self) -> torch.Tensor:
        return self._source[self._index]


def materialize(t: torch.Tensor | LazyTensor | QuantizedWeight) -> torch.Tensor:
    """The float tensor a checkpoint tensor stands for: read if lazy, dequantized if quantized
    (a layer that keeps quantized weights takes them before this)."""
    if isinstance(t, LazyTensor):
        return t.read()
    return t.dequantize() if isinstance(t, QuantizedWeight) else t
