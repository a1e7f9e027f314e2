"""--quantization and checkpoint quantization configs: refused by name before anything starts."""

from __future__ import annotations

import pytest

from deepinfer.engine.config import EngineConfig, ModelConfig, ModelConfigError

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}


def test_fp8_checkpoints_are_recognized() -> None:
    raw = dict(BASE, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                           "activation_scheme": "dynamic",
                                           "weight_block_size": [64, 32]})
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.quantization, cfg.fp8_block) == ("fp8", (64, 32))
    assert ModelConfig.from_hf(BASE).quantization is None


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "dynamic activations"),
])
def test_other_schemes_are_refused_by_name(qc: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(dict(BASE, quantization_config=qc))


@pytest.mark.parametrize("kwargs,message", [
    ({"quantization": "int4"}, "--quantization must be one of none, int8, fp8"),
    ({"quantization": "int8", "dtype": "bfloat16"}, "computes in float32"),
])
def test_bad_settings_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        EngineConfig(**kwargs).check_quantization()


def test_the_cli_refuses_an_unknown_choice(capsys) -> None:
    from deepinfer.frontend.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--quantization", "int4", "hello"])
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_a_missing_gguf_is_named(tmp_path) -> None:
    from deepinfer.engine.model_store import ensure_model

    with pytest.raises(ModelConfigError, match="nothing.gguf"):
        ensure_model(str(tmp_path / "nothing.gguf"))
