"""Which product a quantized linear picks by row count and layout, and what each computes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import quant_linear as ql
from deepinfer.workers.quantization.matmul import QuantizedMatmul
from deepinfer.workers.quantization.weight import QuantizedWeight, quantize_int8

pytestmark = pytest.mark.skipif(not ql.available(torch.empty(1)),
                                reason=f"not built: {ql.build_error()}")


def float_weight(n: int = 48, k: int = 128) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("rows", [1, 4, 5, 64])
def test_int8_rounds_activations_the_same_way_at_every_row_count(rows: int) -> None:
    """Small-M kernel up to 4 rows, int8 GEMM above: both see activations rounded to int8 per
    block of 32, so each row's output is the same whatever the batch around it."""
    weight = quantize_int8(float_weight())
    mm = QuantizedMatmul(weight, None)
    assert mm.int_gemm and mm.packed is None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    ref = ql.reference(ql.quantize_activations(x), weight.dequantize())
    torch.testing.assert_close(mm(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mm(x)[:1], mm(x[:1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 6])
def test_four_bit_weights_round_activations_at_every_row_count(rows: int) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = QuantizedWeight(torch.randint(0, 256, (48, 64), generator=gen, dtype=torch.uint8),
                             torch.rand(48, 4, generator=gen) * 0.01,
                             torch.randn(48, 4, generator=gen) * 0.01)
    mm = QuantizedMatmul(weight, None)
    assert mm.int_gemm
    x = torch.randn(rows, 128, generator=gen)
    ref = ql.reference(ql.quantize_activations(x), weight.dequantize())
    torch.testing.assert_close(mm(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["int8 per channel", "Q8_0", "4-bit"])
def test_pre_packed_weights_compute_what_packing_per_call_does(layout: str) -> None:
    """The integer GEMM's weight packed once (the default) or per call (`pack=False`, what
    --cpu-linear-weights plain keeps): the same arithmetic, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    if layout == "4-bit":
        weight = QuantizedWeight(torch.randint(0, 256, (40, 64), generator=gen, dtype=torch.uint8),
                                 torch.rand(40, 4, generator=gen).half() * 0.01,
                                 torch.randn(40, 4, generator=gen).half() * 0.01)
    elif layout == "Q8_0":
        weight = QuantizedWeight(torch.randint(-127, 128, (40, 128), generator=gen,
                                               dtype=torch.int8),
                                 torch.rand(40, 4, generator=gen).half() * 0.01)
    else:
        weight = quantize_int8(float_weight(40))
    packed, per_call = QuantizedMatmul(weight, None), QuantizedMatmul(weight, None, pack=False)
    assert packed.tiles is not None and per_call.tiles is None
    assert packed.nbytes() > per_call.nbytes()
    x = torch.randn(37, 128, generator=gen)
    assert torch.equal(packed(x), per_call(x))


def test_other_layouts_take_float_activations_above_four_rows() -> None:
    """fp8 (and Q6_K's groups of 16) multiply dequantized tiles: activations as they are."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 0x70, (48, 128), generator=gen, dtype=torch.uint8)
    weight = QuantizedWeight(codes.view(torch.float8_e4m3fn), torch.rand(48, 1, generator=gen))
    mm = QuantizedMatmul(weight, None)
    assert not mm.int_gemm
    x = torch.randn(6, 128, generator=gen)
    torch.testing.assert_close(mm(x), ql.reference(x, weight.dequantize()), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.skipif(not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines),
                    reason="this torch has no FBGEMM")
def test_fbgemm_is_opt_in(monkeypatch) -> None:
    """DEEPINFER_INT8_DYNAMIC_ACTIVATIONS=1: more than 4 rows through FBGEMM (per-token 7-bit
    activations: within a few % of the float product, not the int8 GEMM's rounding)."""
    monkeypatch.setenv("DEEPINFER_INT8_DYNAMIC_ACTIVATIONS", "1")
    weight = quantize_int8(float_weight())
    mm = QuantizedMatmul(weight, None)
    assert mm.packed is not None
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    exact = ql.reference(x, weight.dequantize())
    out = mm(x)
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()
    assert not torch.allclose(out, ql.reference(ql.quantize_activations(x), weight.dequantize()),
                              rtol=1e-5, atol=1e-5)
