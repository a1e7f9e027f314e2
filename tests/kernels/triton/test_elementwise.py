"""RMSNorm (+ residual), silu * up and the grammar bitmask against their torch references."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from deepinfer.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_ref
from deepinfer.kernels.triton.silu_mul import silu_and_mul, silu_and_mul_ref
from tests.kernels.triton.device import DEVICE, DTYPES, check, scaled, tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 48), (3, 17)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(DEVICE, dtype)
    residual = torch.randn(rows, n, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.randn(n, generator=gen).to(DEVICE, dtype)
    res_out = residual.clone() if with_residual else None
    res_ref = residual.clone() if with_residual else None
    out = add_rms_norm(x, res_out, weight, 1e-5)
    ref = add_rms_norm_ref(x.clone(), res_ref, weight, 1e-5)
    assert out.dtype == dtype
    check("rmsnorm", out, ref, 2 * scaled(dtype, ref))
    if with_residual:
        check("rmsnorm residual", res_out, res_ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 40), (2, 3, 2 * 9)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 2).to(DEVICE, dtype)
    out = silu_and_mul(x, block=32)  # several column blocks per row
    ref = silu_and_mul_ref(x)
    assert out.dtype == dtype
    check("silu_and_mul", out, ref, 2 * scaled(dtype, ref))


@pytest.mark.parametrize("vocab,words", [(100, 4), (64, 2), (70, 2), (40, 3)])
def test_bitmask_masks_only_listed_rows(vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(DEVICE)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(DEVICE)
    rows = [0, 3, 4]
    out, ref = logits.clone(), logits.clone()
    apply_token_bitmask(out, bitmask, rows, block=32)
    apply_token_bitmask_ref(ref, bitmask, rows)
    check("bitmask", out, ref, 1e-30)  # exact: -inf or untouched
    assert torch.equal(out, ref)
    assert torch.equal(out[[1, 2]], logits[[1, 2]])
    # the layout itself: bit j of word w is token 32 * w + j
    covered = min(vocab, 32 * words)
    for r in rows:
        for t in range(covered):
            bit = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == float("-inf")) == (bit == 0)
        assert torch.equal(out[r, covered:], logits[r, covered:])


def test_bitmask_rows_as_tensor_and_empty() -> None:
    logits = torch.zeros(3, 40, device=DEVICE)
    bitmask = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    apply_token_bitmask(logits, bitmask, [])
    assert torch.equal(logits, torch.zeros_like(logits))
    apply_token_bitmask(logits, bitmask, torch.tensor([1], device=DEVICE))
    assert torch.isinf(logits[1]).all() and not torch.isinf(logits[[0, 2]]).any()
