"""Quantized models (int8 at load, fp8 checkpoints, GGUF files) against HF transformers running
their dequantized float weights: prompts chunked through the scheduler, then greedy decode steps.

Where activations stay float32 (fp8 weights; 4-bit weights above 4 rows, through dequantized
tiles), logits must match to float32 summation order, as the float model's do (~1e-6; 1e-3
allowed, tests/workers/models/test_model_vs_hf.py). Where int8 and 4-bit weights meet activations
rounded to int8 per block of 32 (every decode step of at most 4 rows; int8 weights at any row
count, through the int8 GEMM, prompts included) each linear's input moves by at most
max|block| / 254, which through these random models moves logits by a few % of their spread
(measured <= 0.12 of a 0.64 std, most 0.03-0.07); ROUNDED_TOL allows 0.2. A wrong scale,
group, nibble order or row order moves them by the spread itself.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.kernels.cpu import quant_linear
from scripts.tiny_models import save_tiny_model
from tests.workers.engine_steps import run_engine
from tests.workers.quantization.quantized_checkpoints import (
    write_fp8_checkpoint,
    write_int8_reference,
)

EXACT_TOL = 1e-3  # absolute, scaled by the logits' std when that is above 1
ROUNDED_TOL = 0.2  # of the logits' std


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def check_against(engine_dir: Path, quantization: str | None, reference: Path,
                  prompts: dict[str, list[int]], rounded_prompt: bool,
                  rounded_decode: bool = True) -> dict:
    """`rounded_*`: whether the prompt's / decode steps' activations are rounded to int8 (then
    ROUNDED_TOL of the logits' std holds), or stay float32 (EXACT_TOL)."""
    runner, logits, tokens, _ = run_engine(engine_dir, prompts, max_tokens=4,
                                           quantization=quantization)
    for rid, ids in prompts.items():
        ref = hf_logits(reference, ids + tokens[rid][:-1])  # teacher-forced on our tokens
        ours = logits[rid]
        assert ours.shape == ref.shape
        std = ref.std().item()
        for part, rows, rounded in (("prompt", slice(0, len(ids)), rounded_prompt),
                                    ("decode", slice(len(ids), None), rounded_decode)):
            err = (ours[rows] - ref[rows]).abs().max().item()
            bound = ROUNDED_TOL * std if rounded else EXACT_TOL * max(1.0, std)
            print(f"{rid}: {part} logits within {err:.2g} ({err / std:.2g} std)")
            assert err < bound, f"{rid}: {part} logits off by {err:.3g} (std {std:.3g})"
    return {"runner": runner, "tokens": tokens}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    """Untied (the head is quantized on its own) and 128 wide inside the MLP (whole blocks)."""
    return save_tiny_model(tmp_path_factory.mktemp("float"), tie_word_embeddings=False,
                           intermediate_size=128)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([5, 17, 33])}


def quantized_linears(runner) -> dict[str, int]:
    kinds = defaultdict(int)
    for module in runner.model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None and hasattr(quant, "weight"):
            kinds[quant.weight.kind] += 1
    return dict(kinds)


needs_native = pytest.mark.skipif(not quant_linear.available(torch.empty(1)),
                                  reason=f"not built: {quant_linear.build_error()}")


@needs_native
def test_int8_at_load_matches_its_round_trip(float_model, prompts, tmp_path) -> None:
    reference = write_int8_reference(float_model, tmp_path / "int8-ref")
    got = check_against(float_model, "int8", reference, prompts, rounded_prompt=True)
    # 3 layers x (qkv, o, gate_up, down) + the head, every one int8, all in the one-call layer
    assert quantized_linears(got["runner"]) == {"int8": 13}
    assert got["runner"].model.model.fast_layers is not None


@needs_native
def test_fp8_checkpoint_matches_its_dequantized_twin(float_model, prompts, tmp_path) -> None:
    """No activation rounding on the fp8 path: everything is held to the exact bound."""
    fp8, reference = write_fp8_checkpoint(float_model, tmp_path / "fp8", tmp_path / "fp8-ref")
    got = check_against(fp8, None, reference, prompts, False, False)
    assert quantized_linears(got["runner"]) == {"fp8": 12}  # the head stays float, as shipped
    # --quantization none reads the same checkpoint into float weights: the same logits
    none = check_against(fp8, "none", reference, prompts, False, False)
    assert quantized_linears(none["runner"]) == {}
    assert none["tokens"] == got["tokens"]


