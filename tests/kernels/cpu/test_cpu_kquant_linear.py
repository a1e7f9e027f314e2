"""The K-quant linear kernels (GGUF Q4_K, Q5_K, Q6_K super-blocks as stored) against gguf's own
numpy dequantizer: the weight bit for bit, the products within float32 rounding of the
dequantized weight times the int8-per-256 activations (decode) or the activations as they are
(dequantized tiles)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from deepinfer.kernels.cpu import kquant_linear as kq
from deepinfer.kernels.cpu.quant_linear import quantize_activations
from deepinfer.workers.quantization.matmul import QuantizedMatmul
from deepinfer.workers.quantization.weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not kq.available(), reason=f"not built: {kq.build_error()}")

KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Where a block keeps its fp16 factors (d, and dmin for Q4_K / Q5_K).
FP16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random super-blocks over every code (gguf cannot quantize K-quants), fp16 factors like a
    trained layer's, one zero factor."""
    rng = np.random.default_rng(seed)
    per, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        d = rng.uniform(1e-4, 2e-3, (n, k // per, 1)).astype(np.float16)
        d[0, 0] = 0.0
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(n, -1)


def reference_weight(raw: np.ndarray, qtype: Q, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, qtype).astype(np.float32).reshape(-1, k))


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_dequantize_is_gguf_bit_for_bit(qtype: Q) -> None:
    raw = blocks(qtype, 5, 768)
    got = kq.kquant_dequantize(torch.from_numpy(raw), int(qtype), 768)
    torch.testing.assert_close(got, reference_weight(raw, qtype, 768), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 22, 40])
@pytest.mark.parametrize("n,k", [(1, 256), (37, 512), (133, 2048)])
def test_int8_kernel_matches_reference(qtype: Q, m: int, n: int, k: int) -> None:
    """Any row count: the streaming kernel up to 16 (groups of 4, and the rest), int8 tiles of
    32 output rows above (where built; groups of 4 and the rest again; a last tile part
    empty), any slice of output rows."""
    raw = blocks(qtype, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    expected = quantize_activations(x, 256) @ reference_weight(raw, qtype, k).T + bias
    got = kq.kquant_linear(x, torch.from_numpy(raw), int(qtype), bias)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.skipif(not kq.int8_gemm(), reason="the lanes layout needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 4, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(32, 256), (64, 768), (96, 2048)])
def test_lanes_layout_matches_reference(qtype: Q, m: int, n: int, k: int) -> None:
    """The repacked copy: any row count (groups of up to 8, evenly), strips of 16 rows in
    pairs; the same products as the blocks' kernels."""
    raw = blocks(qtype, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    expected = quantize_activations(x, 256) @ reference_weight(raw, qtype, k).T + bias
    lanes = kq.kquant_pack_lanes(torch.from_numpy(raw), int(qtype), k)
    got = kq.kquant_lanes_linear(x, lanes, int(qtype), bias)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.skipif(not kq.int8_gemm(), reason="the lanes layout needs AVX512-VNNI")
def test_lanes_layout_refuses_what_it_cannot_hold() -> None:
    raw = torch.from_numpy(blocks(Q.Q4_K, 40, 256))
    assert kq.kquant_pack_lanes(raw, int(Q.Q4_K), 256) is None  # 40 rows: not strips of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.deepinfer_cpu.kquant_pack_lanes(raw, int(Q.Q4_K), 256)
    lanes = kq.kquant_pack_lanes(torch.from_numpy(blocks(Q.Q4_K, 32, 256)), int(Q.Q4_K), 256)
    with pytest.raises(RuntimeError, match="do not hold"):
        kq.kquant_lanes_linear(torch.zeros(2, 512), lanes, int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="do not hold"):
        kq.kquant_lanes_linear(torch.zeros(2, 256), lanes, int(Q.Q6_K))


# bf16 tiles: the weight, the activations and the output each rounded to bf16 (2^-9 relative)
BF16_TOL = 2**-6


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 17, 70])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_dequantized_tiles_match_reference(qtype: Q, m: int, bf16: bool) -> None:
    raw = blocks(qtype, 300, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    expected = x @ reference_weight(raw, qtype, 512).T
    got = kq.kquant_dequant_linear(x, torch.from_numpy(raw), int(qtype), bf16=bf16)
    tol = BF16_TOL if bf16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_extreme_codes_and_activations_do_not_overflow(qtype: Q) -> None:
    """Every weight at its largest code against activations at +-127: the u8 x s8 sums must
    not saturate anywhere (the streaming kernel, int8 tiles, the lanes copy)."""
    per, size = GGML_QUANT_SIZES[qtype]
    raw = np.full((32, 2 * size), 0xFF, dtype=np.uint8)
    for at in FP16_AT[qtype]:
        raw.reshape(32, 2, size)[..., at:at + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
    lanes = kq.kquant_pack_lanes(torch.from_numpy(raw), int(qtype), 2 * per)
    for rows in (3, 21):  # the streaming kernel; int8 tiles
        x = torch.full((rows, 2 * per), 5.0)
        x[1::2] = -5.0
        expected = quantize_activations(x, 256) @ reference_weight(raw, qtype, 2 * per).T
        got = kq.kquant_linear(x, torch.from_numpy(raw), int(qtype))
        torch.testing.assert_close(got, expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item())
        if lanes is not None:
            got = kq.kquant_lanes_linear(x, lanes, int(qtype))
            torch.testing.assert_close(got, expected, rtol=1e-5,
                                       atol=1e-5 * expected.abs().max().item())


def test_refuses_what_it_cannot_read() -> None:
    x = torch.zeros(1, 256)
    with pytest.raises(RuntimeError, match="not Q4_K"):
        kq.kquant_linear(x, torch.zeros(2, 144, dtype=torch.uint8), 8)
    with pytest.raises(RuntimeError, match="bytes a row"):
        kq.kquant_linear(x, torch.zeros(2, 143, dtype=torch.uint8), int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="super-blocks of 256"):
        kq.kquant_linear(torch.zeros(1, 128), torch.zeros(2, 144, dtype=torch.uint8), 12)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16, 17, 40])
@pytest.mark.parametrize("pack", [False, True], ids=["one-copy", "lanes"])
def test_quantized_matmul_takes_every_row_count(qtype: Q, rows: int, pack: bool) -> None:
    """The layer's choice: with the lanes copy (`pack`, 32 rows) it from 4 rows; else the
    streaming kernel up to 16 rows, int8 tiles above (or dequantized tiles where not built); a
    column shard (tensor parallelism) along whole super-blocks reads the same bytes."""
    raw = blocks(qtype, 32 if pack else 24, 1024, seed=rows)
    weight = QuantizedWeight(torch.from_numpy(raw), None, None, int(qtype))
    ref_w = reference_weight(raw, qtype, 1024)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    int8 = rows <= kq.SMALL_M or kq.int8_gemm()
    expected = (quantize_activations(x, 256) if int8 else x) @ ref_w.T
    matmul = QuantizedMatmul(weight, None, pack=pack)
    assert (matmul.lanes is not None) == (pack and kq.int8_gemm())
    got = matmul(x)
    tol = BF16_TOL if not int8 and kq.BF16_TILES else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())
    shard = weight.narrow(1, 256, 512)
    assert tuple(shard.shape) == (raw.shape[0], 512)
    torch.testing.assert_close(shard.dequantize(), ref_w[:, 256:768], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot be split"):
        weight.narrow(1, 128, 256)
