"""DeepInfer engine: protocol, config, tokenizer and scheduler processes, launcher, offline API."""

from __future__ import annotations

from engine.protocol import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import engine.protocol` in a worker stays light.
    if name == "LLM":
        from engine.runtime.llm import LLM

        return LLM
    raise AttributeError(name)
