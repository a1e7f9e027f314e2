"""Build a model from an HF directory (config.json + *.safetensors, fused params by name) or from
a GGUF's sidecar directory (engine/model_store/gguf_model.py), its weights read from the GGUF.

Quantized checkpoint weights (a GGUF's blocks, an fp8 checkpoint's `weight` + `weight_scale_inv`)
reach the layers that keep them quantized (linears, the vocabulary embedding) as they are, and
any other layer dequantized; `quantization` then settles each linear's final form. A bf16
checkpoint's matrices under a float32 model on CPU reach them the same way, as bf16 weights (read
as stored: half the memory and the bytes a decode step reads, the same values)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deepinfer.engine.model_config import ModelConfig, ModelConfigError
from deepinfer.engine.model_store.gguf_model import gguf_source
from deepinfer.workers.attention import AttentionBackend, select_backend
from deepinfer.workers.layers.checkpoint_tensor import LazyTensor, materialize
from deepinfer.workers.layers.linear import Linear, MergedLinear, resolve_weight_copies
from deepinfer.workers.layers.moe import FusedExperts
from deepinfer.workers.layers.vocab_parallel import VocabParallelEmbedding
from deepinfer.workers.models import model_class
from deepinfer.workers.quantization.fp8 import from_checkpoint
from deepinfer.workers.quantization.gguf import gguf_weights
from deepinfer.workers.quantization.weight import QuantizedWeight

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# One expert's weight, as HF checkpoints store them: (experts module, expert, projection).
# Fused [E, ...] expert tensors (`experts.gate_up_proj`) load by name like any parameter.
EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight$")
FP8_SCALE = "_scale_inv"  # an fp8 weight's block scales: `X.weight` -> `X.weight_scale_inv`


def load_model(model_dir: str, dtype: str = "float32", weight_copies: str = "auto",
               attention: AttentionBackend | None = None, cls: type | None = None,
               quantization: str | None = None, device: torch.device | None = None
               ) -> nn.Module:
    """The model with its weights, ready to run: packed, fused paths chosen. `weight_copies`:
    which copies of each linear weight to keep on CPU (workers/layers/linear.py); `cls`: another
    module built from the same checkpoint (default: the architecture's model); `quantization`:
    the linears' weights (engine/config.py QUANTIZATIONS; None: as the checkpoint has them);
    `device`: where it runs (default the CPU). The weights load on the host and move before
    the layers settle their paths, so each picks by where its tensors are (the native CPU ops
    only on the CPU)."""
    cfg = ModelConfig.from_dir(model_dir)
    cls = cls or model_class(cfg.architecture)
    torch_dtype = DTYPES[dtype]
    with torch.device("cpu"):
        model = cls(cfg, attention or select_backend("cpu", torch_dtype))
    on_cpu = device is None or device.type == "cpu"
    load_weights(model, model_dir, cfg, keep_bf16=on_cpu and torch_dtype == torch.float32
                 and quantization is None)
    for module in model.modules():  # checkpoint conventions folded in, in float32
        if hasattr(module, "after_load"):
            module.after_load()
    model.to(torch_dtype)
    if device is not None and device.type != "cpu":
        quantized = [name for name, m in model.named_modules()
                     if getattr(m, "quantized_parts", None)
                     or getattr(m, "quantized", None) is not None]
        if quantized:
            raise ModelConfigError(
                f"{model_dir} keeps quantized weights ({quantized[0]}, ...), which run on CPU "
                f"workers only so far: --device cpu, or a float checkpoint on {device.type}")
        model.to(device)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    copies = resolve_weight_copies(weight_copies, sum(m.second_copy_bytes() for m in linears))
    # Weights final: packing and hot-path choices, each module after the ones inside it.
    for module in reversed(list(model.modules())):
        if isinstance(module, Linear):
            module.finalize(copies, quantization)
        elif isinstance(module, VocabParallelEmbedding):
            module.finalize(quantization)
        elif hasattr(module, "finalize"):
            module.finalize()
    return model.eval()


def checkpoint_tensors(model_dir: str, cfg: ModelConfig
                       ) -> Iterator[tuple[str, LazyTensor | torch.Tensor | QuantizedWeight]]:
    """Every weight of the checkpoint by name: lazily read safetensors slices (an fp8 weight with
    its block scales as one QuantizedWeight), or a GGUF's tensors."""
    source = gguf_source(model_dir)
    if source is not None:
        yield from gguf_weights(str(source))
        return
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    scale_files = {}  # fp8 block scales, wherever their weight lies
    if cfg.quantization == "fp8":
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                scale_files.update({n: path for n in f.keys() if n.endswith(FP8_SCALE)})
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(FP8_SCALE):
                    continue
                scale = scale_files.get(name + FP8_SCALE)
                if scale is not None:
                    if scale == path:  # as DeepSeek's shards have them: beside the weight
                        scale_inv = f.get_tensor(name + FP8_SCALE)
                    else:
                        with safe_open(str(scale), framework="pt") as s:
                            scale_inv = s.get_tensor(name + FP8_SCALE)
                    yield name, from_checkpoint(f.get_tensor(name), scale_inv, cfg.fp8_block)
                    continue
                # Read when a layer has taken its part (all of it, without parallelism).
                sliced = f.get_slice(name)
                yield name, LazyTensor(sliced, tuple(sliced.get_shape()))


def load_weights(model: nn.Module, model_dir: str, cfg: ModelConfig | None = None,
                 keep_bf16: bool = False) -> None:
    """`keep_bf16`: bf16 matrices go to the layers that keep weights as stored (linears, the
    vocabulary embedding) in bf16, not widened."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    skips = getattr(model, "skips_weight", None)  # weights that are someone else's (MTP)
    cfg = cfg or ModelConfig.from_dir(model_dir)
    for name, tensor in checkpoint_tensors(model_dir, cfg):
        if "rotary_emb.inv_freq" in name or (skips is not None and skips(name)):
            continue
        loaded.add(_load_one(model, params, modules, name, tensor, keep_bf16))
    if getattr(model, "tie_word_embeddings", False):
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


def _as_stored_bf16(tensor, name: str, keep_bf16: bool):
    """A bf16 checkpoint matrix as a bf16 QuantizedWeight (read now), else the tensor as it is."""
    if (keep_bf16 and isinstance(tensor, LazyTensor) and tensor.is_bfloat16
            and len(tensor.shape) == 2 and name.endswith(".weight")):
        return QuantizedWeight(tensor.read().contiguous(), None)
    return tensor


def _load_one(model, params, modules, name: str, tensor: LazyTensor,
              keep_bf16: bool = False) -> str:
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
        tensor = materialize(tensor)  # experts are kept in float
        return f"{expert[1]}.{module.load_expert(int(expert[2]), part, tensor)}"
    for fragment, (fused, part) in model.stacked_params.items():
        if f".{fragment}." in name:
            target = name.replace(f".{fragment}.", f".{fused}.")
            module_name, _, kind = target.rpartition(".")
            module = modules[module_name]
            assert isinstance(module, MergedLinear)
            module.load_part(part, _as_stored_bf16(tensor, target, keep_bf16),
                             is_bias=kind == "bias")
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
    owner = modules[name.rpartition(".")[0]]
    if hasattr(owner, "load_quantized"):
        tensor = _as_stored_bf16(tensor, name, keep_bf16)
    if (isinstance(tensor, QuantizedWeight) and name.endswith(".weight")
            and hasattr(owner, "load_quantized")):
        owner.load_quantized(tensor)
        return name
    param.data.copy_(materialize(tensor))
    return name
