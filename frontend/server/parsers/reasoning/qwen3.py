"""`qwen3`: the model opens `<think>` itself (an answer without it has no reasoning)."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.reasoning.base import ReasoningParser


class Qwen3Parser(ReasoningParser):
    model_opens = True

    def __init__(self, thinking: bool | None = None) -> None:
        super().__init__(opened=False)
