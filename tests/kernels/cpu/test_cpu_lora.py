"""The grouped LoRA products (native kernel and torch reference) against a per-row float64 loop."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import lora

# (N, IN, R, S, sizes, offsets, OUT): P = 1..3, IN / OUT off multiples of 16, parts with gaps
# between them (columns no part covers must stay as they were)
SHAPES = [
    (5, 37, 8, 3, (45,), (0,), 45),
    (9, 100, 16, 4, (33, 20), (0, 40), 67),
    (12, 64, 32, 2, (96, 24, 24), (0, 96, 120), 144),
    (7, 130, 64, 5, (50, 17, 9), (3, 60, 80), 95),
    (64, 576, 16, 8, (576, 192, 192), (0, 576, 768), 960),
    (6, 4, 12, 2, (21, 7), (2, 30), 40),  # IN below a vector, a rank that divides none
    (5, 24, 24, 3, (33,), (0,), 33),
]
# (rtol, atol): float32 sums against float64; a half type's result is rounded once (half an ulp)
TOL = {torch.float64: (1e-7, 1e-7), torch.float32: (2e-5, 2e-5), torch.bfloat16: (5e-3, 1e-4),
       torch.float16: (1e-3, 1e-4)}


def make(seed: int, n: int, in_: int, rank: int, n_slots: int, sizes, out: int,
         dtype: torch.dtype, slots: list[int] | None = None):
    """Weights scaled so that the deltas are of order 1, like y's entries."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_, generator=gen).to(dtype)
    y = torch.randn(n, out, generator=gen).to(dtype)
    a = (torch.randn(n_slots, len(sizes) * rank, in_, generator=gen) / in_**0.5).to(dtype)
    bs = [(torch.randn(n_slots, size, rank, generator=gen) / rank**0.5).to(dtype)
          for size in sizes]
    if slots is None:  # every slot, and rows with none
        slots = torch.randint(-1, n_slots, (n,), generator=gen).tolist()
    return y, x, torch.tensor(slots, dtype=torch.int32), a, bs


def loop_oracle(y, x, slots, a, bs, offsets) -> torch.Tensor:
    """The semantics row by row in float64: written apart from both implementations."""
    out = y.double().clone()
    rank = a.shape[1] // len(bs)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        t = a[s].double() @ x[i].double()
        for p, (b, off) in enumerate(zip(bs, offsets)):
            out[i, off:off + b.shape[1]] += b[s].double() @ t[p * rank:(p + 1) * rank]
    return out


def check(impl, y, x, slots, a, bs, offsets) -> None:
    expected = loop_oracle(y, x, slots, a, bs, offsets)
    out = y.clone()
    assert impl(out, x, slots, a, bs, offsets) is None
    rtol, atol = TOL[y.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)
    untouched = slots < 0
    assert torch.equal(out[untouched], y[untouched])
    covered = torch.zeros(y.shape[1], dtype=torch.bool)
    for b, off in zip(bs, offsets):
        covered[off:off + b.shape[1]] = True
    assert torch.equal(out[:, ~covered], y[:, ~covered])


def native(y, x, slots, a, bs, offsets) -> None:
    if not lora.available():  # test_native_op_is_built says so, once
        pytest.skip(f"native op not built: {lora.build_error()}")
    lora._OP(y, x, slots, a, bs, offsets)


IMPLS = {"native": native, "reference": lora.lora_delta_reference}


def test_native_op_is_built() -> None:
    """This environment has a compiler: the native kernel must be there, not the fallback."""
    assert lora.available(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)), \
        lora.build_error()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"P{len(s[4])}-R{s[2]}-IN{s[1]}")
def test_matches_loop(impl: str, dtype: torch.dtype, shape) -> None:
    n, in_, rank, n_slots, sizes, offsets, out = shape
    y, x, slots, a, bs = make(n * in_ + rank, n, in_, rank, n_slots, sizes, out, dtype)
    assert (slots >= 0).any() and (slots < 0).any()
    check(IMPLS[impl], y, x, slots, a, bs, offsets)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_rows_and_no_adapters(impl: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        check(IMPLS[impl], *make(0, 0, 20, 8, 2, (12, 6), 18, dtype, slots=[]), (0, 12))
        y, x, slots, a, bs = make(1, 6, 20, 8, 2, (12, 6), 18, dtype, slots=[-1] * 6)
        out = y.clone()
        IMPLS[impl](out, x, slots, a, bs, (0, 12))
        assert torch.equal(out, y)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_thread_counts(n_threads: int) -> None:
    """Rows split over threads at any boundary, one slot's rows spread over several tasks."""
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        y, x, slots, a, bs = make(n_threads, 33, 200, 16, 3, (64, 32), 96, torch.float32)
        check(native, y, x, slots, a, bs, (0, 64))
    finally:
        torch.set_num_threads(before)


def test_dispatch_uses_native(monkeypatch) -> None:
    y, x, slots, a, bs = make(2, 10, 48, 16, 3, (40, 8, 8), 56, torch.bfloat16)

    def no_reference(*args) -> None:
        raise AssertionError("fell back to the reference")

    assert lora.available(), lora.build_error()
    monkeypatch.setattr(lora, "lora_delta_reference", no_reference)
    check(lora.lora_delta_, y, x, slots, a, bs, (0, 40, 48))
    # int64 slots are taken too (converted for the kernel)
    check(lora.lora_delta_, y, x, slots.long(), a, bs, (0, 40, 48))


def test_dispatch_falls_back() -> None:
    """Tensors the kernel does not take (float64, a strided x) go to the reference."""
    y, x, slots, a, bs = make(3, 8, 40, 8, 2, (24, 16), 40, torch.float64)
    check(lora.lora_delta_, y, x, slots, a, bs, (0, 24))
    y, x, slots, a, bs = make(4, 8, 40, 8, 2, (24,), 24, torch.float32)
    strided = torch.cat([x, x], 1)[:, :40]
    assert not strided.is_contiguous()
    check(lora.lora_delta_, y, strided, slots, a, bs, (0,))


def test_rejects_bad_inputs() -> None:
    y, x, slots, a, bs = make(5, 4, 16, 8, 2, (10,), 12, torch.float32, slots=[0, 1, -1, 0])
    with pytest.raises(RuntimeError, match="slot 2"):
        native(y, x, torch.tensor([0, 2, -1, 0], dtype=torch.int32), a, bs, (0,))
    with pytest.raises(RuntimeError, match="does not fit"):
        native(y, x, slots, a, bs, (3,))
    with pytest.raises(RuntimeError, match="one offset per part"):
        native(y, x, slots, a, bs, (0, 0))
    with pytest.raises(RuntimeError, match="contiguous"):
        native(y, x, slots, a, [bs[0].transpose(1, 2).contiguous().transpose(1, 2)], (0,))
    with pytest.raises(RuntimeError):
        native(y.double(), x.double(), slots, a.double(), [b.double() for b in bs], (0,))
