"""Models DeepInfer prepares by itself (`deepinfer prepare-model`) and the checks on a model
directory, with no torch or transformers: a plain install can prepare and serve its default model.
"""

from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.gguf_model import gguf_source, prepare_gguf_model
from deepinfer.engine.model_store.prepare import (
    is_prepared,
    prepare,
    prepared_dir,
    prepared_gguf,
    recipe_for,
)
from deepinfer.engine.model_store.recipes import RECIPES, Recipe, find_recipe
from deepinfer.engine.model_store.validate import check_model_dir, ensure_config, ensure_model

__all__ = ["RECIPES", "ModelPrepareError", "Recipe", "check_model_dir", "ensure_config",
           "ensure_model", "find_recipe", "gguf_source", "is_prepared", "prepare",
           "prepare_gguf_model", "prepared_dir", "prepared_gguf", "recipe_for"]
