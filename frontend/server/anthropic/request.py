"""An Anthropic Messages request as the OpenAI chat request the shared chat path runs.

The translation is shape only: system -> a system message; a user turn's tool_result blocks ->
"tool" messages (in block order, text between them kept as user messages); an assistant turn's
thinking -> `reasoning_content`, its tool_use blocks -> `tool_calls`; tools -> function tools;
tool_choice any -> "required", tool -> the named function; thinking -> the template's switches,
output_config.effort -> reasoning_effort (handed to the template), .format -> response_format;
a system message inside `messages` -> a system message there; a search_result block -> text.
Every check of the values (ranges, tool schemas, the model's name) is the chat path's, and its
errors name OpenAI's fields: `renamed` turns those back into the names this client sent.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from deepinfer.frontend.server.anthropic.schema import (
    Block,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    SearchResultBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from deepinfer.frontend.server.common.lenient import warn_once
from deepinfer.frontend.server.errors import APIError

_UNSUPPORTED = (ImageBlock, DocumentBlock)
# Claude Code's first system block: a line that differs in every session (it hashes the first
# prompt). At the prompt's start it would make every session miss the prefix cache, and it
# tells a local model nothing: dropped.
_PER_SESSION = "x-anthropic-billing-header:"


def _kind(block: msgspec.Struct) -> str:
    """A block's `type` (its tag: tagged Structs keep it in their class, not as a field)."""
    return str(block.__struct_config__.tag)


def _unsupported(block: msgspec.Struct, at: str) -> APIError:
    return APIError(f"{_kind(block)} content is not supported by this text model",
                    param=f"{at}.type")


def _as_text(block: TextBlock | SearchResultBlock) -> TextBlock:
    if isinstance(block, TextBlock):
        return block
    body = "\n\n".join(b.text for b in block.content)
    return TextBlock(text=f"{block.title}\n{block.source}\n\n{body}")


def _texts(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _tool_result(block: ToolResultBlock, at: str) -> dict[str, Any]:
    content = block.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, _UNSUPPORTED):
                raise _unsupported(part, f"{at}.content[{j}]")
        content = "".join(_as_text(part).text for part in content
                          if isinstance(part, (TextBlock, SearchResultBlock)))
    text = content or ""
    if block.is_error:  # OpenAI's tool message has no error flag: the model reads it instead
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _user(blocks: list[Block], at: str) -> list[dict[str, Any]]:
    """One user turn's blocks: tool results as tool messages, text runs as user messages."""
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for j, block in enumerate(blocks):
        if isinstance(block, (TextBlock, SearchResultBlock)):
            texts.append(_as_text(block))
            continue
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": _texts(texts)})
                texts = []
            out.append(_tool_result(block, f"{at}.content[{j}]"))
            continue
        if isinstance(block, _UNSUPPORTED):
            raise _unsupported(block, f"{at}.content[{j}]")
        raise APIError(f"a user turn cannot hold a {_kind(block)} block",
                       param=f"{at}.content[{j}].type")
    if texts or not out:
        out.append({"role": "user", "content": _texts(texts)})
    return out


def _assistant(blocks: list[Block], at: str) -> dict[str, Any]:
    texts: list[TextBlock] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # opaque to anyone but its author: nothing a template could show
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, _UNSUPPORTED):
            raise _unsupported(block, f"{at}.content[{j}]")
        else:
            raise APIError(f"an assistant turn cannot hold a {_kind(block)} block",
                           param=f"{at}.content[{j}].type")
    message: dict[str, Any] = {"role": "assistant", "content": _texts(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _system_text(system: str | list[TextBlock]) -> str:
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text for b in system if not b.text.startswith(_PER_SESSION))


def _system_message(blocks: list[Block], at: str) -> dict[str, Any]:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise APIError(f"a system message cannot hold a {_kind(block)} block",
                           param=f"{at}.content[{j}].type")
        texts.append(block)
    return {"role": "system", "content": _system_text(texts)}


def _messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict]:
    out: list[dict[str, Any]] = []
    text = _system_text(system) if system else ""
    if text:  # an empty system prompt is none: the template's default stays
        out.append({"role": "system", "content": text})
    for i, msg in enumerate(messages):
        if not msg.content and (msg.role != "assistant" or i < len(messages) - 1):
            raise APIError("all messages must have non-empty content except for the optional "
                           "final assistant message", param=f"messages[{i}].content")
        if msg.role == "system":
            out.append(_system_message(msg.content, f"messages[{i}]")
                       if isinstance(msg.content, list) else {"role": "system",
                                                              "content": msg.content})
        elif isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
        elif msg.role == "user":
            out.extend(_user(msg.content, f"messages[{i}]"))
        else:
            out.append(_assistant(msg.content, f"messages[{i}]"))
    return out


