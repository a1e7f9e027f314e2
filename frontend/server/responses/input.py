"""A Responses API request as the OpenAI chat request the shared chat path serves.

Input items become chat messages: a reasoning item, the assistant message after it and the
function calls after that are one assistant turn (reasoning_content, content, tool_calls), as
the model wrote them; a function_call_output is a `tool` message. Flat function tools, the
`{"type": "function", "name"}` tool choice and `text.format` become chat's nested shapes (a
namespace's tools are function tools; hosted tools are dropped, logged once). The
chat path names chat fields in its errors; `responses_error` renames them back.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from deepinfer.frontend.server.common.lenient import convert_lenient, warn_once
from deepinfer.frontend.server.errors import APIError, decode_error
from deepinfer.frontend.server.responses.schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputContentPart,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

_ITEM_TYPES: dict[str, type] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_TRUNCATIONS = ("auto", "disabled")


def _convert(value: Any, kind: type, at: str) -> Any:
    """msgspec.convert (fields `kind` does not declare ignored: common/lenient.py), its error's
    field path prefixed with where `value` sits."""
    try:
        return convert_lenient(value, kind, "/v1/responses")
    except msgspec.ValidationError as exc:
        inner = decode_error(exc)
        param = f"{at}.{inner.param}" if inner.param else at
        raise APIError(f"{at}: {inner.message}", param=param) from None


def _item(i: int, raw: dict[str, Any]) -> InputItem:
    kind = raw.get("type", "message")
    cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise APIError(f"input[{i}].type {kind!r} is not supported (message, function_call, "
                       "function_call_output or reasoning)", param=f"input[{i}].type")
    item = _convert(raw, cls, f"input[{i}]")
    if isinstance(item, MessageItem) and item.role not in _ROLES:
        raise APIError(f"input[{i}].role must be one of {', '.join(_ROLES)}",
                       param=f"input[{i}].role")
    return item


def parse_items(raw: str | list[dict[str, Any]] | None) -> list[InputItem]:
    """The request's `input` as typed items; a string is one user message."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    return [_item(i, item) for i, item in enumerate(raw)]


