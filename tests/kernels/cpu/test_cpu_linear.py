"""The native small-M linear kernel against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu.linear import available, build_error, linear_small_m

pytestmark = pytest.mark.skipif(
    not available(), reason=f"small-M linear extension cannot be built: {build_error()}"
)


def make(gen: torch.Generator, m: int, k: int, n: int, bias: bool):
    """Weights scaled like a trained layer's (outputs of order 1)."""
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    out = linear_small_m(x, w, b)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 64), (13, 7), (577, 35),
                                 (1, 9), (15, 17), (17, 1), (100, 4099)])
def test_matches_f_linear(m: int, bias: bool, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k * 7 + n)
    check(*make(gen, m, k, n, bias))


def test_random_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        m = int(torch.randint(1, 5, (1,), generator=gen))
        k = int(torch.randint(1, 700, (1,), generator=gen))
        n = int(torch.randint(1, 300, (1,), generator=gen))
        check(*make(gen, m, k, n, bool(torch.randint(0, 2, (1,), generator=gen))))


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_thread_counts(threads, n_threads: int) -> None:
    """Slices split between threads at any boundary (odd N, leftover rows per slice)."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(n_threads)
    for m in (1, 3):
        check(*make(gen, m, 576, 8195, True))


def test_larger_m_and_leading_dims() -> None:
    """M > 4 (groups of 4 and a rest) is still right; x [..., K] keeps its leading dims."""
    gen = torch.Generator().manual_seed(1)
    for m in (5, 8, 11):
        check(*make(gen, m, 200, 37, True))
    x, w, b = make(gen, 6, 96, 40, True)
    check(x.view(2, 3, 96), w, b)
    check(x.view(96 * 6)[:96], w, None)  # 1-D x -> 1-D out


def test_non_contiguous_x() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 3, generator=gen).t()  # [3, 64], strided
    w = torch.randn(31, 64, generator=gen) / 8
    check(x, w, None)


def test_empty() -> None:
    w = torch.randn(5, 8)
    assert linear_small_m(torch.randn(0, 8), w).shape == (0, 5)
    b = torch.randn(5)
    torch.testing.assert_close(linear_small_m(torch.randn(2, 0), torch.randn(5, 0), b),
                               b.expand(2, 5))


def test_rejects_bad_inputs() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError):
        linear_small_m(x, torch.randn(8, 5).t())  # non-contiguous weight
    with pytest.raises(RuntimeError):
        linear_small_m(x, torch.randn(5, 7))  # K mismatch
    with pytest.raises(RuntimeError):
        linear_small_m(x, torch.randn(5, 8), torch.randn(4))  # bias size
    with pytest.raises(RuntimeError):
        linear_small_m(x.double(), torch.randn(5, 8).double())


def test_available_checks_tensors() -> None:
    assert available(torch.randn(2, 3), torch.randn(4, 3), None)
    assert not available(torch.randn(2, 3, dtype=torch.float64))
    assert not available("x")  # type: ignore[arg-type]


def test_coexists_with_paged_attention() -> None:
    """Both extensions register ops in the deepinfer_cpu namespace; loading both must work."""
    from deepinfer.kernels.cpu import attention as cpu_attention

    assert cpu_attention.available(), cpu_attention.build_error()
    assert hasattr(torch.ops.deepinfer_cpu, "paged_decode_attention")
    check(*make(torch.Generator().manual_seed(3), 2, 32, 16, False))
