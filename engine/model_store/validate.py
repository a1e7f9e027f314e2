"""Is this a model directory the engine can start on? Answered before any process starts, as
one line the user can act on (ModelConfigError), instead of a traceback from deep inside."""

from __future__ import annotations

import json
from pathlib import Path

from engine import envs
from engine.config import ModelConfigError
from engine.model_store.recipes import RECIPES


def _hint(path: Path) -> str:
    for recipe in RECIPES.values():
        if path == envs.cache_dir() / recipe.dir_name:
            return f"; run `deepinfer prepare-model {recipe.name}` to prepare it"
    return (" (give a Hugging Face model directory, or a named model such as 'default': "
            "`deepinfer prepare-model` prepares it)")


def check_model_dir(model_dir: str | Path) -> None:
    """Raise ModelConfigError unless `model_dir` holds a parseable config.json, safetensors
    weights and a tokenizer.json."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model directory {path} does not exist{_hint(path)}")
    config = path / "config.json"
    if not config.is_file():
        raise ModelConfigError(f"{path} has no config.json: not a Hugging Face model directory"
                               f"{_hint(path)}")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{config} cannot be read: {e}") from None
    if not isinstance(parsed, dict):
        raise ModelConfigError(f"{config} is not a JSON object")
    if not any(path.glob("*.safetensors")):
        raise ModelConfigError(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelConfigError(f"{path} has no tokenizer.json")
