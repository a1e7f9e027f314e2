"""Reading a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors)
into each adapted module's A and B, B scaled as PEFT scales that module.

PEFT gives each module its own rank and alpha: `rank_pattern` and `alpha_pattern` map a pattern
of module names to them (peft.utils.other.get_pattern_key: the first pattern that ends the
module's name), else `r` and `lora_alpha`; the scale is alpha / r (alpha / sqrt(r) with rsLoRA).
A config setting that changes the forward some other way (DoRA, layer replication, aLoRA, ...)
is refused, naming the key. Errors name the problem and the adapter's path, never values read
from its files (a runtime load may point at any file the server can read).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from deepinfer.engine.kv_identity import adapter_digest

# PEFT's module names this engine maps onto its linears.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?([\w.]*\.(\w+_proj))\.lora_([AB])\.weight")
# Config keys whose set value changes the forward beyond W + scale * B A: refused by name.
_UNSUPPORTED = ("layer_replication", "alora_invocation_tokens", "use_dora", "use_qalora",
                "lora_bias", "arrow_config", "modules_to_save", "trainable_token_indices",
                "target_parameters")


class LoRAError(ValueError):
    """An adapter that cannot be served (its message names the problem)."""


@dataclass
class AdapterFiles:
    """An adapter as read: {PEFT module path: (A [r, in], B [out, r] with its scale folded in)},
    and a digest of the bytes it came from (a later read of other bytes is another adapter)."""

    products: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str
    rank: int  # the largest of its modules' ranks


def read_adapter(path: str | Path, max_rank: int) -> AdapterFiles:
    """The adapter at `path`, checked against PEFT's format; raises LoRAError."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{path}: not a PEFT LoRA adapter (adapter_config.json and "
                        "adapter_model.safetensors expected)")
    try:  # read once: the digest names exactly the bytes served
        config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    except OSError as exc:
        raise LoRAError(f"{path}: cannot read the adapter ({exc.strerror})") from None
    config = _config(path, config_bytes)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception:  # noqa: BLE001 (any parse failure: its message may quote the file)
        raise LoRAError(f"{path}: cannot read the adapter (adapter_model.safetensors is not "
                        "a safetensors file)") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if ".experts." in key:
            raise LoRAError(f"{path}: adapts MoE experts, which is not supported yet "
                            "(attention and dense MLP projections are)")
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoRAError(f"{path}: holds a tensor that is not a LoRA A or B weight of a "
                            "linear (only those are served)")
        if m[2] not in TARGETS:
            raise LoRAError(f"{path}: target module {m[2]} is not supported (one of "
                            f"{', '.join(TARGETS)})")
        pairs.setdefault(m[1], {})[m[3]] = tensor.float()
    products = {}
    for name, ab in pairs.items():
        rank, alpha = _rank_alpha(path, config, name)
        if set(ab) != {"A", "B"} or ab["A"].dim() != 2 or ab["B"].dim() != 2 \
                or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise LoRAError(f"{path}: {name} needs lora_A and lora_B of its configured rank "
                            f"{rank}")
        if rank > max_rank:
            raise LoRAError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        products[name] = (ab["A"], ab["B"] * scale)
    digest = adapter_digest(config_bytes, weights_bytes)
    return AdapterFiles(products, digest, max((a.shape[0] for a, _ in products.values()),
                                              default=0))


def _config(path: Path, raw: bytes) -> dict:
    """adapter_config.json, checked for what this engine serves."""
    try:
        config = json.loads(raw)
    except ValueError:
        raise LoRAError(f"{path}: adapter_config.json is not JSON") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: not a LoRA adapter (its peft_type is another method)")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise LoRAError(f"{path}: {key} is set in adapter_config.json, which is not "
                            "supported (only plain LoRA, rsLoRA and per-module ranks and "
                            "alphas are)")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias is set in adapter_config.json (trained biases are not "
                        "supported)")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(
                isinstance(k, str) and _number(v) for k, v in pattern.items()):
            raise LoRAError(f"{path}: {key} in adapter_config.json is not a map of module "
                            "patterns to numbers")
        config[key] = pattern
    if not _number(config.get("r")) or config["r"] <= 0 \
            or not _number(config.get("lora_alpha", config["r"])):
        raise LoRAError(f"{path}: r and lora_alpha in adapter_config.json must be numbers")
    return config


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank_alpha(path: Path, config: dict, module: str) -> tuple[int, float]:
    """The module's rank and alpha as PEFT picks them (LoraModel._create_and_replace)."""
    rank = config["rank_pattern"].get(_pattern_key(path, config["rank_pattern"], module),
                                      config["r"])
    alpha = config["alpha_pattern"].get(_pattern_key(path, config["alpha_pattern"], module),
                                        config.get("lora_alpha", config["r"]))
    return int(rank), float(alpha)


def _pattern_key(path: Path, patterns: dict, module: str) -> str:
    """peft.utils.other.get_pattern_key: the first pattern that ends `module` (at a dot)."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            raise LoRAError(f"{path}: a rank_pattern or alpha_pattern key is not a regular "
                            "expression") from None
    return module
