"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), attached to
a loaded model's linears, and the low-rank products they add in a mixed batch.

An adapter changes a linear W into W + scale * B A (A: [r, in], B: [out, r]; scale lora_alpha / r,
or lora_alpha / sqrt(r) with rsLoRA, as PEFT computes it). It is attached by wrapping the
forward of each linear it targets (a fused q|k|v or gate|up linear takes one product per part):
the base product runs as always, then, for each adapter the batch uses, its rows get
x A^T B^T added. Which rows use which adapter is the step's `LoRABatch` (set by the runner
around the forward); a linear no adapter targets runs untouched.
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from deepinfer.workers.layers.linear import Linear, MergedLinear

# PEFT's module names this engine maps onto its linears.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?(.*\.(\w+_proj))\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served (its message names the problem)."""


@dataclass
class _Product:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [size, r], scale folded in
    offset: int  # where its output columns start in the linear's output
    size: int


class LoRABatch(threading.local):
    """The step's rows per adapter: adapter name -> row indices of the batch (set around each
    forward by the runner; empty: the base model for every row)."""

    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}


CURRENT = LoRABatch()


def lora_rows(batch, device: torch.device) -> None:
    """Set CURRENT for a step (workers/step_batch.py StepBatch): each adapter's rows."""
    rows: dict[str, list[int]] = {}
    for r in batch.rows:
        adapter = r.state.params.lora
        if adapter is not None:
            rows.setdefault(adapter, []).extend(range(r.first_row, r.first_row + r.num_rows))
    CURRENT.rows = {name: torch.tensor(ix, dtype=torch.long, device=device)
                    for name, ix in rows.items()}


def read_adapter(path: str | Path, max_rank: int) -> tuple[float, dict[str, tuple]]:
    """(scale, {PEFT module path: (A, B)}) of a PEFT adapter; raises LoRAError."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{path}: not a PEFT LoRA adapter (adapter_config.json and "
                        "adapter_model.safetensors expected)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: a {config.get('peft_type')} adapter, not LoRA")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise LoRAError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{path}: unexpected tensor {key} (only LoRA A/B weights are served)")
        if m[2] not in TARGETS:
            raise LoRAError(f"{path}: target module {m[2]} is not supported (one of "
                            f"{', '.join(TARGETS)})")
        pairs.setdefault(m[1], {})[m[3]] = tensor.float()
    return scale, {name: (ab["A"], ab["B"]) for name, ab in pairs.items()}


def attach(model: nn.Module, name: str, path: str | Path, max_rank: int) -> None:
    """Load adapter `name` from `path` onto `model`'s linears; raises LoRAError (nothing is
    attached then)."""
    scale, weights = read_adapter(path, max_rank)
    modules = dict(model.named_modules())
    plan: list[tuple[Linear, _Product]] = []
    for module_path, (a, b) in weights.items():
        for old, new in model.checkpoint_renames.items():
            module_path = module_path.replace(old, new)
        leaf = module_path.rpartition(".")[2]
        part = None
        if leaf in model.stacked_params:
            fused, part = model.stacked_params[leaf]
            module_path = module_path[: -len(leaf)] + fused
        linear = modules.get(module_path)
        if not isinstance(linear, Linear):
            raise LoRAError(f"{path}: the model has no {module_path} (an adapter of another "
                            "base model?)")
        offset, size = (linear.parts[part] if isinstance(linear, MergedLinear) and part
                        else (0, linear.out_features))
        if a.shape[1] != linear.in_features or b.shape[0] != size or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{path}: {module_path}{'.' + part if part else ''} has A "
                            f"{tuple(a.shape)} and B {tuple(b.shape)}, the model's linear "
                            f"takes {linear.in_features} -> {size} (another base model?)")
        dev, dtype = linear.weight.device, _dtype(linear)
        plan.append((linear, _Product(a.to(dev, dtype), (b * scale).to(dev, dtype), offset,
                                      size)))
    for linear, product in plan:
        _products(linear).setdefault(name, []).append(product)


def detach(model: nn.Module, name: str) -> None:
    for module in model.modules():
        products = getattr(module, "lora_products", None)
        if products is not None:
            products.pop(name, None)


def _dtype(linear: Linear) -> torch.dtype:
    return linear.bias.dtype if linear.bias is not None else (
        linear.weight.dtype if linear.weight.numel() else torch.float32)


def _products(linear: Linear) -> dict[str, list[_Product]]:
    """The adapters' products on `linear`, its forward wrapped the first time."""
    if not hasattr(linear, "lora_products"):
        linear.lora_products = {}
        base = linear.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = base(x)
            if not CURRENT.rows:
                return y
            for adapter, rows in CURRENT.rows.items():
                for p in linear.lora_products.get(adapter, ()):
                    xs = x.index_select(0, rows)
                    delta = (xs.to(p.a.dtype) @ p.a.T) @ p.b.T
                    y[rows, p.offset:p.offset + p.size] += delta.to(y.dtype)
            return y

        linear.forward = forward
    return linear.lora_products