def _text(content: str | list[InputContentPart], at: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise APIError(f"content part type {part.type!r} is not supported by this text "
                           "model", param=f"{at}[{j}].type")
    return "".join(texts)


def _reasoning_text(item: ReasoningItem) -> str:
    parts = item.content or item.summary  # the full text when the client kept it
    return "".join(p.text for p in parts)


def _open_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn the next output item belongs to: the last message when it is one
    (an item after it continues the same turn), else a new, empty one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            turn = _open_turn(messages)
            if turn["content"] or turn.get("tool_calls") or turn.get("reasoning_content"):
                turn = {"role": "assistant", "content": ""}  # reasoning opens a turn
                messages.append(turn)
            turn["reasoning_content"] = _reasoning_text(item)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            _open_turn(messages).setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        else:
            text = _text(item.content, f"input[{i}].content")
            last = messages[-1] if messages else None
            if (item.role == "assistant" and last is not None and last["role"] == "assistant"
                    and not last["content"] and not last.get("tool_calls")):
                last["content"] = text  # the answer after its reasoning
            else:
                messages.append({"role": item.role, "content": text})
    return messages


def _function_tools(tools: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The function tools (with where each was) among `tools`, a namespace's expanded into
    them; hosted tools (web_search, file_search, ...: OpenAI's servers run them) are dropped
    with a warning once per type, as Codex offers web_search by default."""
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "function":
            out.append((f"tools[{i}]", raw))
        elif kind == "namespace" and isinstance(raw.get("tools"), list):
            out += [(f"tools[{i}].{at}", tool) for at, tool in _function_tools(raw["tools"])]
        elif isinstance(kind, str) and kind != "namespace":
            warn_once("/v1/responses", kind,
                      f"dropping hosted tool type {ascii(kind[:80])} (this server runs no tools)")
        else:
            raise APIError(f"tools[{i}] must be a tool object with a type", param=f"tools[{i}]")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for at, raw in _function_tools(tools):
        tool = _convert(raw, FunctionTool, at)
        fn = {"name": tool.name, "description": tool.description,
              "parameters": tool.parameters, "strict": tool.strict}
        out.append({"type": "function",
                    "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def tool_namespaces(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """Function name -> the namespace tool it came from: a call to it names the namespace, as
    the client routes it by both (Codex's multi-agent tools). A top-level name wins."""
    out: dict[str, str] = {}
    for raw in tools or []:
        if raw.get("type") == "namespace" and isinstance(raw.get("name"), str):
            for tool in raw.get("tools") or []:
                if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                    out.setdefault(tool["name"], raw["name"])
    for raw in tools or []:
        if raw.get("type") == "function":
            out.pop(raw.get("name"), None)
    return out


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's (checked) tools as the response repeats them."""
    return [{"type": "function", **t["function"]} for t in _tools(tools) or []]


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # the chat path checks the word
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError('tool_choice must be "auto", "none", "required" or '
                       '{"type": "function", "name": ...}', param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type != "json_schema":
        raise APIError(f"text.format.type {fmt.type!r} is not supported (text, json_object or "
                       "json_schema)", param="text.format.type")
    if fmt.schema is None:
        raise APIError("text.format.schema is required with json_schema",
                       param="text.format.schema")
    if not fmt.name:  # OpenAI's rule; echoed without one, the SDK's own check fails
        raise APIError("text.format.name is required with json_schema", param="text.format.name")
    spec = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict,
            "description": fmt.description}
    return {"type": "json_schema",
            "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _refuse_unserved(req: ResponsesRequest) -> None:
    """Fields a client relies on that this server cannot honour: a 400 naming each."""
    unserved = {"background": bool(req.background), "conversation": req.conversation is not None,
                "prompt": req.prompt is not None}
    for name, asked in unserved.items():
        if asked:
            raise APIError(f"{name} is not supported by this server", param=name)
    if req.truncation is not None and req.truncation not in _TRUNCATIONS:
        raise APIError("truncation must be 'auto' or 'disabled'", param="truncation")
    _check_metadata(req.metadata)


# OpenAI's bounds on metadata: it is stored and echoed, so a client must not grow it at will.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise APIError(f"metadata has {len(metadata)} pairs, more than {METADATA_PAIRS}",
                       param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise APIError(f"metadata keys are at most {METADATA_KEY_CHARS} characters",
                           param="metadata")
        if len(value) > METADATA_VALUE_CHARS:
            raise APIError(f"metadata[{key!r}] is longer than {METADATA_VALUE_CHARS} characters",
                           param="metadata")


def wants_logprobs(req: ResponsesRequest) -> bool:
    return bool(req.top_logprobs) or "message.output_text.logprobs" in (req.include or [])


def chat_request(req: ResponsesRequest, items: list[InputItem]) -> dict[str, Any]:
    """The chat request (as a client would send it) serving `req` over the conversation
    `items` (any earlier response's first, then this request's input)."""
    _refuse_unserved(req)
    messages = chat_messages(items)
    if req.instructions is not None:  # never carried over from a previous response
        messages.insert(0, {"role": "system", "content": req.instructions})
    body = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req), "user": req.user,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "logprobs": wants_logprobs(req) or None, "top_logprobs": req.top_logprobs,
        "stream": req.stream, "cache_salt": req.cache_salt,
    }
    return {k: v for k, v in body.items() if v is not None}


# Chat field names in the chat path's errors, and what this API calls them.
_RENAMES = [
    (re.compile(r"\bmessages(\[\d+\])?(\.[\w.\[\]]+)?"), "input"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
]


def _rename(text: str) -> str:
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


def responses_error(exc: APIError) -> APIError:
    """`exc` with the chat field names in its param and message put as this API names them."""
    return APIError(_rename(exc.message), exc.status, _rename(exc.param) if exc.param else None,
                    exc.type, exc.code, exc.headers)
