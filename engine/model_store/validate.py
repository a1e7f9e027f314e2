"""Is this a model the engine can start on? Answered before any process starts, as one line the
user can act on (ModelConfigError), instead of a traceback from deep inside.

`ensure_config` is what every entry point (`deepinfer serve` / `generate`, the offline `LLM`)
calls first: the settings are checked, a named model is prepared on first use, a directory is
checked.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig, ModelConfig, ModelConfigError
from deepinfer.engine.model_store.gguf_model import gguf_source, prepare_gguf_model
from deepinfer.engine.model_store.prepare import prepare
from deepinfer.engine.model_store.recipes import RECIPES, find_recipe


def _hint(path: Path) -> str:
    for recipe in RECIPES.values():
        if path == envs.cache_dir() / recipe.dir_name:
            return f"; run `deepinfer prepare-model {recipe.name}` to prepare it"
    return (" (give a Hugging Face model directory, or a named model such as 'default': "
            "`deepinfer prepare-model` prepares it)")


def check_model_dir(model_dir: str | Path) -> None:
    """Raise ModelConfigError unless `model_dir` holds a parseable config.json, weights
    (safetensors, or the GGUF a sidecar directory stands for) and a tokenizer.json."""
    path = Path(model_dir)
    try:
        ModelConfig.from_dir(str(path))
    except ModelConfigError as exc:
        hint = "" if (path / "config.json").is_file() else _hint(path)
        raise ModelConfigError(f"{exc}{hint}") from None
    source = gguf_source(path)
    if source is not None and not source.is_file():
        raise ModelConfigError(f"{path} stands for the GGUF file {source}, which is gone")
    if source is None and not any(path.glob("*.safetensors")):
        raise ModelConfigError(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelConfigError(f"{path} has no tokenizer.json")


def ensure_model(model: str) -> str:
    """The --model value to run, checked: a named model is prepared on first use (progress on
    stderr); a GGUF file is served through its sidecar directory (gguf_model.py), whose path
    is returned; a directory must look like a model. Raises ModelConfigError."""
    if model.endswith(".gguf") and not Path(model).expanduser().is_dir():
        gguf = Path(model).expanduser()
        if not gguf.is_file():
            raise ModelConfigError(f"no GGUF file {model}")
        model = str(prepare_gguf_model(gguf))
    recipe = find_recipe(model)
    if recipe is not None:
        path = prepare(recipe.name)
        # 'default' keeps its name (engine.config resolves it; clients may ask for it by name).
        if EngineConfig(model=model).resolved_model_dir() != str(path):
            model = str(path)
    check_model_dir(EngineConfig(model=model).resolved_model_dir())
    return model


def ensure_config(config: EngineConfig) -> EngineConfig:
    """`config` checked before any process starts, with the models to run (each setting's own
    values were checked when the config was made): the settings that go together first (a typo
    costs no download), then --model (ensure_model), then a draft model like --model, resolved
    to its directory. Raises ModelConfigError."""
    config.check_speculative()
    config.check_disaggregation()
    config.check_disk_tier()
    config.check_lora()
    config.check_quantization()
    config.check_device()
    config = msgspec.structs.replace(config, model=ensure_model(config.model))
    config.check_parallel()
    config.check_kv_cache_dtype()
    if config.speculative_method == "draft":
        config = msgspec.structs.replace(
            config, speculative_model=_draft_model_dir(config.speculative_model))
    return config


def _draft_model_dir(model: str) -> str:
    try:
        return EngineConfig(model=ensure_model(model)).resolved_model_dir()
    except ModelConfigError as exc:
        raise ModelConfigError(f"--speculative-model: {exc}") from None
