"""A named model whose wheel is a tiny local GGUF: preparation tests need no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.model_store.tiny_gguf import use_tiny_default_model


@pytest.fixture()
def tiny_cache(tmp_path, monkeypatch) -> Path:
    return use_tiny_default_model(tmp_path / "cache", monkeypatch)
