"""A bf16 checkpoint under the default float32 model: its matrices stay bf16 in memory (the
checkpoint's bytes, not widened), read by the bf16 kernels, and the model's logits follow HF
transformers on the same weights widened to float32.

The kernels round each linear's input to bf16 (as oneDNN's and llama.cpp's bf16 paths do): a
relative move of at most 2^-9 per element, which through these random models moves logits by
well under ROUNDED_TOL of their spread; a wrong row, column or byte order moves them by the
spread itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.kernels.cpu import bf16_linear
from deepinfer.workers.quantization.weight import QuantizedWeight
from scripts.tiny_models import save_tiny_model
from tests.workers.quantization.test_quantized_model import (
    check_against,
    prompts,  # noqa: F401  (a fixture)
    quantized_linears,
)

pytestmark = pytest.mark.skipif(not bf16_linear.available(),
                                reason=f"not built: {bf16_linear.build_error()}")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    """A tiny Llama saved in bf16, as most checkpoints on the hub are."""
    out = save_tiny_model(tmp_path_factory.mktemp("bf16"), tie_word_embeddings=False,
                          intermediate_size=128)
    for path in out.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_kernel_matches_the_rounded_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    # rows 1-3 one weight row at a time, 4-8 in pairs of weight rows (an odd one left over:
    # 37, 33, 19 rows), above 8 in groups of 8 and the rest
    for m, n, k in ((1, 37, 64), (3, 100, 2048), (5, 64, 96), (16, 300, 512), (4, 9, 50),
                    (8, 37, 128), (7, 33, 256), (12, 19, 64)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen)
        expected = x.bfloat16().float() @ w.float().T + bias
        scale = expected.abs().max().item()
        torch.testing.assert_close(bf16_linear.bf16_linear_small_m(x, w, bias), expected,
                                   rtol=1e-5, atol=1e-5 * scale)
        # oneDNN's GEMM also rounds its output to bf16 (2^-9 relative) before the bias
        torch.testing.assert_close(bf16_linear.bf16_linear(x, w, bias) - bias, expected - bias,
                                   rtol=2**-8, atol=1e-5 * scale)


def test_strips_copy_matches_the_rounded_reference() -> None:
    """The strips copy (16 rows a line): rows in even groups of up to 8 against strip pairs;
    the same rounded products as the row-major kernel."""
    if bf16_linear.bf16_pack_strips(torch.zeros(32, 64, dtype=torch.bfloat16)) is None:
        pytest.skip("the strips copy needs AVX512-BF16")
    gen = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 32, 64), (4, 64, 2048), (8, 96, 96), (9, 32, 514), (16, 64, 256),
                    (20, 32, 128)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen)
        expected = x.bfloat16().float() @ w.float().T + bias
        strips = bf16_linear.bf16_pack_strips(w)
        assert strips.shape == w.shape and not torch.equal(strips, w)  # reordered, same size
        torch.testing.assert_close(bf16_linear.bf16_strips_linear(x, strips, bias), expected,
                                   rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for shape in ((40, 64), (32, 63)):  # rows not strips of 32, an odd row length
        assert bf16_linear.bf16_pack_strips(torch.zeros(shape, dtype=torch.bfloat16)) is None
    with pytest.raises(RuntimeError, match="do not hold"):
        bf16_linear.bf16_strips_linear(torch.zeros(2, 32), strips)


@pytest.mark.parametrize("pack", [False, True], ids=["one-copy", "strips"])
def test_bf16_matmul_takes_every_row_count(pack: bool) -> None:
    from deepinfer.workers.quantization.matmul import QuantizedMatmul

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=gen).bfloat16()
    matmul = QuantizedMatmul(QuantizedWeight(w, None), None, pack=pack)
    assert (matmul.lanes is not None) == (
        pack and bf16_linear.bf16_pack_strips(w[:32, :64].contiguous()) is not None)
    for rows in (1, 3, 4, 8, 16, 17):
        x = torch.randn(rows, 256, generator=gen)
        expected = x.bfloat16().float() @ w.float().T
        tol = 2**-8 if rows > bf16_linear.SMALL_M else 1e-5  # oneDNN's output rounded to bf16
        torch.testing.assert_close(matmul(x), expected, rtol=tol,
                                   atol=1e-5 * expected.abs().max().item())


def test_bf16_weights_stay_bf16_and_follow_hf(bf16_model, prompts) -> None:  # noqa: F811
    got = check_against(bf16_model, None, bf16_model, prompts, rounded_prompt=True)
    model = got["runner"].model
    # 3 layers x (qkv, o, gate_up, down) + the head, all bf16; the embedding too
    assert quantized_linears(got["runner"]) == {"bf16": 13}
    embed = model.model.embed_tokens.quantized
    assert isinstance(embed, QuantizedWeight) and embed.kind == "bf16"
    stored = load_file(str(next(bf16_model.glob("*.safetensors"))))
    assert torch.equal(embed.qweight, stored["model.embed_tokens.weight"])


@pytest.mark.slow  # (make test's budget: the bf16 path above stays in the default run)
def test_quantization_none_widens_them(bf16_model, prompts) -> None:  # noqa: F811
    got = check_against(bf16_model, "none", bf16_model, prompts, rounded_prompt=False,
                        rounded_decode=False)
    assert quantized_linears(got["runner"]) == {}