def _tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Client tools as function tools; server tools (run by Anthropic's servers, no
    input_schema) are dropped, with a warning once per type: nothing here could run them."""
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            warn_once("/v1/messages", t.type,
                      f"dropping server tool type {ascii(t.type[:80])} (this server runs no "
                      "tools)")
            continue
        if t.input_schema is None:
            raise APIError("input_schema is required for a custom tool",
                           param=f"tools[{i}].input_schema")
        out.append({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema,
            **({"strict": t.strict} if t.strict is not None else {})}})
    return out


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if not choice.name:
            raise APIError("tool_choice.name is required when tool_choice.type is 'tool'",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_body(req: MessagesRequest | CountTokensRequest, context_len: int) -> dict[str, Any]:
    """The OpenAI chat request (as a dict, for `decode_chat_dict`) that runs `req`; n is 1.

    A count_tokens request has no max_tokens: it asks for one token (never waited for)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req.system, req.messages)}
    if req.tools and (tools := _tools(req.tools)):
        body["tools"] = tools
    config = req.output_config
    if config is not None and config.effort is not None:  # the template's, as on chat
        body["reasoning_effort"] = config.effort
    fmt = config.format if config is not None else None
    if fmt is not None:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                           param="output_config.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt["schema"]}}
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not req.tool_choice.disable_parallel_tool_use
    if req.thinking is not None and req.thinking.type != "adaptive":  # adaptive: the default
        on = req.thinking.type == "enabled"
        body["chat_template_kwargs"] = {"thinking": on, "enable_thinking": on}
    final = body["messages"][-1] if body["messages"] else {}
    if final.get("role") == "assistant" and final.get("content") and not final.get("tool_calls"):
        # A prefill: the answer goes on from the assistant's text, as Anthropic's does.
        if final["content"] != final["content"].rstrip():
            raise APIError("final assistant content cannot end with trailing whitespace",
                           param="messages")
        body["continue_final_message"] = True
    if not isinstance(req, MessagesRequest):
        body["max_tokens"] = 1
        return body
    # Anthropic makes max_tokens mandatory, so clients send a fixed generous ceiling (32000 is
    # common) whatever the model: past this model's context it means "to the context's end".
    body["max_tokens"] = min(req.max_tokens, max(context_len, 1))
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences is not None:
        body["stop"] = req.stop_sequences
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    return body


# OpenAI's names in the chat path's errors -> this request's: (pattern, name, also in the
# message text; "stop" is a plain word there too).
_RENAMES = [
    (re.compile(r"^stop$"), "stop_sequences", False),
    (re.compile(r"\bparallel_tool_calls\b"), "tool_choice.disable_parallel_tool_use", True),
    (re.compile(r"\bchat_template_kwargs\b|\bthinking\.type\b"), "thinking", True),
    (re.compile(r"\b(tools\[\d+\])\.function\.parameters\b"), r"\1.input_schema", True),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1", True),
    (re.compile(r"tool_choice 'required'"), "tool_choice 'any'", True),
    (re.compile(r"tool_choice 'named'"), "tool_choice 'tool'", True),
    # The translation splits and merges turns: an OpenAI message index is no Anthropic one.
    (re.compile(r"\bmessages\[\d+\](\.[\w\[\].]+)?"), "messages", True),
]


def _rename(text: str, in_text: bool) -> str:
    for pattern, name, also_text in _RENAMES:
        if also_text or not in_text:
            text = pattern.sub(name, text)
    return text


def renamed(exc: APIError) -> APIError:
    """The chat path's error `exc`, speaking of the fields by their Anthropic names."""
    param = _rename(exc.param, in_text=False) if exc.param else None
    return APIError(_rename(exc.message, in_text=True), exc.status, param, exc.type, exc.code,
                    exc.headers)
