"""The grouped LoRA Triton kernels against a per-row float64 loop (interpreter: small shapes)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.lora import lora_delta_
from tests.kernels.triton.device import DEVICE, DTYPES, check, scaled


def make(seed: int, n: int, in_: int, rank: int, n_slots: int, sizes, out: int,
         dtype: torch.dtype, slots: list[int]):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_, generator=gen).to(DEVICE, dtype)
    y = torch.randn(n, out, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(n_slots, len(sizes) * rank, in_, generator=gen) / in_**0.5).to(DEVICE, dtype)
    bs = [(torch.randn(n_slots, size, rank, generator=gen) / rank**0.5).to(DEVICE, dtype)
          for size in sizes]
    return y, x, torch.tensor(slots, dtype=torch.int32, device=DEVICE), a, bs


def loop_oracle(y, x, slots, a, bs, offsets) -> torch.Tensor:
    """The semantics row by row in float64, on the CPU."""
    out = y.cpu().double().clone()
    rank = a.shape[1] // len(bs)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        t = a[s].cpu().double() @ x[i].cpu().double()
        for p, (b, off) in enumerate(zip(bs, offsets)):
            out[i, off:off + b.shape[1]] += b[s].cpu().double() @ t[p * rank:(p + 1) * rank]
    return out


# (IN, R, sizes, offsets, OUT, slots): P = 1..3, sizes / IN off the block sizes, gaps in y
CASES = [
    (40, 8, (24,), (0,), 24, [0, -1, 2, 1, 0, 2]),
    (33, 16, (20, 12), (0, 24), 37, [1, 1, -1, 0, -1]),
    (24, 8, (16, 8, 8), (0, 16, 24), 32, [2, 0, 1, -1]),
    (70, 32, (36, 20), (4, 40), 64, [0, 2, 2]),
    (50, 64, (18,), (0,), 18, [1, -1]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{len(c[2])}-R{c[1]}-IN{c[0]}")
def test_matches_loop(dtype: torch.dtype, case) -> None:
    in_, rank, sizes, offsets, out, slots = case
    y, x, slots_t, a, bs = make(in_ + rank, len(slots), in_, rank, 3, sizes, out, dtype, slots)
    ref = loop_oracle(y, x, slots_t, a, bs, offsets)
    got = y.clone()
    lora_delta_(got, x, slots_t, a, bs, offsets, block_j=8, block_k=16, block_o=16)  # tiles
    check("lora_delta", got, ref, scaled(dtype, ref))
    untouched = slots_t < 0
    assert torch.equal(got[untouched], y[untouched])


def test_strided_rows_and_no_adapters() -> None:
    """x and y as column slices of wider tensors (row strides); rows without slots untouched."""
    in_, rank, sizes, offsets = 20, 8, (12, 6), (0, 14)
    y, x, slots, a, bs = make(7, 4, in_, rank, 2, sizes, 20, torch.float32, [1, -1, 0, 1])
    wide_y = torch.cat([y, torch.ones_like(y)], dim=1)
    wide_x = torch.cat([torch.zeros_like(x), x], dim=1)
    got_y, view_x = wide_y.clone(), wide_x[:, in_:]
    lora_delta_(got_y[:, :20], view_x, slots, a, bs, offsets)
    ref = loop_oracle(y, x, slots, a, bs, offsets)
    check("lora_delta", got_y[:, :20], ref, scaled(torch.float32, ref))
    assert torch.equal(got_y[:, 20:], wide_y[:, 20:])
    none = slots.new_full(slots.shape, -1)
    untouched = y.clone()
    lora_delta_(untouched, x, none, a, bs, offsets)
    assert torch.equal(untouched, y)
    lora_delta_(y[:0], x[:0], none[:0], a, bs, offsets)  # no rows: no launch
