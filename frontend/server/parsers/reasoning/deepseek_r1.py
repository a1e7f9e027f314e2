"""`deepseek_r1`: the chat template already opened `<think>` in the prompt, so the output starts
inside the reasoning (a leading `<think>`, as older R1 checkpoints write, is dropped); an output
that never closes it is all reasoning. Thinking turned off for the request (a template that
honours the switch closes the reasoning in the prompt), everything is answer, as the grammar
then constrains it from the first token."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.reasoning.base import ReasoningParser


class DeepSeekR1Parser(ReasoningParser):
    drops_leading_start = True

    def __init__(self, thinking: bool | None = None) -> None:
        super().__init__(opened=True)
        if thinking is False:
            self.state = "answer"
