"""The suite writes nothing into the user's DeepInfer cache: for the session DEEPINFER_CACHE is a
temporary folder (tests/conftest.py), so GGUF sidecars and whatever else DeepInfer caches land
there, while the prepared default model is still read from the user's cache (~15 s to prepare)."""

from __future__ import annotations

from pathlib import Path

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model_store import is_prepared
from deepinfer.engine.model_store.gguf_model import sidecar_dir


def test_gguf_sidecars_are_made_under_the_sessions_temporary_root(tmp_path, tmp_path_factory):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    root = tmp_path_factory.getbasetemp().resolve()
    assert sidecar_dir(gguf).resolve().is_relative_to(root), sidecar_dir(gguf)
    assert envs.cache_dir().resolve().is_relative_to(root), envs.cache_dir()


def test_the_default_model_is_still_read_from_the_users_cache(default_model):
    resolved = Path(EngineConfig(model="default").resolved_model_dir())
    assert is_prepared(resolved)
    assert resolved.resolve() == default_model.resolve()
