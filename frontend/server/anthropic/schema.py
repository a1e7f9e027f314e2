"""Bodies of the Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as
msgspec Structs, request and response alike.

Content blocks are a union tagged by `type`, so an unknown block type fails decoding with a
400 that names it. Image and document blocks decode (a client may well send them) and are
refused by the translation with a message saying why. Fields that change nothing here are
accepted and ignored: `cache_control` (the prefix cache works without hints), `citations` on a
text block sent back, `metadata`, `service_tier`; so is every field no struct here declares
(`context_management`, `thinking.display`, tool fields such as `eager_input_streaming`:
common/lenient.py logs each once). Server tools (a `type` other than
"custom", run by Anthropic's servers) are dropped with a warning, as `mcp_servers` is ignored:
the model is offered only the tools its client runs.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from deepinfer.frontend.server.common.lenient import decode_lenient

_REQ = dict(forbid_unknown_fields=True, kw_only=True)
_BLOCK = dict(tag_field="type", **_REQ)

CacheControl = dict[str, Any]


class TextBlock(msgspec.Struct, tag="text", **_BLOCK):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ImageBlock(msgspec.Struct, tag="image", **_BLOCK):
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(msgspec.Struct, tag="document", **_BLOCK):
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", **_BLOCK):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", **_BLOCK):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock | SearchResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class SearchResultBlock(msgspec.Struct, tag="search_result", **_BLOCK):
    """A search result the client found: the model reads it as text (no citations here)."""

    source: str
    title: str
    content: list[TextBlock]
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", **_BLOCK):
    thinking: str
    signature: str


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", **_BLOCK):
    data: str


Block = (TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ToolUseBlock
         | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock)


class Message(msgspec.Struct, **_REQ):
    # "system": an instruction in the middle of the conversation (Claude Code sends them)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(msgspec.Struct, **_REQ):
    """A client tool (`type` "custom" or none: `input_schema` required), or a server tool
    (web_search_20250305, ...), which the translation drops."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct, **_REQ):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, **_REQ):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the engine has no thinking budget


class OutputConfig(msgspec.Struct, **_REQ):
    effort: str | None = None  # handed to the template as reasoning_effort (as chat's is)
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}


class CountTokensRequest(msgspec.Struct, **_REQ):
    """What count_tokens takes: the conversation, without generation settings."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, **_REQ):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_salt: str | None = None  # vLLM's extension (frontend/server/common/sampling.py)


def decode_messages(body: bytes) -> MessagesRequest:
    return decode_lenient(body, MessagesRequest, "/v1/messages")


def decode_count_tokens(body: bytes) -> CountTokensRequest:
    return decode_lenient(body, CountTokensRequest, "/v1/messages/count_tokens")


# ---------------------------------------------------------------- responses


class TextOut(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingOut(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # nothing to sign: the reasoning is sent back as it came


class ToolUseOut(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(msgspec.Struct):
    input_tokens: int  # the prompt's tokens not read from the cache, as Anthropic counts
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageOut(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(msgspec.Struct):
    input_tokens: int


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorOut(msgspec.Struct, kw_only=True):
    type: Literal["error"] = "error"
    error: ErrorDetail
