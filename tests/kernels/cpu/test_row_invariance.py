"""The kernels --deterministic relies on (workers/deterministic.py) give each row the same bits
whatever else is in the call: the small-M linear at any M, the paged attention kernel under a
fixed split at any batch; and the paged kernel's default split does not (why the mode exists)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import linear as cpu_linear

if not (cpu_linear.available(torch.zeros(1)) and cpu_attention.available(torch.zeros(1))):
    pytest.skip("native CPU kernels unavailable", allow_module_level=True)


@pytest.mark.parametrize("k,n", [(64, 96), (576, 1536), (100, 37)])
def test_small_m_linear_rows_do_not_depend_on_m(k, n):
    torch.manual_seed(0)
    w, b = torch.randn(n, k), torch.randn(n)
    rows = torch.randn(70, k)
    alone = torch.cat([cpu_linear.linear_small_m(rows[i: i + 1], w, b) for i in range(70)])
    for m in (2, 3, 4, 5, 9, 17, 64, 70):
        assert torch.equal(cpu_linear.linear_small_m(rows[:m], w, b), alone[:m]), m
    torch.testing.assert_close(alone, torch.nn.functional.linear(rows, w, b), rtol=1e-5,
                               atol=1e-4)


@pytest.fixture()
def fixed_split():
    cpu_attention.set_fixed_split(cpu_attention.FIXED_SPLIT_BLOCKS)
    yield
    cpu_attention.set_fixed_split(0)  # process-wide: the other tests want the default


def batch(rows: int, seed: int, q0: torch.Tensor, hi0: int, num_blocks: int, bs: int):
    """Row 0 is (q0, keys [0, hi0)); other rows random queries over random ranges."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, *q0.shape, generator=g)
    q[0] = q0
    hi = torch.randint(1, num_blocks * bs, (rows,), generator=g, dtype=torch.int32)
    hi[0] = hi0
    lo = torch.zeros(rows, dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g) for _ in range(rows)])
    tables[0] = torch.arange(num_blocks)
    return q, tables, lo, hi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_rows_under_a_fixed_split_do_not_depend_on_the_batch(fixed_split,
                                                                            dtype):
    torch.manual_seed(1)
    nb, bs, kvh, d, h = 80, 16, 2, 64, 6
    k, v = torch.randn(nb, bs, kvh, d).to(dtype), torch.randn(nb, bs, kvh, d).to(dtype)
    q0, hi0 = torch.randn(h, d), nb * bs - 7  # a long row: several runs of 16 blocks
    outs = []
    for rows in (1, 2, 7, 64):
        q, tables, lo, hi = batch(rows, rows, q0, hi0, nb, bs)
        outs.append(cpu_attention.paged_decode_attention(q, k, v, tables, lo, hi, 0.125)[0])
    assert all(torch.equal(o, outs[0]) for o in outs)
    q, tables, lo, hi = batch(1, 0, q0, hi0, nb, bs)
    ref = cpu_attention.paged_decode_attention_ref(q, k, v, tables, lo, hi, 0.125)[0]
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


def test_paged_attention_by_default_splits_by_the_batch():
    """Without the fixed split one long row alone is cut into more runs than beside 63 others:
    its bits move (by float32 rounding only)."""
    torch.manual_seed(2)
    nb, bs, kvh, d, h = 80, 16, 2, 64, 6
    k, v = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    q0, hi0 = torch.randn(h, d), nb * bs - 7
    q, tables, lo, hi = batch(1, 0, q0, hi0, nb, bs)
    alone = cpu_attention.paged_decode_attention(q, k, v, tables, lo, hi, 0.125)[0]
    q, tables, lo, hi = batch(64, 3, q0, hi0, nb, bs)
    beside = cpu_attention.paged_decode_attention(q, k, v, tables, lo, hi, 0.125)[0]
    assert not torch.equal(alone, beside)
    torch.testing.assert_close(alone, beside, rtol=1e-5, atol=1e-6)
