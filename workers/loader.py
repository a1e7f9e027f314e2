"""Build a model from an HF directory: config.json + *.safetensors, fused params by name."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig
from workers.attention import AttentionBackend, select_backend
from workers.layers.checkpoint_tensor import LazyTensor, materialize
from workers.layers.linear import Linear, MergedLinear, resolve_weight_copies
from workers.layers.moe import FusedExperts
from workers.models import model_class

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# One expert's weight, as HF checkpoints store them: (experts module, expert, projection).
# Fused [E, ...] expert tensors (`experts.gate_up_proj`) load by name like any parameter.
EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight$")


def load_model(model_dir: str, dtype: str = "float32", weight_copies: str = "auto",
               attention: AttentionBackend | None = None, cls: type | None = None
               ) -> nn.Module:
    """The model with its weights, ready to run: packed, fused paths chosen. `weight_copies`:
    which copies of each linear weight to keep on CPU (workers/layers/linear.py); `cls`: another
    module built from the same checkpoint (default: the architecture's model)."""
    cfg = ModelConfig.from_dir(model_dir)
    cls = cls or model_class(cfg.architecture)
    torch_dtype = DTYPES[dtype]
    with torch.device("cpu"):
        model = cls(cfg, attention or select_backend("cpu", torch_dtype))
    load_weights(model, model_dir)
    for module in model.modules():  # checkpoint conventions folded in, in float32
        if hasattr(module, "after_load"):
            module.after_load()
    model.to(torch_dtype)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    copies = resolve_weight_copies(weight_copies, sum(
        m.weight.numel() * m.weight.element_size() for m in linears))
    # Weights final: packing and hot-path choices, each module after the ones inside it.
    for module in reversed(list(model.modules())):
        if isinstance(module, Linear):
            module.finalize(copies)
        elif hasattr(module, "finalize"):
            module.finalize()
    return model.eval()


def load_weights(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    skips = getattr(model, "skips_weight", None)  # weights that are someone else's (MTP)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (skips is not None and skips(name)):
                    continue
                # Read when a layer has taken its part (all of it, without parallelism).
                source = f.get_slice(name)
                tensor = LazyTensor(source, tuple(source.get_shape()))
                loaded.add(_load_one(model, params, modules, name, tensor))
    if getattr(model, "tie_word_embeddings", False):
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def _load_one(model, params, modules, name: str, tensor: LazyTensor) -> str:
    rename = getattr(model, "rename_weight", None)  # a model whose checkpoints name it their way
    if rename is not None:
        name = rename(name)
    for old, new in model.checkpoint_renames.items():
        name = name.replace(old, new)
    expert = EXPERT_WEIGHT.match(name)
    if expert and expert[3] in model.expert_params:
        module = modules[expert[1]]
        assert isinstance(module, FusedExperts)
        part = model.expert_params[expert[3]]
        return f"{expert[1]}.{module.load_expert(int(expert[2]), part, tensor)}"
    for fragment, (fused, part) in model.stacked_params.items():
        if f".{fragment}." in name:
            target = name.replace(f".{fragment}.", f".{fused}.")
            module_name, _, kind = target.rpartition(".")
            module = modules[module_name]
            assert isinstance(module, MergedLinear)
            module.load_part(part, tensor, is_bias=kind == "bias")
            return target
    if name not in params:
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            return name
        raise ValueError(f"unexpected checkpoint weight {name}")
    param = params[name]
    part = getattr(param, "load", None)  # the part a parallel rank holds
    if part is not None:
        tensor = part(tensor)
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(materialize(tensor))
    return name
