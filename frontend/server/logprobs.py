"""The engine's per-position logprobs in the two OpenAI formats (chat and legacy completions)."""

from __future__ import annotations

from deepinfer.engine.protocol import PositionLogprobs
from deepinfer.frontend.server.openai_responses import (
    ChatLogprobEntry,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(positions: list[PositionLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatLogprobEntry(
            token=p.chosen.token,
            logprob=p.chosen.logprob,
            bytes=_bytes(p.chosen.token),
            top_logprobs=[ChatTopLogprob(t.token, t.logprob, _bytes(t.token)) for t in p.top],
        )
        for p in positions
    ])


def completion_logprobs(positions: list[PositionLogprobs], offset: int = 0) -> CompletionLogprobs:
    """Legacy format; `offset` is where the first token's text starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for p in positions:
        tokens.append(p.chosen.token)
        token_logprobs.append(p.chosen.logprob)
        top = {t.token: t.logprob for t in p.top}
        top.setdefault(p.chosen.token, p.chosen.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(p.chosen.token)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset)
