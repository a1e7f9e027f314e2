"""The token embedding and the LM head split by vocabulary over the tensor-parallel ranks.

Each rank holds the rows of its vocabulary range. An embedding lookup of ids outside it gives
zeros there, and one all-reduce sums the ranks' rows; the head computes logits for its range,
and one all-gather puts the full vocabulary together (every rank gets all logits). With one
rank both are the plain embedding and linear. A quantized embedding (a GGUF's) stays quantized:
a lookup dequantizes only the rows it takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.workers.distributed.parallel_state import tp
from deepinfer.workers.layers.linear import Linear, shard_on_load
from deepinfer.workers.quantization.weight import QuantizedWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp = tp()
        self.start, self.size = self.tp.shard(vocab_size, "vocabulary size")
        self.weight = nn.Parameter(torch.empty(self.size, hidden), requires_grad=False)
        shard_on_load(self.weight, 0, self.start, self.size)
        self.quantized: QuantizedWeight | None = None

    def load_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.weight.data = torch.empty(0)  # (never written: its pages were never touched)

    def finalize(self, quantization: str | None = None) -> None:
        """--quantization none: the float embedding after all."""
        if self.quantized is not None and quantization == "none":
            self.weight.data = self.quantized.dequantize()
            self.quantized = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.take_rows(ids.reshape(-1)).dequantize().view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return self._rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.size)
        rows = self._rows(local.clamp(0, self.size - 1))
        return self.tp.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(Linear):
    def __init__(self, hidden: int, vocab_size: int) -> None:
        self.tp = tp()
        start, size = self.tp.shard(vocab_size, "vocabulary size")
        super().__init__(hidden, size)
        shard_on_load(self.weight, 0, start, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(super().forward(x), dim=-1)
