"""Which copies of a linear weight are kept, and that every choice computes the same thing."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import quant_linear as ql
from deepinfer.workers.layers.linear import Linear, can_pack, resolve_weight_copies
from deepinfer.workers.quantization.matmul import packed_bytes
from deepinfer.workers.quantization.weight import QuantizedWeight


def test_auto_keeps_both_copies_only_while_they_are_cheap():
    gib = 1 << 30
    assert resolve_weight_copies("auto", gib // 2, memory_bytes=24 * gib) == "both"
    assert resolve_weight_copies("auto", 6 * gib, memory_bytes=24 * gib) == "both"
    assert resolve_weight_copies("auto", 6 * gib + 1, memory_bytes=24 * gib) == "packed"
    assert resolve_weight_copies("auto", 4 * gib, memory_bytes=8 * gib) == "packed"
    assert resolve_weight_copies("plain", 4 * gib) == "plain"
    with pytest.raises(ValueError):
        resolve_weight_copies("two", 1)


@pytest.mark.parametrize("copies", ["both", "packed", "plain"])
@pytest.mark.parametrize("rows", [1, 3, 9, 64])
def test_every_choice_matches_f_linear(copies, rows):
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=True)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    w, b = lin.weight.data.clone(), lin.bias.data.clone()
    lin.finalize(copies)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.skipif(not ql.available(torch.empty(1)), reason=f"not built: {ql.build_error()}")
@pytest.mark.parametrize("copies", ["both", "packed", "plain"])
def test_quantized_weights_keep_the_gemm_copy_only_with_both(copies):
    """int8 at load: the quantized weight always (the decode kernel reads it), the integer
    GEMM's pre-packed copy as the second one; both compute the same."""
    torch.manual_seed(1)
    lin = Linear(128, 40)
    lin.weight.data.normal_()
    lin.finalize(copies, "int8")
    assert (lin.quant.tiles is not None) == (copies == "both")
    if copies == "both":
        assert lin.quant.tiles.numel() * 4 == packed_bytes(lin.quant.weight)
    x = torch.randn(9, 128)
    torch.testing.assert_close(lin(x), ql.reference(ql.quantize_activations(x),
                                                    lin.quant.weight.dequantize()),
                               rtol=1e-5, atol=1e-5)


def test_auto_counts_a_quantized_checkpoint_by_its_packed_copy():
    """A GGUF's linears hold no float weight: what `auto` weighs is the GEMM copy they would
    add (4-bit: 2.5x its bytes)."""
    lin = Linear(128, 40)
    q4 = QuantizedWeight(torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 4),
                         torch.zeros(40, 4))
    lin.load_quantized(q4)
    assert lin.second_copy_bytes() == packed_bytes(q4) == 48 * (128 + 4 * 4 * 2)


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN on this torch build")
def test_packed_only_drops_the_plain_weight():
    both, packed = Linear(64, 64), Linear(64, 64)
    for lin in (both, packed):
        lin.weight.data.normal_()
    both.finalize("both")
    packed.finalize("packed")
    assert both.packed is not None
    assert both.weight.numel() == 64 * 64 and both.small_m
    assert packed.weight.numel() == 0 and packed.packed is not None and not packed.small_m
