"""What a chat request asks of the template and of reasoning: its chat_template_kwargs, with
DeepSeek's `thinking: {"type": ...}` and `reasoning_effort` folded in, and whether thinking is
on (None: the template's default)."""

from __future__ import annotations

from typing import Any

from deepinfer.frontend.server.common.openai_schema import ChatCompletionRequest
from deepinfer.frontend.server.errors import APIError

# Variables the server itself gives the chat template.
_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
             "raise_exception", "strftime_now")
_SWITCHES = ("thinking", "enable_thinking")  # how templates name thinking on/off


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    kwargs = dict(req.chat_template_kwargs or {})
    for name in kwargs:
        if name in _RESERVED:
            raise APIError(f"chat_template_kwargs may not set {name!r} (the server sets it)",
                           param="chat_template_kwargs")
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise APIError("thinking.type must be 'enabled' or 'disabled'", param="thinking.type")
        for name in _SWITCHES:
            kwargs.setdefault(name, kind == "enabled")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs or None


def thinking_on(kwargs: dict[str, Any] | None) -> bool | None:
    for name in _SWITCHES:
        if kwargs and name in kwargs:
            return bool(kwargs[name])
    return None
