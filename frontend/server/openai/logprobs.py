"""The engine's per-position logprobs in the two OpenAI formats (chat and legacy completions),
and prompt logprobs in vLLM's format and in an echoed legacy completion."""

from __future__ import annotations

from deepinfer.engine.protocol import PositionLogprobs, PromptLogprob
from deepinfer.frontend.server.openai.objects import (
    ChatLogprobEntry,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobOut,
    PromptLogprobsOut,
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


def prompt_logprobs_out(prompt: list[PromptLogprob], k: int) -> PromptLogprobsOut:
    """vLLM's shape: per position None (the first) or {token id: entry}, the prompt's own
    token first, then the top k (ranks 1..k) where they are other tokens."""
    out: PromptLogprobsOut = []
    for p in prompt:
        if p.logprob is None:
            out.append(None)
            continue
        entries = {str(p.token_id): PromptLogprobOut(p.logprob, p.rank, p.token)}
        for rank, t in enumerate(p.top[:k], start=1):
            entries.setdefault(str(t.token_id), PromptLogprobOut(t.logprob, rank, t.token))
        out.append(entries)
    return out


def echo_logprobs(prompt: list[PromptLogprob], k: int) -> CompletionLogprobs:
    """The echoed prompt's part of legacy logprobs (its tokens' texts from offset 0): the
    first token's logprob and top_logprobs are null, as OpenAI and vLLM give them."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for p in prompt:
        tokens.append(p.token)
        token_logprobs.append(p.logprob)
        top = None
        if p.logprob is not None:
            top = {t.token: t.logprob for t in p.top[:k]}
            top.setdefault(p.token, p.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(p.token)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + then.tokens,
                              first.token_logprobs + then.token_logprobs,
                              first.top_logprobs + then.top_logprobs,
                              first.text_offset + then.text_offset)
