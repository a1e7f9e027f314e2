"""A GGUF file served directly: its sidecar directory (config, tokenizer, gguf.json, no weights)
is made once per file version and checked like any model directory."""

from __future__ import annotations

import json
import os

import pytest
from gguf import GGMLQuantizationType as Q

from deepinfer.engine.config import ModelConfig, ModelConfigError
from deepinfer.engine.model_store import (
    check_model_dir,
    ensure_model,
    gguf_source,
    prepare_gguf_model,
)
from deepinfer.engine.model_store.errors import ModelPrepareError
from tests.engine.model_store import tiny_gguf


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    tiny_gguf.write_tiny_gguf(path)
    return path


def test_sidecar_holds_config_tokenizer_and_the_files_path(tiny, tmp_path):
    out = prepare_gguf_model(tiny)
    assert out.parent.parent == tmp_path / "cache" / "gguf" and out.name == "tiny.Q4_1"
    assert json.loads((out / "gguf.json").read_text()) == {"path": str(tiny.resolve())}
    assert gguf_source(out) == tiny.resolve()
    config = json.loads((out / "config.json").read_text())
    assert config["num_attention_heads"] == tiny_gguf.HEADS and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    assert ModelConfig.from_dir(str(out)).num_kv_heads == tiny_gguf.KV_HEADS
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.safetensors"))
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left behind
    check_model_dir(out)


def test_sidecar_is_reused_and_remade_when_the_file_changes(tiny):
    out = prepare_gguf_model(tiny)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert prepare_gguf_model(tiny) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp
    os.utime(tiny, ns=(tiny.stat().st_atime_ns, tiny.stat().st_mtime_ns + 10**9))
    assert prepare_gguf_model(tiny) != out


def test_an_ordinary_directory_has_no_gguf_source(tmp_path):
    assert gguf_source(tmp_path) is None


def test_ensure_model_serves_a_gguf_through_its_sidecar(tiny):
    model = ensure_model(str(tiny))
    assert model == str(prepare_gguf_model(tiny))
    assert ensure_model(model) == model  # the sidecar is a model directory in its own right


def test_a_missing_gguf_is_named(tmp_path):
    missing = tmp_path / "nowhere.Q4_K_M.gguf"
    with pytest.raises(ModelConfigError, match="nowhere.Q4_K_M.gguf"):
        ensure_model(str(missing))


def test_a_sidecar_whose_gguf_is_gone_fails_the_check(tiny):
    out = prepare_gguf_model(tiny)
    tiny.unlink()
    with pytest.raises(ModelConfigError, match="is gone"):
        check_model_dir(out)


def test_unsupported_tensor_types_and_non_gguf_files_are_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    q5 = tmp_path / "q5.gguf"
    tiny_gguf.write_tiny_gguf(q5, qtype=lambda n: Q.Q5_0 if "up_proj" in n else Q.F32)
    with pytest.raises(ModelPrepareError, match=r"'blk\.0\.ffn_up\.weight' is Q5_0"):
        ensure_model(str(q5))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelPrepareError, match="not a readable GGUF"):
        ensure_model(str(junk))
    assert not any((tmp_path / "cache" / "gguf").rglob("config.json"))  # nothing half-made
