"""Quantized tiny checkpoints and their dequantized float references, for the quantization tests.

Each writer takes a float HF directory (scripts/tiny_models.py save_tiny_model) and writes the same
model as a quantized engine holds it, plus a float directory HF transformers can run whose linear
weights are exactly the dequantized ones: the reference the engine is held to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepinfer.workers.quantization.fp8 import quantize_fp8
from deepinfer.workers.quantization.weight import quantize_int8

BLOCK = (128, 128)


def is_linear(name: str) -> bool:
    """Weights the engine's linear layers hold (not embeddings, norms or routers)."""
    return name.endswith(("proj.weight", "lm_head.weight"))


def _copy_dir(src: Path, out: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(src, out)
    return load_file(str(out / "model.safetensors"))


def write_int8_reference(src: Path, out: Path) -> Path:
    """`src` with every linear weight replaced by its per-channel int8 round trip: what
    --quantization int8 computes with."""
    tensors = _copy_dir(src, out)
    for name, w in tensors.items():
        if is_linear(name):
            tensors[name] = quantize_int8(w).dequantize().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_fp8_checkpoint(src: Path, out: Path, reference: Path) -> tuple[Path, Path]:
    """`src` as DeepSeek ships fp8 checkpoints (e4m3 `weight` + `weight_scale_inv` per 128 x 128
    block, the lm_head in float, quantization_config in config.json) at `out`, and its
    dequantized float twin at `reference`."""
    tensors = _copy_dir(src, out)
    shutil.copytree(src, reference)
    fp8, dequantized = {}, {}
    for name, w in tensors.items():
        if is_linear(name) and not name.startswith("lm_head"):
            q, scale_inv = quantize_fp8(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            expanded = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            dequantized[name] = (q.float() * expanded[: w.shape[0], : w.shape[1]]).contiguous()
        else:
            fp8[name] = dequantized[name] = w
    save_file(fp8, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, reference
