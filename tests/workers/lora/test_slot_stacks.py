"""SlotStacks (workers/lora/adapters.py) hold each linear's adapters padded to the largest rank
they hold, not to --max-lora-rank: a rank-4 adapter costs rank 4, a larger one arriving widens
the stacks and every product stays exact."""

from __future__ import annotations

import torch

from deepinfer.workers.layers.linear import MergedLinear
from deepinfer.workers.lora.adapters import SlotStacks


def test_stacks_are_as_wide_as_the_largest_rank_they_hold():
    torch.manual_seed(0)
    linear = MergedLinear(32, {"q": 16, "k": 8})
    stacks = SlotStacks(linear)
    products = {  # slot -> part -> (A, B)
        0: {0: (torch.randn(4, 32), torch.randn(16, 4)),
            1: (torch.randn(4, 32), torch.randn(8, 4))},
        1: {1: (torch.randn(12, 32), torch.randn(8, 12))},
    }
    for part, (a, b) in products[0].items():
        stacks.put(0, part, a, b)
    assert stacks.a.shape[1:] == (2 * 4, 32) and [b.shape[2] for b in stacks.bs] == [4, 4]
    for part, (a, b) in products[1].items():
        stacks.put(1, part, a, b)
    assert stacks.a.shape[1:] == (2 * 12, 32) and [b.shape[2] for b in stacks.bs] == [12, 12]
    x = torch.randn(5, 32)
    slots = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    y = torch.zeros(5, 24)
    stacks.add_products(y, x, slots)
    want = torch.zeros(5, 24)
    offsets = [0, 16]
    for row, slot in enumerate(slots.tolist()):
        for part, (a, b) in products.get(slot, {}).items():
            size = b.shape[0]
            want[row, offsets[part]:offsets[part] + size] += b @ (a @ x[row])
    assert torch.allclose(y, want, atol=1e-4)