def test_odd_shapes_fall_back_to_dequantized_weights(tmp_path, prompts) -> None:
    """An MLP 136 wide has no whole blocks of 32 in down_proj's input: that linear multiplies by
    its dequantized weight (no activation rounding) and the model still matches."""
    model = save_tiny_model(tmp_path / "odd", tie_word_embeddings=False)
    reference = write_int8_reference(model, tmp_path / "odd-ref")
    got = check_against(model, "int8", reference, prompts, rounded_prompt=True)
    runner = got["runner"]
    down = runner.model.model.layers[0].mlp.down_proj.quant
    assert down is not None and not down.native


def _mixed_types(name: str):
    """Each kind of linear in another type; q|k|v and gate|up fuse parts of different types."""
    from gguf import GGMLQuantizationType as Q

    if name.endswith("norm.weight"):
        return Q.F32
    for fragment, qtype in (("q_proj", Q.Q4_0), ("k_proj", Q.Q8_0), ("v_proj", Q.Q8_0),
                            ("gate_proj", Q.Q4_1), ("up_proj", Q.Q4_0), ("down_proj", Q.Q8_0),
                            ("o_proj", Q.Q4_1)):
        if fragment in name:
            return qtype
    return Q.Q4_0  # the tied embedding and head


@needs_native
@pytest.mark.parametrize("types", ["default", "mixed"])
def test_gguf_served_quantized_matches_its_conversion(types: str, tmp_path) -> None:
    """A GGUF served as it is against HF on the float32 directory the converter makes of it."""
    from deepinfer.engine.model_store.convert import convert_gguf
    from deepinfer.engine.model_store.validate import ensure_model
    from tests.engine.model_store.tiny_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    # Default: Q8_0 embedding and down_proj, Q4_1 elsewhere, F32 norms. Projections scaled
    # like a trained model's (unit-variance ones make a chaotic model).
    qtypes = {} if types == "default" else {"qtype": _mixed_types}
    write_tiny_gguf(gguf, scale=0.125, **qtypes)
    reference = tmp_path / "converted"
    reference.mkdir()
    convert_gguf(gguf, reference, progress=False)
    sidecar = Path(ensure_model(str(gguf)))
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(3, 260, size=n).tolist() for i, n in enumerate([6, 19])}
    # Prompts: the int8 parts (Q8_0) round activations through the int8 GEMM.
    got = check_against(sidecar, None, reference, prompts, rounded_prompt=True)
    kinds = quantized_linears(got["runner"])
    if types == "default":
        assert kinds == {"q4": 6, "int8": 3}  # qkv, o, gate_up per layer; down; the head
        assert got["runner"].model.model.fast_layers is not None
    else:  # o, gate_up (Q4_1 | Q4_0: both 4-bit) and down whole, the head (the Q4_0
        # embedding's); q|k|v (Q4_0 | Q8_0 | Q8_0) one product per part
        assert kinds == {"q4": 5, "int8": 2}
        qkv = got["runner"].model.model.layers[0].self_attn.qkv_proj.quant
        assert [p.weight.kind for p in qkv.parts] == ["q4", "int8", "int8"]
    embed = got["runner"].model.model.embed_tokens  # the lookups dequantize rows
    assert embed.quantized is not None and embed.weight.numel() == 0


@needs_native
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_deepseek_fp8_checkpoint_matches_its_dequantized_twin(arch: str, tmp_path) -> None:
    """DeepSeek ships fp8 checkpoints: its linears stay fp8 where their inputs split into whole
    blocks; experts, MLA's absorbed projections and odd shapes are dequantized at load."""
    src = save_tiny_model(tmp_path / "float", arch)
    fp8, reference = write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "fp8-ref")
    rng = np.random.default_rng(2)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([7, 12])}
    got = check_against(fp8, None, reference, prompts, False, False)
    assert quantized_linears(got["runner"]).get("fp8", 0) > 0
