"""Reasoning parsers (`--reasoning-parser NAME`, named in registry.py): split a reasoning
model's output into its reasoning (`reasoning_content`) and its answer (`content`), as the text
streams in.

Every family writes its reasoning between `<think>` and `</think>`; they differ in where the
reasoning starts (each family's file says how): whether the prompt already opened it, and
whether a leading `<think>` is then dropped. This base class reads the tags; a family only sets
where it starts.

A tag split across two chunks is held back until it can be told apart from text, so streamed
and whole outputs split alike. The content never contains the tags.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def merge(self, later: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + later.reasoning, self.content + later.content)


class ReasoningParser:
    """One request's output. `opened`: the prompt already opened the reasoning."""

    drops_leading_start = False  # an opened reasoning may still begin with `<think>`
    model_opens = False  # the model writes `<think>` itself, or not at all (then no reasoning)

    @staticmethod
    def thinks(thinking: bool | None) -> bool:
        """Whether the output starts with reasoning (then a grammar waits for its end)."""
        return thinking is not False

    def __init__(self, opened: bool) -> None:
        # before: the model may open the reasoning; opened: it is open; reasoning: inside it;
        # after_end: past `</think>` (newlines dropped); answer: the rest is content.
        self.state = "opened" if opened else "before"
        self.held = ""  # text that may still be the start of a tag

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.held += text
        while self.held:
            if self.state == "answer":
                out.content, self.held = out.content + self.held, ""
            elif self.state == "after_end":
                self.held = self.held.lstrip("\n")
                if self.held:
                    self.state = "answer"
            elif self.state == "reasoning":
                at = self.held.find(END)
                if at < 0:  # all of it is reasoning, but what may begin the end tag
                    cut = len(self.held) - _partial_suffix(self.held, END)
                    out.reasoning += self.held[:cut]
                    self.held = self.held[cut:]
                    break
                out.reasoning += self.held[:at]
                self.held = self.held[at + len(END):]
                self.state = "after_end"
            else:  # before or opened: does `<think>` come first?
                stripped = self.held.lstrip()
                if self.state == "before" or self.drops_leading_start:
                    if stripped.startswith(START):
                        self.held, self.state = stripped[len(START):], "reasoning"
                        continue
                    if START.startswith(stripped):  # maybe the tag, not all here yet
                        break
                self.state = "answer" if self.state == "before" else "reasoning"
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back. Unclosed reasoning stays reasoning."""
        held, self.held = self.held, ""
        if self.state in ("opened", "reasoning"):
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


def _partial_suffix(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

