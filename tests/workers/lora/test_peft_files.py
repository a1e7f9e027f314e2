"""Reading PEFT adapters (workers/lora/peft_files.py) against adapters PEFT itself saved: each
module's B carries the scale PEFT's own layer uses (rank_pattern / alpha_pattern / rsLoRA);
settings that change the forward otherwise are refused naming their key; errors never quote
the files' contents."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.workers.lora.peft_files import LoRAError, read_adapter
from scripts.tiny_models import save_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PATTERNS = {  # PEFT's per-module ranks and alphas: by leaf name, by full path, by regex
    "rank_pattern": {"q_proj": 8, "model.layers.1.self_attn.v_proj": 2, r"layers\.0\.mlp\..*": 6},
    "alpha_pattern": {"down_proj": 32, "o_proj": 3},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("lora-files") / "base")


@pytest.fixture(scope="module")
def plain(base, tmp_path_factory):
    """A plain adapter PEFT saved, for the config and file variations below."""
    return peft_adapter(base, tmp_path_factory.mktemp("plain") / "p")[0]


def peft_adapter(base, out, rslora: bool = False, **patterns):
    """(path, the PEFT model) of a random adapter saved by PEFT."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_rslora=rslora,
                             init_lora_weights=False, **patterns)
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out, peft_model


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_each_module_is_scaled_as_peft_scales_it(base, tmp_path, rslora):
    from peft.tuners.lora import LoraLayer

    path, peft_model = peft_adapter(base, tmp_path / "p", rslora, **PATTERNS)
    adapter = read_adapter(path, max_rank=16)
    layers = {name.removeprefix("base_model.model."): m for name, m in
              peft_model.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(adapter.products) == sorted(layers) and len(layers) >= 14
    ranks = set()
    for name, layer in layers.items():
        a, b = adapter.products[name]
        want_b = layer.lora_B["default"].weight * layer.scaling["default"]
        assert torch.equal(a, layer.lora_A["default"].weight.detach()), name
        assert torch.allclose(b, want_b.detach(), rtol=1e-6, atol=0), name
        ranks.add(a.shape[0])
    assert ranks == {2, 4, 6, 8} and adapter.rank == 8
    scales = {round(layers[n].scaling["default"], 4) for n in layers}
    assert len(scales) >= 4  # the patterns really differ from one scale for all


def with_config(src, out, **changes):
    shutil.copytree(src, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("key,value", [
    ("layer_replication", [[0, 2], [1, 3]]), ("alora_invocation_tokens", [5, 6, 7]),
    ("use_dora", True), ("lora_bias", True), ("modules_to_save", ["lm_head"]),
    ("bias", "all")])
def test_settings_that_change_the_forward_are_refused_naming_the_key(plain, tmp_path, key,
                                                                     value):
    changed = with_config(plain, tmp_path / "changed", **{key: value})
    with pytest.raises(LoRAError, match=f"{key} is set"):
        read_adapter(changed, max_rank=16)


SECRET = "SECRET-7f3a"


def test_errors_name_the_problem_not_the_files_contents(plain, tmp_path):
    """A runtime load may point at any file the server reads: nothing of its content comes back."""
    path = plain
    bad_configs = [{"r": SECRET}, {"peft_type": SECRET}, {"lora_alpha": [SECRET]},
                   {"rank_pattern": {"q_proj": SECRET}}, {"rank_pattern": {f"({SECRET}": 4}}]
    cases = [with_config(path, tmp_path / f"c{i}", **c) for i, c in enumerate(bad_configs)]
    not_json = with_config(path, tmp_path / "not_json")
    (not_json / "adapter_config.json").write_text(f"{SECRET}: 1\n")
    not_tensors = with_config(path, tmp_path / "not_tensors")
    (not_tensors / "adapter_model.safetensors").write_bytes(
        b"\x20\x00\x00\x00\x00\x00\x00\x00" + f'{{"{SECRET}": 1}}'.encode().ljust(32))
    other_tensor = with_config(path, tmp_path / "other_tensor")
    save_file({f"{SECRET}.weight": torch.zeros(2, 2)},
              other_tensor / "adapter_model.safetensors")
    for case in [*cases, not_json, not_tensors, other_tensor]:
        with pytest.raises(LoRAError) as info:
            read_adapter(case, max_rank=16)
        assert SECRET not in str(info.value) and str(case) in str(info.value), str(info.value)
