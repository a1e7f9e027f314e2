"""The model class of an architecture (engine/model_registry.py names it), imported only when
used."""

from __future__ import annotations

import importlib

from deepinfer.engine.model_registry import architecture


def model_class(name: str) -> type:
    """The class of HF `architectures` name `name`; ModelConfigError if unsupported."""
    module, cls = architecture(name).model_class.split(":")
    return getattr(importlib.import_module(module), cls)
