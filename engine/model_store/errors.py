"""The model store's errors: each is the user's to fix and is reported as one line."""

from __future__ import annotations

from deepinfer.engine.config import ModelConfigError


class ModelPrepareError(ModelConfigError):
    """A named model could not be prepared (download failed, unsupported GGUF contents)."""
