"""`deepseek_v3` (V3.1 / V4 thinking mode): the template opens `<think>` only when thinking is on
for the request (`chat_template_kwargs`, or DeepSeek's `thinking`); off, everything is answer."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.reasoning.base import ReasoningParser


class DeepSeekV3Parser(ReasoningParser):
    """Thinking off (its template's default): the prompt closed the reasoning; all is answer."""

    drops_leading_start = True

    @staticmethod
    def thinks(thinking: bool | None) -> bool:
        return bool(thinking)

    def __init__(self, thinking: bool | None = None) -> None:
        super().__init__(opened=bool(thinking))
        if not thinking:
            self.state = "answer"
