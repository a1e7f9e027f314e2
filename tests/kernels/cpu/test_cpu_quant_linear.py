"""The quantized linear kernels (int8, fp8, 4-bit) against their dequantized references."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import kquant_linear
from deepinfer.kernels.cpu import quant_linear as ql
from deepinfer.workers.quantization.weight import QuantizedWeight

pytestmark = pytest.mark.skipif(
    not ql.available(torch.empty(1)), reason=f"not built: {ql.build_error()}")


def weight(gen: torch.Generator, kind: str, n: int, k: int, group: int) -> QuantizedWeight:
    """Random quantized weights over their whole code range, scales like a trained layer's."""
    groups = k // group
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight(q, scales)
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaNs
        return QuantizedWeight(codes.view(torch.float8_e4m3fn), scales / 64)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    return QuantizedWeight(q, scales, torch.randn(n, groups, generator=gen) * 0.01)


# More than 64 blocks of 32 a row (2304 / 32): the small-M kernel combines scales 64 blocks at
# a time, and groups of 3 blocks (96) straddle those chunks.
CASES = [("int8", 576, 576), ("int8", 1536, 32), ("int8", 256, 16), ("int8", 192, 64),
         ("int8", 2304, 16), ("int8", 2304, 96), ("int8", 2304, 2304), ("fp8", 512, 128),
         ("fp8", 320, 16), ("fp8", 64, 64), ("q4", 576, 32), ("q4", 96, 32), ("q4", 2304, 32)]


@pytest.mark.parametrize("kind,k,group", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("n", [1, 7, 133])
def test_small_m_matches_reference(kind: str, k: int, group: int, m: int, n: int) -> None:
    """Exact up to float32 summation order: int8 and 4-bit weights meet the activations as
    `quantize_activations` rounds them (int8 per block of 32); fp8 ones meet them as they are."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = weight(gen, kind, n, k, group)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    seen = x if kind == "fp8" else ql.quantize_activations(x)
    ref = ql.reference(seen, w.dequantize(), bias)
    out = ql.quant_linear_small_m(x, w.qweight, w.scales, w.mins, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind,k,group", CASES)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_dequantized_tiles_match_reference(kind: str, k: int, group: int, m: int) -> None:
    """The large-M path takes x as it is: the float32 product with the dequantized weight."""
    gen = torch.Generator().manual_seed(m)
    w = weight(gen, kind, 300, k, group)
    x = torch.randn(2, m, k, generator=gen)  # leading dims kept
    ref = ql.reference(x, w.dequantize())
    out = ql.quant_linear_dequant(x, w.qweight, w.scales, w.mins)
    assert out.shape == (2, m, 300)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("k,group", [(576, 576), (576, 32), (1536, 64), (96, 32)])
@pytest.mark.parametrize("m", [1, 5, 8, 13, 70, 300])  # 300: two passes of 256 rows
@pytest.mark.parametrize("n", [1, 16, 45])  # tiles of 16 columns, whole and partial
@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_int_gemm_matches_reference(kind: str, k: int, group: int, m: int, n: int) -> None:
    """The integer GEMM computes what the small-M kernel computes (activations int8 per block
    of 32), for any M: the same reference, exact up to summation order; -128 weights
    included."""
    if kind == "q4":
        group = 32
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w = weight(gen, kind, n, k, group)
    if kind == "int8":
        w.qweight[0, :8] = -128  # outside the symmetric range, yet a valid int8
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)  # outlier columns
    bias = torch.randn(n, generator=gen)
    ref = ql.reference(ql.quantize_activations(x), w.dequantize(), bias)
    out = ql.quant_linear_int_gemm(x, w.qweight, w.scales, w.mins, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    tiles = ql.quant_linear_pack(w.qweight, w.scales, w.mins)  # packed once: the same sums
    assert torch.equal(ql.quant_linear_int_gemm(x, w.qweight, w.scales, w.mins, bias, tiles), out)
    w16 = QuantizedWeight(w.qweight, w.scales.half(), None if w.mins is None else w.mins.half())
    half = ql.quant_linear_int_gemm(x.view(1, m, k), w16.qweight, w16.scales, w16.mins)  # 3-D x
    torch.testing.assert_close(half[0], ql.reference(ql.quantize_activations(x),
                                                     w16.dequantize()),
                               rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_quant_linear_routes_rows_to_the_faster_kernel(kind: str, m: int) -> None:
    """quant_linear: the small-M kernel for decode batches, the integer GEMM above 4 rows, and
    (AVX512-VNNI) from 3 rows for an int8 weight whose tiles are kept; the two kernels' float
    sums differ in order, so the bits tell which ran."""
    gen = torch.Generator().manual_seed(m)
    w = weight(gen, kind, 48, 1536, 32)
    x = torch.randn(m, 1536, generator=gen)
    tiles = ql.quant_linear_pack(w.qweight, w.scales, w.mins)
    small = ql.quant_linear_small_m(x, w.qweight, w.scales, w.mins)
    gemm = ql.quant_linear_int_gemm(x, w.qweight, w.scales, w.mins, None, tiles)
    assert not torch.equal(small, gemm)  # else this test could not tell them apart
    vnni_tiles = kind == "int8" and kquant_linear.int8_gemm() and tiles.numel() > 0
    expect = gemm if m > 4 or (m >= 3 and vnni_tiles) else small
    assert torch.equal(ql.quant_linear(x, w.qweight, w.scales, w.mins, None, tiles), expect)
    without = small if m <= 4 else gemm  # no tiles: per-call packing costs more than it saves
    assert torch.equal(ql.quant_linear(x, w.qweight, w.scales, w.mins), without)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int_gemm_extremes_do_not_overflow(sign: float) -> None:
    """The largest sums the GEMM keeps in 16 bits: 4-bit weights all 15 against activations all
    +-127 (a block's 8 quads: 16 products of 15 x 127 each lane), int8 weights all -128 (|w| 128)
    against them (a pair: 2 x 128 x 127)."""
    x = torch.full((7, 64), sign)  # every block rounds to +-127
    q4 = QuantizedWeight(torch.full((16, 32), 0xFF, dtype=torch.uint8), torch.ones(16, 2),
                         torch.zeros(16, 2))
    i8 = QuantizedWeight(torch.full((16, 64), -128, dtype=torch.int8), torch.ones(16, 1))
    for w in (q4, i8):
        out = ql.quant_linear_int_gemm(x, w.qweight, w.scales, w.mins)
        ref = ql.reference(ql.quantize_activations(x), w.dequantize())
        assert ref.abs().min() > 900  # 64 x 15 or 64 x 128: the extremes were reached
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)


def test_int_gemm_refuses_tiles_of_another_weight() -> None:
    gen = torch.Generator().manual_seed(5)
    w = weight(gen, "int8", 40, 64, 64)
    other = weight(gen, "int8", 24, 64, 64)
    tiles = ql.quant_linear_pack(other.qweight, other.scales)
    with pytest.raises(RuntimeError, match="tiles are not quant_linear_pack's"):
        ql.quant_linear_int_gemm(torch.randn(8, 64), w.qweight, w.scales, None, None, tiles)


def test_int_gemm_refuses_other_layouts() -> None:
    with pytest.raises(RuntimeError, match="int8 or 4-bit weights in groups of a multiple"):
        ql.quant_linear_int_gemm(torch.randn(5, 64), torch.zeros(3, 64, dtype=torch.int8),
                                 torch.ones(3, 4))  # groups of 16 (Q6_K)
    with pytest.raises(RuntimeError, match="int8 or 4-bit weights"):  # fp8
        ql.quant_linear_int_gemm(torch.randn(5, 64), torch.zeros(3, 64).to(torch.float8_e4m3fn),
                                 torch.ones(3, 2))


@pytest.mark.parametrize("kind,k,group", [("int8", 2304, 32), ("int8", 256, 16),
                                          ("int8", 576, 576), ("fp8", 512, 128),
                                          ("q4", 2304, 32), ("q4", 96, 32)])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_float16_scales_are_read_as_they_are(kind: str, k: int, group: int, m: int) -> None:
    """GGUF's float16 scales and mins stay float16: both paths read them without a float32
    copy, and match the reference as float32 scales do."""
    gen = torch.Generator().manual_seed(7 * m + k)
    w = weight(gen, kind, 133, k, group)
    w = QuantizedWeight(w.qweight, w.scales.half(), None if w.mins is None else w.mins.half())
    x = torch.randn(m, k, generator=gen)
    seen = x if kind == "fp8" else ql.quantize_activations(x)
    for out, ref in ((ql.quant_linear_small_m(x, w.qweight, w.scales, w.mins),
                      ql.reference(seen, w.dequantize())),
                     (ql.quant_linear_dequant(x, w.qweight, w.scales, w.mins),
                      ql.reference(x, w.dequantize()))):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_compact_scales_only_when_exact() -> None:
    """float16 scales replace float32 ones only when every value survives the trip."""
    q = torch.zeros(2, 32, dtype=torch.uint8)  # two groups of 32 a row
    exact = QuantizedWeight(q, torch.tensor([[0.5, 0.25], [1.0, 3.0]]), torch.zeros(2, 2))
    compact = exact.compact_scales()
    assert compact.scales.dtype == compact.mins.dtype == torch.float16
    assert torch.equal(compact.dequantize(), exact.dequantize())
    inexact = QuantizedWeight(q, torch.tensor([[0.1, 0.25], [1.0, 3.0]]), torch.zeros(2, 2))
    assert inexact.compact_scales().scales.dtype == torch.float32
    with pytest.raises(ValueError, match="mins must be torch.float16"):
        QuantizedWeight(q, compact.scales, torch.zeros(2, 2))


def test_every_fp8_code_decodes_exactly() -> None:
    """All 254 finite e4m3fn values, subnormals and -0 included, against torch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])
    q = codes.view(torch.float8_e4m3fn).view(1, -1).repeat(256, 1)
    w = QuantizedWeight(q.contiguous(), torch.ones(256, 1))
    out = ql.quant_linear_small_m(torch.eye(256), w.qweight, w.scales)  # row i: column i
    assert torch.equal(out.diagonal(), q[0].float())


def test_activation_rounding_is_small() -> None:
    """What the int8 activations cost: at most half a step (max |block| / 254) per element."""
    x = torch.randn(8, 256) * torch.logspace(-3, 2, 256)  # outlier columns, as LLMs have
    err = (ql.quantize_activations(x) - x).abs().view(8, -1, 32)
    bound = x.abs().view(8, -1, 32).amax(-1, keepdim=True) / 254
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("qweight,scales,message", [
    (torch.zeros(4, 60, dtype=torch.int8), torch.ones(4, 1), "features"),  # K not a block
    (torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 8), "groups"),  # groups of 8
    (torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), "mins"),  # 4-bit without mins
    (torch.zeros(4, 64, dtype=torch.int16), torch.ones(4, 1), "no quantized layout"),
])
def test_refuses_layouts_it_cannot_read(qweight, scales, message) -> None:
    k = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    with pytest.raises(RuntimeError, match=message):
        ql.quant_linear_small_m(torch.zeros(1, k), qweight, scales)
